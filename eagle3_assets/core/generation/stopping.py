"""Stopping a run on the operator's word: Dagster's Terminate (and a backfill's cancel), SIGTERM, Ctrl-C.

Dagster stops a step by sending SIGINT to the step's own process; its handler raises an interrupt at whatever
line the main thread is on. Inside an event loop that line is usually some request's task, where a request
error is expected and retried: the interrupt would be swallowed there and the run go on buying answers until
every prompt is paid for. So while an event loop runs here, the loop itself takes SIGINT and SIGTERM
(`loop.add_signal_handler`), and the first one calls the caller's `on_stop` (the engine stops sending, gives
what is in flight a moment to land, stores what arrived and settles its ledger); a second one, or the first
where there is no `on_stop`, cancels the loop's main task. When the loop is done, `RunTerminated` is raised: a
KeyboardInterrupt, which Dagster reads as an interrupt (the run ends CANCELED), and which no `except
Exception` on the way can swallow.

Some stops send no signal in time: a backfill cancelled from the UI reaches its runs at the backfill daemon's
next pass (every 30 s), and a run launcher may lose the signal. So a step may also name a `StopProbe`
(`watching`): every loop polls it each second, off the loop's thread, and stops the same way when it answers a
reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
PROBE_INTERVAL_S = 1.0
# Why the run should stop at once (the operator's word seen elsewhere than in a signal), or None to go on.
StopProbe = Callable[[], str | None]
_probe: contextvars.ContextVar[StopProbe | None] = contextvars.ContextVar("stop_probe", default=None)


@contextlib.contextmanager
def watching(probe: StopProbe | None) -> Iterator[None]:
    """Every event loop run inside this block (`run_loop`) polls `probe` and stops when it gives a reason."""
    token = _probe.set(probe)
    try:
        yield
    finally:
        _probe.reset(token)


class RunTerminated(KeyboardInterrupt):
    """The operator stopped the run; what had arrived is stored."""


class _Stop:
    def __init__(self, on_stop: Callable[[], None] | None):
        self.on_stop = on_stop
        self.reasons: list[str] = []
        self.task: asyncio.Task | None = None

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        if len(self.reasons) == 1 and self.on_stop is not None:
            self.on_stop()
        elif self.task is not None:
            self.task.cancel()

    def signal(self, signum: int) -> None:
        self(signal.Signals(signum).name)

    async def poll(self, probe: StopProbe) -> None:
        while not self.reasons:
            await asyncio.sleep(PROBE_INTERVAL_S)
            reason = await asyncio.to_thread(probe)
            if reason and not self.reasons:
                self(reason)

    def describe(self) -> str:
        return f"stopped ({self.reasons[0]}): terminated by the operator; what had arrived is stored"


def _install(loop: asyncio.AbstractEventLoop, stop: _Stop) -> dict[int, Any]:
    """Route the stop signals to `stop` while the loop runs; returns the handlers to put back. Only the main
    thread may set signal handlers; elsewhere nothing is routed (the caller's thread is not the one Dagster
    interrupts either)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[int, Any] = {}
    for sig in STOP_SIGNALS:
        previous[sig] = signal.getsignal(sig)
        loop.add_signal_handler(sig, stop.signal, sig)
    return previous


def _restore(loop: asyncio.AbstractEventLoop, previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        loop.remove_signal_handler(sig)
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _new_loop_runner() -> Callable[[Coroutine[Any, Any, T]], T]:
    """uvloop where it is installed (its C event loop halves the loop's own cost per socket read, which is
    most of a streamed event's), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run
    return uvloop.run


def run_loop(coro: Awaitable[T], on_stop: Callable[[], None] | None = None) -> T:
    """Run `coro` on a new event loop that a stop (a signal, the probe of `watching`) ends cleanly: `on_stop`
    first (a graceful stop), the main task cancelled on a second stop or without `on_stop`; then
    `RunTerminated`."""
    stop = _Stop(on_stop)
    probe = _probe.get()

    async def main() -> T:
        loop = asyncio.get_running_loop()
        stop.task = asyncio.current_task()
        previous = _install(loop, stop)
        poller = asyncio.create_task(stop.poll(probe)) if probe is not None else None
        try:
            return await coro
        finally:
            if poller is not None:
                poller.cancel()
            _restore(loop, previous)

    try:
        result = _new_loop_runner()(main())
    except asyncio.CancelledError:
        if stop.reasons:
            raise RunTerminated(stop.describe()) from None
        raise
    if stop.reasons:
        raise RunTerminated(stop.describe())
    return result
