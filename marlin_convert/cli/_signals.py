"""SIGINT and SIGTERM while a command runs: the first one of a kind raises (the caller's clean-up runs), the same one
again within :data:`REPEAT_SECONDS` is the same request and is ignored, a later one ends the process at once. Once a
command's output is complete they are only noted (:func:`defer_signals`), and once it has ended, ignored.

GNU ``timeout`` sends its signal to the command and then to the command's process group, so the command gets it twice
at once; by the default action, the copy ended the process in the middle of its clean-up. Shared by the console
script's first step (:mod:`marlin_convert.cli.launch`, before the command line is imported) and the command line
(:mod:`marlin_convert.cli.app`); imports nothing heavy.
"""

from __future__ import annotations

import os
import signal
import threading
import time

#: seconds after a signal in which the same signal again is taken as the same request
REPEAT_SECONDS = 1.0
_first_signal_at: dict[int, float] = {}
_deferred: list[int] = []  # signals noted once the output was complete (defer_signals)


def forget_signals() -> None:
    """Start afresh (a new command in this process): no signal so far is the first of its kind, none deferred."""
    _first_signal_at.clear()
    _deferred.clear()


def _note(signum: int, _frame) -> None:
    _deferred.append(signum)


def defer_signals() -> None:
    """From now on SIGINT and SIGTERM do not raise: the command's output is complete and is being moved into place
    (an interrupt there would report a failure beside a finished OUT_DIR). They are noted for
    :func:`deferred_signal`. Only in the main thread, and only for a signal the process does not ignore."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _note)


def deferred_signal() -> int | None:
    """The first signal noted since :func:`defer_signals`, or None."""
    return _deferred[0] if _deferred else None


def ignore_signals() -> None:
    """The command is over and its exit code decided: SIGINT and SIGTERM while the interpreter shuts down are ignored
    (a KeyboardInterrupt in an exit handler was printed as a traceback, and the exit code stayed 0 anyway)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def is_repeat(signum: int) -> bool:
    """Whether ``signum`` came within :data:`REPEAT_SECONDS` of the first one of its kind."""
    first = _first_signal_at.get(signum)
    return first is not None and time.monotonic() - first < REPEAT_SECONDS


def take_first(signum: int, exception: BaseException) -> None:
    """In a signal handler, for the first ``signum``: note its time, hand later ones to :func:`_repeated`, and
    raise ``exception`` in the main thread."""
    _first_signal_at[signum] = time.monotonic()
    signal.signal(signum, _repeated)
    raise exception


def _repeated(signum: int, _frame) -> None:
    """The same signal during the clean-up: within :data:`REPEAT_SECONDS` of the first, ignored (one request sent
    twice); later, a second Ctrl-C (or SIGTERM) that ends the process at once, by the signal's default action."""
    if is_repeat(signum):
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
