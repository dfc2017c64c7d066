"""Resources that take their settings from eagle3.yaml only, never from run config at launch.

Open-source Dagster has no login: anyone who reaches the UI can launch runs with run config. If a resource's
fields could be set there, one launch could send any environment variable of the run worker as a Bearer token
to any host (`api_key_env`, `base_url`), run code from the hub (`trust_remote_code`) or write anywhere
(`storage.root`). So every resource here is built in code from the validated config file and wrapped in a
definition that accepts no run config: a launch that tries is refused, naming the file to edit, before any
step runs. What is safe and useful per run (`limit`, `retry_permanent_failures`, a lower `max_concurrency`) is
op config of the asset.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from eagle3_assets.config import DOCS_CONFIG


class LaunchOverrideRefused(dg.Failure):
    pass


def _refuse(name: str, config_path: str, section: str, given: dict[str, Any]) -> LaunchOverrideRefused:
    keys = ", ".join(sorted(given))
    return LaunchOverrideRefused(
        description=(
            f"run config may not set resources.{name} ({keys}): endpoints, API key variables, tokenizer and "
            f"model references, remote code and storage come from the config file only. Edit {section} in "
            f"{config_path} and reload the code location (see {DOCS_CONFIG}). Per run you may set the "
            "responses asset's limit, retry_permanent_failures and a lower max_concurrency."
        )
    )


def locked(obj: Any, name: str, config_path: str, section: str) -> dg.ResourceDefinition:
    """`obj` as a resource (an IO manager when it is one) that refuses any run config."""

    def init(context: dg.InitResourceContext) -> Any:
        if context.resource_config:
            raise _refuse(name, config_path, section, context.resource_config)
        return obj

    kind = dg.IOManagerDefinition if isinstance(obj, dg.IOManager) else dg.ResourceDefinition
    return kind(
        resource_fn=init,
        config_schema=dg.Permissive(),
        description=f"{type(obj).__name__}, from {section} of {config_path} (not settable at launch)",
    )
