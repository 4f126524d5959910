"""Stand-ins for the GPU checker of verify's GPU processes (marlin_convert.gpu_workers.CHECKER), for CPU tests.

Each GPU process imports this module by name (``gpu_standin:<function>``) and calls the function with its GPU index.
The stand-in checks no kernel: per slice it reports one passing check per batch size whose ``max_abs_error`` carries
the CRC-32 of the slice's staged ``qweight`` bytes as the process found them in its shared slot, so a test can tell
that every slice reached the right process with its own bytes (a slot reused too early would show). Slots are given
back a few milliseconds after their slice arrived, as an upload would. Some variants misbehave on purpose.
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
        offset, dtype, shape = placed["qweight"]
        start = slot * self.setup.stage_size + offset
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        crc = zlib.crc32(self.slots[start:start + nbytes])
        checks = [KernelCheck(m, float(crc), 0.0, True) for m in self.setup.batch_sizes]
        self.results[(layer_index, expert)] = (checks, f"gpu {self.gpu} pid {os.getpid()}")
        self.uploads.append((time.perf_counter(), slot))

    def uploaded_slots(self) -> list[int]:
        now = time.perf_counter()
        done = [slot for at, slot in self.uploads if now - at >= UPLOAD_SECONDS]
        self.uploads = [(at, slot) for at, slot in self.uploads if now - at < UPLOAD_SECONDS]
        return done

    def finish(self) -> dict:
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
