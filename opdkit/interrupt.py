"""Stop requests by signal, and cutting a rollout short: a flag the loop reads, a check the decode loops call.

SIGTERM / SIGINT set a flag that the training loop reads between steps; no exception is raised from
the handler, so a signal never lands inside a collective, a CUDA graph capture or a half-written
file. The loop then saves the state and a checkpoint of the last complete step and the command
exits 128+N.

One stop, delivered several times: a signal sent to the whole process group reaches the trainer
once from the group and again from each wrapper that relays it (run.sh's trap, ``timeout``, which
signals its child and then the group, torchrun's agent, which signals every rank). A repeat that
arrives within ``REPEAT_WINDOW_S`` of the first is that same request and changes nothing; a
signal after that is a second request and stops at once with the signal's default action (the
atomic writes leave no partial checkpoint or state behind: the previous ones stay).

A step in flight is cut short between decode steps: the loop arms ``deadline(t)`` around its
rollout (t: the monotonic time by which the rollout must end so that the saves end inside the wall
budget, or None), and the decode loops (``engines.hf``, ``engines.static``, ``engines.vllm``) call
``check_abandon()`` between tokens, which raises ``StepAbandoned`` once a stop signal has arrived
or t has passed. It acts in the thread that armed it only (a background prefetch,
``rollout.overlap``, is not cut), costs a global read and a clock read, and does nothing when
nothing is armed (an evaluation, a library caller). The weights have not changed at that point:
the loop saves the last complete step.

A child forked after the handlers were installed (a library's helper process) inherits them but is
not the trainer: in it they restore the default action and re-deliver the signal, so the helper
stops as it would have without them (and never takes part in the trainer's stop).

Only the command line installs the handlers (``stop_on_signals``); importing this module changes
nothing, and a library caller without them keeps Python's default (KeyboardInterrupt).
``ensure_installed`` puts them back if a library replaced them (the loop calls it after building
its engines and before every save) and says so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 5.0  # a repeat within this many seconds of the first signal is the same stop request
_received: int | None = None
_received_at = 0.0
_installed = False  # stop_on_signals is active
_owner = 0  # the pid that installed the handlers (a forked child inherits them but is no trainer)
_armed: tuple[int, float | None] | None = None  # (thread ident, monotonic deadline or None) while a rollout runs


class StepAbandoned(BaseException):
    """The step in flight was cut short (a stop signal, or past its deadline); its weights are unchanged.

    A ``BaseException`` (as ``KeyboardInterrupt``), so that a library's ``except Exception`` around a
    decode step does not swallow it."""

    def __init__(self, reason: str):
        self.reason = reason  # the signal's name, or "wall_clock"
        super().__init__(f"step abandoned ({reason})")


def requested() -> int:
    """The number of the first stop signal received (0: none)."""
    return _received or 0


def _say(msg: str) -> None:
    try:
        os.write(2, msg.encode())
    except OSError:
        pass


def _handler(signum, frame) -> None:
    global _received, _received_at
    if os.getpid() != _owner:  # a child forked with our handlers (a library's helper): it stops as it would without
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _received is not None:
        if time.monotonic() - _received_at < REPEAT_WINDOW_S:
            return  # the same stop, delivered again (process group + a relaying parent)
        signal.signal(signum, signal.SIG_DFL)  # a second request: stop now, with the signal's default action
        os.kill(os.getpid(), signum)
        return
    _received, _received_at = signum, time.monotonic()
    _say(f"opdkit: {signal.Signals(signum).name} received: stopping (a rollout in flight ends at its next token; "
         f"the last complete step's state and checkpoint are saved first); send it again after {REPEAT_WINDOW_S:g} s "
         "to stop at once\n")


@contextlib.contextmanager
def stop_on_signals():
    """Within the block, SIGTERM/SIGINT request a stop instead of interrupting."""
    global _received, _installed, _owner
    _received, _owner = None, os.getpid()
    previous = {s: signal.signal(s, _handler) for s in SIGNALS}
    _installed = True
    try:
        yield
    finally:
        _installed = False
        for s, h in previous.items():
            signal.signal(s, h)


def ensure_installed(log=None) -> list[str]:
    """Within ``stop_on_signals``: put our handler back on any of the signals whose handler a library
    replaced (vLLM's engine core installs its own in the processes it runs in); the names of those
    it put back (logged). Outside it, or off the main thread: nothing."""
    if not _installed or threading.current_thread() is not threading.main_thread():
        return []
    fixed = []
    for s in SIGNALS:
        current = signal.getsignal(s)
        if current is not _handler:
            signal.signal(s, _handler)
            fixed.append(f"{signal.Signals(s).name} (was {getattr(current, '__qualname__', current)!r})")
    if fixed and log is not None:
        log(f"warning: a library replaced opdkit's stop-signal handler for {', '.join(fixed)}; put it back")
    return fixed


@contextlib.contextmanager
def deadline(t: float | None):
    """Arm ``check_abandon`` in this thread for the block: it raises once a stop signal has arrived or
    ``time.monotonic()`` passes ``t`` (None: signals only)."""
    global _armed
    outer, _armed = _armed, (threading.get_ident(), t)
    try:
        yield
    finally:
        _armed = outer


def check_abandon() -> None:
    """Raise ``StepAbandoned`` if the rollout in flight must end here (see the module docstring)."""
    armed = _armed
    if armed is None or armed[0] != threading.get_ident():
        return
    if _received:
        raise StepAbandoned(signal.Signals(_received).name)
    if armed[1] is not None and time.monotonic() >= armed[1]:
        raise StepAbandoned("wall_clock")
