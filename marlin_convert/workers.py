"""Worker processes that live and die with the converter.

The converter forks its workers (:func:`worker_pool`). Each one, as it starts (:func:`worker_started`):

- ignores SIGINT and SIGHUP: a Ctrl-C at the terminal, or the terminal's hang-up, reaches the whole process group,
  and the parent alone decides what to do (it stops the workers and removes the partial output);
- takes SIGTERM's default action again (the CLI's handler, inherited through fork, would raise inside the
  worker instead of ending it);
- asks the kernel to SIGKILL it when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere a thread
  watches the parent's pid), so a parent killed with SIGKILL leaves no orphans holding the partial directory.

:func:`run_parallel` maps a function over items in such a pool and, when its caller stops early (an error, an
interrupt), kills the workers instead of waiting for them.
"""

from __future__ import annotations

import ctypes
import errno
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Iterator, TypeVar

from .errors import InputError, ResourceError
from .interrupts import held

#: the most worker processes a command starts (``--workers``; each is a process with its own buffers: 100000
#: exhausted a machine's memory)
MAX_WORKERS = 256


#: where the cgroup file systems and this process's cgroups are (tests point them elsewhere)
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def cgroup_cpu_quota() -> int | None:
    """The CPUs this process's cgroup quota allows, rounded up (``docker --cpus 4``, a Kubernetes CPU limit): cgroup
    v2 ``cpu.max`` (``"400000 100000"``; ``"max ..."`` is none) of the process's own cgroup, else of the root, or
    cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1 is none). None without a quota, or where the files
    cannot be read or make no sense."""
    own = ""
    for line in (_read_text(PROC_SELF_CGROUP) or "").splitlines():
        if line.startswith("0::"):
            own = line[3:].strip().strip("/")
    quota = period = None
    for directory in dict.fromkeys([f"{CGROUP_ROOT}/{own}".rstrip("/"), CGROUP_ROOT]):
        text = _read_text(f"{directory}/cpu.max")
        if text is not None:
            fields = text.split()
            if len(fields) == 2 and fields[0] != "max":
                quota, period = fields
            break
    else:
        quota = _read_text(f"{CGROUP_ROOT}/cpu/cpu.cfs_quota_us")
        period = _read_text(f"{CGROUP_ROOT}/cpu/cpu.cfs_period_us")
    try:
        quota, period = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return -(-quota // period) if quota > 0 and period > 0 else None


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity (``taskset``, a Slurm job's or a container's cpuset; the machine's
    ``os.cpu_count()`` where it cannot be read), at most its cgroup's CPU quota (:func:`cgroup_cpu_quota`): the default
    number of workers."""
    try:
        cpus = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, quota)) if quota is not None else cpus


def check_workers(workers: int) -> None:
    """Raise :class:`InputError` unless 1 <= ``workers`` <= MAX_WORKERS."""
    if not 1 <= workers <= MAX_WORKERS:
        raise InputError(f"--workers {workers}: expected 1 to {MAX_WORKERS}")

Item = TypeVar("Item")
Result = TypeVar("Result")

_PR_SET_PDEATHSIG = 1
#: how often the fallback watcher (no prctl) checks whether the parent is gone
_WATCH_SECONDS = 0.5
#: the longest a wait for the workers runs with interrupts held back (:mod:`.interrupts`): an interrupt is raised
#: at most this late
POLL_SECONDS = 0.1


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(_WATCH_SECONDS)
            os._exit(1)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the request above took effect
        os._exit(1)


def worker_started(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent)


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` forked processes set up as the module docstring says (made with interrupts held back:
    :func:`.interrupts.held`)."""
    with held():
        return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"),
                                   initializer=worker_started, initargs=(os.getpid(),))


#: what the hint of a refused process or thread says
LIMIT_HINT = ("the process limit (ulimit -u, a container's pids limit) or memory is reached: free some, or run with "
               "fewer --workers")


def thread_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is Python's ``RuntimeError("can't start new thread")``: the system refused a thread (threads
    count against the same process limit as processes, ``ulimit -u`` or a container's pids limit, and need memory
    for their stacks)."""
    return isinstance(exc, RuntimeError) and "can't start new thread" in str(exc)


def start_thread(thread: threading.Thread) -> None:
    """``thread.start()``; raises :class:`ResourceError` where the system refuses the thread."""
    try:
        thread.start()
    except RuntimeError as exc:
        if not thread_refused(exc):
            raise
        raise ResourceError(f"cannot start a thread ({thread.name}): {exc}", hint=LIMIT_HINT) from exc


def submit_all(pool: ProcessPoolExecutor, function: Callable, items: Iterable) -> set:
    """``pool.submit(function, item)`` for every item (the pool starts its worker processes, and its own thread that
    manages them, here). Raises :class:`ResourceError` where the system refuses to start them (fork: EAGAIN at the
    process limit, ``ulimit -u`` or a container's pids limit; ENOMEM; the thread: ``can't start new thread``)."""
    try:
        return {pool.submit(function, item) for item in items}
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.ENOMEM):
            raise
        raise ResourceError(f"cannot start worker processes: {exc.strerror or exc}", hint=LIMIT_HINT) from exc
    except RuntimeError as exc:
        if not thread_refused(exc):
            raise
        raise ResourceError(f"cannot start worker processes: the thread that manages them was refused ({exc})",
                            hint=LIMIT_HINT) from exc


#: the signals that end a process when it crashes (a fault in native code: this package's C extension, numpy, torch),
#: not when something kills it (the out-of-memory killer sends SIGKILL)
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT})


#: how long :func:`results_of` waits for a broken pool's processes to end (the pool kills the rest itself)
_REAP_SECONDS = 2.0


class WorkerCrashed(RuntimeError):
    """A worker process ended on a crash signal (:data:`CRASH_SIGNALS`): a bug, reported as an internal error, not
    as the machine running out of something (:class:`~concurrent.futures.process.BrokenProcessPool` alone)."""


def results_of(pool: ProcessPoolExecutor, done: Iterable[Future]) -> list:
    """``[future.result() for future in done]``, where a broken pool whose worker crashed raises
    :class:`WorkerCrashed` naming the signal instead of ``BrokenProcessPool``. (The exit codes are read from the
    pool's processes, which it exposes no public handle on; they are there until the pool is shut down.)"""
    try:
        return [future.result() for future in done]
    except BrokenProcessPool as exc:
        processes = list((getattr(pool, "_processes", None) or {}).values())
        deadline = time.monotonic() + _REAP_SECONDS
        for process in processes:  # (the pool's own thread reaps them too, and a code it took is there once it has)
            process.join(max(0.0, deadline - time.monotonic()))
        codes = [process.exitcode for process in processes]
        crashes = sorted({signal.Signals(-code).name for code in codes
                          if code is not None and code < 0 and -code in CRASH_SIGNALS})
        if crashes:
            raise WorkerCrashed(f"a worker process crashed ({', '.join(crashes)})") from exc
        raise


def completion_queue(futures: Iterable[Future]) -> queue.SimpleQueue:
    """A queue that each of ``futures`` enters as it completes (put by the pool's own thread, or here for one done
    already). Taking from it (:func:`take_completed`) costs nothing per pending future, where
    ``concurrent.futures.wait`` locks, sorts and scans every pending one on each call: over the tens of thousands of
    tasks of a large MoE checkpoint's verify, one per layer source, that was quadratic (61 layers x 256 experts,
    47,275 tasks: 172 s, the workers busy for about 20 of them)."""
    finished: queue.SimpleQueue = queue.SimpleQueue()
    for future in futures:
        future.add_done_callback(finished.put)
    return finished


def take_completed(finished: queue.SimpleQueue, wait_seconds: float = 0.0) -> list[Future]:
    """The futures of ``finished`` (:func:`completion_queue`) completed so far: the first waited for up to
    ``wait_seconds`` (0: not at all), then every other one already there; [] when none came."""
    done: list[Future] = []
    try:
        done.append(finished.get(timeout=wait_seconds) if wait_seconds > 0 else finished.get_nowait())
        while True:
            done.append(finished.get_nowait())
    except queue.Empty:
        pass
    return done


def check_pool(pool: ProcessPoolExecutor | None, waiting: Iterable[Future]) -> None:
    """Raise :class:`ResourceError` where ``pool``'s own managing thread has ended while work in ``waiting`` is not
    done: nothing would ever complete it, and the caller's wait would go on for good. It ends so when a thread it
    starts is refused (its call queue's feeder, started on its first item: ``can't start new thread`` at the process
    limit, ``ulimit -u`` or a container's pids limit), or memory runs out there; a pool that broke (a worker killed)
    completes its work with :class:`BrokenProcessPool` before its thread ends. (The thread is the pool's private
    ``_executor_manager_thread``: no public handle on it.)"""
    manager = getattr(pool, "_executor_manager_thread", None)
    if manager is None or manager.ident is None or manager.is_alive():
        return
    if any(not future.done() for future in waiting):
        raise ResourceError("cannot run worker processes: the thread that manages them ended with work pending (a "
                            "thread it starts was refused, or memory ran out)", hint=LIMIT_HINT)


def run_parallel(function: Callable[[Item], Result], items: Iterable[Item], workers: int) -> Iterator[Result]:
    """Yield ``function(item)`` for every item, in the order they finish: in ``workers`` forked processes (see
    the module docstring), or in this process when ``workers <= 1`` or fork is missing. Forked workers inherit
    this process's state, so ``function`` may read module globals set just before. A worker's exception is
    raised here. Close the generator (``contextlib.closing``) to abandon the work: the workers are killed.
    Every call into the pool runs with interrupts held back (:func:`.interrupts.held`; the waits poll every
    :data:`POLL_SECONDS`), so an interrupt never lands inside the pool's locks."""
    items = list(items)
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for item in items:
            yield function(item)
        return
    pool = worker_pool(workers)
    finished = False
    try:
        with held():
            waiting = submit_all(pool, function, items)
        while waiting:
            with held():
                done, waiting = wait(waiting, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
                results = results_of(pool, done)
                check_pool(pool, waiting)
            yield from results
        finished = True
    finally:
        shutdown_pool(pool, finished)


def shutdown_pool(pool: ProcessPoolExecutor, finished: bool) -> None:
    """Shut ``pool`` down, its workers killed first unless the work ``finished``. While an error or an interrupt
    unwinds (``finished`` False), a pool caught half-started does not replace it: an interrupt raised inside
    ``submit`` (a caller without :func:`.interrupts.held`, such as Python's own SIGINT handler where the library is
    used directly) can land between the creation and the start of the executor's manager thread, and ``shutdown``
    then raises "cannot join thread before it is started" (seen as exit 3 on a Ctrl-C 0.3 s into verify). Runs with
    interrupts held back (:func:`.interrupts.held`): one that arrives meanwhile is raised once the pool is down."""
    with held():
        if not finished:
            kill_workers(pool)
        try:
            pool.shutdown(wait=True, cancel_futures=True)
        except RuntimeError:
            if finished:
                raise


def kill_workers(pool: ProcessPoolExecutor) -> None:
    """SIGKILL every worker process of ``pool`` now (their work is being thrown away)."""
    # ProcessPoolExecutor exposes no public handle on its processes before Python 3.14 (kill_workers()).
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        if process.is_alive():
            process.kill()
