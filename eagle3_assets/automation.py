"""Scheduled top-ups: on a cron from the config, one backfill over the datasets whose budget is not met yet;
downstream stages follow when their inputs change, never past a failing blocking check."""

import dagster as dg

from .config import load_config
from .core.layout import DatasetLayout
from .core.topup import top_up_status


class BudgetNotMet(dg.AutomationCondition):
    """True for the partitions whose dataset is under budget and has prompts left to answer (or a changed source).

    Reads the outputs on storage, so it runs on the code server (the sensor sets use_user_code_server)."""

    def __init__(self, config_path: str, backend: str | None = None):
        self.config_path = config_path
        self.backend = backend

    @property
    def description(self) -> str:
        return "dataset budget not met and work remains"

    @property
    def name(self) -> str:
        return "budget_not_met"

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        if context.candidate_subset.is_empty:  # no cron tick: do not read every dataset's journal
            return dg.AutomationResult(context=context, true_subset=context.candidate_subset)
        cfg = load_config(self.config_path, self.backend)
        keys = {
            key
            for key, ds in cfg.datasets.items()
            if top_up_status(
                DatasetLayout(cfg.storage_root, key),
                cfg.resolve_path(ds.source),
                ds.budget_tokens,
                ds.budget_usd,
                ds.max_tokens,
            ).needed
        }
        return dg.AutomationResult(
            context=context,
            true_subset=context.candidate_subset.compute_intersection_with_partition_keys(keys),
        )


def top_up_condition(cron: str, config_path: str, backend: str | None) -> dg.AutomationCondition:
    return (dg.AutomationCondition.on_cron(cron) & BudgetNotMet(config_path, backend)).with_label(
        "scheduled top-up"
    )


def follow_upstream() -> dg.AutomationCondition:
    return (
        dg.AutomationCondition.eager() & dg.AutomationCondition.all_deps_blocking_checks_passed()
    ).with_label("follow upstream, blocking checks passed")


def automation_sensor(enabled: bool) -> dg.AutomationConditionSensorDefinition:
    return dg.AutomationConditionSensorDefinition(
        "eagle3_automation",
        target=dg.AssetSelection.all(),
        use_user_code_server=True,  # BudgetNotMet reads the project's outputs
        emit_backfills=True,  # several partitions at one tick: one backfill
        default_status=dg.DefaultSensorStatus.RUNNING if enabled else dg.DefaultSensorStatus.STOPPED,
        minimum_interval_seconds=30,
        description="Scheduled top-ups of datasets under budget, and downstream stages after their inputs change.",
    )
