"""The training frameworks' own code reading this project's exports: speculators, SpecForge and
Model-Optimizer.

Each framework pins other versions of transformers (and of torch) than the project, so each runs in its own
virtual environment, created from the package registries on first use and cached beside the embedded model
(`environments.py`). The `read_*.py` drivers run inside those environments: they import nothing from this
project, call the framework's own loaders, checks and model, and print one JSON line that the tests assert on.
"""
