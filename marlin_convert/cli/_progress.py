"""Progress bars behind one wrapper that ``--quiet`` or MARLIN_CONVERT_NO_PROGRESS=1 switches off, and that stays
off when stderr is not a terminal (no progress frames in logs)."""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from tqdm.auto import tqdm

DISABLE_VARIABLE = "MARLIN_CONVERT_NO_PROGRESS"
# no monitor thread: the converter forks worker processes, and forking is safest with no other threads
tqdm.monitor_interval = 0


def progress_disabled() -> bool:
    return bool(os.environ.get(DISABLE_VARIABLE)) or sys.stderr is None or not sys.stderr.isatty()


@contextmanager
def byte_progress(total: int, description: str, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """Yield a thread-safe ``advance(nbytes)`` callback drawing a bytes bar on stderr (or doing nothing)."""
    if not enabled or progress_disabled():
        yield lambda _n: None
        return
    lock = threading.Lock()
    with tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              dynamic_ncols=True, leave=False) as bar:

        def advance(nbytes: int) -> None:
            with lock:
                bar.update(nbytes)

        yield advance


@contextmanager
def item_progress(total: int, description: str, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(count)`` drawing a bar over items on stderr (or doing nothing); ``description`` says what
    they are (verify's are layers and files: the unit is "item", not a name that would count one of them only)."""
    if not enabled or progress_disabled():
        yield lambda _n: None
        return
    with tqdm(total=total, desc=description, unit="item", file=sys.stderr, dynamic_ncols=True, leave=False) as bar:
        yield bar.update
