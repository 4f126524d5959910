"""One place that turns library errors into an ``Error:`` line, a ``Hint:`` line and an exit code."""

from __future__ import annotations

import os
import sys
import traceback

from ..errors import MarlinConvertError

DEBUG_VARIABLE = "MARLIN_CONVERT_DEBUG"


def report_error(exc: BaseException) -> int:
    """Print ``exc`` for a person on stderr and return the exit code. Tracebacks only with MARLIN_CONVERT_DEBUG=1."""
    if os.environ.get(DEBUG_VARIABLE):
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, MarlinConvertError):
        print(f"Error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"Hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        print("Error: interrupted", file=sys.stderr)
        return 130
    print(f"Error: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"Hint: this is a bug in marlin-convert; set {DEBUG_VARIABLE}=1 for the traceback and report it",
          file=sys.stderr)
    return 3
