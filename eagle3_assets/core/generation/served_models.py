"""The names a backend may serve the target under: read by the backends' protocol and by the binding of
answers, so kept apart from both (no circle through the binding)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import PurePosixPath


@dataclass(frozen=True)
class ServedModels:
    """The names under which a backend may serve the target: exact names (compared without case) and glob
    patterns of `accepted_models`; a served path matches a name when their last components are equal (a local
    copy of the same checkpoint)."""

    names: tuple[str, ...]
    patterns: tuple[str, ...] = ()
    by_basename: bool = False

    def accepts(self, served: str | None) -> bool:
        if not served:
            return False
        low = served.lower()
        if any(low == n.lower() for n in self.names):
            return True
        if any(fnmatch.fnmatchcase(low, p.lower()) for p in self.patterns):
            return True
        if self.by_basename:
            base = PurePosixPath(low.rstrip("/")).name
            return any(base == PurePosixPath(n.lower().rstrip("/")).name for n in self.names)
        return False

    def describe(self) -> str:
        return ", ".join([*self.names, *self.patterns])

    def __or__(self, other: ServedModels) -> ServedModels:
        return ServedModels(
            tuple(dict.fromkeys(self.names + other.names)),
            tuple(dict.fromkeys(self.patterns + other.patterns)),
            self.by_basename or other.by_basename,
        )
