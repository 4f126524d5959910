"""The CUDA kernel compiles without a GPU: ``nvcc -c`` of each ``kernel/*.cu`` for Ampere (sm_80) and Hopper (sm_90a,
with the wgmma kernels, as the build makes it), no spills.

Runs wherever ``nvcc`` is installed (this project's CI machines have it; there is no GPU there), skipped with the
reason elsewhere. The GPU tests (``-m gpu``) run the kernel itself.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernel"
UNITS = sorted(p.name for p in KERNEL_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA's compiler) is not on PATH: kernel compile check skipped")
@pytest.mark.parametrize("unit", UNITS)
def test_kernel_compiles_for_ampere_and_hopper_without_spills(tmp_path, unit):
    command = [NVCC, "-c", "-std=c++17", "-O3", "-Xptxas", "-v", f"-I{KERNEL_DIR}",
               "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a", "-DMARLIN_CONVERT_SM90A",
               str(KERNEL_DIR / unit), "-o", str(tmp_path / "unit.o")]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "unit.o").stat().st_size > 0
    spills = [line for line in done.stderr.splitlines() if re.search(r"[1-9]\d* bytes spill", line)]
    assert spills == [], "\n".join(spills)
