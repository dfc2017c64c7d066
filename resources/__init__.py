"""Dagster resources: each adapts one outside system (an inference service, the target tokenizer, storage),
built from its section of eagle3.yaml and not settable at launch (`locked`)."""

from .inference import Inference
from .locked import locked, locked_default_io_manager
from .project import Project
from .storage import Storage, StorageJsonIOManager
from .target import Target

__all__ = [
    "Inference",
    "Project",
    "Storage",
    "StorageJsonIOManager",
    "Target",
    "locked",
    "locked_default_io_manager",
]
