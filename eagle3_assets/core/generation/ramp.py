"""The window's first slow start, counted on first tokens rather than on whole answers.

While the window ramps from cold (nothing refused yet, the ceiling not reached), a streamed request grows it
when its first token arrives (`AdaptiveLimit.on_accepted`): the provider has accepted it, one network round
trip and a first token after it went out, where its answer may take minutes (a thinking model's). Each request
counts once, at its first token or at its answer. The requests in flight during the ramp are looked at once
per heartbeat tick (a client reads streams in ticks, and acceptances land in bunches anyway); the ramp ends
for good at the first limit or the ceiling, or when the backend turns out not to stream (an answer came with
no token before it), and from then on answers alone grow the window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lanes import PendingPrompt
    from .limiter import AdaptiveLimit, DispatchToken


class FirstTokenRamp:
    """The requests in flight during the first slow start, by dispatch number, until their first token."""

    def __init__(self, limiter: AdaptiveLimit):
        self._limiter = limiter
        # The sent requests by dispatch number, with the token they went out with; None once the ramp is over.
        self._waiting: dict[int, tuple[PendingPrompt, DispatchToken]] | None = {}

    def track(self, p: PendingPrompt) -> None:
        """A request just sent (its token set): it counts for the window at its first token."""
        if self._waiting is not None and p.token is not None:
            self._waiting[p.token.seq] = (p, p.token)

    def on_answer(self, p: PendingPrompt) -> None:
        """An answer with no token streamed before it: the backend does not stream, acceptance cannot be
        seen."""
        if self._waiting is not None and not p.request.streamed_tokens:
            self._waiting = None

    def on_end(self, token: DispatchToken) -> None:
        if self._waiting is not None:
            self._waiting.pop(token.seq, None)

    def credit(self) -> bool:
        """Grow the window for every request whose first token arrived; whether any did (the dispatcher
        wakes)."""
        if not self._waiting:
            return False
        if not self._limiter.ramping:
            self._waiting = None
            return False
        accepted = [(p, token) for p, token in self._waiting.values() if p.request.streamed_tokens]
        for p, token in accepted:
            del self._waiting[token.seq]
            p.accepted = True
            self._limiter.on_accepted(token)
        return bool(accepted)
