"""Stop requests by signal: SIGTERM / SIGINT set a flag that the training loop reads between steps.

No exception is raised from the handler, so a signal never lands inside a collective, a CUDA
graph capture or a half-written file: the step in flight finishes, the loop saves the state and a
checkpoint of it, and the command exits 128+N. A second signal exits at once with the default
action (the atomic writes leave no partial checkpoint or state behind).

Only the command line installs the handlers (``stop_on_signals``); importing this module changes
nothing, and a library caller without them keeps Python's default (KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import os
import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: int | None = None


def requested() -> int:
    """The number of the first stop signal received (0: none)."""
    return _received or 0


def _handler(signum, frame) -> None:
    global _received
    if _received is not None:  # the second one: stop now, with the signal's default action
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _received = signum
    msg = (f"opdkit: {signal.Signals(signum).name} received: stopping after the current step (its state and "
           "checkpoint are saved first); send it again to stop at once\n")
    try:
        os.write(2, msg.encode())
    except OSError:
        pass


@contextlib.contextmanager
def stop_on_signals():
    """Within the block, SIGTERM/SIGINT request a stop instead of interrupting."""
    global _received
    _received = None
    previous = {s: signal.signal(s, _handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
