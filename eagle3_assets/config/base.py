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
_PARTITION_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Where users read more, named in error messages (pages of the documentation site, paths in the repository).
DOCS_CONFIG = "docs/configuration.md"
DOCS_CONFIG_REFERENCE = "docs/reference/configuration.md"
DOCS_BACKENDS = "docs/backends.md"


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
