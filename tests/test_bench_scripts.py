"""The benchmark scripts' smoke preset: sizes readable at any scale, no infinite rates, no verdicts on targets
that only the full presets are measured against."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_convert import rate_label, ratio_label, size_label, verdict

REPO = Path(__file__).resolve().parent.parent


def test_sizes_rates_and_verdicts_are_printed_with_meaning_at_every_scale():
    assert size_label(454_400) == "454.4 kB" and size_label(3_500_000) == "3.50 MB"
    assert size_label(3_900_000_000) == "3.900 GB"
    assert rate_label(454_400, 0.001) == "n/a (time rounds to 0)" and rate_label(454_400, 0.0) == rate_label(1, 0.001)
    assert rate_label(1_420_000, 1.0) == "1.42 MB/s" and rate_label(620_000_000, 1.0) == "0.620 GB/s"
    assert ratio_label(0.32, 0.0) == "n/a (baseline time rounds to 0)" and ratio_label(3.0, 2.0) == "1.50x"
    assert verdict(True, "llama-7b") == "PASS" and verdict(False, "qwen3-moe") == "MISS"
    assert "PASS" not in verdict(True, "tiny") and "targets apply only to the full presets" in verdict(False, "tiny")


@pytest.mark.parametrize("script, extra", [("bench_convert.py", []), ("bench_verify.py", ["--skip-gpu"])])
def test_the_tiny_preset_prints_no_zero_sizes_no_inf_and_no_pass_or_miss(tmp_path, script, extra):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--preset", "tiny", "--repeat", "1",
                           "--dir", str(tmp_path), *extra], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "0.000 GB" not in text and "inf" not in text.replace("info", ""), text
    assert "PASS" not in text and "MISS" not in text, text
    assert "targets apply only to the full presets" in text, text


def _stamp_row(entry: int, phases: list[int], sm: int) -> list[int]:
    """One block's row of the [TRACE] buffer: %globaltimer at phases 0 .. 6, the SM id, unused words."""
    times = [entry]
    for step in phases:
        times.append(times[-1] + step)
    return times + [sm] + [0] * 8


def test_trace_summary_reads_spans_spreads_phases_and_sm_sharing():
    """scripts/trace_kernel.py's summary of a traced call, on rows made by hand: 4 blocks on 3 SMs (blocks 0 and 3
    share SM 5; SMs = 2, so block 0's second-round partner is block 2, on another SM), one block that never ran past
    the grid is ignored."""
    from trace_kernel import PHASES, summarize

    rows = [_stamp_row(1000, [100, 200, 300, 10, 20, 30], 5), _stamp_row(1040, [100, 200, 300, 10, 20, 30], 6),
            _stamp_row(1100, [100, 400, 300, 10, 20, 30], 7), _stamp_row(1010, [100, 200, 300, 10, 500, 30], 5),
            [0] * 16]
    s = summarize(rows, 4, 2)
    ends = sorted(r[6] - 1000 for r in rows[:4])
    assert ends == [660, 700, 960, 1150]
    assert s["blocks"] == 4 and s["sms"] == 3 and s["per_sm"] == 2
    assert s["span"] == 1150 and s["entry"] == 100 and s["end"] == 1150 - 660
    assert s["pair"] == 0.0  # blocks 0 / 2 and 1 / 3 ran on different SMs
    assert s["ends"] == [660, 700, 1150]  # 10th, 50th, 90th percentile of 4, nearest rank: items 1, 2, 4
    assert s["lone"] == (2, (700 + 960) / 2, (660 + 1150) / 2)  # blocks 1, 2 alone; 0, 3 share SM 5
    assert s[PHASES[1]] == (200, 400) and s[PHASES[4]] == (20, 500)
    assert summarize([[0] * 16], 1, 2) == {}
    # a phase a block never reached (0: phase 2 where warp 0 had no chunk) is left out of that phase's figures only
    rows[1][2] = 0
    s = summarize(rows, 4, 2)
    assert s[PHASES[1]] == (200, 400) and s[PHASES[2]] == (300, 300) and s["blocks"] == 4


def test_trace_script_needs_the_trace_build():
    """Without MARLIN_CONVERT_TRACE=1 the script would time the release build, which has no stamps: one line, exit 2."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "MARLIN_CONVERT_TRACE"}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "trace_kernel.py")], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 2 and "MARLIN_CONVERT_TRACE=1" in done.stderr, done.stderr


@pytest.mark.parametrize("script, env", [("trace_kernel.py", {"MARLIN_CONVERT_TRACE": "1"}), ("bench_kernel.py", {}),
                                         ("bench_host_overhead.py", {})])
def test_kernel_scripts_say_why_when_the_kernel_cannot_run(script, env):
    """Without a usable GPU (CI: a CPU build of torch) the kernel scripts print one line and exit 2, not a traceback."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the scripts would run the kernel")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_gpu_check_without_a_gpu_says_so_in_one_line_before_building(tmp_path):
    """It built the kernel first: a traceback, then 'kernel build failed'. Now one line, exit 2, nothing written."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the script would run the whole check")
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")})
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"gpu_check: no CUDA GPU visible to torch (torch {torch.__version__}"), done.stderr
    assert done.stderr.endswith("); run it on a machine with an NVIDIA GPU\n"), done.stderr
    assert not (tmp_path / "out").exists()


def test_peak_rss_help_and_a_command_that_cannot_start(capsys):
    """--help printed a traceback (it was run as the command); a command that cannot start is one line, exit 2."""
    import peak_rss

    assert peak_rss.main(["--help"]) == 0 and "peak resident set size" in capsys.readouterr().out
    assert peak_rss.main(["--", "/nonexistent/command"]) == 2
    err = capsys.readouterr().err
    assert "cannot start /nonexistent/command" in err and "Traceback" not in err


def test_sanitize_kernel_lists_and_indexes_its_calls_without_a_gpu():
    """``--list`` prints the selected calls with their index (what ``--index I`` and ``--isolate TOOL`` run, one per
    process, to tell a racecheck report inside one launch from one across launches) and touches no GPU."""
    def listed(*args):
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "sanitize_kernel.py"), "--list", *args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    every, few, wgmma = listed(), listed("--few"), listed("--few", "--wgmma", "any")
    assert len(every) > len(few) > len(wgmma) > 0
    assert [line.split(" ", 1)[0] for line in wgmma] == [str(i) for i in range(len(wgmma))]
    assert all(" wgmma=None" not in line for line in wgmma) and any(" wgmma=None" in line for line in few)
    assert {line.split(" ", 1)[1] for line in wgmma} <= {line.split(" ", 1)[1] for line in few}


def test_sanitize_kernel_isolate_runs_each_selected_call_once_with_the_selection_rebuilt(tmp_path, monkeypatch,
                                                                                           capsys):
    """``--isolate TOOL`` runs one compute-sanitizer child per selected call (``--index`` narrows it to one). The
    children's options were the parent's words with '--isolate ...' filtered out: an abbreviation ('--iso') or a
    second '--isolate=' went through, and every child started its own round of children; and --index was ignored.
    Here a stand-in compute-sanitizer records its arguments instead of running the child."""
    import sanitize_kernel

    log = tmp_path / "calls.txt"
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\necho "========= RACECHECK SUMMARY: 0 hazards displayed"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr("marlin_convert.kernel.ensure_kernel", lambda device_index=0: None)
    wgmma = len(subprocess.run([sys.executable, str(REPO / "scripts" / "sanitize_kernel.py"), "--list", "--few",
                                "--wgmma", "any"], capture_output=True, text=True, check=True).stdout.splitlines())

    assert sanitize_kernel.main(["--few", "--wgmma", "any", "--isolate", "racecheck"]) == 0
    calls = log.read_text().splitlines()
    assert len(calls) == wgmma
    for i, call in enumerate(calls):
        assert call.startswith("--tool racecheck --kernel-name kns=marlin_ --error-exitcode 3 ")
        assert call.endswith(f"sanitize_kernel.py --few --wgmma any --index {i}") and "--isolate" not in call
    assert f"sanitize_kernel --isolate racecheck: {wgmma} calls, 0 with a failing run" in capsys.readouterr().out

    log.unlink()
    assert sanitize_kernel.main(["--few", "--wgmma", "any", "--index", "3", "--isolate=synccheck"]) == 0
    (call,) = log.read_text().splitlines()
    assert call.startswith("--tool synccheck ") and call.endswith("--few --wgmma any --index 3")
    with pytest.raises(SystemExit):  # (an abbreviation is refused, not passed on)
        sanitize_kernel.main(["--few", "--iso", "racecheck"])


@pytest.mark.slow
def test_gpu_check_end_to_end_checkpoints_convert_and_verify_on_the_cpu(tmp_path):
    """gpu_check.sh's end-to-end step generates its checkpoints with the Python between ``<<'PYEOF'`` and ``PYEOF``
    and converts and verifies each on the GPU. The same Python, run here, writes checkpoints that convert and pass
    ``verify --skip-kernel --source`` on the CPU, so a GPU run does not find a broken case only there (the AutoRound
    cases came in without a GPU run)."""
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    generator = script.split("<<'PYEOF'\n", 1)[1].split("\nPYEOF\n", 1)[0]
    done = subprocess.run([sys.executable, "-c", generator, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    sources = sorted(tmp_path.glob("*-gptq"))
    assert len(sources) >= 15 and any(src.name.startswith("autoround-") for src in sources), sources
    for src in sources:
        out = tmp_path / src.name.replace("-gptq", "-marlin")
        extra = ["--stack-experts"] if src.name == "moe-per-expert-gptq" else []
        for command in ([str(src), str(out), "-q", *extra], ["verify", str(out), "--skip-kernel", "--source", str(src),
                                                              "-q"]):
            run = subprocess.run([sys.executable, "-m", "marlin_convert.cli.app", *command], capture_output=True,
                                 text=True, timeout=300)
            assert run.returncode == 0, (src.name, command[0], run.stderr[-2000:])
