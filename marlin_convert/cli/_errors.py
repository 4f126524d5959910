"""One place that turns library errors into an ``Error:`` line, a ``Hint:`` line and an exit code."""

from __future__ import annotations

import os
import signal
import sys
import traceback

from ..errors import MarlinConvertError

DEBUG_VARIABLE = "MARLIN_CONVERT_DEBUG"


class Interrupted(BaseException):
    """SIGINT (Ctrl-C) or SIGTERM arrived; raised in the main thread by the CLI's signal handler.

    A ``BaseException`` (like KeyboardInterrupt) so that no ``except Exception`` swallows it, but not a
    KeyboardInterrupt, which typer would turn into a plain return value.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def report_error(exc: BaseException) -> int:
    """Print ``exc`` for a person on stderr and return the exit code. Tracebacks only with MARLIN_CONVERT_DEBUG=1.

    Interrupts exit 128 + the signal number: 130 for SIGINT (``Error: interrupted``), 143 for SIGTERM
    (``Error: terminated``), as shells report them.
    """
    if os.environ.get(DEBUG_VARIABLE):
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, MarlinConvertError):
        print(f"Error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"Hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    if isinstance(exc, Interrupted) and exc.signum == signal.SIGTERM:
        print("Error: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    if isinstance(exc, (Interrupted, KeyboardInterrupt)):
        print("Error: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    print(f"Error: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"Hint: this is a bug in marlin-convert; set {DEBUG_VARIABLE}=1 for the traceback and report it",
          file=sys.stderr)
    return 3
