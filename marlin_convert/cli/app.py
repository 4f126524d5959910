"""Entry point of the ``marlin-convert`` command.

Usage examples:
    marlin-convert --help
    marlin-convert IN_DIR OUT_DIR                 # same as: marlin-convert convert IN_DIR OUT_DIR
    marlin-convert inspect IN_DIR
    marlin-convert verify OUT_DIR --gpu 0

Errors from the library are printed once, here, as ``Error: ...`` and ``Hint: ...`` on stderr with a non-zero
exit code; set MARLIN_CONVERT_DEBUG=1 to see the traceback.
"""

from __future__ import annotations

import difflib
import os
import signal
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import typer
from typer.core import TyperCommand

from .. import __version__
from ..errors import InputError
from ..workers import thread_refused
from ._errors import Interrupted, InterruptedAfterPublish, InterruptedAtExit, error_hint, error_message, report_error
from ._output import (OutputClosed, amend_written_outcome, forget_report_target, forget_written_report, report_written,
                      print_stdout, report_failure, report_target_checked)
from ._signals import (HANDLED, child_signal, finish_at_exit, first_signal, forget_signals, in_forked_child,
                       is_repeat, take_first)
from ._stale_report import replace_stale_report
from .convert import convert
from .inspect import inspect
from .verify import verify

app = typer.Typer(
    name="marlin-convert",
    help="Convert 4- and 8-bit GPTQ (or compressed-tensors) safetensors checkpoints to the Marlin format offline, "
    "and verify every layer: the lossless round trip on the CPU, and the Marlin kernel against an fp32 reference on "
    "the GPU (verify --skip-kernel: the CPU checks only). 'marlin-convert IN_DIR OUT_DIR' is short for "
    "'marlin-convert convert IN_DIR OUT_DIR'.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: typer's rich panels show every flag with a '<bool>' value it does not take
    context_settings={"help_option_names": ["-h", "--help"]},
)


class _Command(TyperCommand):
    """Usage lines name the arguments as the README does (``IN_DIR OUT_DIR``; typer writes ``{IN_DIR}``), and an
    option that takes one value is refused when given twice."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [piece.strip("{}") for piece in super().collect_usage_pieces(ctx)]

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        """The parser keeps the last of a repeated option's values and drops the others without a word (``verify OUT
        --source A --source B`` compared with B only): refused, as the parser's own errors are (exit 2, usage)."""
        _, _, order = self.make_parser(ctx).parse_args(args=list(args))  # (the parameters in the order given)
        counts = Counter(param for param in order if param.param_type_name == "option"
                         and not (param.is_flag or param.multiple or param.count))
        repeated = next((param for param, count in counts.items() if count > 1), None)
        if repeated is not None:
            ctx.fail(f"option {'/'.join(repeated.opts)} is given {counts[repeated]} times; it takes one value")
        return super().parse_args(ctx, args)


# each command's line in the top-level help, whole: the docstring's first sentence would be cut off with '...' at
# about 65 characters
app.command("convert", cls=_Command, short_help="Convert the checkpoint in IN_DIR to Marlin form in OUT_DIR.")(convert)
app.command("inspect", cls=_Command, short_help="Show the conversion plan of IN_DIR; nothing is written.")(inspect)
app.command("verify", cls=_Command, short_help="Check a converted OUT_DIR: files, round trip, the kernel.")(verify)

COMMANDS = {"convert", "inspect", "verify"}


def _version(value: bool) -> None:
    if value:
        print_stdout(f"marlin-convert {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                 help="Print the version."),
) -> None:
    """Convert GPTQ checkpoints to Marlin format and verify them."""


#: the options of ``marlin-convert`` itself (not of a command)
ROOT_OPTIONS = {"--version", "-V", "-h", "--help"}


def _refuse_empty(argv: list[str]) -> None:
    """Raise :class:`InputError` for an empty argument: every argument here is a path, a number or a list, and an
    empty one is nearly always an unset shell variable (``marlin-convert IN "$OUT" --overwrite`` with OUT unset would
    otherwise take the current directory as OUT_DIR and replace it). ``--opt=`` is one too (``--json=a=`` is not)."""
    for i, word in enumerate(argv):
        if word == "" or (word.startswith("--") and word.find("=") == len(word) - 1):  # '--source=': no value
            where = word if word else f"after {argv[i - 1]}" if i else "the first"
            raise InputError(f"argument {i + 1} ({where}) is empty: an unset shell variable?",
                             hint="give the path (or value) itself; the current directory is '.'")


def _options_of(command: str) -> set[str]:
    """The option names (``-q``, ``--json``, ...) that ``command`` takes."""
    click_command = typer.main.get_command(app).commands[command]
    return {name for param in click_command.params for name in (*param.opts, *param.secondary_opts)}


def _refuse_misspelt_command(word: str) -> None:
    """Raise :class:`InputError` when ``word`` (the first argument, read as convert's IN_DIR) names nothing on disk
    and is one letter or two from a command's name: ``marlin-convert verfy OUT`` would otherwise be a conversion of a
    directory 'verfy' into OUT, and OUT's problems (not empty: "pass --overwrite") would be reported first."""
    if word.startswith("-") or os.path.lexists(word):
        return
    close = difflib.get_close_matches(word, sorted(COMMANDS), n=1, cutoff=0.7)
    if close:
        raise InputError(f"'{word}' is no command, and no file or directory of that name exists",
                         hint=f"did you mean 'marlin-convert {close[0]} ...'? ('marlin-convert -h' lists the commands)")


def with_default_command(argv: list[str]) -> list[str]:
    """``marlin-convert IN OUT ...`` means ``marlin-convert convert IN OUT ...``, with convert's options anywhere
    (``marlin-convert -q --workers 2 IN OUT`` too): everything but a command name or one of the root's own options
    first is convert's. Options first and a command name after them (``marlin-convert -q verify OUT``) are refused
    (:class:`InputError`): that reads as a command's options put before its name, and taking it as a conversion of
    a directory named ``verify`` could overwrite the wrong one."""
    _refuse_empty(argv)
    if not argv or argv[0] in COMMANDS or argv[0] in ROOT_OPTIONS:
        return argv
    _refuse_misspelt_command(argv[0])
    if argv[0].startswith("-"):
        option = argv[0].split("=", 1)[0]
        convert_options = _options_of("convert")
        if option.startswith("--") and option not in convert_options:
            close = difflib.get_close_matches(option, sorted(ROOT_OPTIONS | convert_options), n=1, cutoff=0.7)
            if close and close[0] in ROOT_OPTIONS:  # (a root option mistyped: convert's usage would be no help)
                raise InputError(f"no option {option}", hint=f"did you mean 'marlin-convert {close[0]}'?")
        elif option not in convert_options:  # a short root option in the other case: -v for -V, -H for -h
            close = [root for root in sorted(ROOT_OPTIONS) if root.lower() == option.lower()]
            if close:
                raise InputError(f"no option {option}", hint=f"did you mean 'marlin-convert {close[0]}'?")
        words = argv[1:argv.index("--")] if "--" in argv else argv[1:]
        named = next((word for word in words if word in COMMANDS), None)
        if named is not None:
            move = (f"write 'marlin-convert {named} ... {argv[0]}'" if option in _options_of(named) else
                    f"'{named}' has no option {option} ('marlin-convert {named} -h' lists its options)")
            raise InputError(f"option {argv[0]} comes before the command name '{named}': a command's options go "
                             "after its name", hint=f"{move}; a directory called '{named}' is './{named}'")
    return ["convert", *argv]


def _raise_interrupted(signum: int, _frame) -> None:
    if in_forked_child():  # a worker process before its own handlers are set (:mod:`._signals`)
        child_signal(signum)
    elif not is_repeat(signum):  # (a copy of the console script's own first signal: :mod:`._signals`)
        take_first(signum, Interrupted(signum))


@contextmanager
def _interrupts_raise() -> Iterator[None]:
    """While the command runs, SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread, so that the
    library's clean-up runs (partial output removed, worker processes stopped) and the exit code says so. A signal
    that whoever started the process ignores (a script's background command, ``cmd &``, gets SIGINT ignored;
    ``nohup``) stays ignored for the whole run, as Python itself leaves it: taking it over here made the same signal
    ignored before this point and an interruption after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    forget_signals()  # a signal an earlier command of this process took is no repeat of this one's
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in HANDLED
                if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


#: exit code when the reader of stdout went away (128 + SIGPIPE), as shells report a process killed by SIGPIPE
EXIT_BROKEN_PIPE = 141


def _failed(exc: BaseException, argv: list[str] | None = None) -> int:
    """Report ``exc`` (stderr), and in the command's --json target where it has one; the exit code. An interruption
    before the command checked its --json path replaces a report of an earlier run there (``argv``: the command's
    arguments, default the process's; :func:`._stale_report.replace_stale_report`). An input error without a hint
    where the arguments read ``help`` as convert's IN_DIR gets :func:`_help_hint`'s."""
    if isinstance(exc, InputError) and exc.hint is None:
        exc.hint = _help_hint(list(sys.argv[1:] if argv is None else argv))
    code = report_error(exc)
    if isinstance(exc, InterruptedAfterPublish) or report_written():  # (a report written before: right but for the
        amend_written_outcome(code)  # exit code, e.g. a Ctrl-C while the table was printed after it)
    elif isinstance(exc, (Interrupted, KeyboardInterrupt)) and not report_target_checked():
        replace_stale_report(code, error_message(exc), argv)
    else:
        report_failure(error_message(exc), code, error_hint(exc))
    return code


def _parser_error(exc: Exception, args: list[str]) -> int:
    """An error of the command-line parser (click's, as typer bundles it: an unknown option, a missing argument, a
    value of the wrong type), in the form of every other error: an ``Error:`` line, a ``Hint:`` line with the
    command's usage, exit 2 (``marlin-convert help``, read as convert's IN_DIR: a hint pointing to ``--help``,
    :func:`_help_hint`). A bare ``marlin-convert`` still prints the whole help."""
    if type(exc).__name__ == "NoArgsIsHelpError":
        exc.show()
        return exc.exit_code
    ctx = getattr(exc, "ctx", None)
    usage = ctx.get_usage().strip() if ctx is not None else ""
    usage = usage[len("Usage:"):].strip() if usage.startswith("Usage:") else usage
    hint = f"usage: {' '.join(usage.split())}; '{ctx.command_path} -h' explains it" if ctx is not None else None
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    # (the usage hint unless _failed gives the one for `help`)
    return _failed(InputError(message.removesuffix("."), hint=None if _help_hint(args) else hint), args)


def _help_hint(args: list[str]) -> str | None:
    """Where the first argument that is not an option is ``help`` and no such path exists (``marlin-convert help``,
    ``help verify``, ``-q help``: read as convert's IN_DIR), a hint pointing to ``--help``; else None."""
    positional = next((arg for arg in args if not arg.startswith("-")), None)
    if positional != "help" or os.path.lexists(positional):
        return None
    return "'help' was read as convert's IN_DIR: 'marlin-convert --help' lists the commands, " \
           "'marlin-convert COMMAND --help' explains one"


def main(argv: list[str] | None = None) -> int:
    """Run marlin-convert with ``argv`` (default: the process's arguments); returns the exit code. While it runs, a
    thread that ended because a thread it starts was refused (the worker pool's managing thread, whose call queue's
    feeder the system refused at the process limit) prints nothing: the command reports it as one ``Error:`` line
    (:func:`marlin_convert.workers.check_pool`); ``threading.excepthook`` is as before for anything else, and after."""
    previous = threading.excepthook

    def thread_died(args) -> None:
        if thread_refused(args.exc_value) and not os.environ.get("MARLIN_CONVERT_DEBUG"):
            return
        previous(args)

    threading.excepthook = thread_died
    try:
        return _main(argv)
    finally:
        threading.excepthook = previous


def _main(argv: list[str] | None) -> int:
    forget_report_target()
    forget_written_report()
    try:
        args = with_default_command(list(sys.argv[1:] if argv is None else argv))
        with _interrupts_raise():
            returned = app(args=args, prog_name="marlin-convert", standalone_mode=False)
    except OutputClosed:  # stdout's reader went away (EPIPE, e.g. `inspect ... | head`): as shells report SIGPIPE
        amend_written_outcome(EXIT_BROKEN_PIPE)
        return EXIT_BROKEN_PIPE
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        print("Error: aborted", file=sys.stderr)
        return 1
    except Exception as exc:
        if hasattr(exc, "show") and isinstance(getattr(exc, "exit_code", None), int):
            return _parser_error(exc, list(sys.argv[1:] if argv is None else argv))
        signum = first_signal()  # a signal came first: the failure is its consequence (a worker it stopped)
        return _failed(exc if signum is None else Interrupted(signum), argv)
    except (Interrupted, KeyboardInterrupt) as exc:
        return _failed(exc, argv)
    signum = first_signal()
    if signum is not None:  # taken, but its exception dropped by Python (:mod:`._signals`), after the command's own
        code = report_error(Interrupted(signum))  # check (its report is written: no second one): interrupted
        amend_written_outcome(code)
        return code
    # typer returns the exit code of a typer.Exit raised inside a command (--version: 0), else the command's None
    return returned if isinstance(returned, int) else 0


def _interrupted_at_exit(signum: int) -> int:
    """A signal after the command had ended with exit code 0 (:func:`._signals.finish_at_exit`): say so, amend the
    report file it wrote, and return the exit code (130 / 143 / 129)."""
    code = report_error(InterruptedAtExit(signum))
    amend_written_outcome(code)
    return code


def run() -> None:
    """The console script's command (after :func:`marlin_convert.cli.launch.run`): :func:`main`, then exit; a signal
    from then on is noted, and turns an exit code of 0 into 130 / 143 / 129 (:func:`._signals.finish_at_exit`; the
    process ends in the console script's last exit handler, :func:`._signals.exit_now`)."""
    code = main()
    finish_at_exit(code, _interrupted_at_exit)
    sys.exit(code)


if __name__ == "__main__":
    run()
