"""Verify's kernel check, in one process per GPU.

``verify --gpu 0,1`` starts one process per GPU listed as its first step, before it reads the manifest. Each is a
fresh interpreter (``python -m marlin_convert.gpu_workers``: nothing is inherited, so it works whether or not the
caller has touched CUDA already) that imports torch, initialises CUDA on its GPU and loads the kernel while the
parent reads the manifest and its workers hash files and stage slices; then it checks the slices of its layers
(layer index modulo the number of GPUs) with a :class:`marlin_convert.gpu_check.GpuChecker`. Each GPU thus has a
thread of its own queuing the per-slice work (reference, kernel runs, statistics): when one thread fed every GPU, it
bounded the GPU phase, and a second GPU made verify slower, not faster. CUDA also starts on every GPU at once.

The staged slices live in one shared memory file (Linux ``memfd``) of ``slot_count`` slots, mapped by the parent,
its forked workers and each GPU process. Messages, pickled, over one socket pair per GPU process:

- GPU process -> parent: ``("ready", loaded_at)`` or ``("unavailable", message, hint)`` once the kernel is loaded
  (or cannot be); ``("free", [slot, ...])``: slots whose upload has finished, for the workers again;
  ``("done", GpuOutcome)`` after ``"end"``; ``("error", text)`` when anything else went wrong.
- parent -> GPU process: ``("gpu", index, CHECKER)`` once (the process imports torch before it knows its GPU, so
  the console script can start one before its own imports: :func:`prestart`); ``("setup", GpuSetup)`` once;
  ``("slice", layer index, layer, expert, slot, placed, zero format)`` per staged slice; ``("end",)`` when no
  more come.

A GPU process ignores SIGINT and SIGHUP (a Ctrl-C or a hang-up reaches the whole process group; the parent decides),
dies with its parent (:mod:`marlin_convert.workers`), and leaves with ``os._exit`` once its outcome is sent: torch's
teardown is not waited for. Times are ``time.perf_counter()`` values (CLOCK_MONOTONIC on Linux: one clock for all
processes).
"""

from __future__ import annotations

import importlib
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from .errors import KernelUnavailableError, VerificationFailed

#: how each GPU process loads its checker: "module:function", called with the GPU index; it returns a function
#: ``make(slots, setup)`` that builds the checker. Tests point it at a stand-in (the value travels to the process).
CHECKER = "marlin_convert.gpu_workers:kernel_checker"
#: seconds between a GPU process's checks for finished uploads while some are in flight
_UPLOAD_POLL = 0.0005
#: seconds the parent waits for a GPU process's message at a time (it checks that they are alive in between)
_PARENT_WAIT = 0.05
#: the last bytes of a dead GPU process's stderr quoted in the error
_STDERR_TAIL = 600


@dataclass(frozen=True)
class GpuSetup:
    slot_count: int
    stage_size: int
    batch_sizes: tuple[int, ...]
    activation_dtype: str
    seed: int


@dataclass
class GpuOutcome:
    """What one GPU process reports at the end: ``results`` maps ``(layer index, expert)`` to ``([KernelCheck],
    note)``."""

    device: str
    results: dict
    seconds: dict[str, float]
    peak_memory: dict[str, int]
    pinned: bool
    pid: int
    peak_rss: int
    ready_at: float


def kernel_checker(gpu: int):
    """Load the kernel on GPU ``gpu`` (:func:`marlin_convert.kernel.ensure_kernel`: raises
    :class:`KernelUnavailableError`) and return ``make(slots, setup)``, which builds its :class:`GpuChecker`."""
    from .kernel import ensure_kernel

    device = ensure_kernel(gpu)

    def make(slots, setup: GpuSetup):
        from .gpu_check import GpuChecker

        return GpuChecker([device], slots, setup.stage_size, list(setup.batch_sizes), setup.activation_dtype,
                          setup.seed)

    return make


def _resolve(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


# ------------------------------------------------------------------------------------------------ the GPU process


def _serve(gpu: int, conn: Connection, stage_fd: int, checker: str) -> None:
    try:
        make = _resolve(checker)(gpu)
    except KernelUnavailableError as exc:
        conn.send(("unavailable", exc.message, exc.hint))
        return
    conn.send(("ready", time.perf_counter()))
    message = conn.recv()
    if message[0] != "setup":  # the parent has no slice to check
        return
    setup: GpuSetup = message[1]
    slots = mmap.mmap(stage_fd, setup.slot_count * setup.stage_size)
    checker_ = make(slots, setup)
    ready_at = time.perf_counter()
    feeding = 0.0
    while True:
        # block while nothing is uploading (a slot is freed only once its upload is done); poll while something is
        if conn.poll(_UPLOAD_POLL if checker_.uploads else None):
            message = conn.recv()
            if message[0] == "end":
                break
            _, layer_index, layer, expert, slot, placed, zero_format = message
            began = time.perf_counter()
            checker_.submit(layer_index, layer, expert, slot, placed, zero_format)
            feeding += time.perf_counter() - began
        freed = checker_.uploaded_slots()
        if freed:
            conn.send(("free", freed))
    results = checker_.finish()
    seconds = dict(checker_.seconds)
    seconds["feed (host)"] = feeding
    import resource

    outcome = GpuOutcome(checker_.device_of(0), results, seconds, checker_.peak_memory(), checker_.pinned, os.getpid(),
                         resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, ready_at)
    conn.send(("done", outcome))  # then os._exit (main): unregistering, synchronising, torch's teardown not needed


def main(argv: list[str]) -> None:
    """``python -m marlin_convert.gpu_workers SOCKET_FD STAGE_FD PARENT_PID`` (started by :class:`GpuWorkers` or
    :func:`prestart`, not by hand). Imports torch at once, then learns its GPU and checker from the parent."""
    sock_fd, stage_fd, parent = (int(v) for v in argv[:3])
    from .workers import worker_started

    worker_started(parent)
    conn = Connection(sock_fd)
    try:
        try:
            importlib.import_module("torch")  # the long part of the start-up, before the GPU is even known
        except ImportError:  # the checker's loader says so, in its own words
            pass
        _, gpu, checker = conn.recv()  # ("gpu", index, CHECKER)
        _serve(gpu, conn, stage_fd, checker)
    except BaseException:  # anything at all: the parent reports it (it cannot see this process's stderr)
        try:
            conn.send(("error", traceback.format_exc(limit=6)))
        except OSError:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)


# ------------------------------------------------------------------------------------------------ the parent side


@dataclass
class _Process:
    popen: subprocess.Popen
    conn: Connection
    stderr: object
    gpu: int = -1
    ready: bool = False
    loaded_at: float = 0.0
    outcome: GpuOutcome | None = None


def _shared_file() -> int:
    """A file descriptor of an empty, unnamed shared memory file (sized later with ftruncate)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("marlin-convert-staging")
    handle = tempfile.TemporaryFile()  # no memfd (not Linux): an unlinked temporary file does the same
    fd = os.dup(handle.fileno())
    handle.close()
    return fd


#: the folder that holds this package: the GPU processes run there (``python -m`` puts the working directory first
#: on the import path, so a ``marlin_convert`` folder where verify was started must not be the one they import)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


def _child_env() -> dict[str, str]:
    """The environment, with this process's import path (so the GPU process imports this same code)."""
    env = dict(os.environ)
    # ("" on the path is this process's working directory: the GPU processes run elsewhere, so it is spelled out)
    paths = [str(Path(p or os.getcwd()).resolve()) for p in sys.path if Path(p or os.getcwd()).is_dir()]
    env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *paths])
    return env


def _spawn(stage_fd: int) -> _Process:
    """Start one GPU process (it imports torch, then waits to be told its GPU)."""
    ours, theirs = socket.socketpair()
    stderr = tempfile.TemporaryFile()
    verbose = os.environ.get("MARLIN_CONVERT_VERBOSE_BUILD") == "1"  # the compiler's output, when asked for
    try:
        popen = subprocess.Popen(  # (its stdout, when shown, goes to our stderr: stdout may be `--json -`'s report)
            [sys.executable, "-m", "marlin_convert.gpu_workers", str(theirs.fileno()), str(stage_fd), str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=2 if verbose else subprocess.DEVNULL,
            stderr=None if verbose else stderr, env=_child_env(), pass_fds=(theirs.fileno(), stage_fd), close_fds=True,
            cwd=_PACKAGE_ROOT)
    except BaseException:
        ours.close()
        stderr.close()
        raise
    finally:
        theirs.close()
    return _Process(popen, Connection(ours.detach()), stderr)


#: (owner pid, time, stage fd, process) of :func:`prestart`, until a GpuWorkers of the same process takes it
_prestarted: tuple[int, float, int, _Process] | None = None


def prestart() -> None:
    """Start the first GPU process now, before the caller imports the rest of what it needs: the console script calls
    this first for a verify that will run the kernel (its own imports took 0.5 s on the H200 machine, without cached
    bytecode; torch's import in the GPU process runs meanwhile). The next :class:`GpuWorkers` of this process takes
    it; :func:`discard_prestarted` stops it if none does. Does nothing where GPU processes cannot run."""
    global _prestarted
    if _prestarted is not None or sys.platform == "win32":
        return
    started = time.perf_counter()
    stage_fd = _shared_file()
    try:
        process = _spawn(stage_fd)
    except OSError:
        os.close(stage_fd)
        return
    _prestarted = (os.getpid(), started, stage_fd, process)


def discard_prestarted() -> None:
    """Stop a prestarted GPU process that no GpuWorkers took."""
    global _prestarted
    if _prestarted is not None:
        owner, _, stage_fd, process = _prestarted
        _prestarted = None
        if owner == os.getpid():
            _stop(process)
            os.close(stage_fd)


def _stop(process: _Process) -> None:
    # one that sent its outcome is leaving on its own (os._exit): its CUDA teardown (0.2 s on the H200) is not waited
    # for; any other is killed now
    if process.outcome is None and process.popen.poll() is None:
        process.popen.kill()
        try:
            process.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    process.conn.close()
    process.stderr.close()


class _ChildTraceback(Exception):
    """A GPU process's traceback, as text (the cause of the error raised for it)."""


class GpuWorkers:
    """The GPU processes of one verify run; see the module docstring. Use as a context manager (or call
    :meth:`close`): whatever happens, no GPU process outlives it."""

    def __init__(self, gpus: list[int]) -> None:
        global _prestarted
        if sys.platform == "win32":
            raise KernelUnavailableError("verify's GPU check needs Linux (it shares staging memory with its "
                                         "GPU processes)")
        self.slots: mmap.mmap | None = None
        self.setup_sent = False
        self.processes: list[_Process] = []
        if _prestarted is not None and _prestarted[0] == os.getpid():
            _, self.started_at, self.stage_fd, first = _prestarted
            _prestarted = None
            self.processes.append(first)
        else:
            self.started_at = time.perf_counter()
            self.stage_fd = _shared_file()
        try:
            while len(self.processes) < len(gpus):
                self.processes.append(_spawn(self.stage_fd))
            for process, gpu in zip(self.processes, gpus):
                process.gpu = gpu
                self._send(process, ("gpu", gpu, CHECKER))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> GpuWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def count(self) -> int:
        return len(self.processes)

    def setup(self, slot_count: int, stage_size: int, batch_sizes: list[int], activation_dtype: str,
              seed: int) -> mmap.mmap:
        """Size the shared slots and tell every GPU process how to check; returns the slots' mapping (map it
        before forking workers: they inherit it)."""
        os.ftruncate(self.stage_fd, slot_count * stage_size)
        self.slots = mmap.mmap(self.stage_fd, slot_count * stage_size)
        setup = GpuSetup(slot_count, stage_size, tuple(batch_sizes), activation_dtype, seed)
        for process in self.processes:
            self._send(process, ("setup", setup))
        self.setup_sent = True
        return self.slots

    def submit(self, layer_index: int, layer, expert: int | None, slot: int, placed: dict, zero_format: str) -> None:
        """Hand one staged slice to the GPU process of its layer."""
        process = self.processes[layer_index % len(self.processes)]
        self._send(process, ("slice", layer_index, layer, expert, slot, placed, zero_format))

    def poll(self) -> list[int]:
        """Read what the GPU processes have said (without waiting); returns the slots they freed. Raises
        :class:`KernelUnavailableError` when a GPU cannot run the kernel and :class:`VerificationFailed` when a GPU
        process failed or died."""
        freed: list[int] = []
        for process in self.processes:
            freed += self._read(process)
        return freed

    def wait_ready(self) -> None:
        """Wait until every GPU process has loaded the kernel (raising as :meth:`poll` does)."""
        while not all(p.ready for p in self.processes):
            self._wait_any()
            self.poll()

    def finish(self) -> list[GpuOutcome]:
        """Tell every GPU process that no more slices come and collect their outcomes (raising as :meth:`poll`)."""
        if not self.setup_sent:
            self.wait_ready()
            return []
        for process in self.processes:
            self._send(process, ("end",))
        while not all(p.outcome is not None for p in self.processes):
            self._wait_any()
            self.poll()
        return [p.outcome for p in self.processes]

    def loaded_at(self) -> float | None:
        return max((p.loaded_at for p in self.processes), default=None) if all(p.ready for p in self.processes) \
            else None

    def _wait_any(self) -> None:
        from multiprocessing.connection import wait

        wait([p.conn for p in self.processes if p.outcome is None], timeout=_PARENT_WAIT)

    def _send(self, process: _Process, message) -> None:
        try:
            process.conn.send(message)
        except OSError:  # it died: say why
            self._read(process)
            self._died(process)

    def _read(self, process: _Process) -> list[int]:
        freed: list[int] = []
        while process.outcome is None:
            try:
                if not process.conn.poll():
                    break
                message = process.conn.recv()
            except (EOFError, OSError):
                self._died(process)
            except Exception as exc:  # a message that does not unpickle here: not the same code on both sides
                raise self._failure(process, f"unreadable message from its check process ({exc})") from None
            kind = message[0]
            if kind == "free":
                freed += message[1]
            elif kind == "ready":
                process.ready, process.loaded_at = True, message[1]
            elif kind == "done":
                process.outcome = message[1]
            elif kind == "unavailable":
                raise KernelUnavailableError(message[1], hint=message[2])
            else:  # "error": one line here; the process's traceback is the exception's cause (MARLIN_CONVERT_DEBUG=1)
                text = message[1].strip()
                last = text.splitlines()[-1] if text else "no details"
                raise self._failure(process, f"the kernel check stopped: {last}") from _ChildTraceback(text)
        if process.outcome is None and process.popen.poll() is not None and not process.conn.poll():
            self._died(process)
        return freed

    @staticmethod
    def _failure(process: _Process, what: str):
        """The error for a GPU process that failed: before its kernel was ready, the kernel cannot run here
        (KernelUnavailableError, exit 2); after, the check of its layers failed (VerificationFailed, exit 1)."""
        if not process.ready:
            return KernelUnavailableError(f"GPU {process.gpu}: {what}")
        return VerificationFailed(f"GPU {process.gpu}: {what}")

    def _died(self, process: _Process):
        code = process.popen.wait()
        how = f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 and -code in \
            signal.valid_signals() else f"exit code {code}"
        tail = ""
        try:
            process.stderr.seek(0, os.SEEK_END)
            size = process.stderr.tell()
            process.stderr.seek(max(0, size - _STDERR_TAIL))
            text = process.stderr.read().decode(errors="replace").strip()
            tail = f"; its stderr ends: {text.splitlines()[-1]}" if text else ""
        except (OSError, ValueError):
            pass
        raise self._failure(process, f"the kernel check process ended before its result ({how}){tail}")

    def close(self) -> None:
        """Stop every GPU process still running and release the shared memory."""
        for process in self.processes:
            _stop(process)
        self.processes = []
        if self.slots is not None:
            try:
                self.slots.close()
            except BufferError:  # a view is still referenced somewhere: the mapping goes with its last user
                pass
            self.slots = None
        if self.stage_fd >= 0:
            os.close(self.stage_fd)
            self.stage_fd = -1


__all__ = ["GpuWorkers", "GpuOutcome", "GpuSetup", "kernel_checker", "prestart", "discard_prestarted", "CHECKER"]


if __name__ == "__main__":  # run as a module: import this file under its own name, so pickled classes are found
    from marlin_convert.gpu_workers import main as _main

    _main(sys.argv[1:])
