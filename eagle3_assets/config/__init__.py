"""The project config (`eagle3.yaml`): one validated object, loaded once per process.

Unknown keys are errors that name the key, so a typo (`budget_tokns`) fails before any paid request instead of
silently running with a default. Relative paths are resolved against the config file's folder.
"""

from __future__ import annotations

from .acceptance import AcceptanceConfig, AcceptanceVllmConfig
from .backends import BackendsConfig, LocalConfig, OpenRouterConfig, SamplingConfig, SGLangConfig
from .base import (
    BACKEND_ENV,
    BUILTIN_SMOLLM2,
    CONFIG_ENV,
    DEFAULT_CONFIG_NAME,
    DOCS_BACKENDS,
    DOCS_CONFIG,
    DOCS_CONFIG_REFERENCE,
    BackendName,
    ConfigError,
    StorageDtype,
    Strict,
    dataset_key_problem,
    is_loopback,
)
from .datasets import ChecksConfig, DatasetConfig, InstructionFields, TokensConfig
from .hidden_states import HiddenStatesConfig, VllmExtractionConfig
from .loading import config_path, get_config, load_config
from .project import AutomationConfig, ExecutionConfig, PoolsConfig, ProjectConfig
from .storage_target import StorageConfig, TargetConfig
from .vllm_server import VllmServerConfig

__all__ = [
    "BACKEND_ENV",
    "BUILTIN_SMOLLM2",
    "CONFIG_ENV",
    "DEFAULT_CONFIG_NAME",
    "DOCS_BACKENDS",
    "DOCS_CONFIG",
    "DOCS_CONFIG_REFERENCE",
    "AcceptanceConfig",
    "AcceptanceVllmConfig",
    "AutomationConfig",
    "BackendName",
    "BackendsConfig",
    "ChecksConfig",
    "ConfigError",
    "DatasetConfig",
    "ExecutionConfig",
    "HiddenStatesConfig",
    "InstructionFields",
    "LocalConfig",
    "OpenRouterConfig",
    "PoolsConfig",
    "ProjectConfig",
    "SGLangConfig",
    "SamplingConfig",
    "StorageConfig",
    "StorageDtype",
    "Strict",
    "TargetConfig",
    "TokensConfig",
    "VllmExtractionConfig",
    "VllmServerConfig",
    "config_path",
    "dataset_key_problem",
    "get_config",
    "is_loopback",
    "load_config",
]
