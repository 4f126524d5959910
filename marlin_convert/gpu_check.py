"""The kernel check of ``verify``: each slice's kernel output against an fp32 reference, on one or more GPUs.

Workers stage each slice (its Marlin tensors and the GPTQ tensors rebuilt from them, see
:func:`marlin_convert.rebuild.rebuild_slice`) in shared host slots, which this module pins
(``cudaHostRegister``). Per slice, on the GPU its layer is assigned to:

1. one asynchronous copy of the slot's used bytes into one of two device buffers, on a copy stream, so the next
   slice uploads while this one computes (double buffering: a buffer is refilled only after the compute stream
   is done with it; the host slot goes back to the workers once its copy has finished);
2. the reference, from the GPTQ integers with plain torch ops (nothing shared with the kernel):
   ``q`` unpacked from ``qweight``, ``z`` from ``qzeros`` (+1 for v1), ``W = (q - z[g_idx]) * scales[g_idx]`` in
   fp32, and one fp32 GEMM (TF32 off) of fresh random activations for all batch sizes at once;
3. the kernel once per batch size on the padded layer (activations zero-padded to K_pad), into one output buffer
   filled with NaN first, each batch in its own block of rows followed by guard rows that must stay NaN; the first
   N columns are compared with the reference, padded columns must be exactly 0;
4. the statistics ([batches, 7] per slice) stay on the GPU until :meth:`GpuChecker.finish` fetches them all with
   one copy, so the host never waits on a slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import layout
from .rebuild import MarlinLayer

#: stage arrays the GPU needs (kernel inputs, then the rebuilt GPTQ tensors); rebuild places them first
UPLOADED = ("B", "s", "zp", "perm", "sorted_g_idx", "qweight", "scales", "qzeros", "g_idx")
#: documented pass bound on mean|C - C_ref| / mean|C_ref| for fp16 activations (the reference Marlin tests' bound)
RELATIVE_ERROR_BOUND = 1e-3
#: bf16 activations: one bf16 rounding of the weights and one of the output already give about 1e-3, so the bound is
#: max(this, twice the error of torch's own bf16 matmul of the same activations and weights), as the kernel tests use
RELATIVE_ERROR_FLOOR_BF16 = 2e-3
_BUFFERS_PER_DEVICE = 2
_CUDA_HOST_REGISTER_PORTABLE = 1


@dataclass
class KernelCheck:
    """One batch size of one slice (``batch`` 0: the workspace check after the runs)."""

    batch: int
    max_abs_error: float
    relative_error: float
    ok: bool
    problem: str | None = None
    bound: float = RELATIVE_ERROR_BOUND


def _torch_dtype(torch, numpy_dtype: str, name: str):
    if name in ("s", "scales") and numpy_dtype == "<u2":
        return torch.bfloat16
    return {"<i4": torch.int32, "<f2": torch.float16, "<f4": torch.float32}[numpy_dtype]


def reference_weight(qweight, scales, qzeros, g_idx, bits: int, zero_format: str, contiguous_groups: bool = False):
    """The fp32 weight ``W[k, n] = (q[k, n] - z[g, n]) * s[g, n]`` with ``g = g_idx[k]``, from GPTQ tensors with plain
    torch ops on their device: ``qweight`` int32 [K/p, N], ``scales`` [G, N] (any float dtype), ``qzeros`` int32
    [G, ceil(N/p)] (stored values: z - 1 for ``zero_format`` "v1", z for "v2"), ``g_idx`` int32 [K]. Returns
    float32 [K, N].

    ``contiguous_groups``: the caller has checked that ``g_idx[k] == k // (K / G)`` (no act-order): the groups are then
    broadcast over K / G rows instead of gathered per row (two fewer K x N tensors written; same values)."""
    import torch

    p = 32 // bits
    k, n = qweight.shape[0] * p, qweight.shape[1]
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    mask = (1 << bits) - 1
    q = (qweight.unsqueeze(1) >> shifts.view(1, p, 1)).bitwise_and_(mask).reshape(k, n)
    z = ((qzeros.unsqueeze(2) >> shifts.view(1, 1, p)) & mask).reshape(qzeros.shape[0], -1)[:, :n]
    if zero_format == "v1":
        z = z + 1
    if contiguous_groups:
        groups = scales.shape[0]
        weight = q.view(groups, k // groups, n).float()
        return weight.sub_(z.float().unsqueeze(1)).mul_(scales.float().unsqueeze(1)).view(k, n)
    rows = g_idx.long()
    return q.sub_(z[rows]).float().mul_(scales.float()[rows])


def groups_are_contiguous(g_idx: np.ndarray, groups: int) -> bool:
    """Whether ``g_idx`` (int32 [K]) is the plain grouping ``k // (K / groups)`` (no act-order)."""
    k = g_idx.shape[0]
    if groups < 1 or k % groups:
        return False
    return bool(np.array_equal(g_idx, np.arange(k, dtype=np.int64) // (k // groups)))


def scales_exact_in(scales_bits: np.ndarray, scale_dtype: str, target: str) -> bool:
    """Whether every scale (its stored bits, bfloat16 as uint16) is exactly representable in ``target``."""
    if scale_dtype == target or scale_dtype == "float32":
        return True
    if scale_dtype == "bfloat16":
        values = (scales_bits.astype(np.uint32) << 16).view(np.float32)
        with np.errstate(over="ignore"):
            return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))
    values = scales_bits.astype(np.float32)  # float16 -> bfloat16: the low 16 bits of the float32 must be 0
    return bool(((values.view(np.uint32) & 0xFFFF) == 0).all())


def slice_seed(seed: int, layer_index: int, expert: int | None) -> int:
    """The random activations' seed of one slice: the run's ``seed``, the layer's index and the expert, so a slice
    gets the same activations whichever GPU checks it and in whatever order."""
    return (seed * 1_000_003 + layer_index * 65_537 + (0 if expert is None else expert + 1)) % (1 << 63)


@dataclass
class _RowLayout:
    """The output buffer's row blocks as tensors (see GpuChecker._layout)."""

    rows: object  # long [total]: the rows batches own, in batch order
    row_batch: object  # long [total]: the batch of each
    guards: object  # long [guards]: the guard rows
    guard_batch: object  # long [guards]: the batch of each


@dataclass
class _Queued:
    """One slice's checks, queued on a GPU: statistics per batch (a [batches, 7] float64 GPU tensor: max |error|,
    sum |error|, sum |reference|, NaN outputs, non-zero padded outputs, torch's own bf16 error, outputs written past
    the batch's rows), the workspace's non-zero count after the runs, the kernel's host-side rejections, and how it
    ran."""

    key: tuple[int, int | None]
    stats: object
    workspace_left: object
    errors: list
    run_dtype: str
    note: str | None


class _Device:
    def __init__(self, torch, device, stage_size: int) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)
        self.compute_stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(stage_size, dtype=torch.uint8, device=device) for _ in range(_BUFFERS_PER_DEVICE)]
        self.compute_done = [None] * _BUFFERS_PER_DEVICE
        self.next_buffer = 0
        self.workspace = torch.zeros(0, dtype=torch.int32, device=device)


class GpuChecker:
    """Kernel checks of staged slices on ``devices`` (layers spread round-robin); see the module docstring."""

    def __init__(self, devices: list, slots, stage_size: int, batch_sizes: list[int], activation_dtype: str,
                 seed: int) -> None:
        import torch

        self.torch = torch
        self.stage_size = stage_size
        self.activation_dtype = activation_dtype
        self.seed = seed
        self.host = torch.frombuffer(slots, dtype=torch.uint8)
        result = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), self.host.numel(),
                                                      _CUDA_HOST_REGISTER_PORTABLE)
        self.pinned = int(result) == 0
        for device in devices:
            torch.cuda.reset_peak_memory_stats(device)
        self.devices = [_Device(torch, device, stage_size) for device in devices]
        self.previous_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference is plain fp32
        self.uploads: list[tuple[object, int]] = []  # (copy finished event, host slot)
        self.pending: list[_Queued] = []
        self.timing: list[tuple[str, object, object]] = []
        self.seconds: dict[str, float] = {}
        self._set_batches(batch_sizes)

    def _set_batches(self, batch_sizes: list[int]) -> None:
        """The batch sizes and their output row blocks (see _check): m rows, guard rows up to a multiple of 16, and
        16 more."""
        self.batch_sizes = list(batch_sizes)
        self.blocks = [(m + 15) // 16 * 16 + 16 for m in self.batch_sizes]
        self.block_starts = [int(v) for v in np.cumsum([0, *self.blocks[:-1]])]
        self.output_rows = sum(self.blocks)
        self._rows_by_device: dict = {}

    def _layout(self, device) -> "_RowLayout":
        """Index tensors of the output row blocks on ``device`` (made once per device): the rows that batches own in
        batch order, the guard rows, and the batch of each."""
        layout_ = self._rows_by_device.get(str(device))
        if layout_ is None:
            owned, guards = [], []
            for b, (m, first, block) in enumerate(zip(self.batch_sizes, self.block_starts, self.blocks)):
                owned += [(first + i, b) for i in range(m)]
                guards += [(first + i, b) for i in range(m, block)]
            tensors = [self.torch.tensor([pair[i] for pair in pairs], dtype=self.torch.long, device=device)
                       for pairs in (owned, guards) for i in (0, 1)]
            layout_ = _RowLayout(*tensors)
            self._rows_by_device[str(device)] = layout_
        return layout_

    def device_of(self, layer_index: int) -> str:
        return str(self.devices[layer_index % len(self.devices)].device)

    def uploaded_slots(self) -> list[int]:
        """Host slots whose upload has finished (free for the workers again)."""
        done = [slot for event, slot in self.uploads if event.query()]
        self.uploads = [(event, slot) for event, slot in self.uploads if slot not in done]
        return done

    def _event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def submit(self, layer_index: int, layer: MarlinLayer, expert: int | None, slot: int,
               placed: dict[str, tuple[int, str, tuple[int, ...]]], zero_format: str) -> None:
        """Queue the upload and the checks of one staged slice; returns without waiting for the GPU."""
        torch = self.torch
        gpu = self.devices[layer_index % len(self.devices)]
        which = gpu.next_buffer
        gpu.next_buffer = (which + 1) % _BUFFERS_PER_DEVICE
        used = max(offset + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                   for name, (offset, dtype, shape) in placed.items() if name in UPLOADED)
        buffer = gpu.buffers[which]
        start = slot * self.stage_size
        with torch.cuda.device(gpu.device), torch.cuda.stream(gpu.copy_stream):
            if gpu.compute_done[which] is not None:
                gpu.copy_stream.wait_event(gpu.compute_done[which])
            began, uploaded = self._event(), self._event()
            began.record(gpu.copy_stream)
            buffer[:used].copy_(self.host[start:start + used], non_blocking=True)
            uploaded.record(gpu.copy_stream)
        self.uploads.append((uploaded, slot))
        self.timing.append(("upload", began, uploaded))
        arrays = {name: buffer[offset:offset + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize]
                  .view(_torch_dtype(torch, dtype, name)).view(shape)
                  for name, (offset, dtype, shape) in placed.items() if name in UPLOADED}
        host_scales = self.host[start + placed["s"][0]:]  # only its first bytes are read, below
        g_offset, g_dtype, g_shape = placed["g_idx"]
        g_idx = np.frombuffer(memoryview(self.host[start + g_offset:start + g_offset + 4 * g_shape[0]].numpy()),
                              dtype=np.dtype(g_dtype))
        contiguous = groups_are_contiguous(g_idx, placed["scales"][2][0])
        with torch.cuda.device(gpu.device), torch.cuda.stream(gpu.compute_stream):
            gpu.compute_stream.wait_event(uploaded)
            run_dtype, note = self._run_dtype(layer, host_scales, placed["s"])
            stats, workspace_left, errors = self._check(gpu, layer, arrays, zero_format, run_dtype,
                                                        slice_seed(self.seed, layer_index, expert), contiguous)
            done = self._event()
            done.record(gpu.compute_stream)
            gpu.compute_done[which] = done
        self.pending.append(_Queued((layer_index, expert), stats, workspace_left, errors, run_dtype, note))

    def _run_dtype(self, layer: MarlinLayer, host_scales, placed_s) -> tuple[str, str | None]:
        """CONTRACT D: scales of another 16-bit dtype are converted to the activations' only when exact."""
        wanted, stored = self.activation_dtype, layer.spec.scale_dtype
        if stored in (wanted, "float32"):
            return wanted, None
        _, dtype, shape = placed_s
        bits = np.frombuffer(memoryview(host_scales.numpy()), dtype=np.dtype(dtype),
                             count=int(np.prod(shape, dtype=np.int64)))
        if scales_exact_in(bits, stored, wanted):
            return wanted, None
        return stored, f"ran in {stored}: its {stored} scales are not exact in {wanted}"

    def _check(self, gpu: _Device, layer: MarlinLayer, arrays: dict, zero_format: str, run_dtype: str, seed: int,
               contiguous_groups: bool):
        """Queue the reference, the kernel runs and the statistics of one slice: ``(stats, workspace_left, errors)``
        (see :class:`_Queued`)."""
        torch = self.torch
        from .kernel import marlin_gemm

        spec = layer.spec
        k, n = spec.in_features, spec.out_features
        k_pad, n_pad = layer.padded_in_features, layer.padded_out_features
        bits = spec.bits
        device = gpu.device
        dtype = getattr(torch, run_dtype)
        began = self._event()
        began.record(gpu.compute_stream)
        weight = reference_weight(arrays["qweight"], arrays["scales"], arrays["qzeros"], arrays["g_idx"], bits,
                                  zero_format, contiguous_groups)
        total = sum(self.batch_sizes)
        generator = torch.Generator(device=device).manual_seed(seed)
        a = torch.randn(total, k, generator=generator, device=device, dtype=torch.float32).to(dtype)
        reference = a.float() @ weight
        # bf16: torch's own bf16 product of the same data sets the bound (fp16: the fixed bound)
        same_dtype = (a @ weight.to(dtype)).float() if run_dtype == "bfloat16" else None
        del weight
        referenced = self._event()
        referenced.record(gpu.compute_stream)
        if k_pad != k:
            a = torch.nn.functional.pad(a, (0, k_pad - k))
        ints = layout.workspace_ints(n_pad)
        if gpu.workspace.numel() < ints:
            gpu.workspace = torch.zeros(ints, dtype=torch.int32, device=device)
        scales = arrays["s"] if arrays["s"].dtype == dtype else arrays["s"].to(dtype)
        # Every batch's output in one NaN-filled buffer, so that the statistics below are a few operations over all
        # rows at once. Batch b owns a block of rows: its m rows, then guard rows up to the next multiple of 16 and 16
        # more; the guards must still be NaN afterwards (a kernel writing past its m rows is caught, not hidden by the
        # next batch's output).
        out = torch.full((self.output_rows, n_pad), float("nan"), dtype=dtype, device=device)
        errors = []
        row = 0
        for m, first in zip(self.batch_sizes, self.block_starts):
            try:
                marlin_gemm(a[row:row + m], arrays["B"], scales, gpu.workspace, perm=arrays.get("perm"),
                            out=out[first:first + m], zp=arrays.get("zp"), bits=bits)
                errors.append(None)
            except Exception as exc:  # the kernel's own rejection, reported on this slice
                errors.append(f"kernel error: {exc}")
            row += m
        rows = self._layout(device)
        c = out.index_select(0, rows.rows).float()  # [total, n_pad], rows in batch order
        diff = (c[:, :n] - reference).abs_().nan_to_num_(nan=float("inf"))
        torch_diff = ((same_dtype - reference).abs_().sum(dim=1, dtype=torch.float64) if same_dtype is not None
                      else torch.zeros(total, dtype=torch.float64, device=device))
        # per row: sum |error|, sum |reference|, NaN outputs, non-zero padded outputs, torch's own error, added up per
        # batch with one index_add; the max |error| per batch with one scatter; the guard rows' written (no longer
        # NaN) outputs per batch with another index_add: [batches, 7] float64, in a dozen operations for all batches
        f64, batches = torch.float64, len(self.batch_sizes)
        per_row = torch.stack([diff.sum(dim=1, dtype=f64), reference.abs().sum(dim=1, dtype=f64),
                               c.isnan().sum(dim=1, dtype=f64), (c[:, n:] != 0).sum(dim=1, dtype=f64), torch_diff],
                              dim=1)
        largest = torch.zeros(batches, dtype=torch.float32, device=device).scatter_reduce_(
            0, rows.row_batch, diff.amax(dim=1), reduce="amax")
        written = out.index_select(0, rows.guards).isnan().logical_not_().sum(dim=1, dtype=f64)
        stats = torch.zeros(batches, 7, dtype=f64, device=device)
        stats[:, 0] = largest
        stats[:, 1:6].index_add_(0, rows.row_batch, per_row)
        stats[:, 6].index_add_(0, rows.guard_batch, written)
        workspace_left = gpu.workspace.count_nonzero().float()
        gpu.workspace.zero_()
        finished = self._event()
        finished.record(gpu.compute_stream)
        self.timing += [("reference", began, referenced), ("kernel", referenced, finished)]
        return stats, workspace_left, errors

    def finish(self) -> dict[tuple[int, int | None], tuple[list, str | None]]:
        """Wait for every queued slice; ``(layer index, expert) -> ([KernelCheck per batch], note)``. Bound per batch:
        :data:`RELATIVE_ERROR_BOUND` in fp16; in bf16 the larger of :data:`RELATIVE_ERROR_FLOOR_BF16` and twice the
        error of torch's bf16 product of the same data."""
        torch = self.torch
        for gpu in self.devices:
            torch.cuda.synchronize(gpu.device)
        for stage, begin, end in self.timing:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + begin.elapsed_time(end) / 1000
        if not self.pending:
            return {}
        by_device: dict = {}
        for queued in self.pending:
            by_device.setdefault(queued.stats.device, []).append(queued)
        fetched = {}
        for items in by_device.values():  # one copy per device
            stats = torch.stack([q.stats for q in items]).cpu().numpy()
            left = torch.stack([q.workspace_left for q in items]).cpu().numpy()
            fetched.update({id(q): (slice_stats, leftover) for q, slice_stats, leftover in zip(items, stats, left)})
        results = {}
        for queued in self.pending:
            slice_stats, leftover = fetched[id(queued)]
            checks = []
            for m, (max_abs, diff_sum, ref_sum, nan, pad_nonzero, torch_diff, outside), error in zip(
                    self.batch_sizes, slice_stats, queued.errors):
                relative = float(diff_sum / ref_sum) if ref_sum > 0 else (0.0 if diff_sum == 0 else float("inf"))
                bound = RELATIVE_ERROR_BOUND
                if queued.run_dtype == "bfloat16":
                    bound = max(RELATIVE_ERROR_FLOOR_BF16, 2 * float(torch_diff / ref_sum) if ref_sum > 0 else 0.0)
                problem = error
                if problem is None and nan:
                    problem = f"{int(nan)} outputs NaN or never written"
                if problem is None and pad_nonzero:
                    problem = f"{int(pad_nonzero)} outputs in padded columns are not 0"
                if problem is None and outside:
                    problem = f"{int(outside)} outputs written past the batch's {m} rows"
                if problem is None and not relative < bound:
                    problem = f"relative error {relative:.2e} >= {bound:.1e}"
                checks.append(KernelCheck(m, float(max_abs), relative, problem is None, problem, bound))
            if leftover:
                checks.append(KernelCheck(0, 0.0, 0.0, False, "workspace not left zeroed after the kernel"))
            results[queued.key] = (checks, queued.note)
        return results

    def peak_memory(self) -> dict[str, int]:
        """Peak bytes allocated by torch on each device during the run."""
        return {str(gpu.device): int(self.torch.cuda.max_memory_allocated(gpu.device)) for gpu in self.devices}

    def close(self) -> None:
        torch = self.torch
        torch.backends.cuda.matmul.allow_tf32 = self.previous_tf32
        for gpu in self.devices:
            torch.cuda.synchronize(gpu.device)
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
            self.pinned = False
        self.host = None
