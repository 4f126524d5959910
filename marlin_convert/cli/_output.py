"""One output object: a rich table (and lines) for people, or the same data as JSON for machines."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import InputError, OutputError
from ..fileio import is_hub_blob, replace_file
from ._errors import one_line


#: the escapes of ``json.dumps``'s text read left to right: an escaped backslash, a surrogate pair (a character
#: beyond U+FFFF, whose second half may be \\udc80..\\udcff: U+1F480 is \\ud83d\\udc80), or a lone surrogate
#: (``\\udcff``: group 1), a byte of a path or name that is not UTF-8, as the file system gives it (surrogateescape)
_SURROGATE_ESCAPE = re.compile(r"\\\\|\\ud[89ab][0-9a-f]{2}\\ud[c-f][0-9a-f]{2}|\\udc([89a-f][0-9a-f])")


def json_text(data: dict) -> str:
    """A report's JSON (``str()`` of what JSON has no type for), with every byte of a path or name that is not UTF-8
    written ``\\xNN`` (as :func:`~marlin_convert.fileio.name_text` and the manifest write it), never as a lone surrogate
    escape, which strict JSON readers refuse. Works on the text, so a report nests as deep as JSON itself allows."""
    text = json.dumps(data, indent=2, default=str)
    return _SURROGATE_ESCAPE.sub(lambda m: m.group(0) if m.group(1) is None else "\\\\x" + m.group(1), text) \
        if "\\udc" in text else text


class OutputClosed(Exception):
    """The reader of stdout went away (EPIPE: ``inspect IN | head``). The CLI exits 141, as shells report SIGPIPE,
    not 1, which ``verify`` uses for a failed layer."""


def silence_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so that the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


class _Console(Console):
    """rich's Console, with a closed stdout reported as :class:`OutputClosed` (rich's own answer is exit 1)."""

    def on_broken_pipe(self) -> None:
        silence_stdout()
        raise OutputClosed()


def print_stdout(text: str) -> None:
    """``print`` for what does not go through rich (JSON, the version): a closed stdout is :class:`OutputClosed`
    here too (left to click, it would be exit 1)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        silence_stdout()
        raise OutputClosed() from None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclass
class Output:
    """Collects a report's title, a table, summary lines and the machine-readable data.

    ``render()`` prints the table for people (or, with ``as_json``, the data as JSON on stdout);
    ``write_json(path)`` writes the data for machines beside whatever was printed.
    """

    title: str
    data: dict
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    lines: list[str | Text] = field(default_factory=list)  # plain strings (never markup), or styled Text
    as_json: bool = False
    row_styles: list[str | None] = field(default_factory=list)

    def add_row(self, *cells: object, style: str | None = None) -> None:
        self.rows.append([str(c) for c in cells])
        self.row_styles.append(style)

    def set_outcome(self, exit_code: int) -> None:
        """Put ``"ok"`` and ``"exit_code"`` first in the data, as a failed command's report has them
        (:func:`report_failure`): a script reads every report's outcome the same way."""
        rest = {key: value for key, value in self.data.items() if key not in ("ok", "exit_code")}
        self.data = {"ok": exit_code == 0, "exit_code": exit_code, **rest}

    def render(self) -> None:
        """Print for people. Names, paths and reasons are printed as they are: nothing in them is read as rich
        markup (a label such as ``P[expert 3]`` stays visible), and control characters in them are written as
        ``\\xNN`` (:func:`one_line`: a newline or a terminal escape in a tensor name stays inert text). Where
        stdout is not a terminal (a pipe, a log file) nothing is wrapped at 80 columns: the table takes the width it
        needs and every line stays one line, so that logs can be searched."""
        console = _Console()
        if self.as_json:
            print_stdout(json_text(self.data))
            return
        wrap = console.is_terminal
        if self.title:
            console.print(Text(one_line(self.title), style="bold"), soft_wrap=not wrap)
        if self.rows:
            table = Table()
            for column in self.columns:
                table.add_column(column, overflow="fold")
            for row, style in zip(self.rows, self.row_styles):
                table.add_row(*(Text(one_line(cell)) for cell in row), style=style)
            if not wrap:
                wanted = console.measure(table, options=console.options.update_width(1 << 16)).maximum
                console = _Console(width=max(console.width, wanted))
            console.print(table)
        for line in self.lines:
            if isinstance(line, str):
                line = one_line(line)
            console.print(line, markup=False, highlight=False, soft_wrap=not wrap)

    def render_then_raise(self, error: Exception | None) -> None:
        """:meth:`render`, then raise ``error`` when there is one: a failed run outranks a closed stdout (its exit
        code, not 141, is what a script sees)."""
        try:
            self.render()
        except OutputClosed:
            if error is None:
                raise
        if error is not None:
            raise error

    def write_json(self, path: str | Path | None) -> None:
        """Write the data as JSON to ``path``; ``-`` means stdout: then :meth:`render` prints the JSON instead of the
        table (a pipe gets one JSON document, nothing else). A file named ``-`` is ``./-``.

        A regular file (or a new one) gets a new file renamed over it, in the directory where it lies (through a
        symbolic link: the link's target), so an existing file is replaced, never written through: a hard link to a
        shard or a config keeps its content. A stream (``/dev/stdout``, ``/dev/fd/N`` of a process substitution,
        ``/dev/null``, a FIFO: :func:`_written_through`) is written through, as a shell's ``>`` would."""
        forget_report_target()  # this run's own report: a failure after it (a dry run's refusal) keeps it
        if is_stdout(path):
            self.as_json = True
            return
        if path is None:
            return
        try:
            _write_report(path, json_text(self.data) + "\n")
        except OSError as exc:
            raise OutputError(f"--json {path}: cannot write: {exc.strerror or exc}") from exc
        _written_report[:] = [path, self.data]

    def write_json_once_done(self, path: str | Path | None, done: str, hint: str | None = None) -> None:
        """:meth:`write_json` once the command's work is done (``done`` says what it did: an output in place, a
        verdict): a report that cannot be written (a full disk) still fails the command, exit 2, but after the table
        and summary are printed, and its line says ``done`` (alone it read as nothing done, and the summary was
        lost)."""
        try:
            self.write_json(path)
        except OutputError as exc:
            self.render_then_raise(OutputError(f"{exc.message}; {done} (its summary is above)", hint=hint))


def _write_report(path: str | Path, text: str) -> None:
    """``text`` to the --json file ``path``: through a stream (:func:`_written_through`), else as a new file renamed
    over the name (:func:`~marlin_convert.fileio.replace_file`). Raises OSError."""
    if _written_through(Path(path)):
        with open(path, "w", encoding="utf-8") as stream:
            stream.write(text)
    else:
        replace_file(Path(os.path.realpath(path)), text.encode("utf-8"))


def _written_through(path: Path) -> bool:
    """Whether a report goes through ``path`` rather than into a new file renamed over it: ``path`` names one of
    this process's descriptors (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``, ``/proc/self/fd/N``: a link to
    whatever the descriptor is, a regular file too), or exists (after links) and is not a regular file (a device,
    a FIFO, a socket). A new or regular file elsewhere, ``/dev/shm`` included, is not."""
    parts = Path(os.path.abspath(path)).parts
    if parts[1:3] in (("dev", "stdout"), ("dev", "stderr"), ("dev", "fd")) or (
            parts[1:2] == ("proc",) and parts[3:4] == ("fd",)):
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # absent (or a broken link): a new file
        return False


def is_stdout(path: str | Path | None) -> bool:
    """Whether a ``--json`` argument, as given on the command line (a string: ``Path("./-")`` would read ``-``), is
    ``-`` (stdout)."""
    return isinstance(path, str) and path == "-"


#: the running command's --json target once check_json_path accepted it (for report_failure), else None
_report_target: list = [None]


#: the report file this command wrote and its data (Output.write_json), for amend_written_outcome; empty when none
_written_report: list = []


def forget_report_target() -> None:
    """A new command: no --json target yet."""
    _report_target[0] = None


def report_target_checked() -> bool:
    """Whether this command has checked (and accepted) a --json target (check_json_path)."""
    return _report_target[0] is not None


def forget_written_report() -> None:
    """A new command: no report file written yet."""
    _written_report.clear()


def report_written() -> bool:
    """Whether this command wrote its report file (Output.write_json)."""
    return bool(_written_report)


def amend_written_outcome(exit_code: int) -> None:
    """Where this command wrote its report file and then ends with another exit code (a closed stdout while the table
    was printed: 141; a signal once the output was in place: 130 / 143 / 129), rewrite the report's ``"ok"`` and
    ``"exit_code"`` to that, the rest as written: a report's exit code is always the process's. Best effort, as
    :func:`report_failure`."""
    if not _written_report:
        return
    path, data = _written_report
    text = json_text({**data, "ok": exit_code == 0, "exit_code": exit_code}) + "\n"
    try:
        _write_report(path, text)
    except BaseException:  # (the exit code stands; the Error line says what happened)
        pass


def report_failure(message: str, exit_code: int, hint: str | None = None) -> None:
    """Where the failed command had a --json target: write ``{"ok": false, "exit_code": ..., "error": ...,
    "hint": ...}`` there (``-``: on stdout; the whole message and hint, ``hint`` null where there is none), so that no
    report of an earlier run is left to read as this one's. Best effort: a target that cannot be written now is left
    as it is (the Error line on stderr says what failed)."""
    path = _report_target[0]
    if path is None:
        return
    text = json_text({"ok": False, "exit_code": exit_code, "error": message, "hint": hint}) + "\n"
    try:
        if is_stdout(path):
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            _write_report(path, text)
    except BaseException:  # (an interrupt or a closed stdout while reporting a failure: the exit code stands)
        pass


def _link_into(directory: str | Path, target: Path, limit: int = 100_000) -> Path | None:
    """A symbolic link under ``directory`` (walked without following directory links; at most ``limit`` entries)
    whose resolved target is ``target``, else None."""
    seen = 0
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            seen += 1
            if seen > limit:
                return None
            entry = Path(root) / name
            if os.path.islink(entry) and Path(os.path.realpath(entry)) == target:
                return entry
    return None


def check_json_path(path: str | Path | None, *checkpoints: str | Path | None) -> None:
    """Refuse a ``--json`` file that cannot be written, or that lies inside one of the ``checkpoints`` directories
    the command reads or writes (it would overwrite a shard, a config or the manifest, or land in a converted
    directory), before the command does any work. Creates nothing. An accepted one is where :func:`report_failure`
    writes if the command fails."""
    if path is None:
        return
    if is_stdout(path):
        _report_target[0] = path
        return
    if isinstance(path, str) and path.startswith("-"):  # (`--json --`, `--json -q`: an option taken for the file)
        raise InputError(f"--json {path}: looks like an option, not a file name",
                         hint=f"give the report's file after --json; for a file of that name write ./{path}")
    path = Path(path)
    resolved = Path(os.path.realpath(path))
    for directory in checkpoints:
        if directory is not None and (resolved.is_relative_to(os.path.realpath(directory))
                                      or Path(os.path.abspath(path)).is_relative_to(os.path.abspath(directory))):
            raise OutputError(f"--json {path}: inside {directory}, which this command reads or writes",
                              hint="write the report outside the checkpoint directories")
        if directory is not None and Path(os.path.realpath(directory)).is_relative_to(resolved):
            raise OutputError(f"--json {path}: {directory}, which this command reads or writes, lies inside it",
                              hint="write the report to a file of its own")
    if path.is_dir():
        raise OutputError(f"--json {path}: is a directory")
    # a checkpoint's files may be links to files elsewhere (a Hugging Face cache snapshot's to its repository's blobs):
    # the report must not land on the file such a link reads
    if is_hub_blob(resolved):
        raise OutputError(f"--json {path}: a file of a Hugging Face cache's blob store (it may be a checkpoint's "
                          "shard or config)", hint="write the report outside the cache")
    for directory in checkpoints:
        linked = _link_into(directory, resolved) if directory is not None else None
        if linked is not None:
            raise OutputError(f"--json {path}: {linked} in {directory}, which this command reads or writes, is a link "
                              "to it", hint="write the report outside the checkpoint directories")
    if _written_through(path):  # (write_json)
        if not os.access(path, os.W_OK):
            raise OutputError(f"--json {path}: not writable")
        _report_target[0] = str(path)
        return
    parent = resolved.parent  # where the new file is created and renamed over the name (write_json)
    if not parent.is_dir():
        raise OutputError(f"--json {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"--json {path}: not writable (the report is written as a new file in {parent}, "
                          "which this user cannot write)")
    _report_target[0] = str(path)
