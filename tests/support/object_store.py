"""An S3-compatible object store on loopback (moto's server mode) for the object-store tests, and the storage
sections that point a project at it. The `s3_server` and `aws_env` fixtures (tests/conftest.py) start it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from resources.vllm.server import free_port

from .projects import make_project, user_rows

BUCKET = "eagle3-test"


@contextlib.contextmanager
def moto_server(bucket: str) -> Iterator[str]:
    """moto's S3-compatible server started on a free loopback port, with `bucket` created; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto server did not start"
                time.sleep(0.3)
        # moto accepts any credentials; a bucket is created with one plain PUT.
        urllib.request.urlopen(urllib.request.Request(f"{url}/{bucket}", method="PUT"), timeout=10)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def s3_options(url: str) -> dict:
    """The storage options that reach the server at `url` (plain HTTP on loopback)."""
    return {"endpoint": url, "region": "us-east-1", "allow_http": True}


def s3_storage(url: str, prefix: str, cache_dir: Path) -> dict:
    """A project's `storage` section with its root under `prefix` in `BUCKET`."""
    return {"root": f"s3://{BUCKET}/{prefix}", "options": s3_options(url), "cache_dir": str(cache_dir)}


def s3_project(tmp_path: Path, url: str, prefix: str, cache: str = "cache") -> Path:
    """A six-prompt B1 project in `tmp_path` whose storage root is `prefix` in the bucket."""
    return make_project(
        tmp_path,
        {"B1": {"rows": user_rows([f"Say the number {i}." for i in range(6)]), "max_tokens": 8}},
        storage=s3_storage(url, prefix, tmp_path / cache),
    )
