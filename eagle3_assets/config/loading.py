"""Which file is read and how: one validated config per process, reloaded when the file changes."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import ValidationError

from .base import BACKEND_ENV, CONFIG_ENV, DEFAULT_CONFIG_NAME, DOCS_CONFIG_REFERENCE, ConfigError
from .project import ProjectConfig


def _format_error(err: ValidationError, path: Path) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(
                f"{path}: unknown key '{loc}' (check the spelling; every key is listed in "
                f"{DOCS_CONFIG_REFERENCE})"
            )
        elif e["type"] == "missing":
            lines.append(f"{path}: missing required key '{loc}'")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{path}: key '{loc}': {msg}")
    return "\n".join(lines)


def config_path() -> Path:
    explicit = os.environ.get(CONFIG_ENV)
    if explicit:
        return Path(explicit).expanduser().resolve()
    here = Path.cwd() / DEFAULT_CONFIG_NAME
    if here.exists():
        return here.resolve()
    # The checkout's own config, so `dagster dev` works from any folder.
    return (Path(__file__).resolve().parent.parent / DEFAULT_CONFIG_NAME).resolve()


def load_config(path: str | Path | None = None, backend_override: str | None = None) -> ProjectConfig:
    """Read, validate and resolve a config file. `EAGLE3_BACKEND` overrides `backend`."""
    path = Path(path).expanduser().resolve() if path else config_path()
    if not path.exists():
        raise ConfigError(f"config file {path} not found; create it or set {CONFIG_ENV} to its path")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    backend = backend_override or os.environ.get(BACKEND_ENV)
    if backend:
        raw["backend"] = backend
    if "base_dir" in raw:
        raise ConfigError(f"{path}: unknown key 'base_dir'")
    raw["base_dir"] = str(path.parent)
    try:
        cfg = ProjectConfig.model_validate(raw)
    except ValidationError as e:
        msg = _format_error(e, path)
        if backend and "backend" in msg:
            msg += f"\n(the backend came from {BACKEND_ENV}={backend!r}; allowed: local, openrouter, sglang)"
        raise ConfigError(msg) from None
    return cfg


@lru_cache(maxsize=8)
def _cached(path: str, backend: str | None, mtime: float) -> ProjectConfig:
    return load_config(path, backend)


def get_config() -> ProjectConfig:
    """The process-wide config (re-read when the file or the environment changes)."""
    path = config_path()
    mtime = path.stat().st_mtime if path.exists() else 0.0
    return _cached(str(path), os.environ.get(BACKEND_ENV), mtime)
