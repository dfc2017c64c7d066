"""Thin Dagster assets, one module per stage, each beside its checks; each calls the plain functions of
`eagle3_assets.core`."""

import dagster as dg

from .acceptance import build_acceptance_asset, build_acceptance_checks
from .data_value import build_data_value_asset, build_data_value_checks
from .hidden_states import build_hidden_states_asset, build_hidden_states_checks
from .overview import build_overview_asset
from .prompts import build_prompts_asset, build_prompts_checks
from .quarantine import build_quarantine_checks
from .report import build_report_asset, build_report_checks
from .responses import build_responses_asset, build_responses_checks
from .tokens import build_tokens_asset, build_tokens_checks

__all__ = [
    "build_acceptance_asset",
    "build_checks",
    "build_data_value_asset",
    "build_hidden_states_asset",
    "build_overview_asset",
    "build_prompts_asset",
    "build_report_asset",
    "build_responses_asset",
    "build_tokens_asset",
]


def build_checks(
    partitions: dg.PartitionsDefinition, reference_ids: bool = True
) -> list[dg.AssetChecksDefinition]:
    """Every stage's checks, per partition. `reference_ids`: the configured backend returns the ids it
    generated (`build_tokens_checks`)."""
    return [
        *build_prompts_checks(partitions),
        *build_responses_checks(partitions),
        *build_tokens_checks(partitions, reference_ids),
        *build_report_checks(partitions),
        *build_hidden_states_checks(partitions),
        *build_acceptance_checks(partitions),
        *build_quarantine_checks(partitions),
        *build_data_value_checks(),
    ]
