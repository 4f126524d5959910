"""The ``marlin-convert`` console script's first step, before the command line's own modules are imported.

A ``verify`` that will run the kernel needs torch in its GPU processes, and torch's import is the longest part of
its start-up (2-3 s on the H200 machine). So when the arguments name ``verify`` without ``--skip-kernel`` (or
``--help``), the first GPU process is started here (:func:`marlin_convert.gpu_workers.prestart`), and imports torch
while this process imports the command line (0.5 s there without cached bytecode) and reads the manifest. Everything
else is :func:`marlin_convert.cli.app.run`.
"""

from __future__ import annotations

import os
import signal
import sys

from ..errors import memory_refused
from ._signals import (HANDLED, child_signal, first_signal, in_forked_child, is_repeat, register_exit_now, say,
                       signal_word, take_first)
from ._stale_report import replace_stale_report

# first of all exit handlers, so it runs last: the process ends there with the command's exit code (:func:`exit_now`)
register_exit_now()

#: arguments after which verify runs no kernel (or nothing at all), so no GPU process is started early
_NO_KERNEL = {"--skip-kernel", "-h", "--help"}

#: numpy's OpenBLAS starts a thread per core as numpy is imported, reserving memory for each, though nothing here
#: multiplies matrices on the CPU; where the system refuses such a thread (a ``ulimit -v``, the process limit) OpenBLAS
#: sends the process SIGINT ("Error: interrupted", exit 130, with no Ctrl-C) or exits 1 with its own message. One
#: thread (unless the environment sets a number) starts none.
_BLAS_THREADS = "OPENBLAS_NUM_THREADS"


#: the least address space (``ulimit -v``) in which the modules load: below it numpy's OpenBLAS, refused the buffer it
#: reserves as it loads, ends the process itself (exit 1, "OpenBLAS error: Memory allocation still failed"), before
#: any error could be reported (about 80-105 MiB with numpy 2.4); nothing converts or verifies in less anyway
MIN_ADDRESS_SPACE = 128 << 20


def _too_little_address_space() -> str | None:
    """The ``Error:`` line's text where the address-space limit is below :data:`MIN_ADDRESS_SPACE`, else None."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError, AttributeError):
        return None
    if soft == resource.RLIM_INFINITY or soft >= MIN_ADDRESS_SPACE:
        return None
    return (f"out of memory: the address-space limit (ulimit -v) is {soft >> 10} KiB, and loading marlin-convert's "
            f"modules (numpy) needs at least {MIN_ADDRESS_SPACE >> 20} MiB")


def _load_failure(exc: BaseException) -> tuple[str, str]:
    """The ``Error:`` line's text and the hint for an exception raised while the command line's modules (numpy among
    them) were imported: memory refused (``ulimit -v``: a MemoryError, or a shared library that cannot be mapped) or
    an installation that is broken. Its innermost cause says why in one line (numpy's own ImportError is a page of
    advice around "Original error was: ...")."""
    cause = exc
    while cause.__cause__ is not None or (cause.__context__ is not None and not cause.__suppress_context__):
        cause = cause.__cause__ or cause.__context__
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    reason = lines[0] if lines else type(cause).__name__
    if memory_refused(exc) or memory_refused(cause):
        return (f"out of memory while loading marlin-convert's modules: {reason}",
                "raise the memory limit (ulimit -v) or free memory")
    return (f"cannot load marlin-convert's modules: {type(cause).__name__}: {reason}",
            "a memory limit (ulimit -v) too small to load numpy, or a broken installation: raise the limit, or "
            "reinstall ('pip install -e .' in a fresh virtual environment)")


class _Terminated(BaseException):
    """SIGTERM or SIGHUP (``signum``) before (or after) the command line's own handler is in place."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


def _take_signal(signum: int, _frame) -> None:
    """A signal of :data:`HANDLED` before (or after) the command line's own handler is in place: :class:`_Terminated`,
    or KeyboardInterrupt as Python's own SIGINT handler raises, but noted (:func:`first_signal`), so that one whose
    exception Python drops (raised in a callback) still ends the run as interrupted."""
    if in_forked_child():  # (a process forked from this one: :mod:`._signals`)
        child_signal(signum)
    elif not is_repeat(signum):  # (the same signal twice: GNU timeout; :mod:`._signals`)
        take_first(signum, KeyboardInterrupt() if signum == signal.SIGINT else _Terminated(signum))


def _amend_report(code: int, message: str) -> None:
    """A signal outside main()'s own handling: right after it returned, the report file it wrote (if any) gets this exit
    code; before the command checked its --json path (while the command line's modules were imported, too), a report
    of an earlier run there is replaced (:func:`replace_stale_report`)."""
    output = sys.modules.get("marlin_convert.cli._output")
    if output is not None and output.report_written():
        output.amend_written_outcome(code)
    elif output is None or not output.report_target_checked():  # (nothing checked or wrote --json yet)
        replace_stale_report(code, message)


def _exit(code: int, message: str, hint: str | None = None):
    """End the process before or after main(): the ``Error:`` line (and the hint), the report file amended
    (:func:`_amend_report`), exit ``code``."""
    say(f"Error: {message}"[:2000])
    if hint:
        say(f"Hint: {hint}")
    _amend_report(code, message)
    sys.exit(code)


def _unraisable(previous):
    """sys.unraisablehook that prints nothing for the exception of a signal of :data:`HANDLED` this process took, where
    Python dropped it (raised in an import lock's callback or an at-fork hook: "Exception ignored in ..."); the signal
    stays noted (:func:`first_signal`) and the command ends as interrupted. Anything else goes to ``previous``."""
    def hook(args) -> None:
        if first_signal() is not None:
            errors = sys.modules.get("marlin_convert.cli._errors")  # (the command's Interrupted, once it is imported)
            taken = (KeyboardInterrupt, _Terminated) + ((errors.Interrupted,) if errors is not None else ())
            if isinstance(args.exc_value, taken):
                return
        previous(args)
    return hook


def run() -> None:
    args = sys.argv[1:]
    sys.unraisablehook = _unraisable(sys.unraisablehook)
    early = args[:1] == ["verify"] and not _NO_KERNEL & set(args)
    for signum in HANDLED:  # (one the process was started ignoring stays ignored: `cmd &` for SIGINT, `nohup`)
        if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(signum, _take_signal)
    os.environ.setdefault(_BLAS_THREADS, "1")
    too_little = _too_little_address_space()
    if too_little is not None:
        _exit(2, too_little, "raise the memory limit (ulimit -v)")
    try:
        if early:
            from ..gpu_workers import prestart

            prestart()
        try:
            from .app import run as run_app
        except (ImportError, MemoryError, OSError) as exc:
            if os.environ.get("MARLIN_CONVERT_DEBUG"):
                raise
            _exit(2, *_load_failure(exc))

        taken = first_signal()
        if taken is not None:  # taken during the imports, its exception dropped by Python (:mod:`._signals`)
            raise KeyboardInterrupt() if taken == signal.SIGINT else _Terminated(taken)
        run_app()
    except KeyboardInterrupt:  # Ctrl-C during the imports, or right after main() (main() turns one during the command
        _exit(130, "interrupted")  # into the same line and exit code)
    except _Terminated as exc:  # SIGTERM / SIGHUP likewise (once app.run has the exit code, signals are only noted)
        _exit(128 + exc.signum, signal_word(exc.signum))
    finally:  # run_app leaves through sys.exit (SystemExit): this runs then too
        if early:
            from ..gpu_workers import discard_prestarted

            discard_prestarted()


if __name__ == "__main__":
    run()
