"""The launch guard: a run coordinator that refuses any launch choosing where or how code runs.

Open-source Dagster has no login: anyone who reaches the UI or its GraphQL endpoint can launch a run with
tags and run config of their own. Launchers and executors read some tags to build what runs the code:
dagster-k8s's `dagster-k8s/config` sets the run pod's image, command, environment and mounted secrets (the
API key's among them), dagster-aws reads `ecs/task_overrides`, dagster-ray `dagster-ray/config` (a Ray job's
`runtime_env`: environment, pip packages, working directory), dagster-celery `dagster-celery/queue`. Run
config's `resources` can rebuild any resource (the endpoint and the key variable, the storage root, the
default `io_manager`'s directory) and `execution` the executor (`k8s_job_executor`'s step images, secrets
and pod specs). None of that belongs to a launch: it comes from the deployment and the project config.

Where: every launch path creates its run in storage, then calls `DagsterInstance.submit_run`, which hands it
to the instance's run coordinator before any launcher reads it (dagster 1.13.27: GraphQL `launchRun`,
`launchMultipleRuns` and re-execution in dagster_graphql/implementation/execution/launch_execution.py; job
backfills in _core/execution/job_backfill.py; asset backfills and declarative automation in
_core/execution/submit_asset_runs.py; sensors in _daemon/sensor.py; schedules in _scheduler/scheduler.py;
run retries in _daemon/auto_run_reexecution). So the check sits in the coordinator, and every shipped
instance config (deploy/) names it. A refused run is never enqueued: it ends FAILURE at once with the
message, which names what was refused and the file to edit, and no launcher ever sees it. Runs that skip
the coordinator (`dagster asset materialize --tags`, an instance without this guard) meet the same check
again inside the run: every resource refuses to start (resources/locked.py).

Allowlist, not denylist: a tag with a namespace other than Dagster's own (`dagster/`, `.dagster/`) or this
project's (`eagle3/`) is refused, whether or not its reader is listed here, because integrations read tags in
their own namespace and the next one's tag must be refused before anyone here knows its name. `LAUNCHER_TAGS`
names the readers found in the integrations' source, for the message. Plain tags (no `/`: `owner`, `note`) and
Dagster's own (`dagster/partition`, `dagster/backfill`, `dagster/schedule_name`, `dagster/priority`, ...)
pass, except `dagster/image`, which dagster-ray's KubeRay resources read as the Ray cluster's image. Run
config may set `ops` and `loggers` only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from dagster._core.run_coordinator import QueuedRunCoordinator, SubmitRunContext
from dagster._core.storage.dagster_run import DagsterRun, DagsterRunStatus

# Tags a launcher or executor reads to choose an image, a command, a secret, a size or a queue, as found in
# the source of dagster-k8s, -celery, -celery-k8s, -celery-docker, -docker, -aws, -azure and -dask 0.29.27
# and dagster-ray 0.4.8. Any other namespaced tag outside OWN_NAMESPACES is refused too (see the docstring).
LAUNCHER_TAGS: Mapping[str, str] = {
    "dagster-k8s/config": "dagster-k8s sets the run pod's image, command, env, secrets and volumes from it",
    "dagster-k8s/resource_requirements": "dagster-k8s sizes the run pod from it",
    "dagster-celery/queue": "dagster-celery picks the queue, so the workers, that run the code from it",
    "dagster-celery/run_priority": "dagster-celery orders its queue by it",
    "dagster-celery/priority": "dagster-celery orders its queue by it",
    "dagster-celery/task_id": "dagster-celery's launcher writes it and stops that task on terminate",
    "dagster-ray/config": "dagster-ray runs the code in a Ray job with its runtime_env (env vars, pip, "
    "working_dir) and resources",
    "dagster-dask/resource_requirements": "dagster-dask places steps by it",
    "dagster/image": "dagster-ray's KubeRay resources start the Ray cluster from this image; run launchers "
    "write it themselves after a launch",
    "docker/container_id": "dagster-docker's launcher writes it and stops that container on terminate",
    "ecs/task_overrides": "dagster-aws overrides the ECS task (command, role, containers) with it",
    "ecs/container_overrides": "dagster-aws overrides the run container (command, env, secrets) with it",
    "ecs/run_task_kwargs": "dagster-aws passes it to ECS RunTask (task definition, network, ...)",
    "ecs/cpu": "dagster-aws sizes the ECS task from it",
    "ecs/memory": "dagster-aws sizes the ECS task from it",
    "ecs/ephemeral_storage": "dagster-aws sizes the ECS task from it",
    "ecs/task_arn": "dagster-aws's launcher writes it and stops that task on terminate",
    "ecs/cluster": "dagster-aws's launcher writes it and stops the task in that cluster on terminate",
    "azure/container_apps/job_name": "dagster-azure's launcher writes it and stops that job on terminate",
}

# Of those, the ones a launcher writes on the run after submitting it. A re-execution from the UI copies its
# parent's tags, so it carries them; it keeps them when their value is the parent's and the parent was not
# refused here (a launcher wrote it, nobody chose it at launch). Inside a run they are the launcher's own.
WRITTEN_BY_LAUNCHERS: frozenset[str] = frozenset(
    {
        "dagster/image",
        "dagster-celery/task_id",
        "docker/container_id",
        "ecs/task_arn",
        "ecs/cluster",
        "azure/container_apps/job_name",
    }
)

# Namespaces whose tags pass: Dagster's own and this project's (`eagle3/source` of `make demo`, the refusal
# mark); no launcher or executor reads them.
OWN_NAMESPACES = ("dagster", ".dagster", "eagle3")
RUN_CONFIG_ALLOWED = frozenset({"ops", "loggers"})
# Set on a run this guard refused: the keys refused (never their values). Read back only to deny the
# inheritance above to that run's re-executions.
REFUSED_TAG = "eagle3/launch_refused"

# Resource key -> the section of the project config it is built from (the definitions use the same table).
RESOURCE_SECTIONS: Mapping[str, str] = {
    "project": "the file",
    "storage": "storage",
    "target": "target",
    "inference": "backend / backends",
    "hidden_states_io": "storage",
}

DOCS = "docs/operations.md#launch-safety"
HELM_VALUES = "deploy/k8s/values.yaml"
PROJECT_CONFIG = "the project config (eagle3.yaml, or the file EAGLE3_CONFIG names to the code location)"


@dataclass(frozen=True)
class Refusal:
    """One thing a launch may not set: `what` names it (a key, never a value), `why` says what it decides."""

    what: str
    why: str
    tag: bool  # a run tag (else a run config section)


def tag_refusal(key: str) -> str | None:
    """Why the run tag `key` may not be set at launch, or None when it may."""
    if key in LAUNCHER_TAGS:
        return LAUNCHER_TAGS[key]
    namespace, slash, _ = key.partition("/")
    if not slash or namespace in OWN_NAMESPACES:
        return None
    return (
        f"tags in namespace {namespace}/ are refused: integrations read tags in their own namespace "
        "(dagster-k8s/, ecs/, dagster-celery/, dagster-ray/, ...); plain tags such as owner or note are fine"
    )


def refusals(
    tags: Mapping[str, str], run_config: Mapping[str, Any] | None, accept: Collection[str] = ()
) -> list[Refusal]:
    """Everything in a run's tags and run config that a launch may not set; `accept` names tags known to come
    from a launcher rather than from the launch."""
    found = []
    for key in sorted(tags):
        why = None if key in accept else tag_refusal(key)
        if why:
            found.append(Refusal(f"run tag {key}", why, tag=True))
    for section, value in sorted((run_config or {}).items()):
        if section in RUN_CONFIG_ALLOWED or not value:
            continue
        if section == "resources" and isinstance(value, Mapping):
            found += [
                Refusal(f"resources.{name}{_fields(value[name])}", _resource_why(name), tag=False)
                for name in sorted(value)
            ]
        elif section == "execution":
            found.append(
                Refusal(
                    "execution",
                    "the executor decides where steps run (k8s_job_executor: their images, secrets and pod "
                    "specs); it is built from execution in the project config only",
                    tag=False,
                )
            )
        else:
            found.append(Refusal(section, "a launch may set ops and loggers only", tag=False))
    return found


def _fields(resource: Any) -> str:
    config = resource.get("config") if isinstance(resource, Mapping) else None
    return f" ({', '.join(sorted(config))})" if isinstance(config, Mapping) and config else ""


def _resource_why(name: str) -> str:
    if name == "io_manager":
        return "the default IO manager is fixed in code (pickles under the instance's storage directory)"
    section = RESOURCE_SECTIONS.get(name)
    source = f"is built from {section} in the project config" if section else "is built in code"
    return (
        f"it {source} only (an override could send the API key elsewhere, run remote code or write anywhere)"
    )


def refusal_message(found: list[Refusal], config_path: str | None = None) -> str:
    """The one message for a refused launch, wherever it is caught: what was refused, what it would decide,
    and the file to edit instead. Names keys only, never a value (a tag's value may hold anything)."""
    config = config_path or os.environ.get("EAGLE3_CONFIG") or None
    project = f"the project config ({config})" if config else PROJECT_CONFIG
    lines = [
        "launch refused: nothing set at launch may change where or how code runs "
        f"({len(found)} refused; see {DOCS}):"
    ]
    lines += [
        f"- {r.what}: {r.why}" if r.tag else f"- run config may not set {r.what}: {r.why}" for r in found
    ]
    if any(r.tag for r in found):
        lines.append(
            "Launch without these tags. Run pods take their image, command, env and secrets from the "
            f"deployment (runLauncher.config.k8sRunLauncher in {HELM_VALUES}, then helm upgrade; the "
            f"run_launcher of $DAGSTER_HOME/dagster.yaml elsewhere), step pods from execution in {project}."
        )
    if any(not r.tag for r in found):
        lines.append(
            "Launch with op config only (the responses asset's limit, retry_permanent_failures and a lower "
            f"max_concurrency). Everything else comes from {project}: edit it and reload the code location."
        )
    return "\n".join(lines)


class LaunchGuardRunCoordinator(QueuedRunCoordinator):
    """Dagster's queued run coordinator (same config: run limits, dequeue interval), refusing any run whose
    tags or run config choose where or how code runs: such a run ends FAILURE with the message instead of
    being enqueued."""

    def submit_run(self, context: SubmitRunContext) -> DagsterRun:
        run = context.dagster_run
        found = refusals(run.tags, run.run_config, accept=self._inherited(run))
        if not found or run.status != DagsterRunStatus.NOT_STARTED:
            return super().submit_run(context)
        message = refusal_message(found)
        self._instance.add_run_tags(run.run_id, {REFUSED_TAG: ", ".join(r.what for r in found)})
        self._instance.report_run_failed(run, message=message)
        logging.getLogger(__name__).warning("run %s refused at launch: %s", run.run_id, message)
        return self._instance.get_run_by_id(run.run_id) or run

    def _inherited(self, run: DagsterRun) -> set[str]:
        """Tags a launcher wrote on this re-execution's parent, carried over with the same value."""
        parent = self._instance.get_run_by_id(run.parent_run_id) if run.parent_run_id else None
        if parent is None or REFUSED_TAG in parent.tags:
            return set()
        return {k for k in WRITTEN_BY_LAUNCHERS if k in run.tags and parent.tags.get(k) == run.tags[k]}
