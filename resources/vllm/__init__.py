"""vLLM as a serving engine: the exact server command for the target (`server.py`), the connector it loads
(`plugin/`), the extraction backend that reads what it writes (`extraction.py`) and its CPU build in an
environment of its own (`cpu_build.py`)."""

from eagle3_assets.config import ProjectConfig
from eagle3_assets.core.hidden_states.layer_ids import aux_layer_count

from .extraction import VllmHiddenStates
from .server import ServeSpec, vllm_layer_ids


def extraction_backend(cfg: ProjectConfig, partition: str) -> VllmHiddenStates | None:
    """The backend of `hidden_states.engine: vllm` for one partition; None for the in-process engine."""
    hs = cfg.hidden_states
    if hs.engine != "vllm":
        return None
    return VllmHiddenStates(hs.vllm, partition, aux_layer_count(hs) + 1)


__all__ = ["ServeSpec", "VllmHiddenStates", "extraction_backend", "vllm_layer_ids"]
