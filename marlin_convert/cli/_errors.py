"""One place that turns library errors into an ``Error:`` line, a ``Hint:`` line and an exit code."""

from __future__ import annotations

import errno
import os
import signal
import traceback
from concurrent.futures.process import BrokenProcessPool

from ..errors import MarlinConvertError, memory_refused
from ..workers import LIMIT_HINT, thread_refused
from ._signals import say, signal_word

DEBUG_VARIABLE = "MARLIN_CONVERT_DEBUG"


class Interrupted(BaseException):
    """SIGINT (Ctrl-C), SIGTERM or SIGHUP arrived; raised in the main thread by the CLI's signal handler.

    A ``BaseException`` (like KeyboardInterrupt) so that no ``except Exception`` swallows it, but not a
    KeyboardInterrupt, which typer would turn into a plain return value.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class InterruptedAfterPublish(Interrupted):
    """A signal that arrived once the output was complete and being moved into place (deferred until the report was
    printed): the run says it was interrupted, and that its output is finished."""

    def __init__(self, signum: int, out_dir: str) -> None:
        super().__init__(signum)
        self.out_dir = out_dir


class InterruptedAtExit(Interrupted):
    """A signal that arrived after the command had completed, while the process was ending (with exit code 0 so far):
    the run says it was interrupted, and that the command had completed."""


#: control characters (C0, DEL, C1): a name from a hostile checkpoint holding a newline or a terminal escape must not
#: turn one ``Error:`` line into two, or reach the terminal raw
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


#: OSError numbers that come from the machine or the files, not from a bug: they exit 2 naming the file
_ENVIRONMENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOENT,
                       errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EMFILE, errno.ENFILE,
                       errno.EFBIG, errno.ENXIO, errno.ENODEV, errno.ETXTBSY, errno.EBUSY, errno.ESTALE}


#: what the machine ran out of, not a bug: memory (a MemoryError where overcommit is off or a ``ulimit -v`` is set), or
#: a worker process the system killed (the out-of-memory killer sends SIGKILL): exit 2, as for a full disk
_OUT_OF_RESOURCES = (MemoryError, BrokenProcessPool)


def one_line(text: str) -> str:
    """``text`` with every control character written as ``\\xNN``: printed, it is one line."""
    return text.translate(_CONTROL)


#: the longest Error / Hint line printed; a longer message (a 300,000-character regex quoted from a config) keeps its
#: start and end (the JSON report of a failed command has it whole)
MAX_LINE = 2000


def shortened(line: str) -> str:
    """``line`` if at most :data:`MAX_LINE` characters, else its first and last parts around a note of what was left
    out."""
    if len(line) <= MAX_LINE:
        return line
    head, tail = MAX_LINE * 2 // 3, MAX_LINE // 4
    return f"{line[:head]} [... {len(line) - head - tail} characters left out ...] {line[-tail:]}"


def error_message(exc: BaseException) -> str:
    """What :func:`report_error` says of ``exc`` after ``Error:`` (also the JSON report of a failed command)."""
    if isinstance(exc, MarlinConvertError):
        return exc.message
    if isinstance(exc, InterruptedAfterPublish):
        return (f"{signal_word(exc.signum)} once the conversion was complete: {exc.out_dir} is finished and in place "
                "(its report is above)")
    if isinstance(exc, InterruptedAtExit):
        return (f"{signal_word(exc.signum)} as the process was ending: the command had completed (its output and "
                "report are above)")
    if isinstance(exc, Interrupted):
        return signal_word(exc.signum)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, OSError) and exc.errno in _ENVIRONMENT_ERRNOS:
        return f"{exc.filename if exc.filename is not None else 'standard output or a file'}: {exc.strerror or exc}"
    if memory_refused(exc):  # (a MemoryError, or a shared library imported late that could not be mapped)
        text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        return f"out of memory: {text}" if text else "out of memory"
    if thread_refused(exc):  # (one the library did not meet itself: multiprocessing's queue feeders, say)
        return f"cannot start a thread: {exc}"
    if isinstance(exc, BrokenProcessPool):
        return ("a worker process ended abruptly (killed: by the system's out-of-memory killer, say); the run is "
                "abandoned")
    return f"internal error: {type(exc).__name__}: {exc}"


def exit_code(exc: BaseException) -> int:
    """The exit code of a command that ends with ``exc`` (see :func:`report_error`)."""
    if isinstance(exc, MarlinConvertError):
        return exc.exit_code
    if isinstance(exc, Interrupted):
        return 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if isinstance(exc, OSError) and exc.errno in _ENVIRONMENT_ERRNOS:
        return 2
    if isinstance(exc, _OUT_OF_RESOURCES) or memory_refused(exc) or thread_refused(exc):
        return 2
    return 3


def error_hint(exc: BaseException) -> str | None:
    """The ``Hint:`` :func:`report_error` prints for ``exc`` (also the JSON report of a failed command), or None: the
    error's own, or for an internal error (exit 3) how to report it."""
    if isinstance(exc, MarlinConvertError):
        return exc.hint or None
    if exit_code(exc) == 3:
        return f"this is a bug in marlin-convert; set {DEBUG_VARIABLE}=1 for the traceback and report it"
    if isinstance(exc, _OUT_OF_RESOURCES) or memory_refused(exc):
        return "free memory, or run with fewer --workers (each holds one layer or expert at a time)"
    if thread_refused(exc):
        return LIMIT_HINT
    return None


def report_error(exc: BaseException) -> int:
    """Print ``exc`` for a person on stderr and return the exit code. Tracebacks only with MARLIN_CONVERT_DEBUG=1.

    Interrupts exit 128 + the signal number: 130 for SIGINT (``Error: interrupted``), 143 for SIGTERM (``Error:
    terminated``), 129 for SIGHUP (``Error: hung up``), as shells report them. An OSError the library did not turn into
    one of its errors (a permission or a full disk met outside the paths it checks, such as stdout;
    :data:`_ENVIRONMENT_ERRNOS`) exits 2 naming the file; any other OSError is an internal error (exit 3), as a bug
    would be. Messages are printed on one line each (:func:`one_line`), of at most :data:`MAX_LINE` characters
    (:func:`shortened`).
    """
    if os.environ.get(DEBUG_VARIABLE):
        say("".join(traceback.format_exception(exc)).rstrip("\n"))
    say(shortened(one_line(f"Error: {error_message(exc)}")))
    hint = error_hint(exc)
    if hint:
        say(shortened(f"Hint: {one_line(hint)}"))
    return exit_code(exc)
