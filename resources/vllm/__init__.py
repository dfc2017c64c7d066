"""vLLM as a serving engine: the exact server command for the target (`server.py`), the connector it loads
(`plugin/`), the extraction backend that reads what it writes (`extraction.py`), the self-check of a server on
a version no test ran (`self_check.py`) and its CPU build in an environment of its own (`cpu_build.py`, which
names the versions the tests ran)."""

from collections.abc import Callable

from eagle3_assets.config import ProjectConfig
from eagle3_assets.core.hidden_states.layer_ids import aux_layer_count

from .extraction import VllmHiddenStates
from .self_check import SelfCheckFailed, ServedSelfCheck
from .server import ServeSpec, vllm_layer_ids


def extraction_backend(
    cfg: ProjectConfig, partition: str, log: Callable[[str], None] = print
) -> VllmHiddenStates | None:
    """The backend of `hidden_states.engine: vllm` for one partition; None for the in-process engine. A
    replica on a vLLM version no test ran is checked against the configured target's checkpoint first."""
    hs = cfg.hidden_states
    if hs.engine != "vllm":
        return None
    return VllmHiddenStates(
        hs.vllm, partition, aux_layer_count(hs) + 1, self_check=ServedSelfCheck.of(cfg), log=log
    )


__all__ = [
    "SelfCheckFailed",
    "ServeSpec",
    "ServedSelfCheck",
    "VllmHiddenStates",
    "extraction_backend",
    "vllm_layer_ids",
]
