"""vLLM as a serving engine: the exact server command for the target (`server.py`), the connector it loads
(`plugin/`), the extraction backend that reads what it writes (`extraction.py`) and its CPU build in an environment of
its own (`cpu_build.py`)."""

from eagle3_assets.config import ProjectConfig

from .extraction import VllmHiddenStates
from .server import ServeSpec, vllm_layer_ids


def extraction_backend(cfg: ProjectConfig, partition: str) -> VllmHiddenStates | None:
    """The backend of `hidden_states.engine: vllm` for one partition; None for the in-process engine."""
    hs = cfg.hidden_states
    if hs.engine != "vllm":
        return None
    n_aux = len(hs.aux_layers) if hs.aux_layers else 3  # default_aux_layers: three
    return VllmHiddenStates(hs.vllm, partition, n_aux + 1)


__all__ = ["ServeSpec", "VllmHiddenStates", "extraction_backend", "vllm_layer_ids"]
