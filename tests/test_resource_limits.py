"""The machine's limits met before or around the command: a small address space (``ulimit -v``) while the command
line's modules load, numpy's OpenBLAS threads, small files read whole, a report that cannot be written once the output
is in place, and a dry run's check of the files a conversion copies. Found by an attack round on resource limits."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from make_gptq_checkpoint import tiny_llama, write_checkpoint

from marlin_convert.cli.app import main

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def src(tmp_path):
    return write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1))


def _console_script(args, code="", preexec_fn=None):
    """The console script (``marlin-convert``: :func:`marlin_convert.cli.launch.run`) with ``args``, ``code`` run first
    in its process."""
    script = f"import sys\n{code}\nsys.argv = ['marlin-convert', *sys.argv[1:]]\n" \
             "from marlin_convert.cli.launch import run\nrun()\n"
    env = {key: value for key, value in os.environ.items() if key not in ("OPENBLAS_NUM_THREADS",
                                                                          "MARLIN_CONVERT_DEBUG")}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=env, preexec_fn=preexec_fn)


def _one_error(proc, *fragments):
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert proc.returncode == 2 and len(errors) == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def test_an_address_space_too_small_to_load_numpy_is_one_error_line(src):
    """``ulimit -v`` of 64 MiB: numpy's import failed, a Traceback (MemoryError, or numpy's page of advice around
    "failed to map segment from shared object"), exit 1; between about 80 and 105 MiB OpenBLAS ended the process itself
    with "OpenBLAS error: Memory allocation still failed", exit 1. Now refused before the import: exit 2, one line."""
    limit = 64 << 20
    proc = _console_script(["inspect", str(src)],
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    _one_error(proc, "out of memory", "ulimit -v")
    assert "OpenBLAS" not in proc.stderr


def test_modules_that_cannot_be_loaded_are_one_error_line(src):
    """An import the command line needs that fails (numpy unloadable: a broken installation, or a shared library the
    address space cannot map) escaped the console script as a Traceback, exit 1."""
    proc = _console_script(["inspect", str(src)], code="sys.modules['numpy'] = None")
    _one_error(proc, "cannot load marlin-convert's modules", "Error", "numpy")


def test_a_shared_library_that_cannot_be_mapped_mid_command_is_out_of_memory(src, capsys, monkeypatch):
    """A module imported late (pydantic's core, while the command ran) whose shared library the address space could not
    map: 'internal error: ImportError ... failed to map segment from shared object' and 'this is a bug', exit 3."""
    import marlin_convert.cli.inspect as inspect_module

    def unmapped(*args, **kwargs):
        raise ImportError("/venv/lib/_pydantic_core.so: failed to map segment from shared object")

    monkeypatch.setattr(inspect_module, "build_plan", unmapped)
    assert main(["inspect", str(src)]) == 2
    err = capsys.readouterr().err
    assert "Error: out of memory: /venv/lib/_pydantic_core.so: failed to map segment" in err, err
    assert "internal error" not in err and "bug" not in err


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts this process's threads in /proc")
def test_numpy_starts_no_blas_threads(src):
    """numpy's OpenBLAS started a thread per core as it loaded, though nothing here multiplies matrices on the CPU;
    where the system refused one (the process limit, a small ulimit -v) OpenBLAS sent the process SIGINT: 'Error:
    interrupted', exit 130, with no Ctrl-C. The console script now asks it for one thread (none started)."""
    count = "import atexit, os\natexit.register(lambda: print('tasks', len(os.listdir('/proc/self/task')), " \
            "file=sys.stderr, flush=True))"
    proc = _console_script(["inspect", str(src)], code=count)
    assert proc.returncode == 0, proc.stderr
    assert "tasks 1" in proc.stderr.splitlines(), proc.stderr


def test_a_small_config_is_read_without_reserving_the_whole_file_limit(src):
    """read_inside read a config with read(256 MiB + 1), which reserves that much before reading 400 bytes: with 128 MiB
    of address space to spare (``ulimit -v`` of 300 MB, or a machine that does not overcommit memory) `inspect` of a
    tiny checkpoint ran out of memory."""
    code = f"""
import re, resource, sys
from pathlib import Path
from marlin_convert.fileio import read_inside
with open('/proc/self/status') as f:
    used = int(re.search(r'VmSize:\\s*(\\d+) kB', f.read()).group(1)) * 1024
limit = used + (128 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
data = read_inside(Path({str(src / 'config.json')!r}))
print(len(data))
"""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("reads VmSize from /proc")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == (src / "config.json").stat().st_size


def test_a_report_that_cannot_be_written_once_the_output_is_in_place_says_so(src, tmp_path, capsys, monkeypatch):
    """--json on a full disk (or in a directory made read-only while the run worked): the conversion had finished and
    moved OUT_DIR into place, but the run said only 'Error: --json r.json: cannot write: No space left on device',
    exit 2 (which the README's table reads as "nothing written"), and printed no summary: the manifest digest was lost.
    Now the summary is printed and the line says OUT_DIR is finished and in place."""
    import errno

    import marlin_convert.cli._output as output_module

    def disk_full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output_module, "_write_report", disk_full)
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q", "--json", str(tmp_path / "r.json")]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "cannot write: No space left on device" in errors[0], captured.err
    assert f"the conversion itself is complete: {out} is finished and in place" in errors[0], errors[0]
    assert "manifest sha256:" in captured.out, captured.out
    assert main(["verify", str(out), "--skip-kernel", "-q"]) == 0


def test_a_dry_run_stops_where_a_file_to_copy_cannot_be_read(src, tmp_path, capsys):
    """A broken link (or an unreadable file) among the files a conversion copies stops the real run before anything is
    written, but --dry-run planned past it: exit 0, "dry run: nothing written", and the real run then failed at once."""
    (src / "chat_template.jinja").symlink_to(tmp_path / "missing")
    out = tmp_path / "out"
    report = tmp_path / "plan.json"
    assert main([str(src), str(out), "--dry-run", "-q", "--json", str(report)]) == 2
    err = capsys.readouterr().err
    assert "Error: " in err and "chat_template.jinja: broken link" in err, err
    data = json.loads(report.read_text())
    assert data["ok"] is False and data["exit_code"] == 2 and "broken link" in data["error"]
    assert main([str(src), str(out), "-q"]) == 2 and not out.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of mode 000")
def test_a_dry_run_stops_where_a_file_to_copy_is_unreadable(src, tmp_path, capsys):
    (src / "tokenizer.json").chmod(0)
    assert main([str(src), str(tmp_path / "out"), "--dry-run", "-q"]) == 2
    assert "tokenizer.json: cannot read: Permission denied" in capsys.readouterr().err


@pytest.mark.parametrize("tamper", [False, True])
def test_a_verify_report_that_cannot_be_written_still_shows_the_verdict(src, tmp_path, capsys, monkeypatch, tamper):
    """verify --json on a full disk: 'Error: --json FILE: cannot write: ...', exit 2, and neither the table nor the
    verdict was printed, so a failing layer went unnamed. Now both are printed and the line says the verdict."""
    import errno

    import marlin_convert.cli._output as output_module

    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    if tamper:
        (out / "tokenizer.json").write_text("{}")
    capsys.readouterr()

    def disk_full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output_module, "_write_report", disk_full)
    assert main(["verify", str(out), "--skip-kernel", "-q", "--json", str(tmp_path / "r.json")]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("Error:")]
    verdict = "FAILED" if tamper else "passed"
    assert len(errors) == 1 and f"verify itself {verdict}" in errors[0], captured.err
    assert captured.out.splitlines()[-2].startswith(f"{verdict}:"), captured.out
