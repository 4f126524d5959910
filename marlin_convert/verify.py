"""Prove a converted checkpoint right, layer by layer.

Two independent checks per converted layer (per expert, for stacked experts):

* **integrity** (CPU, no GPU needed): invert the Marlin layout (``B`` -> GPTQ ``qweight``, ``s`` -> GPTQ
  ``scales``), rebuild the tensors Marlin does not store (``qzeros`` from the recorded zero format, ``g_idx``
  from ``perm`` and the sorted g_idx, or the trivial ``k // g``), and compare their SHA-256 with the digests the
  converter recorded from the source. Equal digests prove the conversion lossless; any flipped bit in ``B`` or
  ``s`` changes them. With a source directory, the rebuilt tensors are also compared with the originals.
* **kernel** (GPU): run the bundled Marlin kernel on fresh random activations for several batch sizes and
  compare with an fp32 reference computed from the rebuilt GPTQ integers: ``W = (q - 8) * scales[g_idx]``,
  ``C_ref = A @ W``. Pass when ``mean|C - C_ref| / mean|C_ref| < 1e-3`` and no output is NaN or unwritten.

Only one layer (one expert slice) is in memory at a time, on the host and on each GPU.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import layout
from .errors import InputError, ManifestError, VerificationFailed
from .gptq import open_checkpoint
from .manifest import load_manifest
from .safetensors_io import SafetensorsFile, read_header, read_tensor

#: documented pass bound on mean|C - C_ref| / mean|C_ref| (the bound the reference Marlin tests use)
RELATIVE_ERROR_BOUND = 1e-3
DEFAULT_BATCH_SIZES = (1, 16, 128)


@dataclass
class KernelCheck:
    batch: int
    max_abs_error: float
    relative_error: float
    ok: bool
    problem: str | None = None


@dataclass
class LayerResult:
    name: str
    expert: int | None
    in_features: int
    out_features: int
    group_size: int
    act_order: bool
    integrity_ok: bool = True
    integrity_problems: list[str] = field(default_factory=list)
    kernel: list[KernelCheck] = field(default_factory=list)
    seconds: float = 0.0
    device: str | None = None

    @property
    def ok(self) -> bool:
        return self.integrity_ok and all(check.ok for check in self.kernel)

    @property
    def label(self) -> str:
        return self.name if self.expert is None else f"{self.name}[expert {self.expert}]"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "expert": self.expert,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "group_size": self.group_size,
            "act_order": self.act_order,
            "ok": self.ok,
            "integrity_ok": self.integrity_ok,
            "integrity_problems": self.integrity_problems,
            "kernel": [check.__dict__ for check in self.kernel],
            "seconds": round(self.seconds, 4),
            "device": self.device,
        }


@dataclass
class VerifyReport:
    out_dir: str
    results: list[LayerResult]
    kernel_checked: bool
    batch_sizes: list[int]
    seconds: float
    bound: float = RELATIVE_ERROR_BOUND

    @property
    def failures(self) -> list[LayerResult]:
        return [r for r in self.results if not r.ok]

    def to_dict(self) -> dict:
        return {
            "out_dir": self.out_dir,
            "ok": not self.failures,
            "layers_checked": len(self.results),
            "failures": [r.label for r in self.failures],
            "kernel_checked": self.kernel_checked,
            "batch_sizes": self.batch_sizes,
            "relative_error_bound": self.bound,
            "seconds": round(self.seconds, 3),
            "results": [r.to_dict() for r in self.results],
        }


# ------------------------------------------------------------------------------------------- rebuilding GPTQ


@dataclass
class RebuiltLayer:
    """One layer (or expert) rebuilt in GPTQ form from its Marlin tensors, plus what the kernel needs."""

    qweight: np.ndarray  # int32 [K/8, N]
    scales: np.ndarray  # [K/g, N], the stored dtype's bits
    qzeros: np.ndarray  # int32 [K/g, N/8]
    g_idx: np.ndarray | None  # int32 [K] (None when the source had none)
    marlin_b: np.ndarray  # int32 [K/16, 2N]
    marlin_s: np.ndarray  # [K/g, N]
    perm: np.ndarray | None  # int32 [K]


class _Shards:
    """Lazily parsed output shard headers."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: dict[str, SafetensorsFile] = {}
        self._lock = threading.Lock()

    def read(self, shard: str, name: str, index: int | None) -> np.ndarray:
        with self._lock:
            if shard not in self._files:
                path = self.directory / shard
                if not path.is_file():
                    raise ManifestError(f"{path}: shard named by the manifest is missing")
                self._files[shard] = read_header(path)
        file = self._files[shard]
        if name not in file.tensors:
            raise ManifestError(f"{file.path}: tensor '{name}' named by the manifest is missing")
        return read_tensor(file, name, index)


def rebuild_layer(entry: dict, shards: _Shards, expert: int | None) -> RebuiltLayer:
    """Read one manifest layer's Marlin tensors and invert them to GPTQ (exact inverse of the converter)."""
    outputs, where = entry["outputs"], entry["shards"]
    k, n = entry["in_features"], entry["out_features"]
    b = shards.read(where["B"], outputs["B"], expert)
    s = shards.read(where["s"], outputs["s"], expert)
    if b.shape != (k // layout.TILE, 2 * n) or s.shape != (entry["num_groups"], n):
        raise ManifestError(f"layer '{entry['name']}': stored B {list(b.shape)} / s {list(s.shape)} do not match "
                            f"K = {k}, N = {n}, {entry['num_groups']} groups")
    perm = sorted_g_idx = None
    if entry["act_order"]:
        perm = shards.read(where["perm"], outputs["perm"], expert)
        sorted_g_idx = shards.read(where["g_idx"], outputs["g_idx"], expert)
    qweight = layout.marlin_to_gptq_weight(b, perm)
    scales = layout.unpermute_scales(s)
    zeros = np.full((entry["num_groups"], n), entry["zero_stored"], dtype=np.uint8)
    qzeros = layout.pack_gptq_qzeros(zeros)
    if entry["g_idx"] == "act_order":
        g_idx = layout.restore_g_idx(perm, sorted_g_idx)
    elif entry["g_idx"] == "trivial":
        g_idx = layout.trivial_g_idx(k, k // entry["num_groups"])
    else:
        g_idx = None
    return RebuiltLayer(qweight, scales, qzeros, g_idx, b, s, perm)


def _rebuilt_tensors(rebuilt: RebuiltLayer) -> dict[str, np.ndarray]:
    tensors = {"qweight": rebuilt.qweight, "scales": rebuilt.scales, "qzeros": rebuilt.qzeros}
    if rebuilt.g_idx is not None:
        tensors["g_idx"] = rebuilt.g_idx
    return tensors


# ------------------------------------------------------------------------------------------------ the kernel


def _dequantize_reference(rebuilt: RebuiltLayer, entry: dict, device) -> "torch.Tensor":
    """fp32 [K, N] weight from the rebuilt GPTQ integers: ``(q - z) * scales[g_idx]``, z = 8 (symmetric)."""
    import torch

    k, n = entry["in_features"], entry["out_features"]
    q = torch.from_numpy(layout.unpack_gptq_qweight(rebuilt.qweight)).to(device=device, dtype=torch.float32)
    scales = _scales_tensor(rebuilt.scales, entry["scale_dtype"]).to(device=device, dtype=torch.float32)
    g_idx = rebuilt.g_idx if rebuilt.g_idx is not None else layout.trivial_g_idx(k, k // entry["num_groups"])
    rows = torch.from_numpy(g_idx.astype(np.int64)).to(device)
    return (q - 8.0) * scales[rows]


def _scales_tensor(bits: np.ndarray, dtype_name: str) -> "torch.Tensor":
    import torch

    if dtype_name == "bfloat16":
        return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(bits))


def _kernel_checks(rebuilt: RebuiltLayer, entry: dict, batch_sizes: list[int], device, seed: int) -> list[KernelCheck]:
    import torch

    from .kernel import marlin_gemm

    k, n = entry["in_features"], entry["out_features"]
    weight = _dequantize_reference(rebuilt, entry, device)
    b = torch.from_numpy(rebuilt.marlin_b).to(device)
    s = _scales_tensor(rebuilt.marlin_s, entry["scale_dtype"]).to(device=device, dtype=torch.float16)
    perm = torch.from_numpy(rebuilt.perm).to(device) if rebuilt.perm is not None else None
    workspace = torch.zeros(entry["workspace"]["ints"], dtype=torch.int32, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    checks = []
    for m in batch_sizes:
        a = torch.randn(m, k, generator=generator, device=device, dtype=torch.float32).to(torch.float16)
        out = torch.full((m, n), float("nan"), dtype=torch.float16, device=device)  # poison: unwritten stays NaN
        problem = None
        try:
            c = marlin_gemm(a, b, s, workspace, perm=perm, out=out)
        except Exception as exc:  # the kernel's own error, reported per layer
            checks.append(KernelCheck(m, float("inf"), float("inf"), False, f"kernel error: {exc}"))
            continue
        reference = a.float() @ weight
        c32 = c.float()
        if torch.isnan(c32).any():
            problem = f"{int(torch.isnan(c32).sum())} outputs NaN or never written"
        diff = (c32 - reference).abs()
        diff = torch.nan_to_num(diff, nan=float("inf"))
        relative = float(diff.mean() / reference.abs().mean().clamp_min(1e-30))
        ok = problem is None and relative < RELATIVE_ERROR_BOUND
        if problem is None and not ok:
            problem = f"relative error {relative:.2e} >= {RELATIVE_ERROR_BOUND:.0e}"
        checks.append(KernelCheck(m, float(diff.max()), relative, ok, problem))
    if int(workspace.abs().sum()) != 0:
        checks.append(KernelCheck(0, 0.0, 0.0, False, "workspace not left zeroed"))
    return checks


# ------------------------------------------------------------------------------------------------ the driver


def _digest(array: np.ndarray) -> str:
    return "sha256:" + hashlib.sha256(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))).hexdigest()


def _verify_entry(entry: dict, shards: _Shards, source, batch_sizes: list[int] | None, device, seed: int,
                  ) -> list[LayerResult]:
    """Integrity (whole tensors, across experts) and kernel checks (per expert) of one manifest layer."""
    experts = list(range(entry["num_experts"])) if entry["num_experts"] else [None]
    hashes = {kind: hashlib.sha256() for kind in entry["digests"]}
    results = []
    for expert in experts:
        start = time.perf_counter()
        result = LayerResult(entry["name"], expert, entry["in_features"], entry["out_features"],
                             entry["group_size"], entry["act_order"], device=str(device) if device else None)
        rebuilt = rebuild_layer(entry, shards, expert)
        tensors = _rebuilt_tensors(rebuilt)
        for kind, digest in hashes.items():
            if kind not in tensors:
                result.integrity_ok = False
                result.integrity_problems.append(f"{kind} cannot be rebuilt")
                continue
            digest.update(memoryview(np.ascontiguousarray(tensors[kind]).reshape(-1).view(np.uint8)))
        if source is not None:
            for kind, name in entry["source"].items():
                original = source.read(name, expert)
                if kind in tensors and not np.array_equal(original.view(np.uint8), tensors[kind].view(np.uint8)):
                    result.integrity_ok = False
                    result.integrity_problems.append(f"rebuilt {kind} differs from the source tensor '{name}'")
        if batch_sizes:
            result.kernel = _kernel_checks(rebuilt, entry, batch_sizes, device, seed)
        result.seconds = time.perf_counter() - start
        results.append(result)
    # whole-tensor digests: compared once, the failure attributed to every expert slice of the layer
    mismatched = [kind for kind, digest in hashes.items() if "sha256:" + digest.hexdigest() != entry["digests"][kind]]
    if mismatched:
        for result in results:
            result.integrity_ok = False
            result.integrity_problems.append(
                "digest mismatch: rebuilt " + ", ".join(mismatched) + " differ(s) from the source recorded at conversion")
        if len(results) > 1 and source is None:
            results[0].integrity_problems.append("pass --source IN_DIR to find which expert differs")
    return results


def parse_gpus(spec: str) -> list[int]:
    """``"0"`` or ``"0,1,3"`` -> list of device indices."""
    try:
        gpus = [int(part) for part in spec.split(",") if part.strip() != ""]
    except ValueError as exc:
        raise InputError(f"--gpu {spec!r}: expected a GPU index or a comma-separated list such as 0,1") from exc
    if not gpus or any(g < 0 for g in gpus):
        raise InputError(f"--gpu {spec!r}: expected a GPU index or a comma-separated list such as 0,1")
    return gpus


def verify(
    out_dir: Path,
    *,
    gpus: list[int] | None = (0,),
    batch_sizes: list[int] | None = DEFAULT_BATCH_SIZES,
    source_dir: Path | None = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Verify every converted layer of ``out_dir``. ``gpus=None`` (or empty ``batch_sizes``) skips the kernel.

    Layers are spread round-robin over ``gpus``, one thread per GPU. Raises :class:`ManifestError` for a
    directory that is not a marlin-convert output, :class:`KernelUnavailableError` when the kernel is asked
    for and cannot run; returns a report in which failed layers have ``ok == False``.
    """
    start = time.perf_counter()
    out_dir = Path(out_dir)
    manifest = load_manifest(out_dir)
    source = open_checkpoint(Path(source_dir)) if source_dir is not None else None
    use_kernel = bool(gpus) and bool(batch_sizes)
    devices: list = [None]
    if use_kernel:
        from .kernel import ensure_kernel

        devices = [ensure_kernel(gpu) for gpu in gpus]
    shards = _Shards(out_dir)
    entries = manifest["layers"]
    results: list[list[LayerResult]] = [[] for _ in entries]
    errors: list[BaseException] = []

    def worker(slot: int) -> None:
        device = devices[slot]
        try:
            for position in range(slot, len(entries), len(devices)):
                results[position] = _verify_entry(entries[position], shards, source,
                                                  list(batch_sizes) if use_kernel else None, device, seed + position)
                if progress is not None:
                    progress(1)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    if len(devices) == 1:
        worker(0)
    else:
        threads = [threading.Thread(target=worker, args=(slot,)) for slot in range(len(devices))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    flat = [result for per_entry in results for result in per_entry]
    return VerifyReport(str(out_dir), flat, use_kernel, list(batch_sizes or []), time.perf_counter() - start)


__all__ = ["VerifyReport", "LayerResult", "verify", "parse_gpus", "rebuild_layer", "VerificationFailed",
           "RELATIVE_ERROR_BOUND"]
