"""How a rebuilt row compares with the ids the model really produced: match, or the kind and place of the first
difference (a non-canonical BPE split, a truncated answer's cut tail, invalid UTF-8, different text)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

TAIL_TOKENS = 3  # a truncated answer's last pre-token may merge differently once the text is cut


@dataclass
class Comparison:
    match: bool
    # None | "truncation_tail" (a cut answer's last tokens) | "invalid_utf8" (bytes text cannot carry) |
    # "bpe_split" (same text, other ids) | "text_differs"
    kind: str | None = None
    first_diff: int | None = None

    @property
    def explained(self) -> bool:
        """Matches, or differs only where text cannot say which ids were produced (the cut of a truncated answer)."""
        return self.match or self.kind == "truncation_tail"


def normalise_reference(ids: list[int], finished: bool, eot_id: int | None, stop_ids: set[int]) -> list[int]:
    """Server output ids as the template would close them: a finished answer ends with the end-of-turn id."""
    if finished and eot_id is not None:
        if ids and ids[-1] in stop_ids and ids[-1] != eot_id:
            return [*ids[:-1], eot_id]  # stopped on another stop id (e.g. eos): the turn still ends with eot
        if not ids or ids[-1] != eot_id:
            return [*ids, eot_id]
    return ids


def compare(
    reconstructed: np.ndarray, reference: list[int], decode: Callable[[list[int]], str], finished: bool = True
) -> Comparison:
    ref = np.asarray(reference, dtype=np.int32)
    if reconstructed.shape == ref.shape and np.array_equal(reconstructed, ref):
        return Comparison(True)
    n = min(len(ref), len(reconstructed))
    diff = np.flatnonzero(reconstructed[:n] != ref[:n])
    first = int(diff[0]) if diff.size else n
    if not finished and first >= len(ref) - TAIL_TOKENS:
        return Comparison(False, "truncation_tail", first)
    ref_text = decode(reference)
    if "\ufffd" in decode(reference[first:]):
        return Comparison(False, "invalid_utf8", first)
    same_text = decode(reconstructed.tolist()) == ref_text
    return Comparison(False, "bpe_split" if same_text else "text_differs", first)
