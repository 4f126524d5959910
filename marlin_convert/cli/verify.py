"""Verify a converted checkpoint: lossless round trip, and the bundled CUDA kernel against an fp32 reference.

Usage examples:
    marlin-convert verify ./Llama-2-7B-Marlin --gpu 0
    marlin-convert verify ./out --gpu 0,1 --batch 1,16,128 --json verify.json
    marlin-convert verify ./out --skip-kernel                 # integrity only, no GPU needed
    marlin-convert verify ./out --skip-kernel --source ./in   # also compare with the original tensors
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import InputError, VerificationFailed
from ..manifest import load_manifest
from ..verify import DEFAULT_BATCH_SIZES, RELATIVE_ERROR_BOUND, parse_gpus, verify as run_verify
from ._output import Output, check_json_path
from ._progress import item_progress

OutDirArg = Annotated[Path, typer.Argument(metavar="OUT_DIR", help="A directory written by 'marlin-convert' (with marlin_manifest.json).")]
GpuOpt = Annotated[str, typer.Option("--gpu", metavar="LIST", help="GPU index, or a comma-separated list to spread layers over.")]
BatchOpt = Annotated[str, typer.Option("--batch", metavar="LIST", help="Comma-separated batch sizes (rows of A) to run per layer.")]
SkipKernelOpt = Annotated[bool, typer.Option(
    "--skip-kernel", help="Only prove the round trip lossless (CPU, no GPU needed).")]
SourceOpt = Annotated[Optional[Path], typer.Option(
    "--source", metavar="IN_DIR", help="The original GPTQ directory: also compare rebuilt tensors with it byte for byte.")]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", metavar="FILE", help="Also write the report as JSON to this file.")]
SeedOpt = Annotated[int, typer.Option("--seed", metavar="N", help="Seed of the random activations.")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="No progress bar, and the table shows failing layers only (then the summary line).")]

#: above this many checked layers (or experts) the table shows failures only, with a summary line
MAX_ROWS = 80


def _parse_batches(spec: str) -> list[int]:
    try:
        sizes = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError as exc:
        raise InputError(f"--batch {spec!r}: expected comma-separated positive integers such as 1,16,128") from exc
    if not sizes or min(sizes) < 1:
        raise InputError(f"--batch {spec!r}: expected comma-separated positive integers such as 1,16,128")
    return sizes


def verify(
    out_dir: OutDirArg,
    gpu: GpuOpt = "0",
    batch: BatchOpt = ",".join(str(b) for b in DEFAULT_BATCH_SIZES),
    skip_kernel: SkipKernelOpt = False,
    source: SourceOpt = None,
    json_file: JsonOpt = None,
    seed: SeedOpt = 0,
    quiet: QuietOpt = False,
) -> None:
    """Check every converted layer: the inverse transform reproduces the source digests (lossless), and the
    Marlin kernel matches an fp32 dequantization reference (mean relative error < 1e-3, no NaN or unwritten
    output). Exits 1 naming the failed layers."""
    check_json_path(json_file)
    batches = _parse_batches(batch)
    gpus = None if skip_kernel else parse_gpus(gpu)
    manifest = load_manifest(out_dir)
    total = len(manifest["layers"])
    with item_progress(total, "verifying", enabled=not quiet) as advance:
        report = run_verify(out_dir, gpus=gpus, batch_sizes=None if skip_kernel else batches, source_dir=source,
                            seed=seed, progress=advance)
    data = report.to_dict()
    output = Output(f"Verified {out_dir}", data)
    output.columns = ["layer", "K x N", "group", "lossless"]
    if report.kernel_checked:
        output.columns += [f"m={m} max / rel err" for m in report.batch_sizes] + ["time", "status"]
    else:
        output.columns += ["time", "status"]
    shown = report.failures if quiet or len(report.results) > MAX_ROWS else report.results
    for result in shown:
        cells = [result.label, f"{result.in_features} x {result.out_features}",
                 "channel" if result.group_size == -1 else result.group_size,
                 "yes" if result.integrity_ok else "NO"]
        if report.kernel_checked:
            cells += [f"{c.max_abs_error:.2e} / {c.relative_error:.1e}" for c in result.kernel if c.batch]
        problems = result.integrity_problems + [c.problem for c in result.kernel if c.problem]
        cells += [f"{result.seconds * 1000:.0f} ms", "ok" if result.ok else "FAIL: " + "; ".join(problems)]
        output.add_row(*cells, style=None if result.ok else "red")
    if len(report.results) > MAX_ROWS and not quiet:
        output.lines.append(f"{len(report.results)} layers/experts checked; showing failures only")
    worst = max((c.relative_error for r in report.results for c in r.kernel if c.batch), default=None)
    summary = (f"{len(report.results) - len(report.failures)}/{len(report.results)} passed"
               f" in {report.seconds:.1f} s; lossless round trip checked for every layer")
    if report.kernel_checked:
        summary += f"; kernel on GPU {gpu}, batch sizes {batch}, worst relative error {worst:.2e}" \
                   f" (bound {RELATIVE_ERROR_BOUND:.0e})"
    else:
        summary += "; kernel not run (--skip-kernel)"
    output.lines.append(summary)
    output.render()
    output.write_json(json_file)
    if report.failures:
        names = ", ".join(r.label for r in report.failures[:5])
        more = f" and {len(report.failures) - 5} more" if len(report.failures) > 5 else ""
        raise VerificationFailed(f"{len(report.failures)} layer(s) failed verification: {names}{more}")
