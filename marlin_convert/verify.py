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
from .errors import InputError, KernelUnavailableError, ManifestError, VerificationFailed
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


def rebuild_layer(entry: dict, source: dict, shards: _Shards, expert: int | None) -> RebuiltLayer:
    """Read one manifest layer's Marlin tensors (one expert slice of them) and invert them to GPTQ.

    ``source`` is the manifest's record of the source layer this slice came from (its g_idx kind and stored
    zero value). The exact inverse of the converter, so the rebuilt tensors hash like the originals.
    """
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
    zeros = np.full((entry["num_groups"], n), source["zero_stored"], dtype=np.uint8)
    qzeros = layout.pack_gptq_qzeros(zeros)
    if source["g_idx"] == "absent":
        g_idx = None
    elif entry["act_order"]:
        g_idx = layout.restore_g_idx(perm, sorted_g_idx)
    else:
        g_idx = layout.trivial_g_idx(k, k // entry["num_groups"])
    return RebuiltLayer(qweight, scales, qzeros, g_idx, b, s, perm)


_REBUILDABLE = ("qweight", "scales", "qzeros", "g_idx")


def _rebuilt_tensors(rebuilt: RebuiltLayer) -> dict[str, np.ndarray]:
    tensors = {"qweight": rebuilt.qweight, "scales": rebuilt.scales, "qzeros": rebuilt.qzeros}
    if rebuilt.g_idx is not None:
        tensors["g_idx"] = rebuilt.g_idx
    return tensors


# ------------------------------------------------------------------------------------------------ the kernel


def _scales_tensor(bits: np.ndarray, dtype_name: str):
    """Host scales (bfloat16 kept as uint16 bits) as a torch tensor of their real dtype."""
    import torch

    if dtype_name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(bits))


class _GpuLayer:
    """One layer's Marlin tensors on a GPU. Stacked experts are uploaded into one [E, ...] buffer, slice by
    slice, and the kernel reads each expert's slice in place (a view at offset e * K*N/8 words, no copy)."""

    def __init__(self, entry: dict, device) -> None:
        import torch

        self.entry, self.device = entry, device
        k, n, groups = entry["in_features"], entry["out_features"], entry["num_groups"]
        lead = (entry["num_experts"],) if entry["num_experts"] else ()
        self.b = torch.empty((*lead, k // layout.TILE, 2 * n), dtype=torch.int32, device=device)
        self.s = torch.empty((*lead, groups, n), dtype=torch.float16, device=device)
        self.perm = torch.empty((*lead, k), dtype=torch.int32, device=device) if entry["act_order"] else None
        self.workspace = torch.zeros(entry["workspace"]["ints"], dtype=torch.int32, device=device)

    def _slot(self, tensor, expert):
        return tensor if expert is None else tensor[expert]

    def check(self, rebuilt: RebuiltLayer, expert: int | None, batch_sizes: list[int], seed: int) -> list[KernelCheck]:
        import torch

        from .kernel import marlin_gemm

        entry, device = self.entry, self.device
        k, n = entry["in_features"], entry["out_features"]
        b, s = self._slot(self.b, expert), self._slot(self.s, expert)
        b.copy_(torch.from_numpy(rebuilt.marlin_b))
        s.copy_(_scales_tensor(rebuilt.marlin_s, entry["scale_dtype"]).to(torch.float16))
        perm = None
        if self.perm is not None:
            perm = self._slot(self.perm, expert)
            perm.copy_(torch.from_numpy(rebuilt.perm))
        # the reference: fp32 dequantization of the rebuilt GPTQ integers, (q - 8) * scales[g_idx]
        q = torch.from_numpy(layout.unpack_gptq_qweight(rebuilt.qweight)).to(device=device, dtype=torch.float32)
        scales = _scales_tensor(rebuilt.scales, entry["scale_dtype"]).to(device=device, dtype=torch.float32)
        g_idx = rebuilt.g_idx if rebuilt.g_idx is not None else layout.trivial_g_idx(k, k // entry["num_groups"])
        weight = (q - 8.0) * scales[torch.from_numpy(g_idx.astype(np.int64)).to(device)]
        del q
        generator = torch.Generator(device=device).manual_seed(seed + (expert or 0))
        checks = []
        for m in batch_sizes:
            a = torch.randn(m, k, generator=generator, device=device, dtype=torch.float32).to(torch.float16)
            out = torch.full((m, n), float("nan"), dtype=torch.float16, device=device)  # poison: unwritten stays NaN
            try:
                c = marlin_gemm(a, b, s, self.workspace, perm=perm, out=out)
            except Exception as exc:  # the kernel's own rejection, reported on this layer
                checks.append(KernelCheck(m, float("inf"), float("inf"), False, f"kernel error: {exc}"))
                continue
            with _no_tf32():
                reference = a.float() @ weight
            c32 = c.float()
            unwritten = int(torch.isnan(c32).sum())
            diff = torch.nan_to_num((c32 - reference).abs(), nan=float("inf"))
            relative = float(diff.mean() / reference.abs().mean().clamp_min(1e-30))
            problem = f"{unwritten} outputs NaN or never written" if unwritten else None
            if problem is None and not relative < RELATIVE_ERROR_BOUND:
                problem = f"relative error {relative:.2e} >= {RELATIVE_ERROR_BOUND:.0e}"
            checks.append(KernelCheck(m, float(diff.max()), relative, problem is None, problem))
        if int(self.workspace.abs().sum()) != 0:
            checks.append(KernelCheck(0, 0.0, 0.0, False, "workspace not left zeroed after the kernel"))
        return checks


class _no_tf32:
    """Keep fp32 matmuls in full fp32 for the reference (restores the previous setting)."""

    def __enter__(self):
        import torch

        self.previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        import torch

        torch.backends.cuda.matmul.allow_tf32 = self.previous


# ------------------------------------------------------------------------------------------------ the driver


def _digest(array: np.ndarray) -> str:
    return "sha256:" + hashlib.sha256(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))).hexdigest()


def _verify_entry(entry: dict, shards: _Shards, source_checkpoint, batch_sizes: list[int] | None, device,
                  seed: int) -> list[LayerResult]:
    """Integrity and kernel checks of one manifest layer, one result per expert slice (one for a 2-D layer)."""
    results = []
    gpu_layer = _GpuLayer(entry, device) if batch_sizes else None
    stacked_source = len(entry["sources"]) == 1 and entry["num_experts"] > 0
    for source in entry["sources"]:
        hashes = {kind: hashlib.sha256() for kind in source["digests"]}
        span = [None] if source["slices"] is None else list(range(*source["slices"]))
        first_result = len(results)
        for expert in span:
            start = time.perf_counter()
            result = LayerResult(entry["name"], expert, entry["in_features"], entry["out_features"],
                                 entry["group_size"], entry["act_order"], device=str(device) if device else None)
            rebuilt = rebuild_layer(entry, source, shards, expert)
            tensors = _rebuilt_tensors(rebuilt)
            for kind, digest in hashes.items():
                if kind in tensors:
                    digest.update(memoryview(np.ascontiguousarray(tensors[kind]).reshape(-1).view(np.uint8)))
            if source_checkpoint is not None:
                for kind, name in source["tensors"].items():
                    original = source_checkpoint.read(name, expert if stacked_source else None)
                    if kind in tensors and original.tobytes() != np.ascontiguousarray(tensors[kind]).tobytes():
                        result.integrity_ok = False
                        result.integrity_problems.append(f"rebuilt {kind} differs from the source tensor '{name}'")
            if gpu_layer is not None:
                result.kernel = gpu_layer.check(rebuilt, expert, batch_sizes, seed)
            result.seconds = time.perf_counter() - start
            results.append(result)
        # a source tensor's digest covers all its slices: a mismatch is reported on each of them
        mismatched = [kind for kind, digest in hashes.items()
                      if kind not in _REBUILDABLE or "sha256:" + digest.hexdigest() != source["digests"][kind]]
        for result in results[first_result:] if mismatched else []:
            result.integrity_ok = False
            result.integrity_problems.append("digest mismatch: rebuilt " + ", ".join(mismatched)
                                             + f" of '{source['name']}' differ(s) from the source")
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
    source_checkpoint = open_checkpoint(Path(source_dir)) if source_dir is not None else None
    use_kernel = bool(gpus) and bool(batch_sizes)
    devices: list = [None]
    if use_kernel:
        from .kernel import ensure_kernel

        try:
            devices = [ensure_kernel(gpu) for gpu in gpus]
        except KernelUnavailableError as exc:
            skip = "'verify --skip-kernel' proves the conversion lossless without a GPU"
            raise KernelUnavailableError(exc.message, hint=f"{exc.hint}; or {skip}" if exc.hint else skip) from exc
    shards = _Shards(out_dir)
    entries = manifest["layers"]
    results: list[list[LayerResult]] = [[] for _ in entries]
    errors: list[BaseException] = []

    def worker(slot: int) -> None:
        device = devices[slot]
        try:
            if device is not None:
                import torch

                torch.cuda.set_device(device)  # per thread: kernel launches go to this GPU's current stream
            for position in range(slot, len(entries), len(devices)):
                results[position] = _verify_entry(entries[position], shards, source_checkpoint,
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
