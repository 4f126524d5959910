"""Prove a converted checkpoint right: nothing in it is taken on trust.

1. **The manifest** (:func:`marlin_convert.manifest.load_manifest`): every field has its type and value, else
   exit 2 naming the field. Its own SHA-256 is reported (and, when ``expect_manifest`` is given, checked against it
   before anything else: a manifest that differs stops the run, :class:`VerificationFailed`).
2. **The manifest against the files** (:mod:`marlin_convert.audit`): every tensor of every shard accounted for,
   every shape consistent with K, N, bits and groups, configs and index saying the same (each layer kept in GPTQ
   form as the configs' settings for it describe it), no file added or missing.
3. **The bytes**, in parallel worker processes (forked; they die with this process):

   * every file is hashed whole against the manifest's ``files`` digest, and while its bytes are in hand, each
     passthrough tensor and each tensor of a layer kept in GPTQ form against its own digest;
   * every converted layer (each expert of a stacked one) is inverted back to GPTQ (:mod:`marlin_convert.rebuild`,
     C fast path) and the rebuilt ``qweight``, ``scales``, ``qzeros`` and ``g_idx`` (for a compressed-tensors
     source: its ``weight_packed``, ``weight_scale``, ``weight_zero_point``, ``weight_g_idx`` and ``weight_shape``)
     hashed against the digests the converter recorded from the source: equal digests prove the conversion
     lossless. With a source directory, the rebuilt tensors are also compared with the originals byte for byte,
     and the copied tensors and files with the source's own, and the output as a whole with what converting the
     source makes (:mod:`marlin_convert.source_match`).

4. **The kernel** (GPU, :mod:`marlin_convert.gpu_check`, in one process per GPU started first:
   :mod:`marlin_convert.gpu_workers`): each slice's Marlin tensors and rebuilt GPTQ tensors travel in one pinned
   upload; the reference ``W = (q - z) * s`` is built on the GPU in fp32 from the GPTQ
   integers with plain torch ops, one fp32 GEMM per slice covers every batch size; the kernel runs per batch size
   into NaN-poisoned outputs. Pass when ``mean|C - C_ref| / mean|C_ref| < 1e-3`` and every output is written.

Memory: each worker holds one slice (one layer or expert) and an 8 MiB read buffer; with the kernel, slices
travel through ``min(workers, 8) + 2 * GPUs + 1`` shared staging slots of the largest slice, and each GPU holds two
slices plus one slice's fp32 reference. A GPU process that fails (a CUDA error) or dies ends verify with
:class:`VerificationFailed` naming the GPU and the cause (:class:`KernelUnavailableError` before its kernel is
loaded).
"""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing
import os
import queue
import resource
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import layout
from .audit import Audit, FileCheck, audit
from .errors import InputError, KernelUnavailableError, ManifestError, VerificationFailed
from .fileio import open_inside
from .gpu_check import RELATIVE_ERROR_BOUND, KernelCheck
from .gpu_workers import GpuWorkers
from .source_match import compare_with_source, layer_problems, plan_source
from .sources import FORM_NAMES, open_checkpoint
from .manifest import layer_count, read_manifest
from .rebuild import SCALE_DTYPES, MarlinLayer, SliceRebuild, Stage, TensorReader, rebuild_slice, stage_bytes
from .interrupts import held
from .workers import (MAX_WORKERS, POLL_SECONDS, check_pool, check_workers, completion_queue, results_of,
                      shutdown_pool, start_thread, submit_all, take_completed, usable_cpus, worker_pool)

DEFAULT_BATCH_SIZES = (1, 16, 128)
DEFAULT_WORKERS = min(MAX_WORKERS, usable_cpus())
#: bytes read per positioned read when hashing a file
READ_CHUNK = 8 << 20
#: staging slots for the workers when the kernel runs (plus two per GPU and a spare); 16 or 32 measured no faster on
#: the H200 machine (16 cores, Llama-7B shapes)
MAX_WORKER_SLOTS = 8
#: seconds the driver waits for a staged slice at a time while it feeds the GPU processes
_FEED_POLL = 0.002
ACTIVATION_DTYPES = ("float16", "bfloat16")


@dataclass
class LayerResult:
    name: str
    expert: int | None
    bits: int
    in_features: int
    out_features: int
    group_size: int
    act_order: bool
    sym: bool
    padded: bool
    integrity_ok: bool = True
    integrity_problems: list[str] = field(default_factory=list)
    kernel: list[KernelCheck] = field(default_factory=list)
    kernel_note: str | None = None
    seconds: float = 0.0
    device: str | None = None

    @property
    def ok(self) -> bool:
        return self.integrity_ok and all(check.ok for check in self.kernel)

    @property
    def label(self) -> str:
        return self.name if self.expert is None else f"{self.name}[expert {self.expert}]"

    def fail(self, problem: str) -> None:
        self.integrity_ok = False
        self.integrity_problems.append(problem)

    def to_dict(self) -> dict:
        data = dict(self.__dict__)
        data["kernel"] = [check.__dict__ for check in self.kernel]
        data["seconds"] = round(self.seconds, 4)
        data["ok"] = self.ok
        return data


@dataclass
class KeptResult:
    name: str
    reason: str
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class VerifyReport:
    out_dir: str
    manifest_sha256: str
    results: list[LayerResult]
    kept: list[KeptResult]
    problems: list[str]
    files_checked: int
    tensors_checked: int
    kernel_checked: bool
    batch_sizes: list[int]
    activation_dtype: str | None
    seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    bytes_checked: int = 0
    peak_rss_bytes: int = 0  # summed over this process and its workers (each one's peak: an upper bound)
    gpu_peak_bytes: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    bound: float = RELATIVE_ERROR_BOUND
    source_format: str = "gptq"  # what the checkpoint was converted from (the manifest's source.format)
    #: when each phase ended, in seconds since verify() began ("process start" is negative: the interpreter's start)
    timeline: dict[str, float] = field(default_factory=dict)
    #: with a source: the copied tensors and files compared with the source's (:mod:`marlin_convert.source_match`)
    source_copies_checked: int = 0

    @property
    def failures(self) -> list[LayerResult]:
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.problems and all(k.ok for k in self.kept)

    def to_dict(self) -> dict:
        return {
            "out_dir": self.out_dir,
            "ok": self.ok,
            "manifest_sha256": self.manifest_sha256,
            "source_format": self.source_format,
            "layers_checked": len(self.results),
            "failures": [r.label for r in self.failures],
            "kept": [{"name": k.name, "reason": k.reason, "ok": k.ok, "problems": k.problems} for k in self.kept],
            "problems": self.problems,
            "files_checked": self.files_checked,
            "tensors_checked": self.tensors_checked,
            "kernel_checked": self.kernel_checked,
            "batch_sizes": self.batch_sizes,
            "activation_dtype": self.activation_dtype,
            "relative_error_bound": self.bound,
            "seconds": round(self.seconds, 3),
            "bytes_checked": self.bytes_checked,
            "stage_seconds": {k: round(v, 3) for k, v in self.stage_seconds.items()},
            "timeline": {k: round(v, 3) for k, v in self.timeline.items()},
            "peak_rss_bytes": self.peak_rss_bytes,
            "gpu_peak_bytes": self.gpu_peak_bytes,
            "notes": self.notes,
            "source_copies_checked": self.source_copies_checked,
            "results": [r.to_dict() for r in self.results],
        }


# ------------------------------------------------------------------------------------------ work in workers


@dataclass(frozen=True)
class SourceTask:
    """Rebuild and hash every slice of one source layer of manifest layer ``layer``."""

    layer: int
    source: int
    nbytes: int


@dataclass(frozen=True)
class FileTask:
    file: FileCheck

    @property
    def nbytes(self) -> int:
        return self.file.size


@dataclass
class SliceOutcome:
    expert: int | None
    problems: list[str]
    seconds: float
    sent: bool  # handed to the GPU (in a staging slot)


@dataclass
class _Outcome:
    """What a task reports back: seconds per stage, and which process ran it with what peak RSS."""

    seconds: dict[str, float]
    pid: int = 0
    peak_rss: int = 0


@dataclass
class SourceOutcome(_Outcome):
    layer: int = 0
    source: int = 0
    slices: list[SliceOutcome] = field(default_factory=list)
    digest_problems: list[str] = field(default_factory=list)


@dataclass
class FileOutcome(_Outcome):
    name: str = ""
    problems: list[str] = field(default_factory=list)
    ranges_checked: int = 0


@dataclass
class _WorkerState:
    """What forked workers inherit (set before the pool forks)."""

    out_dir: Path
    manifest: dict
    layers: list[MarlinLayer | None]
    reader: TensorReader
    source: object | None  # the source Checkpoint, with --source
    stage_size: int
    unmatched: set[int] = field(default_factory=set)  # layers not compared with the source (see _open_source)
    slots: mmap.mmap | None = None  # shared staging slots (kernel runs only)
    free_slots: object | None = None  # multiprocessing queue of free slot numbers
    messages: object | None = None  # multiprocessing queue of staged slices
    wait_for_slot: Callable[[], None] | None = None  # no worker processes: lets the GPU free slots meanwhile


_STATE: _WorkerState | None = None
_private_stage: Stage | None = None


def _stage_for(state: _WorkerState) -> tuple[Stage, int | None]:
    """A stage for the next slice: a shared slot (waits for a free one) when the GPU runs, else this worker's own."""
    global _private_stage
    if state.slots is None:
        if _private_stage is None or _private_stage.bytes.size < state.stage_size:
            _private_stage = Stage(bytearray(state.stage_size))
        return _private_stage, None
    while state.wait_for_slot is not None and state.free_slots.empty():
        state.wait_for_slot()
    slot = state.free_slots.get()
    view = memoryview(state.slots)[slot * state.stage_size:(slot + 1) * state.stage_size]
    return Stage(view), slot


def _run_source(task: SourceTask) -> SourceOutcome:
    state = _STATE
    entry = state.manifest["layers"][task.layer]
    layer = state.layers[task.layer]
    source = entry["sources"][task.source]
    hashes = {kind: hashlib.sha256() for kind in source["digests"]}
    span = [None] if source["slices"] is None else list(range(*source["slices"]))
    stacked_source = source["slices"] is not None and len(entry["sources"]) == 1
    outcomes, complete, non_trivial = [], True, False
    # (act-order layers: whether any expert's rebuilt g_idx is not the trivial one, to hold the source's label to)
    trivial = (layout.trivial_g_idx(layer.spec.in_features, layer.spec.effective_group_size)
               if layer.spec.act_order else None)
    seconds = {"read + inverse": 0.0, "hash": 0.0}
    for expert in span:
        start = time.perf_counter()
        stage, slot = _stage_for(state)
        try:
            rebuilt = rebuild_slice(layer, source, expert, state.reader, stage)
        except (ManifestError, ValueError) as exc:  # bytes the audit could not foresee (a file changed meanwhile)
            rebuilt = SliceRebuild(False, [f"cannot rebuild: {getattr(exc, 'message', exc)}"])
        rebuilt_at = time.perf_counter()
        seconds["read + inverse"] += rebuilt_at - start
        problems = list(rebuilt.problems)
        if rebuilt.complete and trivial is not None:
            non_trivial |= not np.array_equal(stage.view("g_idx"), trivial)
        if rebuilt.complete:
            for kind, digest in hashes.items():
                digest.update(stage.view(kind).reshape(-1).view(np.uint8))
            if state.source is not None and task.layer not in state.unmatched:
                for kind, name in source["tensors"].items():
                    problems += _against_source(state.source, name, kind, stage.view(kind), layer,
                                                expert if stacked_source else None)
        complete &= rebuilt.complete
        seconds["hash"] += time.perf_counter() - rebuilt_at
        sent = slot is not None and rebuilt.complete
        if slot is not None:
            if sent:
                state.messages.put((task.layer, expert, slot, stage.placed, source["zero_format"]))
            else:
                state.free_slots.put(slot)
        outcomes.append(SliceOutcome(expert, problems, time.perf_counter() - start, sent))
    if not complete:
        digest_problems = [f"digests of '{source['name']}' not checked: it could not be rebuilt"]
    else:
        mismatched = [kind for kind, digest in hashes.items()
                      if "sha256:" + digest.hexdigest() != source["digests"][kind]]
        digest_problems = [f"digest mismatch: rebuilt {', '.join(mismatched)} of '{source['name']}' differ(s) "
                           "from the source"] if mismatched else []
        if layer.spec.act_order and (source["g_idx"] == "act_order") != non_trivial:
            # (the audit holds the layer's act_order to its sources' labels, this each label to the data)
            digest_problems.append(f"source '{source['name']}' says its g_idx is {source['g_idx']}, the rebuilt g_idx "
                                   f"is {'not ' if non_trivial else ''}trivial")
    return SourceOutcome(seconds, layer=task.layer, source=task.source, slices=outcomes,
                         digest_problems=digest_problems)


def _source_dtype(layer: MarlinLayer, kind: str) -> str:
    """The safetensors dtype a source stores tensor ``kind`` of ``layer`` in: scales (``scales``, ``weight_scale``)
    in the layer's scale dtype, compressed-tensors' ``weight_shape`` int64, every other kind int32."""
    if kind in ("scales", "weight_scale"):
        return SCALE_DTYPES[layer.spec.scale_dtype][0]
    return "I64" if kind == "weight_shape" else "I32"


def _against_source(source, name: str, kind: str, rebuilt: np.ndarray, layer: MarlinLayer,
                    expert: int | None) -> list[str]:
    """A rebuilt source tensor (one expert slice of a stacked source) against the source's own: dtype, shape and
    bytes (equal bytes under another dtype or shape are another tensor)."""
    info = source.info(name)
    shape = list(info.shape[1:] if expert is not None else info.shape)
    made = _source_dtype(layer, kind), list(rebuilt.shape)
    if (info.dtype, shape) != made:
        return [f"rebuilt {kind} is {made[0]} {made[1]}, the source tensor '{name}' is {info.dtype} {shape}"]
    if source.read(name, expert).tobytes() != rebuilt.tobytes():
        return [f"rebuilt {kind} differs from the source tensor '{name}'"]
    return []


def _run_file(task: FileTask) -> FileOutcome:
    """Hash one file whole, and the digest ranges inside it from the same bytes."""
    check = task.file
    path = _STATE.out_dir / check.name
    whole = hashlib.sha256()
    ranges = [(r, hashlib.sha256()) for r in check.ranges]
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    read_seconds = hash_seconds = 0.0
    position, first = 0, 0  # ranges[:first] are finished
    try:  # (the audit saw a regular file inside OUT_DIR; this checks the file actually opened)
        fd = open_inside(path, _STATE.out_dir)
    except OSError as exc:
        return FileOutcome({"read": 0.0, "hash": 0.0}, name=check.name,
                           problems=[f"file {check.name}: cannot read: {exc.strerror or exc}"], ranges_checked=0)
    with open(fd, "rb", buffering=0) as f:
        while True:
            start = time.perf_counter()
            got = f.readinto(buffer)
            read_seconds += time.perf_counter() - start
            if not got:
                break
            start = time.perf_counter()
            chunk = view[:got]
            whole.update(chunk)
            end = position + got
            for r, digest in ranges[first:]:
                if r.begin >= end:
                    break
                if r.end > position:
                    digest.update(chunk[max(r.begin, position) - position:min(r.end, end) - position])
            while first < len(ranges) and ranges[first][0].end <= end:
                first += 1
            position = end
            hash_seconds += time.perf_counter() - start
    problems = []
    if position != check.size:
        problems.append(f"file {check.name}: {position} bytes read, the manifest says {check.size}")
    elif "sha256:" + whole.hexdigest() != check.digest:
        problems.append(f"file {check.name}: SHA-256 differs from the manifest")
    for r, digest in ranges:
        if "sha256:" + digest.hexdigest() != r.digest:
            problems.append(f"{r.label}: SHA-256 of its bytes in {check.name} differs from the manifest")
    return FileOutcome({"read": read_seconds, "hash": hash_seconds}, name=check.name, problems=problems,
                       ranges_checked=len(ranges))


def _run(task):
    outcome = _run_file(task) if isinstance(task, FileTask) else _run_source(task)
    outcome.pid = os.getpid()
    outcome.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return outcome


def _pool(workers: int) -> ProcessPoolExecutor | None:
    """Forked workers that die with this process (:mod:`marlin_convert.workers`), or None: run here."""
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return None
    return worker_pool(workers)


# ------------------------------------------------------------------------------------------------ the driver


def _process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where that is not known."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def parse_int_list(spec: str, option: str, expected: str) -> list[int]:
    """An option's comma-separated list of non-negative integers (``"1,16,128"``; spaces around an item are allowed,
    as in ``"1, 16"``). Raises :class:`InputError` naming ``option`` and the value, and saying ``expected``, for an
    empty item (``"1,,2"``, ``"1,"``, ``""``), an item that is not decimal digits, or a number given twice."""
    numbers: list[int] = []
    seen: set[int] = set()
    for item in (item.strip() for item in spec.split(",")):
        if not (item.isascii() and item.isdigit()):
            what = "an empty item" if item == "" else f"{item[:20]!r} is not a number"
        elif len(item) > 18:  # (more than any index or size; Python refuses to read 4300 digits and more)
            what = f"{item[:20]}... ({len(item)} digits) is too large"
        elif int(item) in seen:
            what = f"{int(item)} is given twice"
        else:
            numbers.append(int(item))
            seen.add(int(item))
            continue
        raise InputError(f"{option} {spec[:60]!r}: {what}; expected {expected}")
    return numbers


def parse_gpus(spec: str) -> list[int]:
    """``"0"`` or ``"0,1,3"`` -> list of device indices, each once (:func:`parse_int_list`)."""
    return parse_int_list(spec, "--gpu", "a GPU index or a comma-separated list such as 0,1")


def activation_dtype(manifest: dict, override: str | None) -> str:
    """The activations' dtype: ``override`` (--dtype), else the model's (manifest model_dtype), else float16."""
    if override is not None:
        if override not in ACTIVATION_DTYPES:
            raise InputError(f"--dtype {override!r}: expected one of {', '.join(ACTIVATION_DTYPES)}")
        return override
    return "bfloat16" if manifest.get("model_dtype") == "bfloat16" else "float16"


def _results_skeleton(manifest: dict, checked: Audit) -> list[list[LayerResult]]:
    """One result per slice of every layer entry, in manifest order; failures of the audit already recorded."""
    per_entry = []
    for entry, layer, problems in zip(manifest["layers"], checked.layers, checked.layer_problems):
        padded = (entry["padded_in_features"], entry["padded_out_features"]) != (entry["in_features"],
                                                                                 entry["out_features"])
        # an entry the audit refused gets one result: its num_experts is not to be trusted
        slices = list(range(entry["num_experts"])) if layer is not None and entry["num_experts"] else [None]
        results = [LayerResult(entry["name"], e, entry["bits"], entry["in_features"], entry["out_features"],
                               entry["group_size"], entry["act_order"], entry["sym"], padded) for e in slices]
        if layer is None:
            for result in results:
                for problem in problems or ["layer not checked"]:
                    result.fail(problem)
        per_entry.append(results)
    return per_entry


def _open_source(source_dir: Path, manifest: dict):
    """Open ``--source`` and check that it is in the source format the checkpoint was converted from (else
    :class:`InputError`: a wrong ``--source`` is a bad argument). Returns it, the plan of its conversion
    (:func:`marlin_convert.source_match.plan_source`; InputError for a source that cannot be converted) and, by
    manifest layer index, what keeps a layer from being compared with it: a source tensor the manifest names that the source does not have, or a
    stacked source without the manifest's number of experts (the output and the source differ: the layer fails). A
    source that holds none of the tensors the manifest names is another model: InputError."""
    source = open_checkpoint(source_dir)
    hint = f"give the directory the checkpoint was converted from (the manifest names {manifest['source']['path']})"
    expected = manifest["source"]["format"]
    if source.source_format != expected:
        raise InputError(f"--source {source_dir}: a {FORM_NAMES.get(source.source_format, source.source_format)} "
                         f"checkpoint, but this one was converted from {FORM_NAMES.get(expected, expected)}",
                         hint=hint)
    unmatched: dict[int, list[str]] = {}
    present = 0  # source tensors the manifest names that the source has
    for i, entry in enumerate(manifest["layers"]):
        stacked = len(entry["sources"]) == 1 and entry["sources"][0]["slices"] is not None
        found = []
        for src in entry["sources"]:
            for kind, name in src["tensors"].items():
                if name not in source.location:
                    found.append(f"the manifest names source tensor '{name}' (its {kind}), which --source does not "
                                 "have")
                    continue
                present += 1
                shape = source.info(name).shape
                if stacked and (len(shape) < 2 or shape[0] != entry["num_experts"]):
                    found.append(f"the manifest says {entry['num_experts']} stacked experts, --source's tensor "
                                 f"'{name}' has shape {list(shape)}")
        if found:
            unmatched[i] = found
    if unmatched and not present:  # another model altogether: a bad argument, not a failure of every layer
        first = next(iter(manifest["layers"][0]["sources"][0]["tensors"].values()))
        raise InputError(f"--source {source_dir}: holds none of the source tensors the manifest names (such as "
                         f"'{first}'): not the checkpoint this one was converted from",
                         hint=hint)
    plan = plan_source(source, manifest)
    return source, plan, unmatched


def verify(
    out_dir: Path,
    *,
    gpus: list[int] | None = (0,),
    batch_sizes: list[int] | None = DEFAULT_BATCH_SIZES,
    source_dir: Path | None = None,
    seed: int = 0,
    dtype: str | None = None,
    workers: int = DEFAULT_WORKERS,
    expect_manifest: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Verify ``out_dir`` (see the module docstring). ``gpus=None`` (or empty ``batch_sizes``) skips the kernel.

    Raises :class:`ManifestError` for a missing or malformed manifest, :class:`KernelUnavailableError` when the
    kernel is asked for and cannot run, :class:`VerificationFailed` when the manifest's digest is not
    ``expect_manifest`` or a GPU's check process fails (a CUDA error, a crash); returns a report whose ``ok`` is
    False when anything failed. ``progress(count)`` counts layers (each expert one: :func:`layer_count` of each
    entry) and listed files as they finish.
    """
    start = time.perf_counter()
    check_workers(workers)
    timeline: dict[str, float] = {}
    started = _process_age()
    if started is not None:
        timeline["process start"] = -started
    if not (gpus and batch_sizes):
        return _verify(Path(out_dir), None, start, timeline, batch_sizes=batch_sizes, source_dir=source_dir, seed=seed,
                       dtype=dtype, workers=workers, expect_manifest=expect_manifest, progress=progress)
    try:
        # first of all: torch's import and CUDA's start-up in the GPU processes overlap everything below
        with GpuWorkers(list(gpus)) as gpu_workers:
            timeline["GPU processes started"] = time.perf_counter() - start
            return _verify(Path(out_dir), gpu_workers, start, timeline, batch_sizes=batch_sizes,
                           source_dir=source_dir, seed=seed, dtype=dtype, workers=workers,
                           expect_manifest=expect_manifest, progress=progress)
    except KernelUnavailableError as exc:
        skip = "'verify --skip-kernel' proves the conversion lossless without a GPU"
        raise KernelUnavailableError(exc.message, hint=f"{exc.hint}; or {skip}" if exc.hint else skip) from exc


def _verify(out_dir: Path, gpu_workers: GpuWorkers | None, start: float, timeline: dict[str, float], *,
            batch_sizes, source_dir, seed, dtype, workers, expect_manifest, progress) -> VerifyReport:
    def mark(event: str) -> None:
        timeline[event] = time.perf_counter() - start

    manifest, digest = read_manifest(out_dir, expect_manifest)  # (a digest that differs stops here, first)
    checked = audit(out_dir, manifest)
    problems = list(checked.problems)
    source, plan, unmatched = _open_source(Path(source_dir), manifest) if source_dir is not None else (None, None, {})
    source_copies = 0
    use_kernel = gpu_workers is not None
    act_dtype = activation_dtype(manifest, dtype) if use_kernel else None
    per_entry = _results_skeleton(manifest, checked)
    for by_entry in (unmatched, layer_problems(plan, manifest) if plan is not None else {}):
        for i, found in by_entry.items():
            for result in per_entry[i]:
                for problem in found:
                    result.fail(problem)
    kept = [KeptResult(entry["name"], entry["reason"], list(checked.kept_problems.get(entry["name"], [])))
            for entry in manifest["kept"]]
    kept_by_label = {f"kept '{k.name}'": k for k in kept}

    tasks: list = [FileTask(f) for f in checked.files]
    usable = [i for i, layer in enumerate(checked.layers) if layer is not None]
    for i in usable:
        layer = checked.layers[i]
        per_slice = stage_bytes(layer)
        for s, src in enumerate(manifest["layers"][i]["sources"]):
            slices = 1 if src["slices"] is None else src["slices"][1] - src["slices"][0]
            tasks.append(SourceTask(i, s, per_slice * slices))
    tasks.sort(key=lambda t: -t.nbytes)  # largest first: no worker is left with a big task at the end
    stage_size = max((stage_bytes(checked.layers[i]) for i in usable), default=0)
    pending_sources = {i: len(manifest["layers"][i]["sources"]) for i in usable}

    mark("manifest and audit")
    global _STATE
    _STATE = _WorkerState(out_dir, manifest, checked.layers, TensorReader(out_dir, checked.headers), source,
                          stage_size, unmatched=set(unmatched))
    if progress is not None:  # entries and files that cannot be checked are done already
        progress(sum(layer_count(entry) for entry, layer in zip(manifest["layers"], checked.layers) if layer is None)
                 + len(manifest["files"]) - len(checked.files))
    checking = use_kernel and bool(usable)
    stage_seconds: dict[str, float] = {}
    counts = {"files": 0, "tensors": 0, "expected": 0, "received": 0}
    peaks: dict[int, int] = {}
    gpu_peaks: dict[str, int] = {}
    notes: list[str] = []
    pool = None
    finished = False
    try:
        if checking:
            # a slot per busy worker (at most 8: the GPUs drain them faster than workers fill them), two per GPU in
            # flight, one spare
            slot_count = min(max(1, workers), MAX_WORKER_SLOTS) + 2 * gpu_workers.count + 1
            context = multiprocessing.get_context("fork") if workers > 1 else None
            _STATE.slots = gpu_workers.setup(slot_count, stage_size, list(batch_sizes), act_dtype, seed)
            _STATE.free_slots = context.Queue() if context else queue.Queue()
            _STATE.messages = context.Queue() if context else queue.Queue()
            for slot in range(slot_count):
                _STATE.free_slots.put(slot)
        pool = _pool(workers)
        with held():  # (pool calls: never interrupted halfway, :mod:`.interrupts`)
            futures = submit_all(pool, _run, tasks) if pool is not None else set()
        mark("workers started")
        compared: dict = {}
        if source is not None:  # in a thread beside the workers and the GPU feeding (its reads and hashing release
            def compare() -> None:  # the GIL), joined once they are done
                try:
                    compared["result"] = compare_with_source(plan, Path(source_dir), out_dir, manifest, checked.headers)
                except BaseException as exc:  # (raised in this thread after the join)
                    compared["error"] = exc

            comparing = threading.Thread(target=compare, name="compare copies with the source", daemon=True)
            start_thread(comparing)

        def absorb(outcome) -> None:
            peaks[outcome.pid] = max(peaks.get(outcome.pid, 0), outcome.peak_rss)
            for key, value in outcome.seconds.items():
                stage_seconds[key] = stage_seconds.get(key, 0.0) + value
            if isinstance(outcome, FileOutcome):
                counts["files"] += 1
                counts["tensors"] += outcome.ranges_checked
                for problem in outcome.problems:
                    owner = next((k for label, k in kept_by_label.items() if problem.startswith(label)), None)
                    (owner.problems if owner else problems).append(problem)
                if progress is not None:
                    progress(1)
                return
            results = per_entry[outcome.layer]
            for sliced in outcome.slices:
                result = results[sliced.expert or 0]
                result.seconds += sliced.seconds
                for problem in sliced.problems:
                    result.fail(problem)
                counts["expected"] += sliced.sent
            first, stop = manifest["layers"][outcome.layer]["sources"][outcome.source]["slices"] or (0, 1)
            for result in results[first:stop]:
                for problem in outcome.digest_problems:
                    result.fail(problem)
            pending_sources[outcome.layer] -= 1
            if pending_sources[outcome.layer] == 0 and progress is not None:
                progress(layer_count(manifest["layers"][outcome.layer]))

        def feed_gpus(block: bool) -> None:
            """Pass staged slices on to their GPU processes; give the slots they have uploaded back to the workers.
            Raises when a GPU process failed (see GpuWorkers.poll). The queues' calls run with interrupts held back
            (their locks); the sends to the GPU processes, which may block, do not."""
            messages = []
            with held():
                while True:
                    try:
                        message = _STATE.messages.get(timeout=_FEED_POLL) if block else _STATE.messages.get_nowait()
                    except queue.Empty:
                        break
                    messages.append(message)
                    block = False
            for layer_index, expert, slot, placed, zero_format in messages:
                counts["received"] += 1
                gpu_workers.submit(layer_index, checked.layers[layer_index], expert, slot, placed, zero_format)
            uploaded = gpu_workers.poll()
            with held():
                for slot in uploaded:
                    _STATE.free_slots.put(slot)

        if pool is None:  # no worker processes: the tasks run here, the GPUs fed whenever a slot is needed
            if checking:
                _STATE.wait_for_slot = lambda: feed_gpus(True)
            for task in tasks:
                absorb(_run(task))
        waiting = set(futures)
        completed = completion_queue(futures)  # (not concurrent.futures.wait: a scan of every pending task per call)
        while waiting or (checking and counts["received"] < counts["expected"]):
            if checking:
                feed_gpus(True)
            with held():  # the pool's calls: a short wait at most (an interrupt: at its end)
                done = take_completed(completed, 0.0 if checking else POLL_SECONDS)
                outcomes = list(zip(done, results_of(pool, done)))
                check_pool(pool, waiting)  # (its scan runs only once the pool's thread has ended)
            if not checking and gpu_workers is not None:
                gpu_workers.poll()  # a GPU that cannot run the kernel is reported now, not at the end
            for future, outcome in outcomes:
                waiting.discard(future)
                absorb(outcome)
                if not waiting:
                    mark("workers done")
        if gpu_workers is not None:
            outcomes = gpu_workers.finish()
            loaded = gpu_workers.loaded_at()
            if loaded is not None:
                timeline["kernel loaded"] = loaded - start
                stage_seconds["kernel load"] = loaded - gpu_workers.started_at
            if outcomes:
                timeline["GPU checkers ready"] = max(o.ready_at for o in outcomes) - start
                mark("GPU done")
            for outcome in outcomes:
                for (layer_index, expert), (checks, note) in outcome.results.items():
                    result = per_entry[layer_index][expert or 0]
                    result.kernel, result.kernel_note, result.device = checks, note, outcome.device
                for key, value in outcome.seconds.items():
                    stage_seconds[key] = stage_seconds.get(key, 0.0) + value
                gpu_peaks.update(outcome.peak_memory)
                peaks[outcome.pid] = outcome.peak_rss
                if not outcome.pinned:
                    notes.append(f"{outcome.device}: the staging memory could not be pinned (cudaHostRegister "
                                 "failed): uploads ran synchronously")
        if source is not None:
            comparing.join()
            if "error" in compared:
                raise compared["error"]
            copy_problems, source_copies = compared["result"]
            problems += copy_problems
            mark("copies compared with the source")
        finished = True
    finally:
        try:
            if pool is not None:
                shutdown_pool(pool, finished)
        finally:  # (also when an interrupt held back during the shutdown is raised at its end)
            for channel in (_STATE.free_slots, _STATE.messages):
                if hasattr(channel, "cancel_join_thread"):  # a multiprocessing queue: what is left in it is not
                    channel.close()                         # needed, and joining its feeder thread at exit took 0.3 s
                    channel.cancel_join_thread()            # each
            _STATE = None

    flat = [result for results in per_entry for result in results]
    peaks[os.getpid()] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return VerifyReport(str(out_dir), digest, flat, kept, problems, counts["files"], counts["tensors"], use_kernel,
                        list(batch_sizes or []) if use_kernel else [], act_dtype, time.perf_counter() - start,
                        stage_seconds, sum(f.size for f in checked.files), sum(peaks.values()), gpu_peaks, notes,
                        source_format=manifest["source"]["format"],
                        timeline=dict(sorted(timeline.items(), key=lambda item: item[1])),
                        source_copies_checked=source_copies)


__all__ = ["VerifyReport", "LayerResult", "KeptResult", "verify", "parse_gpus", "activation_dtype",
           "VerificationFailed", "RELATIVE_ERROR_BOUND", "ManifestError"]
