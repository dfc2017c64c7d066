"""Thin Dagster assets, one module per stage; each calls the plain functions of `eagle3_assets.core`."""

from .acceptance import build_acceptance_asset
from .hidden_states import build_hidden_states_asset
from .prompts import build_prompts_asset
from .report import build_report_asset
from .responses import build_responses_asset
from .tokens import build_tokens_asset

__all__ = [
    "build_acceptance_asset",
    "build_hidden_states_asset",
    "build_prompts_asset",
    "build_report_asset",
    "build_responses_asset",
    "build_tokens_asset",
]
