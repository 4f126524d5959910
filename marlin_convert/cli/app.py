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

import sys

import typer

from .. import __version__
from ._errors import report_error
from .convert import convert
from .inspect import inspect
from .verify import verify

app = typer.Typer(
    name="marlin-convert",
    help="Convert GPTQ safetensors checkpoints to the Marlin FP16xINT4 format offline, and verify every layer "
    "on the GPU. 'marlin-convert IN_DIR OUT_DIR' is short for 'marlin-convert convert IN_DIR OUT_DIR'.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("convert")(convert)
app.command("inspect")(inspect)
app.command("verify")(verify)

COMMANDS = {"convert", "inspect", "verify"}


def _version(value: bool) -> None:
    if value:
        print(f"marlin-convert {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Convert GPTQ checkpoints to Marlin format and verify them."""


def with_default_command(argv: list[str]) -> list[str]:
    """``marlin-convert IN OUT ...`` means ``marlin-convert convert IN OUT ...``."""
    first = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), None)
    if first is None or argv[first] in COMMANDS:
        return argv
    return [*argv[:first], "convert", *argv[first:]]


def main(argv: list[str] | None = None) -> int:
    args = with_default_command(list(sys.argv[1:] if argv is None else argv))
    try:
        app(args=args, prog_name="marlin-convert", standalone_mode=False)
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        print("Error: aborted", file=sys.stderr)
        return 1
    except Exception as exc:
        if hasattr(exc, "show") and isinstance(getattr(exc, "exit_code", None), int):
            exc.show()  # a usage error (unknown option, missing argument): click formats it with the usage line
            return exc.exit_code
        return report_error(exc)
    except KeyboardInterrupt as exc:
        return report_error(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
