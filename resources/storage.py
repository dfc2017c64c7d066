"""Where outputs land: one sub-folder per partition under `storage.root`, a local folder or an object store
(docs/outputs.md). Stages work in the partition's local folder; with an object-store root that
folder is a working copy synchronised around each stage (`eagle3_assets.core.storage.remote`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import dagster as dg

from eagle3_assets.config import ProjectConfig
from eagle3_assets.core.storage.files import write_json
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.storage.remote import RemoteRoot
from eagle3_assets.core.storage.tables import RESPONSE_SCHEMA, JournalTable


class Storage:
    """The storage root; every stage asks it for a dataset's layout instead of building paths itself."""

    def __init__(self, cfg: ProjectConfig):
        self.root = cfg.storage_root
        self.remote = (
            RemoteRoot(cfg.storage.root, cfg.storage.options, Path(cfg.storage.cache_dir).expanduser())
            if cfg.storage_is_remote
            else None
        )

    def layout(self, key: str) -> DatasetLayout:
        return DatasetLayout(Path(self.root), key).ensure()

    def checkout(self, key: str, stage: str) -> DatasetLayout:
        """The partition's layout with what `stage` reads and writes up to date (a no-op for a local root).
        For readers (checks, automation); a stage that writes uses `stage()`."""
        layout = self.layout(key)
        if self.remote is not None:
            reads, writes = layout.stage_paths(stage)
            # What it writes too: a file it replaces must be replaced at the version this copy saw (If-Match).
            self.remote.pull(key, sorted(set(reads) | set(writes)))
        return layout

    @contextlib.contextmanager
    def stage(self, key: str, stage: str, *, append_only: bool = False) -> Iterator[DatasetLayout]:
        """Check out what `stage` reads and writes, yield the layout, and publish what it wrote once it
        succeeded.

        After an error nothing is published, so a stage that failed halfway never replaces the stored outputs;
        except for an append-only stage (`append_only`: the journal), whose files are each whole and each hold
        answers that were paid for."""
        layout = self.checkout(key, stage)
        try:
            yield layout
        except BaseException:
            if append_only:
                self.publish(key, stage)
            raise
        self.publish(key, stage)

    def publish(self, key: str, stage: str) -> None:
        """Store what `stage` wrote (a no-op for a local root)."""
        if self.remote is not None:
            self.remote.push(key, self.layout(key).stage_paths(stage)[1])

    def modified(self, key: str, path: Path) -> float | None:
        """When `path`, a file of the partition's layout, was last written (seconds since the epoch), None if
        it does not exist."""
        if self.remote is not None:
            return self.remote.modified(key, str(path.relative_to(self.layout(key).dir)))
        return path.stat().st_mtime if path.exists() else None

    def lock(self, key: str) -> Callable[[str], contextlib.AbstractContextManager]:
        """One generating process per dataset: a lease object in the store, or a file lock in the folder."""
        remote = self.remote
        if remote is not None:
            return lambda what: remote.lease(key, what)
        return lambda what: JournalTable(self.layout(key).responses_dir, RESPONSE_SCHEMA).exclusive(what)

    def flusher(self, key: str) -> Callable[[], None] | None:
        """Called after every journal flush: with an object store, the new parts go up at once (a dead pod
        loses what a local kill -9 loses, no more)."""
        remote = self.remote
        if remote is None:
            return None
        paths = self.layout(key).journal_paths()

        def push() -> None:
            remote.push(key, paths)

        return push


class StorageJsonIOManager(dg.IOManager):
    """Small values passed between ops (shard names, stats) as JSON under the storage root.

    The storage root is shared by every step that reads or writes data (pods included), so values that travel
    between steps of one run live there too; no separate object store is needed.
    """

    def __init__(self, root: Path, remote: RemoteRoot | None = None):
        self.root = Path(root)
        self.remote = remote

    def _rel(self, context: dg.OutputContext | dg.InputContext) -> str:
        parts = context.get_identifier()
        return str(Path(".dagster_io", *[str(p) for p in parts]).with_suffix(".json"))

    def handle_output(self, context: dg.OutputContext, obj: object) -> None:
        if self.remote is not None:
            import obstore as obs

            obs.put(self.remote.store, self._rel(context), json.dumps(obj, default=str).encode())
            return
        path = self.root / self._rel(context)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(obj, path)

    def load_input(self, context: dg.InputContext) -> object:
        upstream = context.upstream_output
        if upstream is None:
            raise ValueError(f"{context.name}: an input with no upstream output has nothing to load")
        rel = self._rel(upstream)
        if self.remote is not None:
            import obstore as obs

            return json.loads(bytes(obs.get(self.remote.store, rel).bytes()))
        return json.loads((self.root / rel).read_text())
