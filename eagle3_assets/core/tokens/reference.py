"""How a rebuilt row compares with the ids the model really produced: match, or the kind and place of the
first difference (a non-canonical BPE split, a truncated answer's cut tail, invalid UTF-8, different text)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

TAIL_TOKENS = 3  # a truncated answer's last pre-token may merge differently once the text is cut


@dataclass
class Comparison:
    match: bool
    # None | "truncation_tail" (a cut answer's last tokens) | "invalid_utf8" (bytes text cannot carry) |
    # "model_split" (same text; the model's ids are not the tokenizer's own encoding of it, the rebuild's are)
    # | "bpe_split" (same text, other ids, and the rebuild is not the tokenizer's encoding: a rebuild defect)
    # | "text_differs"
    kind: str | None = None
    first_diff: int | None = None

    @property
    def explained(self) -> bool:
        """Matches, or differs only where text cannot say which ids were produced: the cut of a truncated
        answer, or a split the model chose that no encoding of the text gives (the tokenizer itself encodes
        the text as the rebuild did). Either way the row keeps the produced ids (`prefer_reference_ids`)."""
        return self.match or self.kind in ("truncation_tail", "model_split")


def normalise_reference(ids: list[int], finished: bool, eot_id: int | None, stop_ids: set[int]) -> list[int]:
    """Server output ids as the template would close them: a finished answer ends with the end-of-turn id."""
    if finished and eot_id is not None:
        if ids and ids[-1] in stop_ids and ids[-1] != eot_id:
            return [*ids[:-1], eot_id]  # stopped on another stop id (e.g. eos): the turn still ends with eot
        if not ids or ids[-1] != eot_id:
            return [*ids, eot_id]
    return ids


def compare(
    reconstructed: np.ndarray,
    reference: list[int],
    decode: Callable[[list[int]], str],
    finished: bool = True,
    canonical: Callable[[list[int]], list[int]] | None = None,
) -> Comparison:
    """`canonical(reference)`: the tokenizer's own encoding of the reference's text, in place (an
    independent path: the tokenizer, not this project's encoder). A rebuild that equals it, where the
    reference differs, means the model emitted a non-canonical split of that text (small models do, a few
    answers in a hundred)."""
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
    if not same_text:
        return Comparison(False, "text_differs", first)
    if canonical is not None and reconstructed.tolist() == list(canonical(reference)):
        return Comparison(False, "model_split", first)
    return Comparison(False, "bpe_split", first)
