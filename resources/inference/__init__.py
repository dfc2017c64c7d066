"""Inference resources: one per serving system, all driven by the same generation engine."""

from .base import InferenceResource
from .local import LocalInference
from .openrouter import OpenRouterInference
from .sglang import SGLangInference

__all__ = ["InferenceResource", "LocalInference", "OpenRouterInference", "SGLangInference"]
