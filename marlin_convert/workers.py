"""Worker processes that live and die with the converter.

The converter forks its workers (:func:`worker_pool`). Each one, as it starts (:func:`_worker_started`):

- ignores SIGINT: a Ctrl-C at the terminal reaches the whole process group, and the parent alone decides
  what to do (it stops the workers and removes the partial output);
- takes SIGTERM's default action again (the CLI's handler, inherited through fork, would raise inside the
  worker instead of ending it);
- asks the kernel to SIGKILL it when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere a thread
  watches the parent's pid), so a parent killed with SIGKILL leaves no orphans holding the partial directory.

:func:`kill_workers` ends a pool's workers at once, for a run that is being abandoned.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

_PR_SET_PDEATHSIG = 1
#: how often the fallback watcher (no prctl) checks whether the parent is gone
_WATCH_SECONDS = 0.5


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


def _worker_started(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent)


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` forked processes set up as the module docstring says."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=_worker_started, initargs=(os.getpid(),))


def kill_workers(pool: ProcessPoolExecutor) -> None:
    """SIGKILL every worker process of ``pool`` now (their work is being thrown away)."""
    # ProcessPoolExecutor exposes no public handle on its processes before Python 3.14 (kill_workers()).
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        if process.is_alive():
            process.kill()
