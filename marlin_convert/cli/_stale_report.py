"""A report of an earlier run at ``--json``'s path, replaced when a run is interrupted before its command checked that
path (so that it is not read as this run's): for the console script's first step (:mod:`marlin_convert.cli.launch`,
before the command line is imported) and the command line (:mod:`marlin_convert.cli.app`, a signal before the
command's path checks). Imports nothing heavy until a replacement is due.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

from ..fileio import replace_file


def _refused(target: str, args: list[str]) -> bool:
    """Whether the command's own check (:func:`marlin_convert.cli._output.check_json_path`) could refuse ``target``,
    taking every argument that names a directory as a checkpoint the command reads or writes (the command line is not
    parsed yet, so any of them may be IN_DIR or OUT_DIR). A check that fails counts as refused."""
    try:
        from ._output import check_json_path

        check_json_path(target, *[arg for arg in args if not arg.startswith("-") and os.path.isdir(arg)])
    except BaseException:
        return True
    return False


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


def replace_stale_report(code: int, message: str, argv: list[str] | None = None) -> None:
    """Ctrl-C, SIGTERM or SIGHUP before the command had checked its --json path: where --json (among ``argv``, default
    the process's arguments) names a file that is a report of an earlier run (a JSON object that starts with "ok" and
    "exit_code"), replace it with this run's failure report, so that it is not read as this run's; anything else there
    is left alone, and so is a path the command would refuse (:func:`_refused`: inside, or linked from, a directory
    among the arguments, which may be a checkpoint). Best effort."""
    args = sys.argv[1:] if argv is None else argv
    target = _json_target(args)
    if not target or target == "-" or _refused(target, args):
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
