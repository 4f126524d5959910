"""SIGINT, SIGTERM and SIGHUP (:data:`HANDLED`) while a command runs: the first one of a kind raises (the caller's
clean-up runs), the same one again within :data:`REPEAT_SECONDS` is the same request and is ignored, a later one ends
the process at once. Once a command's output is complete they are only noted (:func:`defer_signals`), and once it has
ended they are noted and turn an exit code of 0 into 130 / 143 / 129 (:func:`finish_at_exit`, :func:`exit_now`); there
too the same signal again, :data:`REPEAT_SECONDS` or more after the first one noted, ends the process (a report that
cannot be written, ``--json`` naming a FIFO nobody reads, or stdout a pipe nobody drains, would otherwise leave a
process that only SIGKILL ends): at once where the output is in place or the command is over, and while the complete
output is still being flushed and moved into place only once it is there (:func:`output_in_place`), so that it never
leaves a partial directory and no OUT_DIR.

The first one's exception goes through :func:`marlin_convert.interrupts.interrupt`: held back while the library is
inside a worker pool's calls, raised at their end. Python drops an exception raised in a handler that runs inside an
at-fork hook or an import lock's callback ("Exception ignored in ..."); the signal stays noted (:func:`first_signal`),
so the command still ends as interrupted (the CLI checks before it publishes an output, and at the end). A forked
worker process that gets a signal before it has set its own handlers does not raise: SIGINT and SIGHUP are ignored
(its parent decides), SIGTERM ends it quietly (:func:`in_forked_child`).

GNU ``timeout`` sends its signal to the command and then to the command's process group, so the command gets it twice
at once; by the default action, the copy ended the process in the middle of its clean-up. Shared by the console
script's first step (:mod:`marlin_convert.cli.launch`, before the command line is imported) and the command line
(:mod:`marlin_convert.cli.app`); imports nothing heavy.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from ..interrupts import interrupt, reset

#: the signals a command takes as a request to stop (128 + the number: 130, 143, 129): Ctrl-C, ``kill``, and the
#: terminal's hang-up (a closed terminal or a dropped ssh session; ``nohup`` starts the process with it ignored, and
#: then it stays ignored)
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: seconds after a signal in which the same signal again is taken as the same request
REPEAT_SECONDS = 1.0
_first_signal_at: dict[int, float] = {}
_deferred: list[int] = []  # signals noted once the output was complete (defer_signals)
_noted_at: dict[int, float] = {}  # when each kind was first noted (_note), for a repeat that ends the process
#: one item while the complete output is being flushed and moved into place (defer_signals .. output_in_place): None,
#: or the signal number of a repeat noted meanwhile, which ends the process once the output is in place
_publishing: list[int | None] = []
_owner_pid = os.getpid()  # the process whose handlers these are (forked workers inherit them)


def signal_word(signum: int) -> str:
    """How an error line names a run stopped by ``signum``: ``terminated`` (SIGTERM), ``hung up`` (SIGHUP: the
    terminal closed), else ``interrupted`` (SIGINT, Ctrl-C)."""
    return {signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}.get(signum, "interrupted")


def say(line: str) -> None:
    """Print ``line`` on stderr, best effort: after a hang-up (SIGHUP: the terminal closed, the ssh session dropped)
    stderr is usually that terminal, and every write to it fails (EIO); the command must still write its report file
    and exit with its own code. After a failed write stderr is replaced by the null device, so that no later flush
    (the interpreter's own at exit, which would turn the exit code into 120) fails again."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        try:
            sys.stderr = open(os.devnull, "w")
        except OSError:
            pass


def forget_signals() -> None:
    """Start afresh (a new command in this process): no signal so far is the first of its kind, none deferred; the
    handlers belong to this process."""
    global _owner_pid
    _first_signal_at.clear()
    _deferred.clear()
    _noted_at.clear()
    _publishing.clear()
    _owner_pid = os.getpid()
    reset()


def first_signal() -> int | None:
    """The first of :data:`HANDLED` this command took (its exception raised, held back or dropped by Python), or
    None."""
    return min(_first_signal_at, key=_first_signal_at.__getitem__) if _first_signal_at else None


def raise_if_signalled(exception_type) -> None:
    """Raise ``exception_type(signum)`` if this command took a signal whose exception Python dropped: called before a
    command writes its report, so that an interrupted run never reports success."""
    signum = first_signal()
    if signum is not None:
        raise exception_type(signum)


def in_forked_child() -> bool:
    """Whether this handler runs in a process forked from the command's (a worker that has not yet set its own)."""
    return os.getpid() != _owner_pid


def child_signal(signum: int) -> None:
    """A forked worker's signal before its own handlers are set: SIGINT and SIGHUP ignored (the parent got it too and
    stops the workers), SIGTERM ends the worker at once, quietly (no traceback from its start-up)."""
    if signum == signal.SIGTERM:
        os._exit(128 + signum)


def _note(signum: int, _frame) -> None:
    """A signal once the output is complete: noted; the same one again :data:`REPEAT_SECONDS` or more after the first
    one noted is a second request, which ends the process by the signal's default action (as :func:`_repeated` does
    while a command runs), whatever it is waiting for: at once where the output is in place or the command is over (a
    report left unwritten is all it costs), else once the output is in place (:func:`output_in_place`; killed while
    it is flushed or moved, the run would leave its partial directory and no OUT_DIR)."""
    first = _noted_at.setdefault(signum, time.monotonic())
    if time.monotonic() - first >= REPEAT_SECONDS:
        if not _publishing:
            _end_by(signum)
            return
        if _publishing[0] is None:
            _publishing[0] = signum
    _deferred.append(signum)


def _end_by(signum: int) -> None:
    """End the process at once by ``signum``'s default action."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def output_in_place() -> None:
    """The output deferred by :func:`defer_signals` is in place: a repeated signal noted while it was flushed and
    moved ends the process now, and a later one at once (:func:`_note`)."""
    repeated = _publishing[0] if _publishing else None
    _publishing.clear()
    if repeated is not None:
        _end_by(repeated)


def defer_signals() -> None:
    """From now on the signals of :data:`HANDLED` do not raise: the command's output is complete and is being moved into
    place (an interrupt there would report a failure beside a finished OUT_DIR). They are noted for
    :func:`deferred_signal`; a repeat that ends the process waits for :func:`output_in_place`. Only in the main thread,
    and only for a signal the process does not ignore."""
    if threading.current_thread() is not threading.main_thread():
        return
    _publishing[:] = [None]
    for signum in HANDLED:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _note)


def deferred_signal() -> int | None:
    """The first signal noted since :func:`defer_signals`, or None."""
    return _deferred[0] if _deferred else None


#: (exit code, on_signal, pid) once the command is over (:func:`finish_at_exit`), for :func:`exit_now`
_finished: list = []


def finish_at_exit(code: int, on_signal) -> None:
    """The command is over and would exit with ``code``: from now on the signals of :data:`HANDLED` are only noted (in
    the main thread, and not one the process ignores), and :func:`exit_now`, the console script's last exit handler,
    ends the process with ``code``, or with ``on_signal(signum)`` where a signal came meanwhile and ``code`` is 0 (it
    reports the interruption and returns the exit code): an interrupted run never exits 0. A signal noted since
    :func:`defer_signals` stays noted: one that came after the command's own last check (:func:`deferred_signal`) counts
    as one that came now."""
    _publishing.clear()  # (the command is over: a repeat ends the process at once)
    if threading.current_thread() is threading.main_thread():
        for signum in HANDLED:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, _note)
    _finished[:] = [code, on_signal, os.getpid()]


def final_exit_code() -> int | None:
    """The exit code :func:`exit_now` ends the process with (None before :func:`finish_at_exit`, and in another
    process)."""
    if not _finished or _finished[2] != os.getpid():
        return None
    code, on_signal, _pid = _finished
    # noted at the end (deferred), or taken after the command's own last check with its exception dropped by Python
    # (raised in a callback): either way the run was interrupted
    signum = deferred_signal() or first_signal()
    if signum is not None and code == 0:
        try:
            code = on_signal(signum)
        except BaseException:  # (reporting failed: the exit code still says interrupted)
            code = 128 + signum
    return code


#: whether exit handlers were registered before :func:`register_exit_now` (a sitecustomize or .pth start-up hook, a
#: coverage tool): then :func:`exit_now` does not end the process, so that those still run
_handlers_before: list = [True]


def register_exit_now() -> None:
    """Register :func:`exit_now` as an exit handler (the console script does, before anything else is imported), and
    note whether any handler came before it."""
    import atexit

    count = getattr(atexit, "_ncallbacks", None)
    _handlers_before[0] = count is None or count() > 0
    atexit.register(exit_now)


def exit_now() -> None:
    """An exit handler, registered by the console script before anything else (so it runs after every other one: worker
    processes stopped, temporary files removed): end the process with :func:`final_exit_code`, its output flushed, at
    once. The interpreter's own shutdown after the handlers took about 55 ms, in which a Ctrl-C could no longer change
    the exit code; now there is none. Does nothing before :func:`finish_at_exit`; where handlers were registered before
    this one (which would run after it), it ends the process only to change a 0 into 130 / 143 / 129, and otherwise
    leaves the interpreter to end it (the 55 ms then remain)."""
    code = final_exit_code()
    if code is None or (_handlers_before[0] and code == _finished[0]):
        return
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # (started with the descriptor closed: nothing to flush)
            continue
        try:
            stream.flush()
        except BrokenPipeError:  # (stdout's reader went away: as the command line reports it, 128 + SIGPIPE)
            code = code or 141
        except BaseException:  # (as Python itself ends when flushing fails at exit)
            code = code or 120
    os._exit(code)


def is_repeat(signum: int) -> bool:
    """Whether ``signum`` came within :data:`REPEAT_SECONDS` of the first one of its kind."""
    first = _first_signal_at.get(signum)
    return first is not None and time.monotonic() - first < REPEAT_SECONDS


def take_first(signum: int, exception: BaseException) -> None:
    """In a signal handler, for the first ``signum``: note it and its time, hand later ones to :func:`_repeated`, and
    raise ``exception`` in the main thread (now, or at the end of the library's held-back section:
    :func:`marlin_convert.interrupts.interrupt`)."""
    _first_signal_at[signum] = time.monotonic()
    signal.signal(signum, _repeated)
    interrupt(exception)


def _repeated(signum: int, _frame) -> None:
    """The same signal during the clean-up: within :data:`REPEAT_SECONDS` of the first, ignored (one request sent
    twice); later, a second Ctrl-C (or SIGTERM) that ends the process at once, by the signal's default action."""
    if is_repeat(signum):
        return
    _end_by(signum)
