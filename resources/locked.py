"""Resources that take their settings from eagle3.yaml only, never from run config at launch.

Open-source Dagster has no login: anyone who reaches the UI can launch runs with run config. If a resource's
fields could be set there, one launch could send any environment variable of the run worker as a Bearer token
to any host (`api_key_env`, `base_url`), run code from the hub (`trust_remote_code`) or write anywhere
(`storage.root`). So every resource here is built in code from the validated config file and wrapped in a
definition that accepts no run config. The instance's launch guard (eagle3_assets/launch_guard.py) refuses
such a launch before it is queued; a run that got past it anyway (an instance without the guard, `dagster
asset materialize`) meets the same check here: every resource, the default `io_manager` included, refuses to
start while the run's config sets any resource or the executor, or its tags include one a launcher or
executor reads, so every step fails before it does any work, with the guard's message and the file to edit.
What is safe and useful per run (`limit`, `retry_permanent_failures`, a lower `max_concurrency`) is op config
of the asset.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from eagle3_assets.launch_guard import WRITTEN_BY_LAUNCHERS, refusal_message, refusals


class LaunchOverrideRefused(dg.Failure):
    pass


def refuse_launch_overrides(context: dg.InitResourceContext, name: str, config_path: str) -> None:
    """Raise when the run being executed sets at launch anything the launch guard refuses, or when resource
    `name` is given config at all. The tags that launchers write on a run after its launch are theirs here,
    not the launch's."""
    run = context.run
    found = refusals(run.tags, run.run_config, accept=WRITTEN_BY_LAUNCHERS) if run is not None else []
    if context.resource_config and not any(r.what.startswith(f"resources.{name}") for r in found):
        found += refusals({}, {"resources": {name: {"config": context.resource_config}}})
    if found:
        raise LaunchOverrideRefused(description=refusal_message(found, config_path))


def locked(obj: Any, name: str, config_path: str, section: str) -> dg.ResourceDefinition:
    """`obj` as a resource (an IO manager when it is one) that accepts no run config and starts in no run
    that the launch guard refuses."""

    def init(context: dg.InitResourceContext) -> Any:
        refuse_launch_overrides(context, name, config_path)
        return obj

    kind = dg.IOManagerDefinition if isinstance(obj, dg.IOManager) else dg.ResourceDefinition
    return kind(
        resource_fn=init,
        config_schema=dg.Permissive(),
        description=f"{type(obj).__name__}, from {section} of {config_path} (not settable at launch)",
    )


def locked_default_io_manager(config_path: str) -> dg.IOManagerDefinition:
    """Dagster's default IO manager (pickles under the instance's storage directory), which the assets leave
    unused (they write their own files), declared so that a launch cannot configure it: left undeclared,
    Dagster's own accepts `resources.io_manager.config.base_dir` from any launch."""

    def init(context: dg.InitResourceContext) -> dg.IOManager:
        refuse_launch_overrides(context, "io_manager", config_path)
        from dagster._core.storage.fs_io_manager import PickledObjectFilesystemIOManager

        assert context.instance is not None, "the default IO manager needs the run's instance"
        return PickledObjectFilesystemIOManager(base_dir=context.instance.storage_directory())

    return dg.IOManagerDefinition(
        resource_fn=init,
        config_schema=dg.Permissive(),
        description="Dagster's default IO manager, in the instance's storage directory (not settable at "
        "launch)",
    )
