"""The command line: help, the default command, reports for people and machines, verify's verdicts."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from make_gptq_checkpoint import CheckpointSpec, LinearSpec, TensorSpec, tiny_llama, write_checkpoint

from marlin_convert.cli.app import COMMANDS, main, with_default_command
from marlin_convert.manifest import load_manifest
from marlin_convert.safetensors_io import read_header

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def src(tmp_path):
    return write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, shards=2, group_size=64))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help_and_is_documented_in_the_readme(capsys, command):
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert "Usage" in text and len(text) > 200
    assert f"marlin-convert {command}" in (REPO / "README.md").read_text()


def test_the_readme_names_every_field_of_every_json_report(src, tmp_path, capsys):
    """README's table of the JSON reports' fields lists each top-level key each report has, and each key of its
    per-layer entries (a field added to a report must be added there)."""
    readme = (REPO / "README.md").read_text()
    rows = {row.split("|")[1].strip(): row for row in readme.splitlines()
            if row.startswith("| `") and "--json" in row.split("|")[1]}
    out, plan_file, report_file, verify_file = (tmp_path / name for name in ("out", "p.json", "c.json", "v.json"))
    assert main(["inspect", str(src), "--json", str(plan_file)]) == 0
    assert main([str(src), str(out), "-q", "--json", str(report_file)]) == 0
    assert main(["verify", str(out), "--skip-kernel", "-q", "--json", str(verify_file)]) == 0
    capsys.readouterr()
    for row_name, path in (("`convert --json`", report_file), ("`inspect --json`", plan_file),
                           ("`verify --json`", verify_file)):
        row = next(text for name, text in rows.items() if name.startswith(row_name))
        report = json.loads(path.read_text())
        entries = report["results"] if "results" in report else report["layers"]
        keys = set(report) - {"ok", "exit_code"} | set(entries[0])
        missing = sorted(key for key in keys if f"`{key}`" not in row)
        assert not missing, f"{row_name}: README does not name {missing}"


def test_top_level_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for command in COMMANDS:
        assert command in text


def test_top_level_help_gives_each_command_a_whole_line_and_does_not_say_verify_needs_a_gpu(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    lines = {line.split()[0]: line for line in text.split("Commands:")[1].splitlines() if line.strip()}
    assert set(lines) == COMMANDS, lines
    assert all(line.rstrip().endswith(".") and "..." not in line for line in lines.values()), lines
    words = " ".join(text.split())
    assert "verify every layer on the GPU" not in words and "verify --skip-kernel: the CPU checks only" in words


def test_verify_help_says_what_exits_1_and_what_exits_2(capsys):
    assert main(["verify", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Exits 0 when all of it passed; 1 naming what failed" in text, text
    assert ("2 for what it cannot check: bad arguments, an OUT_DIR without a readable, well-formed manifest, a "
            "--source that is no checkpoint the converter reads, or no GPU (or no kernel build) for the kernel run"
            ) in text, text


def test_convert_is_the_default_command(tmp_path, src, capsys):
    assert main([str(src), str(tmp_path / "a"), "-q"]) == 0
    assert main(["convert", str(src), str(tmp_path / "b"), "-q"]) == 0
    # convert's options before the directories, one of them with a value
    assert main(["-q", "--workers", "2", str(src), str(tmp_path / "c")]) == 0
    capsys.readouterr()
    a = {p.name: p.read_bytes() for p in (tmp_path / "a").glob("*.safetensors")}
    for other in ("b", "c"):
        assert {p.name: p.read_bytes() for p in (tmp_path / other).glob("*.safetensors")} == a
    assert len(a) == 2


@pytest.mark.parametrize("argv,expected", [
    ([], []),
    (["--help"], ["--help"]),
    (["-h"], ["-h"]),
    (["--version"], ["--version"]),
    (["-V"], ["-V"]),
    (["verify", "OUT", "-q"], ["verify", "OUT", "-q"]),
    (["IN", "OUT"], ["convert", "IN", "OUT"]),
    (["-q", "IN", "OUT"], ["convert", "-q", "IN", "OUT"]),
    (["--workers", "4", "IN", "OUT"], ["convert", "--workers", "4", "IN", "OUT"]),
])
def test_default_command_rewrite(argv, expected):
    assert with_default_command(argv) == expected


@pytest.mark.parametrize("argv,hint", [(["-q", "verify", "OUT"], "Hint: write 'marlin-convert verify ... -q'"),
                                       (["-q", "--overwrite", "inspect", "IN"], "Hint: 'inspect' has no option -q"),
                                       (["--workers", "2", "IN", "convert"], "Hint: write 'marlin-convert convert ...")])
def test_options_before_a_command_name_are_refused(argv, hint, capsys, tmp_path, monkeypatch):
    """Not read as a conversion of a directory named like the command (which --overwrite could make destroy the
    wrong directory): one Error line, exit 2, nothing created; the hint moves the option only where the command
    has it."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: option ") and "comes before the command name" in err and hint in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,error,usage", [
    (["--bogus", "IN", "OUT"], "No such option: --bogus", "marlin-convert convert [OPTIONS] IN_DIR OUT_DIR"),
    (["verify"], "Missing argument 'OUT_DIR'", "marlin-convert verify [OPTIONS] OUT_DIR"),
    (["inspect", "IN", "--workers", "2"], "No such option: --workers", "marlin-convert inspect [OPTIONS] IN_DIR"),
    (["IN", "OUT", "--workers", "two"], "Invalid value for '--workers'", "marlin-convert convert [OPTIONS] IN_DIR OUT_DIR"),
])
def test_a_command_line_error_is_an_error_line_and_a_usage_hint(argv, error, usage, capsys, tmp_path, monkeypatch):
    """The parser's errors read as every other error: ``Error:`` with the reason, ``Hint:`` with the command's usage,
    exit 2, nothing else on stderr and nothing created."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"Error: {error}"), captured.err
    assert lines[1].startswith(f"Hint: usage: {usage}; '") and lines[1].endswith("-h' explains it"), captured.err
    assert captured.out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("word,command", [("verfy", "verify"), ("inspct", "inspect"), ("conver", "convert")])
def test_a_misspelt_command_is_named_not_converted(word, command, capsys, tmp_path, monkeypatch, src):
    """``marlin-convert verfy OUT`` is no conversion of a directory 'verfy' (whose first complaint would be OUT's:
    "not empty, pass --overwrite"); a directory of that name still converts."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    capsys.readouterr()
    assert main([word, str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"Error: '{word}' is no command") and f"did you mean 'marlin-convert {command} ...'" in err
    assert (out / "marlin_manifest.json").exists()
    (tmp_path / word).symlink_to(src)
    assert main([word, str(tmp_path / "out2"), "-q"]) == 0


@pytest.mark.parametrize("command", [[], ["verify"]])
def test_workers_out_of_range_is_one_error_for_both_commands(command, capsys, tmp_path, src):
    argv = [*command, str(tmp_path / "out"), "--workers", "0"] if command else [str(src), str(tmp_path / "out"),
                                                                                 "--workers", "0"]
    assert main(argv) == 2
    assert capsys.readouterr().err == "Error: --workers 0: expected 1 to 256\n"
    assert not (tmp_path / "out").exists()


def test_a_missing_source_is_named_as_the_source(capsys, tmp_path, src):
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    capsys.readouterr()
    for source, what in ((tmp_path / "nothere", "does not exist"), (out / "config.json", "not a directory")):
        assert main(["verify", str(out), "--skip-kernel", "--source", str(source)]) == 2
        assert capsys.readouterr().err.startswith(f"Error: --source {source}: {what}\nHint: ")


@pytest.mark.parametrize("option", ["--version", "-V"])
def test_version_and_its_short_form_print_the_version(capsys, option):
    from marlin_convert import __version__

    assert main([option]) == 0
    assert capsys.readouterr() == (f"marlin-convert {__version__}\n", "")


def test_a_mistyped_root_option_is_named(capsys):
    assert main(["--verison"]) == 2
    assert capsys.readouterr().err == "Error: no option --verison\nHint: did you mean 'marlin-convert --version'?\n"
    assert main(["--son", "IN", "OUT"]) == 2  # nearer to convert's --json: the parser's message, which names it
    assert "(Possible options: --json)" in capsys.readouterr().err
    # a short root option in the other case got convert's usage as its hint
    for option, meant in (("-v", "-V"), ("-H", "-h")):
        assert main([option]) == 2
        assert capsys.readouterr().err == f"Error: no option {option}\nHint: did you mean 'marlin-convert {meant}'?\n"


def test_a_missing_in_dir_is_named_before_out_dir_problems(capsys, tmp_path, src):
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    capsys.readouterr()
    assert main([str(tmp_path / "nothere"), str(out)]) == 2
    assert capsys.readouterr().err == f"Error: {tmp_path / 'nothere'}: does not exist\n"


@pytest.mark.parametrize("argv", [["IN", "", "--overwrite"], ["convert", "", "OUT"], ["inspect", ""],
                                  ["verify", "", "--skip-kernel"], ["IN", "OUT", "--json", ""],
                                  ["verify", "OUT", "--skip-kernel", "--source="], ["IN", "OUT", "--json="]])
def test_an_empty_argument_is_refused_and_the_current_directory_left_alone(argv, capsys, tmp_path, monkeypatch):
    """An unset shell variable ("$OUT") is an empty argument, which a path would read as the current directory:
    with --overwrite, that directory would be replaced by the output."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("keep me")
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1))
    argv = [str(src) if a == "IN" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: argument ") and "is empty: an unset shell variable?" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "notes.txt"]


def test_a_directory_named_like_a_command_converts_as_dot_slash_name(capsys, tmp_path, monkeypatch):
    write_checkpoint(tmp_path / "verify", tiny_llama(num_layers=1))
    monkeypatch.chdir(tmp_path)
    assert main(["-q", "./verify", "out"]) == 0
    assert (tmp_path / "out" / "marlin_manifest.json").exists()


def test_convert_prints_a_table_and_writes_a_json_report(tmp_path, src, capsys):
    report_path = tmp_path / "report.json"
    assert main([str(src), str(tmp_path / "out"), "--json", str(report_path)]) == 0
    text = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj" in text and "7 layer(s) converted into 7 Marlin manifest entries" in text
    report = json.loads(report_path.read_text())
    assert list(report)[:2] == ["ok", "exit_code"] and report["ok"] is True and report["exit_code"] == 0
    assert len(report["layers"]) == 7 and report["skipped"] == []
    assert report["bytes_in"] > 0 and report["manifest"].endswith("marlin_manifest.json")


def test_every_report_starts_with_its_outcome(tmp_path, src, capsys):
    """inspect, a dry run (that would pass, that would stop), verify (passing, failing): "ok" and "exit_code" first,
    the values the command exits with, as a failed command's report has them."""
    out = tmp_path / "out"
    odd_spec = tiny_llama(num_layers=1)
    next(lin for lin in odd_spec.linears if lin.name.endswith("down_proj")).group_size = 8
    odd_spec.dynamic = {"+:.*down_proj": {"group_size": 8}}
    odd = write_checkpoint(tmp_path / "g8", odd_spec)
    runs = [(["inspect", str(src)], 0), ([str(src), str(out), "--dry-run"], 0), ([str(odd), str(out), "--dry-run"], 2),
            ([str(src), str(out), "-q"], 0), (["verify", str(out), "--skip-kernel"], 0)]
    for i, (argv, code) in enumerate(runs):
        report_path = tmp_path / f"r{i}.json"
        assert main([*argv, "--json", str(report_path)]) == code, argv
        report = json.loads(report_path.read_text())
        assert list(report)[:2] == ["ok", "exit_code"] and report["ok"] is (code == 0) and report["exit_code"] == code
    (out / "extra.txt").write_text("x")
    assert main(["verify", str(out), "--skip-kernel", "--json", str(tmp_path / "failed.json")]) == 1
    report = json.loads((tmp_path / "failed.json").read_text())
    assert report["ok"] is False and report["exit_code"] == 1 and report["problems"]


@pytest.mark.parametrize("command", ["convert", "inspect", "verify"])
def test_json_dash_prints_one_json_document_on_stdout_and_writes_no_file(tmp_path, src, capsys, monkeypatch, command):
    out = tmp_path / "out"
    if command == "verify":
        assert main([str(src), str(out), "-q"]) == 0
        capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # a file named "-" would land here
    args = {"convert": [str(src), str(out)], "inspect": [str(src)], "verify": [str(out), "--skip-kernel"]}[command]
    assert main([command, *args, "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)  # the whole of stdout is the JSON document: no table around it
    assert isinstance(data, dict) and data
    assert not (tmp_path / "-").exists()


def test_json_dash_is_not_checked_as_a_file_and_dot_slash_dash_is_a_file(tmp_path, src, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    readable = os.access
    monkeypatch.setattr("marlin_convert.cli._output.os.access",  # nothing is writable (also as root)
                        lambda path, mode, **kw: False if mode & os.W_OK else readable(path, mode, **kw))
    assert main(["inspect", str(src), "--json", "report.json"]) == 2  # a real file is refused before any work
    assert "not writable" in capsys.readouterr().err
    assert main(["inspect", str(src), "--json", "-"]) == 0  # stdout is not a file to check
    assert json.loads(capsys.readouterr().out)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", str(src), "--json", "./-"]) == 0  # the usual way to name a file called "-"
    assert json.loads((tmp_path / "-").read_text()) and "Plan for" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["--", "-q", "--overwrite"])
def test_json_that_looks_like_an_option_is_refused(tmp_path, src, capsys, monkeypatch, value):
    """A new-user helper: `--json --` wrote the report into a file named `--` (the option took the next argument as its
    value). A value that starts with '-' (but '-', stdout) is refused before any work; ./NAME names such a file."""
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", str(src), "--json", value]) == 2
    err = capsys.readouterr().err
    assert f"--json {value}: looks like an option" in err and f"./{value}" in err
    assert not (tmp_path / value).exists()


def test_convert_reports_the_manifest_digest_that_verify_checks(tmp_path, src, capsys):
    report_path = tmp_path / "report.json"
    assert main([str(src), str(tmp_path / "out"), "-q", "--json", str(report_path)]) == 0
    digest = json.loads(report_path.read_text())["manifest_sha256"]
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest)
    assert f"manifest {digest}" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "out"), "--skip-kernel", "-q", "--manifest-sha256", digest]) == 0
    assert f"manifest {digest}" in capsys.readouterr().out


def test_quiet_prints_the_summary_without_the_table(tmp_path, src, capsys):
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 0
    text = capsys.readouterr().out
    assert "7 layer(s) converted into 7 Marlin manifest entries" in text and "manifest:" in text
    assert "self_attn.q_proj" not in text


def test_summary_line_uses_one_unit_family(tmp_path, src, capsys):
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if " in, " in line)
    assert re.search(r"KiB|MiB|GiB", line) and not re.search(r"\b[kMGT]?B/s|\b[kMGT]B\b", line), line


def test_help_shows_flags_without_values_and_arguments_by_name(capsys):
    assert main(["convert", "--help"]) == 0
    text = capsys.readouterr().out
    assert "<bool>" not in text and "{" not in text
    assert "convert [OPTIONS] IN_DIR OUT_DIR" in text
    assert main([str(REPO), str(REPO / "x"), "--overwrite", "true"]) == 2  # a flag takes no value
    capsys.readouterr()


def test_reported_time_includes_planning(tmp_path, src, capsys, monkeypatch):
    import marlin_convert.cli.convert as cli_convert

    real = cli_convert.build_plan

    def slow_plan(*args, **kwargs):
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(cli_convert, "build_plan", slow_plan)
    report = tmp_path / "report.json"
    assert main([str(src), str(tmp_path / "out"), "-q", "--json", str(report)]) == 0
    capsys.readouterr()
    assert json.loads(report.read_text())["seconds"] >= 0.5


def test_no_progress_frames_when_stderr_is_not_a_terminal(tmp_path, src):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MARLIN_CONVERT_NO_PROGRESS", None)
    done = subprocess.run([sys.executable, "-m", "marlin_convert.cli.app", str(src), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_a_long_table_marks_the_rows_left_out(tmp_path, capsys):
    linears = [LinearSpec(f"model.layers.{i}.mlp.down_proj", 128, 64) for i in range(70)]
    src = write_checkpoint(tmp_path / "in", CheckpointSpec(linears=linears, extras=[], group_size=64))
    assert main(["inspect", str(src)]) == 0
    lines = capsys.readouterr().out.splitlines()
    marker = next(i for i, line in enumerate(lines) if "rows not shown" in line)
    assert "... 25 rows not shown" in lines[marker]  # 70 rows: 30 first, the marker, 15 last
    assert sum("mlp.down_proj" in line for line in lines[:marker]) == 30
    assert sum("mlp.down_proj" in line for line in lines[marker:]) == 15


@pytest.mark.parametrize("command", ["convert", "inspect", "verify"])
def test_an_unwritable_json_path_is_refused_before_any_work(tmp_path, src, capsys, command):
    bad = tmp_path / "no-such-dir" / "report.json"
    args = {"convert": [str(src), str(tmp_path / "out")], "inspect": ["inspect", str(src)],
            "verify": ["verify", str(src), "--skip-kernel"]}[command]
    assert main([*args, "--json", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "Error: --json" in err and "does not exist" in err
    assert not (tmp_path / "out").exists()


def test_inspect_and_dry_run_write_nothing(tmp_path, src, capsys):
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["inspect", str(src), "--json", str(tmp_path / "plan.json")]) == 0
    assert main([str(src), str(tmp_path / "out"), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "7 layer(s) to convert into 7 Marlin manifest entries" in text and "bytes in" in text
    assert not (tmp_path / "out").exists()
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["converted"] == 7 and plan["layers"][0]["convert"] is True
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(before + ["plan.json"])


def test_dry_run_fails_where_the_conversion_would(tmp_path, src, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main([str(src), str(tmp_path / "full"), "--dry-run", "-q"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main([str(src), str(tmp_path / "full"), "--dry-run", "-q", "--overwrite"]) == 2  # not a previous output
    assert "holds no marlin_manifest.json" in capsys.readouterr().err
    (tmp_path / "full" / "x").unlink()
    assert main([str(src), str(tmp_path / "full"), "-q"]) == 0  # a previous output: --overwrite may replace it
    capsys.readouterr()
    assert main([str(src), str(tmp_path / "full"), "--dry-run", "-q", "--overwrite"]) == 0
    assert main([str(src), str(src / "out"), "--dry-run", "-q"]) == 2
    assert "inside (or equal to) IN_DIR" in capsys.readouterr().err
    # group size 8 (down_proj's, GPTQModel's dynamic) has no Marlin form: the plan is shown, and the exit code says
    # the conversion would stop
    odd_spec = tiny_llama(num_layers=1)
    next(lin for lin in odd_spec.linears if lin.name.endswith("down_proj")).group_size = 8
    odd_spec.dynamic = {"+:.*down_proj": {"group_size": 8}}
    odd = write_checkpoint(tmp_path / "g8", odd_spec)
    assert main([str(odd), str(tmp_path / "o"), "--dry-run", "--json", str(tmp_path / "plan.json")]) == 2
    captured = capsys.readouterr()
    assert "cannot be converted" in captured.err
    assert "--skip-incompatible" in captured.err and (tmp_path / "plan.json").exists()
    # the table and the summary say what the run would do with that layer: refuse it, not keep it
    assert "kept in GPTQ form" not in captured.out and "1 refused (no Marlin form: the conversion stops" in captured.out
    assert "keep GPTQ" not in captured.out and "refuse: " in captured.out and "of kept layers" not in captured.out
    assert main([str(odd), str(tmp_path / "o"), "--dry-run", "--skip-incompatible"]) == 0
    captured = capsys.readouterr().out
    assert "1 kept in GPTQ form" in captured and "keep GPTQ: " in captured and "refuse" not in captured
    assert main([str(odd), str(tmp_path / "o"), "-q"]) == 2  # what the dry run predicted
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("skip", [False, True])
def test_a_dry_run_where_no_layer_converts_does_not_offer_skip_incompatible(tmp_path, capsys, skip):
    """Every quantized layer without a Marlin form (2-bit): the run stops with --skip-incompatible too (there would be
    nothing to convert), yet the dry run's summary said '1 refused (...; --skip-incompatible keeps them in GPTQ form)',
    also to a user who had given it. It now says that with none converted the run stops either way."""
    spec = CheckpointSpec(linears=[LinearSpec("model.layers.0.mlp.down_proj", 256, 128)],
                          extras=[TensorSpec("model.norm.weight", (128,), "float16")], bits=2)
    src = write_checkpoint(tmp_path / "in", spec)
    args = [str(src), str(tmp_path / "out"), "--dry-run", *(["--skip-incompatible"] if skip else [])]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "--skip-incompatible keeps them" not in captured.out and "refuse: 2-bit weights" in captured.out
    assert "1 refused (no Marlin form, and none converted: the conversion stops, --skip-incompatible or not)" \
        in captured.out
    # and the error's hint agrees with that line (without the option it offered it: "--skip-incompatible keeps such
    # layers in their source form", which would stop all the same)
    assert "none of the 1 quantized layers can be converted" in captured.err
    assert "keeps such layers" not in captured.err and "--skip-incompatible does not help" in captured.err
    assert not (tmp_path / "out").exists()


def _one_two_bit_layer(tmp_path):
    """tiny_llama with its down_proj at 2 bits (a GPTQModel dynamic rule): one layer of seven has no Marlin form."""
    spec = tiny_llama(num_layers=1, dynamic={"+:.*down_proj": {"bits": 2}})
    next(lin for lin in spec.linears if lin.name.endswith("down_proj")).bits = 2
    return write_checkpoint(tmp_path / "b2", spec)


def test_inspect_says_the_conversion_keeps_a_layer_only_with_skip_incompatible(tmp_path, capsys):
    """inspect plans as --skip-incompatible would (the 2-bit layer 'kept'), and said nothing else: a user reading it
    expected the conversion to succeed, and plain convert stopped with exit 2. It now says so, in the text and in the
    JSON; and a dry run that stops has no output format and no kept layers in its JSON, but refused ones."""
    src = _one_two_bit_layer(tmp_path)
    assert main(["inspect", str(src), "--json", str(tmp_path / "plan.json")]) == 0
    text = capsys.readouterr().out
    assert "1 kept in GPTQ form" in text
    assert ("convert keeps the 1 layer(s) with no Marlin form in GPTQ form only with --skip-incompatible; without "
            "it the conversion stops at them (exit 2)") in text
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["stops_without_skip_incompatible"] is True and plan["stops_with_skip_incompatible"] is False
    assert (plan["kept_gptq"], plan["refused"], plan["checkpoint_format"]) == (1, 0, "marlin-partial")
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2  # as inspect said
    capsys.readouterr()
    assert main([str(src), str(tmp_path / "out"), "--dry-run", "-q", "--json", str(tmp_path / "dry.json")]) == 2
    dry = json.loads((tmp_path / "dry.json").read_text())
    assert (dry["kept_gptq"], dry["refused"], dry["checkpoint_format"], dry["exit_code"]) == (0, 1, None, 2)
    assert dry["kept_tensors"] == 0 and plan["kept_tensors"] == 4  # (the text leaves them out too)
    assert main([str(src), str(tmp_path / "out"), "--dry-run", "-q", "--skip-incompatible", "--json",
                 str(tmp_path / "dry.json")]) == 0
    dry = json.loads((tmp_path / "dry.json").read_text())
    assert (dry["kept_gptq"], dry["refused"], dry["checkpoint_format"]) == (1, 0, "marlin-partial")
    text = capsys.readouterr().out
    assert "1 kept in GPTQ form" in text and "only with --skip-incompatible" not in text  # (it was given)


def test_inspect_where_no_layer_converts_calls_them_refused(tmp_path, capsys):
    """Every quantized layer without a Marlin form: inspect showed '0 layer(s) to convert ..., 1 kept in GPTQ form'
    and a 'keep GPTQ' row, a plan no conversion can run (it stops with --skip-incompatible too)."""
    spec = CheckpointSpec(linears=[LinearSpec("model.layers.0.mlp.down_proj", 256, 128)],
                          extras=[TensorSpec("model.norm.weight", (128,), "float16")], bits=2)
    src = write_checkpoint(tmp_path / "in", spec)
    assert main(["inspect", str(src), "--json", str(tmp_path / "plan.json")]) == 0
    text = capsys.readouterr().out
    assert "keep GPTQ" not in text and "refuse: 2-bit weights" in text
    assert "1 refused (no Marlin form, and none converted: the conversion stops, --skip-incompatible or not)" in text
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["stops_without_skip_incompatible"] is True and plan["stops_with_skip_incompatible"] is True
    assert (plan["kept_gptq"], plan["refused"], plan["checkpoint_format"]) == (0, 1, None)


def test_inspect_groups_experts(tmp_path, capsys):
    linears = [LinearSpec(f"model.layers.0.mlp.experts.{e}.{p}", 128, 64) for e in range(16)
               for p in ("gate_proj", "up_proj", "down_proj")]
    spec = CheckpointSpec(linears=linears, extras=[TensorSpec("model.layers.0.mlp.gate.weight", (16, 128), "float16")],
                          group_size=64)
    src = write_checkpoint(tmp_path / "in", spec)
    assert main(["inspect", str(src)]) == 0
    text = capsys.readouterr().out
    assert "model.layers.0.mlp.experts.*.gate_proj" in text
    assert len(re.findall(r"experts\.\*\.", text)) == 3  # one row per projection, not 48


def test_verify_skip_kernel_passes_on_a_fresh_conversion(tmp_path, src, capsys):
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    assert main(["verify", str(out), "--skip-kernel", "--source", str(src), "-q", "--json",
                 str(tmp_path / "v.json")]) == 0
    printed = capsys.readouterr().out
    assert "passed: 7/7 layers ok" in printed and f"rebuilt quantized tensors compared with {src}'s byte for byte" in printed
    result = json.loads((tmp_path / "v.json").read_text())
    assert result["ok"] is True and result["kernel_checked"] is False and result["layers_checked"] == 7


@pytest.mark.parametrize("tensor", ["B", "s"])
def test_a_flipped_bit_makes_verify_fail_on_that_layer(tmp_path, src, capsys, tensor):
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    entry = next(e for e in load_manifest(out)["layers"] if e["name"].endswith("mlp.up_proj"))
    shard = out / entry["shards"][tensor]
    info = read_header(shard).tensors[entry["outputs"][tensor]]
    data = bytearray(shard.read_bytes())
    data[info.begin + info.nbytes // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(out), "--skip-kernel"]) == 1
    captured = capsys.readouterr()
    assert "1 layer(s) failed verification: model.layers.0.mlp.up_proj" in captured.err
    assert "digest mismatch" in captured.out
    assert "Verification FAILED" in captured.out and "Verified" not in captured.out  # the heading says so too


def test_verify_on_a_directory_without_manifest(tmp_path, src, capsys):
    assert main(["verify", str(src), "--skip-kernel"]) == 2
    assert "no marlin_manifest.json" in capsys.readouterr().err


@pytest.mark.parametrize("make, what", [(os.mkfifo, "a FIFO (named pipe)"), (os.mkdir, "a directory"),
                                        (lambda path: os.symlink("gone", path), "a broken link (to gone)")])
def test_a_manifest_that_is_not_a_regular_file_is_named_for_what_it_is_and_never_opened(tmp_path, src, capsys, make,
                                                                                      what):
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    (out / "marlin_manifest.json").unlink()
    make(out / "marlin_manifest.json")  # (a FIFO opened for reading would block: no writer ever comes)
    assert main(["verify", str(out), "--skip-kernel"]) == 2
    err = capsys.readouterr().err
    assert f"Error: {out / 'marlin_manifest.json'}: {what}, not a regular file: not read" in err


def test_a_manifest_with_an_integer_of_too_many_digits_names_the_field(tmp_path, src, capsys):
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    path = out / "marlin_manifest.json"
    path.write_text(path.read_text().replace('"in_features": 256', '"in_features": ' + "9" * 4400, 1))
    assert main(["verify", str(out), "--skip-kernel"]) == 2
    err = capsys.readouterr().err
    assert "'layers[0].in_features': a number of 4400 digits, too large to read" in err
    assert "set_int_max_str_digits" not in err and err.count("Error:") == 1


def test_verify_names_a_missing_or_non_directory_out_dir(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "missing"), "--skip-kernel"]) == 2
    assert f"Error: {tmp_path / 'missing'}: does not exist" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["verify", str(tmp_path / "file"), "--skip-kernel"]) == 2
    assert f"Error: {tmp_path / 'file'}: not a directory" in capsys.readouterr().err


def test_verify_rejects_bad_gpu_and_batch_lists(tmp_path, src, capsys):
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    assert main(["verify", str(out), "--gpu", "zero"]) == 2
    assert "--gpu 'zero'" in capsys.readouterr().err
    assert main(["verify", str(out), "--batch", "1,0"]) == 2
    assert "--batch '1,0'" in capsys.readouterr().err
    # a batch no GPU holds is a bad argument (exit 2), not a GPU out of memory read as a failed checkpoint (exit 1)
    assert main(["verify", str(out), "--batch", "16,100000000000"]) == 2
    assert "--batch '16,100000000000': at most 4096 rows" in capsys.readouterr().err
    # refused with --skip-kernel too, not ignored
    assert main(["verify", str(out), "--skip-kernel", "--gpu", "abc"]) == 2
    assert "--gpu 'abc'" in capsys.readouterr().err
    assert main(["verify", str(out), "--skip-kernel", "--dtype", "foo"]) == 2
    assert "--dtype 'foo'" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, reason", [
    ("--batch", "1,,2", "an empty item"),
    ("--batch", "1,2,", "an empty item"),
    ("--batch", ",", "an empty item"),
    ("--batch", " ", "an empty item"),
    ("--batch", "1_6", "'1_6' is not a number"),
    ("--batch", "16,16", "16 is given twice"),
    ("--batch", "9" * 5000, "(5000 digits) is too large"),
    ("--gpu", "0,0", "0 is given twice"),
    ("--gpu", "0,", "an empty item"),
    ("--gpu", "-1", "'-1' is not a number"),
])
def test_verify_refuses_a_list_with_an_empty_repeated_or_malformed_item(tmp_path, src, capsys, option, value, reason):
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    capsys.readouterr()
    assert main(["verify", str(out), "--skip-kernel", option, value]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("Error:") == 1 and f"Error: {option} '" in captured.err
    assert reason in captured.err and "Traceback" not in captured.err


def test_verify_lists_take_spaces_around_their_items_alike(tmp_path, src, capsys):
    """--batch and --gpu read items alike: spaces around a number are allowed (``"1, 16"`` as people write it)."""
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    assert main(["verify", str(out), "--skip-kernel", "-q", "--batch", " 1, 16 ", "--gpu", "0, 1"]) == 0


@pytest.mark.parametrize("args, option", [
    (["verify", "OUT", "--skip-kernel", "--source", "a", "--source", "b"], "--source"),
    (["verify", "OUT", "--skip-kernel", "--workers", "1", "--workers=2"], "--workers"),
    (["verify", "OUT", "--skip-kernel", "--batch", "1", "--batch", "16"], "--batch"),
    (["convert", "IN", "OUT", "--json", "a.json", "--json", "b.json"], "--json"),
    (["inspect", "IN", "--json", "a.json", "--json", "a.json"], "--json"),
])
def test_an_option_that_takes_one_value_given_twice_is_refused(tmp_path, src, capsys, args, option):
    """The parser kept the last value and dropped the first without a word."""
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    capsys.readouterr()
    args = [str(out) if a == "OUT" else str(src) if a == "IN" else str(tmp_path / a) if a.endswith(".json") else a
            for a in args]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not (tmp_path / "a.json").exists() and not (tmp_path / "b.json").exists()
    assert f"Error: option {option} is given 2 times; it takes one value" in captured.err
    assert f"Hint: usage: marlin-convert {args[0]}" in captured.err


def test_a_flag_given_twice_is_taken(tmp_path, src):
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q", "--quiet"]) == 0
    assert main(["verify", str(out), "--skip-kernel", "-q", "--skip-kernel"]) == 0


def test_verify_without_a_gpu_says_why(tmp_path, src, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the no-GPU message is tested where there is none")
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    assert main(["verify", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert "Error:" in err and "GPU" in err and "--skip-kernel" in err


def test_bundled_example_converts_and_verifies(tmp_path, capsys):
    example = REPO / "examples" / "tiny-gptq"
    out = tmp_path / "tiny-marlin"
    assert main([str(example), str(out), "-q"]) == 0
    assert main(["verify", str(out), "--skip-kernel", "--source", str(example), "-q"]) == 0
    assert np.all([p.stat().st_size > 0 for p in out.iterdir()])


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    """Rich wraps tables to the terminal width; give the captured output room for whole cells."""
    monkeypatch.setenv("COLUMNS", "300")


@pytest.mark.parametrize("kept", [False, True])
def test_manifest_records_every_passthrough_tensor_and_every_file(tmp_path, capsys, kept):
    import hashlib

    # group size 8 has no Marlin form (groups must be whole 16-row strips): down_proj stays in GPTQ form
    linears = [LinearSpec("model.layers.0.mlp.up_proj", 128, 64, bias=True),
               LinearSpec("model.layers.0.mlp.down_proj", 64, 128, group_size=8 if kept else 64)]
    extras = [TensorSpec("model.embed_tokens.weight", (32, 128), "float16"),
              TensorSpec("model.norm.weight", (128,), "float16")]
    spec = CheckpointSpec(linears=linears, extras=extras, group_size=64, shards=2,
                          dynamic={"+:.*down_proj": {"group_size": 8}} if kept else None)
    src = write_checkpoint(tmp_path / "in", spec)
    (src / "tokenizer.json").write_text('{"vocab": {}}')
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q", "--skip-incompatible"]) == 0
    capsys.readouterr()
    manifest = load_manifest(out)
    assert len(manifest["kept"]) == (1 if kept else 0)
    files = {p.name for p in out.iterdir()} - {"marlin_manifest.json"}
    assert set(manifest["files"]) == files
    for name, record in manifest["files"].items():
        data = (out / name).read_bytes()
        assert record == {"bytes": len(data), "sha256": "sha256:" + hashlib.sha256(data).hexdigest()}, name
    converted = {name for entry in manifest["layers"] for name in entry["outputs"].values()}
    converted |= {name for entry in manifest["kept"] for name in entry["tensors"].values()}  # not passthrough
    passthrough = {entry["name"]: entry for entry in manifest["passthrough"]}
    for shard in manifest["shards"]:
        header = read_header(out / shard)
        data = (out / shard).read_bytes()
        for name, info in header.tensors.items():
            if name in converted:
                continue
            entry = passthrough.pop(name)
            assert (entry["shard"], entry["dtype"], entry["shape"]) == (shard, info.dtype, list(info.shape))
            assert entry["sha256"] == "sha256:" + hashlib.sha256(data[info.begin:info.end]).hexdigest()
    assert passthrough == {}


def test_generator_help_cites_nothing_outside_the_repository():
    import subprocess
    import sys

    text = subprocess.run([sys.executable, str(REPO / "scripts" / "make_gptq_checkpoint.py"), "--help"],
                          capture_output=True, text=True, check=True).stdout
    assert "shared/" not in text and "write_checkpoint" in text


def test_verify_table_names_each_expert_and_piped_output_is_not_wrapped(tmp_path, capsys):
    from make_gptq_checkpoint import qwen3_moe

    # '[expert 1]' looks like rich markup: it must be printed, not swallowed as a style tag
    spec = qwen3_moe(num_layers=1, num_experts=2, hidden=128, expert_intermediate=128, stacked=True, vocab=64)
    src = write_checkpoint(tmp_path / "in [x]", spec)
    out = tmp_path / "out [y]"
    assert main([str(src), str(out)]) == 0
    text = capsys.readouterr().out
    assert f"Converted {src} -> {out}" in text  # brackets in paths survive too
    assert main(["verify", str(out), "--skip-kernel"]) == 0
    lines = capsys.readouterr().out.splitlines()  # captured: not a terminal
    for expert in range(2):
        assert any(f"model.layers.0.mlp.experts.down_proj[expert {expert}]" in line for line in lines), lines
    summary = next(line for line in lines if line.startswith("passed: "))
    assert summary.rstrip().endswith("kernel not run (--skip-kernel)")  # one line, however long


def test_a_missing_directory_is_named_as_missing_and_a_file_problem_alone_names_no_layers(tmp_path, src, capsys):
    for args in ([str(tmp_path / "nothere"), str(tmp_path / "out")], ["inspect", str(tmp_path / "nothere")]):
        assert main(args) == 2
        assert f"Error: {tmp_path / 'nothere'}: does not exist" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["inspect", str(tmp_path / "file")]) == 2
    assert f"Error: {tmp_path / 'file'}: not a directory" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    (out / "extra.txt").write_text("x")
    capsys.readouterr()
    assert main(["verify", str(out), "--skip-kernel", "-q"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("Error: 1 problem(s) with the files (listed above)"), captured.err
    # the summary's verdict is the run's, though every layer passed
    summary = next(line for line in captured.out.splitlines() if "layers ok" in line)
    assert summary.startswith("FAILED: 7/7 layers ok") and "1 problem(s) with the files" in summary, summary


def _summary_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if " layer(s) " in line or line.startswith("note: ")]


def test_convert_inspect_and_verify_count_layers_and_tensors_in_the_units_of_the_manifest(tmp_path, capsys):
    from make_gptq_checkpoint import mixtral_like

    # 4 attention layers + 4 experts x 3 projections = 16 layers; --stack-experts writes 4 + 3 = 7 manifest entries.
    # q_proj (group size 48, no Marlin form) is kept in GPTQ form: its 4 tensors are copied, but are not passthrough
    spec = mixtral_like(num_layers=1, num_experts=4, hidden=128, intermediate=128, vocab=64, shards=2)
    spec.linears[0].group_size = 48
    spec.dynamic = {"+:.*q_proj": {"group_size": 48}}
    src = write_checkpoint(tmp_path / "in", spec)
    out = tmp_path / "out"
    report_path = tmp_path / "report.json"
    assert main([str(src), str(out), "-q", "--stack-experts", "--skip-incompatible", "--json", str(report_path)]) == 0
    text = capsys.readouterr().out
    manifest = load_manifest(out)
    assert (len(manifest["layers"]), len(manifest["kept"]), len(manifest["passthrough"])) == (6, 1, 6)
    assert ("15 layer(s) converted (each expert counts as one) into 6 Marlin manifest entries, 1 kept in GPTQ form; "
            "6 tensor(s) passed through, 4 tensor(s) of kept layers copied unchanged; 2 shard(s)") in text, text
    # the note counts the converted layers only (the kept one is copied as it is)
    assert ("note: zero format v1 for 15 symmetric layer(s) (qzeros hold 7), no checkpoint_format label: GPTQ's "
            "default v1") in text, text
    report = json.loads(report_path.read_text())
    assert (report["converted_layers"], report["marlin_entries"], len(report["layers"]), report["passthrough_tensors"],
            report["kept_tensors"]) == (15, 6, 6, 6, 4)
    assert list(report).index("marlin_entries") == list(report).index("converted_layers") + 1
    assert main(["verify", str(out), "--skip-kernel", "-q"]) == 0
    assert "passed: 16/16 layers ok (15 converted, 1 kept in GPTQ form)" in capsys.readouterr().out
    assert main([str(src), str(tmp_path / "dry"), "-q", "--stack-experts", "--skip-incompatible", "--dry-run"]) == 0
    assert ("15 layer(s) to convert (each expert counts as one) into 6 Marlin manifest entries, 1 kept in GPTQ "
            "form; 6 tensor(s) to pass through, 4 tensor(s) of kept layers to copy unchanged") in capsys.readouterr().out
    assert main(["inspect", str(src), "--json-stdout"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["converted_layers"], plan["marlin_entries"], plan["passthrough_tensors"], plan["kept_tensors"]) == (
        15, 15, 6, 4)


@pytest.mark.parametrize("stacked, stack_experts, layers", [(True, False, 12), (False, True, 16)])
def test_verifys_progress_bar_counts_layers_as_its_summary_does_and_the_files(tmp_path, capsys, monkeypatch, stacked,
                                                                              stack_experts, layers):
    """A bar that counted manifest entries showed 0/54 beside '2328/2328 layers ok': it counts each expert now, and
    says that the files hashed beside the layers are in its count."""
    from make_gptq_checkpoint import qwen3_moe

    from marlin_convert.cli import _progress
    from marlin_convert.verify import verify

    # 4 attention layers + 4 experts of 2 stacked projections (gate_up, down) or 3 (gate, up, down), in 6 or 7 entries
    spec = qwen3_moe(num_layers=1, num_experts=4, hidden=128, expert_intermediate=128, stacked=stacked, vocab=64)
    src, out = write_checkpoint(tmp_path / "in", spec), tmp_path / "out"
    assert main([str(src), str(out), "-q"] + (["--stack-experts"] if stack_experts else [])) == 0
    manifest = load_manifest(out)
    files = len(manifest["files"])
    assert len(manifest["layers"]) < layers
    counted: list[int] = []
    report = verify(out, gpus=None, workers=1, progress=counted.append)
    assert (len(report.results), sum(counted)) == (layers, layers + files)
    monkeypatch.setattr(_progress, "progress_disabled", lambda: False)  # (stderr is no terminal here)
    capsys.readouterr()
    assert main(["verify", str(out), "--skip-kernel"]) == 0
    captured = capsys.readouterr()
    assert f"verifying {layers} layers + {files} files:   0%|" in captured.err  # (the first frame: 0 of the total)
    assert f" 0/{layers + files} [" in captured.err and f"passed: {layers}/{layers} layers ok" in captured.out


def test_the_zero_format_note_counts_each_expert_of_a_stacked_layer(tmp_path, capsys):
    from make_gptq_checkpoint import qwen3_moe

    # 4 attention layers + 2 stacked [E=2] projections: 8 layers, 6 manifest entries
    spec = qwen3_moe(num_layers=1, num_experts=2, hidden=128, expert_intermediate=128, stacked=True, vocab=64)
    src = write_checkpoint(tmp_path / "in", spec)
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 0
    text = capsys.readouterr().out
    assert "8 layer(s) converted (each expert counts as one) into 6 Marlin manifest entries" in text, text
    assert "note: zero format v1 for 8 symmetric layer(s)" in text, text
    assert main(["verify", str(tmp_path / "out"), "--skip-kernel", "-q"]) == 0
    assert "passed: 8/8 layers ok (8 converted" in capsys.readouterr().out


@pytest.mark.parametrize("label, sym, zero_format, note", [
    ("gptq", True, "v1", "zero format v1 for 7 symmetric layer(s) (qzeros hold 7), as labelled"),
    (None, True, "v1", "zero format v1 for 7 symmetric layer(s) (qzeros hold 7), no checkpoint_format label: "
                       "GPTQ's default v1"),
    ("gptq", True, "v2", "checkpoint_format says gptq (v1 zeros) but qzeros of 7 symmetric layer(s) hold 8, the v2 "
                         "value: treated as v2"),
    (None, True, "v2", "no checkpoint_format label: GPTQ's default v1 zeros, but qzeros of 7 symmetric layer(s) hold "
                       "8, the v2 value: treated as v2"),
    ("gptq", False, "v1", "7 asymmetric layer(s): zero points read as v1 (from checkpoint_format gptq, v1 stores "
                          "zero - 1); written to zp"),
    (None, False, "v1", "7 asymmetric layer(s): zero points read as v1 (no checkpoint_format label: GPTQ's default "
                        "v1, v1 stores zero - 1); written to zp"),
])
def test_the_zero_format_note_says_as_labelled_only_where_a_config_states_the_label(tmp_path, capsys, label, sym,
                                                                                    zero_format, note):
    spec = tiny_llama(num_layers=1, checkpoint_format_label=label, sym=sym, zero_format=zero_format)
    assert main([str(write_checkpoint(tmp_path / "in", spec)), str(tmp_path / "out"), "-q"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert f"note: {note}" in notes, notes
    assert label is not None or not any("as labelled" in line for line in notes), notes


def test_the_zero_format_notes_name_gptqmodels_format_key_where_only_that_states_the_label(tmp_path, capsys):
    """A config that states the label as GPTQModel's 'format' only was quoted as 'checkpoint_format says gptq'."""
    spec = tiny_llama(num_layers=1, checkpoint_format_label="gptq", sym=True, zero_format="v2")
    src = write_checkpoint(tmp_path / "in", spec)
    for path, keys in ((src / "config.json", ("quantization_config",)), (src / "quantize_config.json", ())):
        data = json.loads(path.read_text())
        section = data
        for key in keys:
            section = section[key]
        section["format"] = section.pop("checkpoint_format")
        path.write_text(json.dumps(data))
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 0
    assert ("note: format says gptq (v1 zeros) but qzeros of 7 symmetric layer(s) hold 8, the v2 value: treated as "
            "v2") in capsys.readouterr().out


def test_skip_incompatible_help_says_what_is_kept_and_what_always_stops_the_run(capsys):
    assert main(["convert", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "configs their tensors contradict" not in text  # those stop the run: see test_bad_input
    for fragment in ("2/3-bit", "group sizes other than -1, 32, 64, 128 or >= K", "contradict 'sym: true'",
                     "activation quantization", "float weights",
                     "A config whose bits or group size the stored tensors' shapes contradict is a malformed "
                     "checkpoint: it always stops the run"):
        assert fragment in text, fragment


def test_inspect_convert_and_the_manifest_list_shards_in_file_name_order(tmp_path, src, capsys):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"].values()))
    if first == "model-00001-of-00002.safetensors":  # make the index name shard 2 first (lm_head sorts first)
        index["weight_map"] = dict(sorted(index["weight_map"].items(), key=lambda item: item[1], reverse=True))
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert main(["inspect", str(src), "--json-stdout"]) == 0
    assert json.loads(capsys.readouterr().out)["shards"] == names
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 0
    assert load_manifest(tmp_path / "out")["shards"] == names




@pytest.mark.parametrize("json_stdout", [False, True])
def test_a_closed_stdout_exits_141_not_1(tmp_path, monkeypatch, json_stdout):
    """`inspect IN | head -1`: the reader goes away; the exit code must not be verify's 1 ("a layer failed")."""
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=2, hidden=256, intermediate=512, group_size=64))
    _closed_stdout(monkeypatch)
    assert main(["inspect", str(src)] + (["--json-stdout"] if json_stdout else [])) == 141


def _closed_stdout(monkeypatch):
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: every write fails with EPIPE (Python ignores SIGPIPE)
    monkeypatch.setattr("sys.stdout", os.fdopen(write_end, "w", buffering=1))
    monkeypatch.setattr("sys.stderr", sys.stderr)  # restored afterwards: click wraps it on EPIPE


def test_a_closed_stdout_loses_no_json_report_and_no_failed_verification(tmp_path, monkeypatch):
    """`convert ... --json r.json | true`: the report (with the manifest digest) is still written; a verification
    that failed still exits 1, not 141."""
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, hidden=256, intermediate=512, group_size=64))
    out = tmp_path / "out"
    _closed_stdout(monkeypatch)  # a fresh one per call: the first EPIPE points the descriptor at /dev/null
    assert main([str(src), str(out), "-q", "--json", str(tmp_path / "c.json")]) == 141
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["manifest_sha256"].startswith("sha256:")
    # the report's outcome is the process's exit code, the rest as written
    assert list(report)[:2] == ["ok", "exit_code"] and (report["ok"], report["exit_code"]) == (False, 141)
    _closed_stdout(monkeypatch)
    assert main(["verify", str(out), "--skip-kernel", "--json", str(tmp_path / "v.json")]) == 141
    report = json.loads((tmp_path / "v.json").read_text())
    assert (report["ok"], report["exit_code"], report["failures"], report["problems"]) == (False, 141, [], [])
    shard = next(out.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # a flipped bit in the last tensor
    shard.write_bytes(bytes(data))
    _closed_stdout(monkeypatch)
    assert main(["verify", str(out), "--skip-kernel", "--json", str(tmp_path / "v2.json")]) == 1
    assert json.loads((tmp_path / "v2.json").read_text())["ok"] is False
    # a dry run that shows refused layers exits 2 (the conversion would stop), closed stdout or not
    odd = write_checkpoint(tmp_path / "g8", tiny_llama(num_layers=1, group_size=8))
    _closed_stdout(monkeypatch)
    assert main([str(odd), str(tmp_path / "never"), "--dry-run", "--json", str(tmp_path / "d.json")]) == 2
    assert json.loads((tmp_path / "d.json").read_text())["refused"] > 0


def test_an_os_error_is_one_line_with_exit_2_not_an_internal_error(capsys):
    from marlin_convert.cli._errors import report_error

    assert report_error(PermissionError(13, "Permission denied", "/x/model.safetensors")) == 2
    err = capsys.readouterr().err
    assert err == "Error: /x/model.safetensors: Permission denied\n"
    assert report_error(OSError(28, "No space left on device")) == 2
    assert "internal error" not in capsys.readouterr().err


def test_control_characters_in_names_are_printed_inert(capsys):
    from marlin_convert.cli._output import Output

    output = Output("title\x1b[2J", {}, columns=["layer"])
    output.add_row("model.a\x1b[31m\nb.qweight")
    output.lines.append("note: c\rd")
    output.render()
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out
    assert "model.a\\x1b[31m\\x0ab.qweight" in out and "title\\x1b[2J" in out and "c\\x0dd" in out


def test_json_to_a_fifo_is_written_through_and_the_fifo_stays(tmp_path, src, capsys):
    """A stream (a FIFO here; /dev/stdout and a shell's process substitution alike) gets the report written through
    it: a new file renamed over it would leave the reader waiting and the FIFO gone."""
    import threading

    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert main(["inspect", str(src), "--json", str(fifo)]) == 0
    capsys.readouterr()
    reader.join(10)
    assert json.loads(received[0])["layers"] and fifo.is_fifo()


def test_json_through_a_link_replaces_its_target_and_keeps_the_link(tmp_path, src, capsys):
    target = tmp_path / "reports" / "plan.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    assert main(["inspect", str(src), "--json", str(link)]) == 0
    capsys.readouterr()
    assert link.is_symlink() and json.loads(target.read_text())["layers"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["plan.json"]


def test_json_with_a_long_name_is_written(tmp_path, src, capsys):
    """The temporary beside the report has a short name of its own (a name built from the report's could pass
    the file system's 255-byte limit)."""
    report = tmp_path / ("r" * 250 + ".json")
    assert main(["inspect", str(src), "--json", str(report)]) == 0
    capsys.readouterr()
    assert json.loads(report.read_text())["layers"]


def test_an_interrupt_while_the_report_is_written_leaves_no_temporary(tmp_path, src, capsys, monkeypatch):
    import signal

    from marlin_convert.cli import _output
    from marlin_convert.cli._errors import Interrupted

    def interrupted(*_args):
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(_output.os, "replace", interrupted)
    report = tmp_path / "plan.json"
    assert main(["inspect", str(src), "--json", str(report)]) == 130
    capsys.readouterr()
    assert not report.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_report_directory_this_user_cannot_write_is_refused_before_any_work(tmp_path, src, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes any directory")
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "plan.json").write_text("old")
    (locked / "plan.json").chmod(0o666)
    locked.chmod(0o555)  # the file is writable, its directory is not: a new file cannot be made there
    try:
        assert main(["inspect", str(src), "--json", str(locked / "plan.json")]) == 2
        assert "which this user cannot write" in capsys.readouterr().err
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("path, through", [
    ("/dev/stdout", True), ("/dev/stderr", True), ("/dev/fd/63", True), ("/proc/self/fd/1", True),
    ("/dev/shm/report.json", False), ("report.json", False),  # a new file: made beside and renamed over the name
])
def test_only_descriptors_are_written_through_by_name(path, through):
    """/dev/stdout names whatever stdout is (a regular file too): written through; a new file under /dev/shm is a
    file like any other (it was refused as 'not writable' when every /dev path counted as a stream)."""
    from marlin_convert.cli._output import _written_through

    assert _written_through(Path(path)) is through


def test_json_that_names_out_dir_or_a_parent_of_it_is_refused_before_any_work(tmp_path, src, capsys, monkeypatch):
    """OUT_DIR would be made inside the path the report then cannot be written to: a complete output with a failed
    run's exit code."""
    monkeypatch.chdir(tmp_path)
    assert main([str(src), "nd/sub", "-q", "--json", "nd"]) == 2
    assert "Error: --json nd: nd/sub, which this command reads or writes, lies inside it" in capsys.readouterr().err
    assert not (tmp_path / "nd").exists()


def test_a_value_that_ends_in_an_equals_sign_is_not_empty(tmp_path, src, capsys):
    report = tmp_path / "plan=="  # (a base64-like name)
    assert main(["inspect", str(src), f"--json={report}"]) == 0
    capsys.readouterr()
    assert json.loads(report.read_text())["layers"]


def test_a_failure_report_carries_the_hint(tmp_path, src, capsys):
    """The JSON report of a failed command holds the Hint line's text as well as the Error line's."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("x")
    report = tmp_path / "report.json"
    assert main([str(src), str(out), "--json", str(report)]) == 2
    assert "Hint: empty it, or choose another OUT_DIR" in capsys.readouterr().err
    failed = json.loads(report.read_text())
    assert failed["hint"].startswith("empty it, or choose another OUT_DIR") and "holds no marlin_manifest.json" in \
        failed["error"]


@pytest.mark.parametrize("command", ["convert", "inspect", "verify"])
def test_a_failed_command_leaves_a_failure_report_not_an_earlier_one(tmp_path, src, capsys, command):
    """--json FILE of a failed run says so ({"ok": false, the exit code, the error}); an earlier run's report at
    that name is not left to read as this one's. ``--json -`` gets the same document on stdout."""
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    report = tmp_path / "report.json"
    ok_args = {"convert": [str(src), str(tmp_path / "out2")], "inspect": ["inspect", str(src)],
               "verify": ["verify", str(out), "--skip-kernel"]}[command]
    assert main([*ok_args, "--json", str(report)]) == 0
    assert "error" not in json.loads(report.read_text())
    config = (src / "config.json").read_text()
    (src / "config.json").write_text("{not JSON")
    manifest = out / "marlin_manifest.json"
    manifest.write_text(manifest.read_text().replace('"layers"', '"layerz"', 1))
    bad_args = {"convert": [str(src), str(tmp_path / "out3")], "inspect": ["inspect", str(src)],
                "verify": ["verify", str(out), "--skip-kernel"]}[command]
    try:
        capsys.readouterr()
        assert main([*bad_args, "--json", str(report)]) == 2
        failed = json.loads(report.read_text())
        assert failed["ok"] is False and failed["exit_code"] == 2 and failed["error"]
        err = capsys.readouterr().err
        assert failed["error"] in err
        hints = [line.removeprefix("Hint: ") for line in err.splitlines() if line.startswith("Hint: ")]
        assert failed["hint"] == (hints[0] if hints else None)
        assert main([*bad_args, "--json", "-"]) == 2
        assert json.loads(capsys.readouterr().out)["ok"] is False
        if command == "inspect":  # --json-stdout (the plan as JSON on stdout) likewise
            assert main([*bad_args, "--json-stdout"]) == 2
            assert json.loads(capsys.readouterr().out)["ok"] is False
    finally:
        (src / "config.json").write_text(config)


def _hub_snapshot(tmp_path, src):
    """src's files moved into a Hugging Face cache layout: <repo>/blobs/<hash> and <repo>/snapshots/abc/<name> links."""
    repo = tmp_path / "cache" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(src.iterdir())):
        blob = repo / "blobs" / (f"{i + 1:x}" * 40)[:40]
        path.rename(blob)
        (snapshot / path.name).symlink_to(f"../../blobs/{blob.name}")
    return repo, snapshot


@pytest.mark.parametrize("command", ["convert", "verify"])
def test_json_onto_a_file_a_checkpoint_links_to_is_refused(tmp_path, src, capsys, command):
    """A Hugging Face snapshot's files are links to its repository's blobs: --json naming such a blob (or the link to
    it) would overwrite a shard or a config of the checkpoint, so it is refused before any work and the blob is
    unchanged; a report outside the cache is written."""
    out = tmp_path / "out"
    if command == "verify":
        assert main([str(src), str(out), "-q"]) == 0
        capsys.readouterr()
        repo, snapshot = _hub_snapshot(tmp_path, out)
        argv = ["verify", str(snapshot), "--skip-kernel", "-q"]
    else:
        repo, snapshot = _hub_snapshot(tmp_path, src)
        argv = [str(snapshot), str(out), "-q"]
    for name in ("config.json", sorted(p.name for p in snapshot.iterdir())[-1]):
        blob = Path(os.path.realpath(snapshot / name))
        before = blob.read_bytes()
        for target in (blob, snapshot / name):
            assert main([*argv, "--json", str(target)]) == 2, target
            err = capsys.readouterr().err
            assert f"Error: --json {target}:" in err and "Traceback" not in err, err
            assert blob.read_bytes() == before
    assert not out.exists() or command == "verify"
    assert main([*argv, "--json", str(tmp_path / "report.json")]) == 0
    assert json.loads((tmp_path / "report.json").read_text())["ok"] is True


def test_json_onto_a_file_a_plain_checkpoint_links_to_is_refused(tmp_path, src, capsys):
    """The same for any link in the input: IN_DIR/notes.txt -> ../elsewhere/notes.txt, --json ../elsewhere/notes.txt."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "README.md").write_text("precious")
    (src / "README.md").symlink_to(elsewhere / "README.md")
    assert main([str(src), str(tmp_path / "out"), "-q", "--json", str(elsewhere / "README.md")]) == 2
    assert "is a link to it" in capsys.readouterr().err
    assert (elsewhere / "README.md").read_text() == "precious"


@pytest.mark.parametrize("command", ["convert", "inspect", "verify", "failure"])
def test_json_reports_hold_paths_that_are_not_utf8_as_escapes_not_lone_surrogates(tmp_path, command):
    """An IN_DIR or OUT_DIR path that is not UTF-8 went into the --json report as a lone surrogate ("in\\udcff"),
    which strict JSON readers (Rust's serde_json; this tool's own reader) refuse; the manifest records such a path
    with \\xNN escapes since 2026-11-29, and so does every report now."""
    import os
    import shutil as sh

    from marlin_convert import strict_json

    example = Path(__file__).parent.parent / "examples" / "tiny-gptq"
    src = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/src\xff"))
    out = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/out\xfe"))
    sh.copytree(example, src)
    report = tmp_path / "report.json"
    args = {"convert": [str(src), str(out)], "inspect": ["inspect", str(src)],
            "verify": ["verify", str(out), "--skip-kernel", "--source", str(src)],
            "failure": ["verify", str(out / "missing"), "--skip-kernel"]}[command]
    if command in ("verify", "failure"):
        assert main([str(src), str(out), "-q"]) == 0
    assert main([*args, "--json", str(report)]) == (2 if command == "failure" else 0)
    text = report.read_text(encoding="utf-8")
    data = strict_json.loads(text.encode("utf-8"))
    assert "\\udc" not in text
    if command == "convert":
        assert data["in_dir"].endswith("src\\xff") and data["out_dir"].endswith("out\\xfe")
    if command == "failure":
        assert "out\\xfe" in data["error"]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and at least two CPUs to run on")
def test_default_workers_count_the_cpus_this_process_may_run_on():
    """The default --workers came from os.cpu_count(), the machine's CPUs: under taskset, a Slurm job's cpuset or
    docker --cpuset-cpus on a 128-core node allowed 4 of them, verify started 128 worker processes (each holding a
    layer: tens of GB where the job had a few) and convert 8. Now they count the CPUs this process may run on."""
    import subprocess

    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "import marlin_convert.convert as c, marlin_convert.verify as v; print(c.DEFAULT_WORKERS, v.DEFAULT_WORKERS)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["1", "1"], done.stdout


def test_default_workers_stay_within_the_cgroup_cpu_quota(tmp_path, monkeypatch):
    """A container limited by a CPU quota (docker --cpus 4, a Kubernetes limit: cgroup v2 cpu.max, v1 cfs quota) sees
    every CPU of the machine in its affinity, so the default --workers would start one per machine core (found by the
    late attack helper). The quota, rounded up, caps them; none ('max', -1) or unreadable files leave the affinity."""
    from marlin_convert import workers

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    root = tmp_path / "cgroup"
    (root / "job").mkdir(parents=True)
    (tmp_path / "self_cgroup").write_text("0::/job\n")
    monkeypatch.setattr(workers, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(workers, "PROC_SELF_CGROUP", str(tmp_path / "self_cgroup"))
    assert workers.cgroup_cpu_quota() is None and workers.usable_cpus() == affinity  # (no files)
    (root / "job" / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: 2
    assert workers.cgroup_cpu_quota() == 2 and workers.usable_cpus() == min(affinity, 2)
    (root / "job" / "cpu.max").write_text("50000 100000\n")  # half a CPU: one worker
    assert workers.usable_cpus() == 1
    (root / "job" / "cpu.max").write_text("max 100000\n")
    assert workers.cgroup_cpu_quota() is None
    (root / "job" / "cpu.max").unlink()
    (root / "cpu").mkdir()
    (root / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert workers.cgroup_cpu_quota() == 3
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert workers.cgroup_cpu_quota() is None
    (root / "cpu" / "cpu.cfs_quota_us").write_text("garbage\n")
    assert workers.cgroup_cpu_quota() is None and workers.usable_cpus() == affinity


def test_json_reports_keep_characters_beyond_u_ffff_whose_second_surrogate_looks_like_a_byte(tmp_path):
    """json_text rewrote every '\\udc80'..'\\udcff' escape, also the second half of a surrogate pair: a character
    beyond U+FFFF with it (U+1F480 '\\U0001F480' is written '\\ud83d\\udc80'; one in 8 of U+10000..) in a valid UTF-8
    path came out as a lone high surrogate and '\\x80' ("in\\ud83d\\\\x80"): other data, which strict readers refuse."""
    import os
    import shutil as sh

    from marlin_convert import strict_json
    from marlin_convert.cli._output import json_text

    example = Path(__file__).parent.parent / "examples" / "tiny-gptq"
    src = Path(os.fsdecode(os.fsencode(str(tmp_path)) + "/src\U0001F480".encode() + b"\xff" + "\U0001F4BE".encode()))
    sh.copytree(example, src)
    report = tmp_path / "report.json"
    assert main([str(src), str(tmp_path / "out\U00020080"), "-q", "--json", str(report)]) == 0
    data = strict_json.loads(report.read_text(encoding="utf-8").encode("utf-8"))
    assert data["in_dir"].endswith("src\U0001F480\\xff\U0001F4BE")
    assert data["out_dir"].endswith("out\U00020080")
    value = {"a\udcff": "\\udc80 \\\\\udcfe \U0001F480\udc80"}
    assert json.loads(json_text(value)) == {"a\\xff": "\\udc80 \\\\\\xfe \U0001F480\\x80"}


@pytest.mark.parametrize("args, error", [
    (["help"], "Error: Missing argument 'OUT_DIR'"),
    (["-q", "help"], "Error: Missing argument 'OUT_DIR'"),
    (["help", "verify"], "Error: help: does not exist"),  # (a review helper: this one had no hint)
])
def test_help_as_a_command_points_to_help(capsys, tmp_path, monkeypatch, args, error):
    """An attack helper: `marlin-convert help` answered only "Missing argument 'OUT_DIR'"."""
    monkeypatch.chdir(tmp_path)  # (no file named help here)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert error in err
    assert "Hint: 'help' was read as convert's IN_DIR: 'marlin-convert --help' lists the commands" in err
