"""Typed errors raised by the library.

The library never prints. Every failure a user can cause or meet is one of these classes; the CLI turns them
into a single ``Error:`` line (plus an optional ``Hint:``) and a non-zero exit code, in one place
(:mod:`marlin_convert.cli.app`).
"""

from __future__ import annotations


class MarlinConvertError(Exception):
    """Base class: ``message`` says what went wrong and where, ``hint`` what to do about it."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __reduce__(self):  # keep the hint when an error crosses from a worker process
        return (type(self), (self.message, self.hint))


class InputError(MarlinConvertError):
    """The input directory is not a readable, consistent GPTQ checkpoint."""


class SettingsMismatchError(InputError):
    """A layer's stored tensors contradict the settings the config resolves for it (bits, group size): its shapes
    are what other settings would give."""


class UnsupportedLayerError(MarlinConvertError):
    """A quantized layer is valid GPTQ but has no Marlin form here (bits, asymmetry, shape limits)."""


class OutputError(MarlinConvertError):
    """The output directory cannot be written (exists, is inside the input, disk full, permissions)."""


class ResourceError(MarlinConvertError):
    """The machine refused what the run needs: worker processes cannot be started (the process limit, memory)."""


class ManifestError(MarlinConvertError):
    """A converted directory's manifest is missing or does not match the files beside it."""


class VerificationFailed(MarlinConvertError):
    """``verify`` ran and at least one layer failed; the report names them."""

    exit_code = 1


class KernelUnavailableError(MarlinConvertError):
    """The CUDA kernel cannot be built or run here (no GPU, no nvcc, GPU too old, ...)."""


class KernelError(MarlinConvertError):
    """The kernel rejected its arguments (shape limits, workspace too small, wrong dtype)."""


#: how the dynamic loader says a shared library could not be mapped for want of address space (``ulimit -v``): an
#: ImportError of a module imported late (numpy's BLAS, pydantic's core) that is memory refused, not a bug
_UNMAPPED = ("failed to map segment from shared object", "cannot allocate memory")


def memory_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is memory the system refused: a MemoryError, or an ImportError of a shared library that could
    not be mapped (:data:`_UNMAPPED`), itself or as its cause."""
    while exc is not None:
        if isinstance(exc, MemoryError) or (isinstance(exc, ImportError)
                                            and any(text in str(exc).lower() for text in _UNMAPPED)):
            return True
        exc = exc.__cause__
    return False
