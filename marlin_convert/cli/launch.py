"""The ``marlin-convert`` console script's first step, before the command line's own modules are imported.

A ``verify`` that will run the kernel needs torch in its GPU processes, and torch's import is the longest part of
its start-up (2-3 s on the H200 machine). So when the arguments name ``verify`` without ``--skip-kernel`` (or
``--help``), the first GPU process is started here (:func:`marlin_convert.gpu_workers.prestart`), and imports torch
while this process imports the command line (0.5 s there without cached bytecode) and reads the manifest. Everything
else is :func:`marlin_convert.cli.app.run`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import sys
from pathlib import Path

from ..fileio import replace_file
from ._signals import child_signal, first_signal, in_forked_child, is_repeat, register_exit_now, take_first

# first of all exit handlers, so it runs last: the process ends there with the command's exit code (:func:`exit_now`)
register_exit_now()

#: arguments after which verify runs no kernel (or nothing at all), so no GPU process is started early
_NO_KERNEL = {"--skip-kernel", "-h", "--help"}


class _Terminated(BaseException):
    """SIGTERM before (or after) the command line's own handler is in place."""


def _terminated(signum: int, _frame) -> None:
    if in_forked_child():  # (a process forked from this one: :mod:`._signals`)
        child_signal(signum)
    elif not is_repeat(signum):  # (the same SIGTERM twice: GNU timeout; :mod:`._signals`)
        take_first(signum, _Terminated())


def _amend_report(code: int, message: str) -> None:
    """A signal outside main(): right after it returned, the report file it wrote (if any) gets this exit code; before
    the command started (while its modules were imported, too), a report of an earlier run at --json's path is replaced
    (:func:`_replace_stale_report`)."""
    output = sys.modules.get("marlin_convert.cli._output")
    if output is None or not output.command_started():  # (nothing checked or wrote --json yet)
        _replace_stale_report(code, message)
    elif output.report_written():
        output.amend_written_outcome(code)


def _json_target(args: list[str]) -> str | None:
    """--json's value among the command-line arguments (the last one given), or None."""
    target = None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--json" and i + 1 < len(args):
            target = args[i + 1]
        elif arg.startswith("--json="):
            target = arg[len("--json="):]
    return target


#: the start of a report this tool wrote: a JSON object whose first keys are "ok" and "exit_code"
_REPORT_START = re.compile(rb'\s*\{\s*"ok"\s*:\s*(true|false)\s*,\s*"exit_code"\s*:\s*-?[0-9]+\s*[,}]')


def _replace_stale_report(code: int, message: str) -> None:
    """Ctrl-C or SIGTERM before the command line was ready (its path checks not yet made): where --json names a file
    that is a report of an earlier run (a JSON object that starts with "ok" and "exit_code"), replace it with this
    run's failure report, so that it is not read as this run's; anything else there is left alone. Best effort."""
    target = _json_target(sys.argv[1:])
    if not target or target == "-":
        return
    try:
        path = os.path.realpath(target)
        if not stat.S_ISREG(os.stat(path).st_mode):  # (a FIFO or a device: nothing stale to replace, and an open could
            return  # block)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            before = os.fstat(f.fileno())
            if not stat.S_ISREG(before.st_mode):
                return
            head = f.read(256)  # (a report may be megabytes: its first two keys say what it is)
        if _REPORT_START.match(head) is None:
            return
        text = json.dumps({"ok": False, "exit_code": code, "error": message, "hint": None}, indent=2) + "\n"
        replace_file(Path(path), text.encode("utf-8"), mode=stat.S_IMODE(before.st_mode))  # (its permissions kept)
    except (OSError, ValueError):
        pass


def _unraisable(previous):
    """sys.unraisablehook that prints nothing for the exception of a SIGINT or SIGTERM this process took, where Python
    dropped it (raised in an import lock's callback or an at-fork hook: "Exception ignored in ..."); the signal stays
    noted (:func:`first_signal`) and the command ends as interrupted. Anything else goes to ``previous``."""
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
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # (one the process was started ignoring stays ignored)
        signal.signal(signal.SIGTERM, _terminated)
    try:
        if early:
            from ..gpu_workers import prestart

            prestart()
        from .app import run as run_app

        if first_signal() is not None:  # taken during the imports, its exception dropped by Python (:mod:`._signals`)
            raise _Terminated()
        run_app()
    except KeyboardInterrupt:  # Ctrl-C during the imports, or right after main() (main() turns one during the command
        print("Error: interrupted", file=sys.stderr)  # into the same line and exit code)
        _amend_report(130, "interrupted")
        sys.exit(130)
    except _Terminated:  # SIGTERM likewise (once app.run has the exit code, signals are only noted)
        print("Error: terminated", file=sys.stderr)
        _amend_report(143, "terminated")
        sys.exit(143)
    finally:  # run_app leaves through sys.exit (SystemExit): this runs then too
        if early:
            from ..gpu_workers import discard_prestarted

            discard_prestarted()


if __name__ == "__main__":
    run()
