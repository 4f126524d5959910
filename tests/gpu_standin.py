"""Stand-ins for the GPU checker of verify's GPU processes (marlin_convert.gpu_workers.CHECKER), for CPU tests.

Each GPU process imports this module by name (``gpu_standin:<function>``) and calls the function with its GPU index.
The stand-in checks no kernel: per slice it reports one passing check per batch size whose ``max_abs_error`` carries
the CRC-32 of the slice's staged ``qweight`` bytes, read from its shared slot a few milliseconds after the slice
arrived, just before the slot is given back (as an asynchronous upload reads it), so a test can tell that every slice
reached the right process with its own bytes and that no worker refilled a slot still being read. Some variants
misbehave on purpose.
"""

from __future__ import annotations

import os
import signal
import time
import zlib

import numpy as np

from marlin_convert.errors import KernelUnavailableError
from marlin_convert.gpu_check import KernelCheck

UPLOAD_SECONDS = 0.003


class StandInChecker:
    def __init__(self, gpu: int, slots, setup, fail_at: int | None = None, how: str = "") -> None:
        self.gpu, self.slots, self.setup = gpu, slots, setup
        self.fail_at, self.how = fail_at, how
        self.uploads: list[tuple[float, int]] = []
        self.results: dict = {}
        self.seconds = {"upload": 0.0}
        self.pinned = True

    def submit(self, layer_index, layer, expert, slot, placed, zero_format) -> None:
        if self.fail_at is not None and len(self.results) == self.fail_at:
            if self.how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if self.how == "slow":
            time.sleep(0.05)
        self.results[(layer_index, expert)] = None  # filled when the "upload" finishes
        self.uploads.append((time.perf_counter(), slot, (layer_index, expert), placed["qweight"]))

    def uploaded_slots(self) -> list[int]:
        now = time.perf_counter()
        done = [u for u in self.uploads if now - u[0] >= UPLOAD_SECONDS]
        self.uploads = [u for u in self.uploads if now - u[0] < UPLOAD_SECONDS]
        for _, slot, key, (offset, dtype, shape) in done:
            start = slot * self.setup.stage_size + offset
            crc = zlib.crc32(self.slots[start:start + int(np.prod(shape)) * np.dtype(dtype).itemsize])
            checks = [KernelCheck(m, float(crc), 0.0, True) for m in self.setup.batch_sizes]
            self.results[key] = (checks, f"gpu {self.gpu} pid {os.getpid()}")
        return [slot for _, slot, _, _ in done]

    def finish(self) -> dict:
        time.sleep(UPLOAD_SECONDS)
        self.uploaded_slots()  # the uploads still in flight finish
        return self.results

    def device_of(self, _index: int) -> str:
        return f"standin:{self.gpu}"

    def peak_memory(self) -> dict[str, int]:
        return {f"standin:{self.gpu}": 1000 + self.gpu}


def passing(gpu: int):
    return lambda slots, setup: StandInChecker(gpu, slots, setup)


def unavailable(gpu: int):
    raise KernelUnavailableError(f"GPU {gpu} does not exist: 0 GPU(s) visible", hint="check nvidia-smi")


def raises_on_third_slice(gpu: int):
    return lambda slots, setup: StandInChecker(gpu, slots, setup, fail_at=2, how="raises")


def killed_on_third_slice(gpu: int):
    return lambda slots, setup: StandInChecker(gpu, slots, setup, fail_at=2, how="killed")


def slow(gpu: int):
    """50 ms per slice: long enough for a test to interrupt verify while the GPU processes work."""
    return lambda slots, setup: StandInChecker(gpu, slots, setup, how="slow")


def cuda_fails_to_start(gpu: int):
    raise RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable")
