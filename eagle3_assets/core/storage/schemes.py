"""Which storage roots are object stores, and where their local working copies live: the one list of URL
schemes, read by the config (to tell a remote root) and by `remote`. A leaf that imports nothing of the
project, so the config may read it without importing the core's storage (which imports the config)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

# The schemes obstore speaks that a root may use.
SCHEMES = ("s3://", "gs://", "az://", "abfs://", "abfss://", "memory://")


def is_remote(root: str) -> bool:
    return root.startswith(SCHEMES)


def cache_folder(url: str, cache_dir: Path) -> Path:
    """The local folder of an object-store root's working copies, one per root under `cache_dir`."""
    parsed = urlparse(url.rstrip("/"))
    return Path(cache_dir) / f"{parsed.scheme}-{parsed.netloc}{parsed.path}".replace("/", "_")
