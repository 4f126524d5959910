"""verify's GPU processes (marlin_convert.gpu_workers) on the CPU: the kernel checker replaced by the stand-ins of
``gpu_standin`` (the real one runs in test_verify_gpu.py). What is under test is the plumbing: every slice reaches
the process of its GPU with its own staged bytes, slots come back, a GPU that cannot run or a process that fails or
dies ends verify with the right error, never a hang, and no GPU process outlives verify."""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from make_gptq_checkpoint import qwen3_moe, tiny_llama, write_checkpoint
from safetensors.numpy import load_file

from marlin_convert import gpu_workers
from marlin_convert.cli.app import main
from marlin_convert.convert import convert
from marlin_convert.errors import KernelUnavailableError, VerificationFailed
from marlin_convert.verify import verify


def _use(monkeypatch, function: str) -> None:
    monkeypatch.setattr(gpu_workers, "CHECKER", f"gpu_standin:{function}")


def _children(grace: float = 0.0) -> set[int]:
    """Live child processes of this process (Linux /proc); with ``grace``, waits up to that many seconds for them to
    be gone (a GPU process that has sent its outcome exits on its own, unwaited)."""
    deadline = time.monotonic() + grace
    while True:
        found = _live_children()
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.02)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process (Linux /proc)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry)] = (int(fields[1]), fields[0])
    return table


def _live_children() -> set[int]:
    return {pid for pid, (parent, state) in _processes().items() if parent == os.getpid() and state != "Z"}


def _source_crcs(src) -> dict[tuple[str, int | None], int]:
    """(layer name, expert or None) -> CRC-32 of its source qweight (each expert's slice of a stacked one)."""
    crcs = {}
    for path in src.glob("*.safetensors"):
        for name, array in load_file(str(path)).items():
            if name.endswith(".qweight"):
                layer = name.removesuffix(".qweight")
                if array.ndim == 3:
                    for e in range(array.shape[0]):
                        crcs[layer, e] = zlib.crc32(np.ascontiguousarray(array[e]).tobytes())
                else:
                    crcs[layer, None] = zlib.crc32(np.ascontiguousarray(array).tobytes())
    return crcs


def _assert_own_bytes(report, src) -> None:
    crcs = _source_crcs(src)
    for result in report.results:
        assert {c.max_abs_error for c in result.kernel} == {float(crcs[result.name, result.expert])}, result.label


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-processes")
    src = write_checkpoint(root / "in", tiny_llama(num_layers=3, hidden=128, intermediate=256, group_size=64))
    convert(src, root / "out", workers=1)
    return src, root / "out"


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("gpus", [[0], [0, 1]])
def test_every_slice_reaches_its_gpu_process_with_its_own_bytes(monkeypatch, llama, workers, gpus):
    _use(monkeypatch, "passing")
    src, out = llama
    before = _children()
    report = verify(out, gpus=gpus, batch_sizes=[1, 16], workers=workers)
    assert report.ok and report.kernel_checked and len(report.results) == 21  # more slices than staging slots
    _assert_own_bytes(report, src)
    for index, result in enumerate(report.results):
        assert result.device == f"standin:{gpus[index % len(gpus)]}"  # round-robin by layer entry
        assert [c.batch for c in result.kernel] == [1, 16]
    pids = {r.kernel_note.split("pid ")[1] for r in report.results}
    assert len(pids) == len(gpus) and str(os.getpid()) not in pids  # one process per GPU, none of them this one
    assert set(report.gpu_peak_bytes) == {f"standin:{g}" for g in gpus}
    assert {"manifest and audit", "workers started", "kernel loaded", "GPU done"} <= set(report.timeline)
    assert _children(grace=10) <= before  # the GPU processes are gone


def test_stacked_experts_each_reach_the_gpu(monkeypatch, tmp_path):
    _use(monkeypatch, "passing")
    spec = qwen3_moe(num_layers=1, num_experts=12, hidden=128, expert_intermediate=64, stacked=True, group_size=64)
    src = write_checkpoint(tmp_path / "in", spec)
    convert(src, tmp_path / "out", workers=1)
    report = verify(tmp_path / "out", gpus=[0, 1], batch_sizes=[1], workers=2)
    assert report.ok
    experts = [r for r in report.results if r.expert is not None]
    names = {r.name for r in experts}
    assert len(names) >= 2 and len(experts) == 12 * len(names) and all(len(r.kernel) == 1 for r in experts)
    assert {r.device for r in experts} == {"standin:0", "standin:1"}
    _assert_own_bytes(report, src)  # each expert's own slice of the stacked tensors


def test_a_gpu_that_cannot_run_the_kernel_stops_verify_with_its_reason(monkeypatch, llama):
    _use(monkeypatch, "unavailable")
    before = _children()
    with pytest.raises(KernelUnavailableError) as caught:
        verify(llama[1], gpus=[0], batch_sizes=[1], workers=2)
    assert caught.value.message == "GPU 0 does not exist: 0 GPU(s) visible"
    assert "check nvidia-smi" in caught.value.hint and "--skip-kernel" in caught.value.hint
    assert _children(grace=10) <= before


@pytest.mark.parametrize("function, expected", [
    ("raises_on_third_slice", "GPU 1: the kernel check stopped: RuntimeError: CUDA error: an illegal memory access"),
    ("killed_on_third_slice", "GPU 1: the kernel check process ended before its result (killed by signal 9 "
                              "(SIGKILL))"),
])
@pytest.mark.parametrize("workers", [1, 3])
def test_a_gpu_process_that_fails_or_dies_ends_verify_with_an_error_not_a_hang(monkeypatch, llama, function,
                                                                                expected, workers):
    _use(monkeypatch, function)
    before = _children()
    with pytest.raises(VerificationFailed) as caught:
        verify(llama[1], gpus=[1], batch_sizes=[1], workers=workers)
    assert caught.value.message.startswith(expected)
    assert _children(grace=10) <= before


def test_the_cli_exits_1_when_a_gpu_process_fails(monkeypatch, llama, capsys):
    _use(monkeypatch, "raises_on_third_slice")
    assert main(["verify", str(llama[1]), "--gpu", "0", "--batch", "1", "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: GPU 0: the kernel check stopped: RuntimeError: CUDA error") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1  # one line (the process's traceback only with MARLIN_CONVERT_DEBUG=1)


def test_a_gpu_process_that_fails_before_its_kernel_is_ready_means_no_kernel_here(monkeypatch, llama, capsys):
    """A CUDA error while the GPU process starts (a busy device, say) is 'the kernel cannot run here': exit 2."""
    _use(monkeypatch, "cuda_fails_to_start")
    assert main(["verify", str(llama[1]), "--gpu", "0", "--batch", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: GPU 0: the kernel check stopped: RuntimeError: CUDA error: CUDA-capable device")
    assert "--skip-kernel" in err


def test_the_cli_exits_0_with_two_gpu_processes(monkeypatch, llama, capsys):
    _use(monkeypatch, "passing")
    assert main(["verify", str(llama[1]), "--gpu", "0,1", "--batch", "1,16"]) == 0
    assert "passed: 21/21 layers ok" in capsys.readouterr().out


def test_a_prestarted_gpu_process_is_the_first_gpus(monkeypatch, llama):
    """The console script starts the first GPU process before its own imports (gpu_workers.prestart); verify takes it
    for its first GPU and starts the others."""
    _use(monkeypatch, "passing")
    gpu_workers.prestart()
    first = gpu_workers._prestarted[3].popen.pid
    report = verify(llama[1], gpus=[0, 1], batch_sizes=[1], workers=2)
    assert report.ok and gpu_workers._prestarted is None
    pids = {r.device: r.kernel_note.split("pid ")[1] for r in report.results}
    assert pids["standin:0"] == str(first) and pids["standin:1"] != str(first)


def test_a_prestarted_gpu_process_nobody_takes_is_stopped():
    before = _children()
    gpu_workers.prestart()
    assert gpu_workers._prestarted is not None
    gpu_workers.discard_prestarted()
    assert gpu_workers._prestarted is None and _children(grace=10) <= before


def test_the_console_script_without_a_gpu_says_why_and_leaves_nothing(llama, tmp_path):
    """`marlin-convert verify OUT --gpu 0` through the console script's launcher (prestart included) on a machine
    where the kernel cannot run: exit 2 with the reason; no process left."""
    import subprocess
    import sys

    from marlin_convert.kernel import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        pytest.skip("the kernel can run here")
    before = _children()
    done = subprocess.run([sys.executable, "-m", "marlin_convert.cli.launch", "verify", str(llama[1]), "--gpu", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"Error: {reason}") and "--skip-kernel" in done.stderr
    assert _children(grace=10) <= before


_DRIVER = """
import sys
import marlin_convert.gpu_workers as gpu_workers
gpu_workers.CHECKER = "gpu_standin:slow"
from marlin_convert.cli.app import main
sys.exit(main(["verify", sys.argv[1], "--gpu", "0,1", "--batch", "1", "-q"]))
"""


def _descendants(pid: int) -> set[int]:
    table, found, todo = _processes(), set(), [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, _) in table.items():
            if ppid == parent and child not in found:
                found.add(child)
                todo.append(child)
    return found


@pytest.mark.parametrize("signal_name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_while_the_gpu_processes_work_ends_verify_cleanly(llama, signal_name, code):
    """SIGINT or SIGTERM to verify while its GPU processes check slices (the stand-in takes 50 ms a slice): exit
    130 / 143 with one line, and no process of it left."""
    import signal
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    # (SIGINT at its default in the child, as a terminal's foreground job has it, whatever pytest inherited: a
    # shell's background job ignores SIGINT, and the command line leaves an inherited ignore alone)
    process = subprocess.Popen([sys.executable, "-c", _DRIVER, str(llama[1])], stderr=subprocess.PIPE, text=True,
                               env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_descendants(process.pid)) < 3:  # workers and GPU processes up
        time.sleep(0.02)
    time.sleep(0.3)  # into the checks
    family = _descendants(process.pid)
    process.send_signal(getattr(signal, signal_name))
    _, err = process.communicate(timeout=60)
    assert process.returncode == code, err
    assert err.strip().splitlines()[-1] in ("Error: interrupted", "Error: terminated")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in family):
        time.sleep(0.05)
    assert not [pid for pid in family if _alive(pid)]


def _alive(pid: int) -> bool:
    entry = _processes().get(pid)
    return entry is not None and entry[1] != "Z"


def test_the_callers_working_directory_on_its_import_path_reaches_the_gpu_processes(llama):
    """A program run from a folder imports its modules through '' on sys.path; the GPU processes run in the
    package's root, so '' is passed on as that folder (here: the stand-in checker, importable only from tests/)."""
    import subprocess
    import sys

    driver = ("import sys\nimport marlin_convert.gpu_workers as g\ng.CHECKER = 'gpu_standin:passing'\n"
              "from marlin_convert.cli.app import main\n"
              "sys.exit(main(['verify', sys.argv[1], '--gpu', '0', '--batch', '1', '-q']))\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))  # the package, not tests/
    done = subprocess.run([sys.executable, "-c", driver, str(llama[1])], cwd=Path(__file__).parent, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
