"""Names, errors and the strict base model every config table shares."""

from __future__ import annotations

import ipaddress
import re
from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict

CONFIG_ENV = "EAGLE3_CONFIG"
BACKEND_ENV = "EAGLE3_BACKEND"
DEFAULT_CONFIG_NAME = "eagle3.yaml"
BUILTIN_SMOLLM2 = "builtin:smollm2"
BackendName = Literal["local", "openrouter", "sglang"]
StorageDtype = Literal["bfloat16", "float16", "float32", "float8_e4m3fn"]
# A dataset key is a partition key of every asset and the name of the partition's folder (a local folder, or
# an object-store prefix) under storage.root: one plain path segment, nothing a path, a shell or Dagster reads
# specially. `dataset_key_problem` says which rule a key breaks.
DATASET_KEY_MAX = 64
_DATASET_KEY = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{DATASET_KEY_MAX - 1}}}")
DATASET_KEY_RULE = (
    f"1 to {DATASET_KEY_MAX} letters, digits, '_', '-' or '.', starting with a letter or digit, with no '..'"
)
# Folders under storage.root that are not partitions (the `data_value` asset's report).
RESERVED_DATASET_KEYS = frozenset({"data_value"})
# Where users read more, named in error messages (pages of the documentation site, paths in the repository).
DOCS_CONFIG = "docs/configuration.md"
DOCS_CONFIG_REFERENCE = "docs/reference/configuration.md"
DOCS_BACKENDS = "docs/backends.md"


def dataset_key_problem(key: object) -> str | None:
    """Why `key` cannot name a partition's folder under a storage root, or None when it can.

    The rule is a whitelist, so nothing can reach outside the root whatever the root is (a local folder, or an
    object-store prefix, where `..` is not even resolved but names another prefix's objects): `.` and `..`
    and anything with a separator, NUL, whitespace or a leading dot (`.dagster_io` beside the partitions) are
    refused; a leading `-` would read as an option on a command line; `..` anywhere is also refused because
    Dagster reserves `...` in partition keys (ranges `B1...B3`). Matched whole (`fullmatch`: a `$` would let
    a trailing newline through)."""
    if not isinstance(key, str):
        return f"must be a string, not {type(key).__name__}"
    if key in (".", ".."):
        return "names a folder itself or its parent, which would put the partition outside storage.root"
    if not _DATASET_KEY.fullmatch(key) or ".." in key:
        return f"must be {DATASET_KEY_RULE}"
    return None


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the fix."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
