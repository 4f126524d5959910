"""Verify a converted checkpoint: lossless round trip, and the bundled CUDA kernel against an fp32 reference.

Usage examples:
    marlin-convert verify ./Llama-2-7B-Marlin --gpu 0
    marlin-convert verify ./out --gpu 0,1 --batch 1,16,128 --json verify.json
    marlin-convert verify ./out --skip-kernel                 # integrity only, no GPU needed
    marlin-convert verify ./out --skip-kernel --source ./in   # also compare with the original tensors
    marlin-convert verify ./out --gpu 0 --dtype bfloat16      # activations in bf16 (default: the model's dtype)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from ..errors import InputError, VerificationFailed
from ..manifest import is_digest, layer_count, load_manifest
from ..verify import (
    ACTIVATION_DTYPES,
    DEFAULT_BATCH_SIZES,
    DEFAULT_WORKERS,
    RELATIVE_ERROR_BOUND,
    LayerResult,
    activation_dtype,
    parse_gpus,
    parse_int_list,
    verify as run_verify,
)
from ..sources import FORM_NAMES
from ..workers import MAX_WORKERS, check_workers
from ._errors import Interrupted, one_line
from ._output import Output, check_json_path
from ._progress import item_progress
from ._signals import raise_if_signalled

#: the most rows of A one check runs: each batch size is one GEMM per layer, its activations and the fp32 reference
#: on the GPU (a batch of 10^11 asked for 95 TB, and a GPU out of memory read as a failed checkpoint, exit 1)
MAX_BATCH = 4096


OutDirArg = Annotated[Path, typer.Argument(metavar="OUT_DIR", help="A directory written by 'marlin-convert' (with marlin_manifest.json).")]
GpuOpt = Annotated[str, typer.Option("--gpu", metavar="LIST", help="GPU index, or a comma-separated list to spread layers over (each once).")]
BatchOpt = Annotated[str, typer.Option("--batch", metavar="LIST", help=f"Comma-separated batch sizes (rows of A, 1 to {MAX_BATCH}, each once) to run per layer.")]
SkipKernelOpt = Annotated[bool, typer.Option(
    "--skip-kernel", help="Do not run the kernel: check the manifest, every file and digest, and the lossless round "
    "trip only (CPU, no GPU needed; --source still compares with IN_DIR).")]
SourceOpt = Annotated[Optional[Path], typer.Option(
    "--source", metavar="IN_DIR", help="The original GPTQ or compressed-tensors directory: also compare rebuilt "
    "tensors with it byte for byte, and the copied tensors and files with its own.")]
JsonOpt = Annotated[Optional[str], typer.Option("--json", metavar="FILE", help="Also write the report as JSON to this file ('-': print it on stdout instead of the table).")]
SeedOpt = Annotated[int, typer.Option("--seed", metavar="N", help="Seed of the random activations.")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="No progress bar, and the table shows failing layers only (then the summary line).")]
DtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", metavar="DTYPE", help=f"Activation dtype for the kernel check ({' or '.join(ACTIVATION_DTYPES)}); default: the model's "
                    "(config.json torch_dtype), else float16.")]
WorkersOpt = Annotated[int, typer.Option("--workers", metavar="N", help=f"Worker processes for hashing and the inverse "
                                         f"repack, 1 to {MAX_WORKERS} (default: one per core this process may run on, "
                                         "within its CPU quota).")]
ManifestDigestOpt = Annotated[Optional[str], typer.Option(
    "--manifest-sha256", metavar="DIGEST", help="Fail unless the manifest's SHA-256 is this (as printed by an earlier run).")]

#: above this many checked layers (or experts) the table shows failures only, with a summary line
MAX_ROWS = 80


def _parse_batches(spec: str) -> list[int]:
    expected = "comma-separated positive integers such as 1,16,128"
    sizes = parse_int_list(spec, "--batch", expected)
    if min(sizes) < 1:
        raise InputError(f"--batch {spec!r}: expected {expected}")
    if max(sizes) > MAX_BATCH:
        raise InputError(f"--batch {spec!r}: at most {MAX_BATCH} rows per check")
    return sizes


def _parse_digest(digest: str | None) -> str | None:
    """``--manifest-sha256``: 64 hex digits, with or without the ``sha256:`` prefix verify prints, any case."""
    if digest is None:
        return None
    normalized = "sha256:" + digest.strip().lower().removeprefix("sha256:")
    if not is_digest(normalized):
        raise InputError(f"--manifest-sha256 {digest!r}: expected a SHA-256 digest, 64 hex digits (optionally "
                         "prefixed 'sha256:')", hint="copy the 'manifest sha256:...' line an earlier verify printed")
    return normalized


def _kind(result: LayerResult) -> str:
    group = "ch" if result.group_size == -1 else f"g{result.group_size}"
    extras = [("sym" if result.sym else "asym")] + (["act"] if result.act_order else []) + (
        ["padded"] if result.padded else [])
    return f"{result.bits}-bit {group} " + " ".join(extras)


def verify(
    out_dir: OutDirArg,
    gpu: GpuOpt = "0",
    batch: BatchOpt = ",".join(str(b) for b in DEFAULT_BATCH_SIZES),
    skip_kernel: SkipKernelOpt = False,
    source: SourceOpt = None,
    dtype: DtypeOpt = None,
    workers: WorkersOpt = DEFAULT_WORKERS,
    manifest_sha256: ManifestDigestOpt = None,
    json_file: JsonOpt = None,
    seed: SeedOpt = 0,
    quiet: QuietOpt = False,
) -> None:
    """Check everything: the manifest against the files (every tensor, shape, config and digest), the inverse
    transform reproducing the source digests (lossless), layers kept in their source form byte for byte, and the Marlin
    kernel against an fp32 dequantization reference on the GPU (mean relative error < 1e-3, no NaN or unwritten
    output; not with --skip-kernel, which needs no GPU).

    Exits 0 when all of it passed; 1 naming what failed (a layer, a kept layer, a file that is missing, unreadable or
    different, a manifest whose digest is not --manifest-sha256, a GPU check process that failed or died once the
    kernel was loaded); 2 for what it cannot check: bad arguments, an OUT_DIR
    without a readable, well-formed manifest, a --source that is no checkpoint the converter reads, or no GPU (or no
    kernel build) for the kernel run."""
    check_json_path(json_file, out_dir, source)
    batches = _parse_batches(batch)
    manifest_sha256 = _parse_digest(manifest_sha256)
    gpus = parse_gpus(gpu)  # checked with --skip-kernel too: a bad argument is refused, not ignored
    if dtype is not None:
        activation_dtype({}, dtype)  # likewise (raises InputError naming the value)
    if skip_kernel:
        gpus = None
    check_workers(workers)
    manifest = load_manifest(out_dir, manifest_sha256)  # (its digest first, when given)
    if source is not None and not source.is_dir():  # (named as --source's, not as a bare path)
        raise InputError(f"--source {source}: {'not a directory' if source.exists() else 'does not exist'}",
                         hint="give the checkpoint directory OUT_DIR was converted from")
    # the bar counts what the summary counts: layers (each expert one), and the files hashed beside them
    layers, files = sum(layer_count(entry) for entry in manifest["layers"]), len(manifest["files"])
    with item_progress(layers + files, f"verifying {layers} layers + {files} files", enabled=not quiet) as advance:
        report = run_verify(out_dir, gpus=gpus, batch_sizes=None if skip_kernel else batches, source_dir=source,
                            seed=seed, dtype=dtype, workers=workers, expect_manifest=manifest_sha256,
                            progress=advance)
    data = report.to_dict()
    output = Output(f"Verified {out_dir}" if report.ok else f"Verification FAILED: {out_dir}", data)
    output.set_outcome(0 if report.ok else 1)
    output.columns = ["layer", "K x N", "kind", "lossless"]
    if report.kernel_checked:
        output.columns += [f"m={m} max / rel err" for m in report.batch_sizes] + ["time", "status"]
    else:
        output.columns += ["time", "status"]
    shown = report.failures if quiet or len(report.results) > MAX_ROWS else report.results
    for result in shown:
        cells = [result.label, f"{result.in_features} x {result.out_features}", _kind(result),
                 "yes" if result.integrity_ok else "NO"]
        if report.kernel_checked:
            runs = {c.batch: c for c in result.kernel if c.batch}
            cells += [f"{runs[m].max_abs_error:.2e} / {runs[m].relative_error:.1e}" if m in runs else "-"
                      for m in report.batch_sizes]
        problems = result.integrity_problems + [c.problem for c in result.kernel if c.problem]
        status = "ok" if result.ok else "FAIL: " + "; ".join(problems)
        if result.kernel_note:
            status += f" ({result.kernel_note})"
        cells += [f"{result.seconds * 1000:.0f} ms", status]
        output.add_row(*cells, style=None if result.ok else "red")
    if len(report.results) > MAX_ROWS and not quiet:
        output.lines.append(f"{len(report.results)} layers/experts checked; showing failures only")
    form = FORM_NAMES[report.source_format]
    for kept in report.kept:
        if quiet and kept.ok:
            continue  # (-q: failures and the summary only)
        state = "ok (bytes equal the source's digests)" if kept.ok else "FAIL: " + "; ".join(kept.problems)
        output.lines.append(f"kept in {form} form: {kept.name} ({kept.reason}): {state}")
    for problem in report.problems:
        output.lines.append(Text(one_line(f"FAIL: {problem}"), style="red"))
    output.lines += [f"note: {note}" for note in report.notes]
    passed = len(report.results) - len(report.failures) + sum(k.ok for k in report.kept)
    # the verdict first: "7/7 layers ok" beside a problem with the files is still a failed run
    summary = (f"{'passed' if report.ok else 'FAILED'}: {passed}/{len(report.results) + len(report.kept)} layers ok "
               f"({len(report.results)} converted, {len(report.kept)} kept in {form} form); {report.files_checked} "
               f"file(s) and {report.tensors_checked} copied tensor(s) hashed against the manifest, "
               f"{len(report.problems)} problem(s) with the files; {report.seconds:.1f} s")
    if report.kernel_checked:
        worst = max((c.relative_error for r in report.results for c in r.kernel if c.batch), default=None)
        bound = f"bound {RELATIVE_ERROR_BOUND:.0e}" + ("; bf16 runs: max(2e-3, twice torch's own bf16 error)"
                                                      if any(c.bound != RELATIVE_ERROR_BOUND for r in report.results
                                                             for c in r.kernel) else "")
        summary += (f"; kernel on GPU {gpu} in {report.activation_dtype}, batch sizes {batch}, worst relative "
                    f"error {worst:.2e} ({bound})" if worst is not None else f"; kernel on GPU {gpu}: no layer ran")
    else:
        summary += "; kernel not run (--skip-kernel)"
    if source is not None:
        summary += (f"; rebuilt quantized tensors compared with {source}'s byte for byte, and "
                    f"{report.source_copies_checked} copied tensor(s) and file(s) with its own")
    output.lines.append(summary)
    output.lines.append(f"manifest {report.manifest_sha256}")
    raise_if_signalled(Interrupted)  # (a signal whose exception Python dropped: no report of success)
    # first: a closed stdout must not lose it (one that cannot be written: the verdict is printed all the same)
    output.write_json_once_done(json_file, f"verify itself {'passed' if report.ok else 'FAILED'}")
    output.render_then_raise(None if report.ok else _failure(report))


def _failure(report) -> VerificationFailed:
    """What failed, for the exit-1 error line."""
    names = ", ".join(r.label for r in report.failures[:5])
    more = f" and {len(report.failures) - 5} more" if len(report.failures) > 5 else ""
    parts = [f"{len(report.failures)} layer(s) failed verification: {names}{more}"] if report.failures else []
    if report.problems:
        parts.append(f"{len(report.problems)} problem(s) with the files (listed above)")
    if not all(k.ok for k in report.kept):
        parts.append(f"{sum(not k.ok for k in report.kept)} kept layer(s) differ")
    return VerificationFailed("; ".join(parts))
