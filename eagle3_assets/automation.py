"""Scheduled top-ups: on a cron from the config, one backfill over the datasets whose budget is not met yet;
downstream stages follow when their inputs change, never past a failing blocking check."""

import dagster as dg

from .config import load_config
from .core.generation.topup import source_changed, top_up_status


class _PerDataset(dg.AutomationCondition):
    """True for the partitions whose dataset passes `wanted` (reads the outputs, so it runs on the code
    server)."""

    label_text = ""

    def __init__(self, config_path: str, backend: str | None = None):
        self.config_path = config_path
        self.backend = backend

    @property
    def description(self) -> str:
        return self.label_text

    def wanted(self, cfg, storage, key: str) -> bool:
        raise NotImplementedError

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        if context.candidate_subset.is_empty:  # no cron tick: do not read every dataset's journal
            return dg.AutomationResult(context=context, true_subset=context.candidate_subset)
        from resources import Storage

        cfg = load_config(self.config_path, self.backend)
        storage = Storage(cfg)
        keys = {key for key in cfg.datasets if self.wanted(cfg, storage, key)}
        return dg.AutomationResult(
            context=context,
            true_subset=context.candidate_subset.compute_intersection_with_partition_keys(keys),
        )


class BudgetNotMet(_PerDataset):
    """Generation has work: the dataset is under budget with prompts unanswered (or was never ingested)."""

    label_text = "dataset budget not met and prompts left"

    @property
    def name(self) -> str:
        return "budget_not_met"

    def wanted(self, cfg, storage, key: str) -> bool:
        layout = storage.checkout(key, "responses")  # an object-store root: its journal, up to date
        return top_up_status(layout, cfg.datasets[key]).needed


class SourceChanged(_PerDataset):
    """The dataset's source file changed since it was ingested (or it never was)."""

    label_text = "source file changed since ingestion"

    @property
    def name(self) -> str:
        return "source_changed"

    def wanted(self, cfg, storage, key: str) -> bool:
        return source_changed(
            storage.modified(key, storage.layout(key).prompts), cfg.resolve_path(cfg.datasets[key].source)
        )


def _quiet() -> dg.AutomationCondition:
    return ~dg.AutomationCondition.in_progress() & ~dg.AutomationCondition.any_deps_in_progress()


def ingest_condition(cron: str, config_path: str, backend: str | None) -> dg.AutomationCondition:
    """prompts: on the cron, only where the source changed."""
    return (dg.AutomationCondition.on_cron(cron) & SourceChanged(config_path, backend)).with_label(
        "scheduled: source changed"
    )


def top_up_condition(cron: str, config_path: str, backend: str | None) -> dg.AutomationCondition:
    """responses: on the cron where there is work for generation, and whenever the prompts' content
    changed."""
    # Dagster types since_last_handled on conditions over assets and checks; this one is over assets only.
    tick = dg.AutomationCondition.cron_tick_passed(cron).since_last_handled()  # type: ignore[misc]
    scheduled = (tick & BudgetNotMet(config_path, backend) & _quiet()).with_label("scheduled top-up")
    return (scheduled | follow_upstream()).with_label("scheduled top-up, or prompts changed")


def follow_upstream() -> dg.AutomationCondition:
    """Run when an input's data version changed (not merely re-materialised): a top-up that bought nothing
    leaves the responses' version as it was, and nothing after it runs. Never past a failing blocking
    check."""
    changed = dg.AutomationCondition.any_deps_match(dg.AutomationCondition.data_version_changed())
    trigger = (dg.AutomationCondition.newly_missing() | changed).since_last_handled()
    return (
        trigger
        & ~dg.AutomationCondition.any_deps_missing()
        & _quiet()
        & dg.AutomationCondition.all_deps_blocking_checks_passed()
    ).with_label("inputs changed, blocking checks passed")


def automation_sensor(enabled: bool) -> dg.AutomationConditionSensorDefinition:
    return dg.AutomationConditionSensorDefinition(
        "eagle3_automation",
        target=dg.AssetSelection.all(),
        use_user_code_server=True,  # BudgetNotMet reads the project's outputs
        emit_backfills=True,  # several partitions at one tick: one backfill
        default_status=dg.DefaultSensorStatus.RUNNING if enabled else dg.DefaultSensorStatus.STOPPED,
        minimum_interval_seconds=30,
        description=(
            "Scheduled top-ups of datasets under budget, and downstream stages after their inputs change."
        ),
    )
