"""Dagster resources: each adapts one outside system (an inference service, the target tokenizer, storage)."""

from .inference import InferenceResource, LocalInference, OpenRouterInference, SGLangInference
from .project import ProjectConfigResource
from .storage import StorageJsonIOManager, StorageResource
from .tokenizer import TargetTokenizerResource

__all__ = [
    "InferenceResource",
    "LocalInference",
    "OpenRouterInference",
    "ProjectConfigResource",
    "SGLangInference",
    "StorageJsonIOManager",
    "StorageResource",
    "TargetTokenizerResource",
]
