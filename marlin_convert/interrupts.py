"""Interrupts held back while the main thread is inside code that must not be unwound halfway.

A signal handler that raises (the CLI's, for SIGINT and SIGTERM) raises between any two bytecodes of the main thread.
Inside ``concurrent.futures`` that can be between a lock's acquisition and the ``try`` that releases it: the lock then
stays held, and the pool's shutdown waits for it forever (seen about once in a hundred interrupts of ``convert`` and
``verify``). The code that drives worker pools therefore runs its pool calls inside :func:`held`, each one short (the
waits poll), and a handler hands its exception to :func:`interrupt`, which raises it at once outside such a section
and at the section's end inside one.

Only the main thread's sections count (signal handlers run in the main thread); :func:`held` elsewhere does nothing.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

_depth = 0  # nesting of held() sections in the main thread
_waiting: list[BaseException] = []  # the interrupt that arrived inside one, raised at its end


def interrupt(exception: BaseException) -> None:
    """From a signal handler (main thread): raise ``exception`` now, or, inside :func:`held`, at the end of the
    outermost section. A second interrupt while one waits is dropped (the first is the request)."""
    if _depth:
        if not _waiting:
            _waiting.append(exception)
        return
    _waiting.clear()  # (one held back by a section that is just ending: this one is raised instead)
    raise exception


def reset() -> None:
    """Forget a held-back interrupt (a new command in this process starts afresh)."""
    _waiting.clear()


@contextmanager
def held() -> Iterator[None]:
    """Run the body with interrupts held back (main thread only); an interrupt that arrived meanwhile is raised when
    the outermost section ends, also while another exception unwinds through it (the interrupt then replaces it: the
    run was asked to stop)."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _waiting:
            exception = _waiting[0]
            _waiting.clear()
            raise exception
