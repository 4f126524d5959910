"""Convert a GPTQ (or compressed-tensors pack-quantized) checkpoint into Marlin format.

Usage examples:
    marlin-convert ./Llama-2-7B-GPTQ ./Llama-2-7B-Marlin
    marlin-convert convert ./in ./out --overwrite --json report.json
    marlin-convert ./in ./out --skip-incompatible          # keep unsupported layers in their source form
    marlin-convert ./in ./out --dry-run                    # only show the plan
    marlin-convert ./Qwen3-30B-A3B-GPTQ ./out --stack-experts   # one [E, ...] tensor per projection
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..convert import DEFAULT_WORKERS, build_plan, convert as run_conversion, plan_refusal, produced_names
from ..errors import InputError, OutputError
from ..outdir import check_free_space, check_out_dir
from ..outfiles import select_extra_files
from ..sources import FORM_NAMES, check_in_dir
from ..workers import MAX_WORKERS, check_workers
from ._errors import Interrupted, InterruptedAfterPublish
from ._output import Output, check_json_path, human_bytes
from ._progress import byte_progress
from ._render import add_layer_rows, counts_line, plain_expert_counts
from ._signals import defer_signals, deferred_signal, output_in_place, raise_if_signalled
from .inspect import plan_output

InDirArg = Annotated[Path, typer.Argument(metavar="IN_DIR", help="GPTQ or compressed-tensors (pack-quantized) checkpoint directory (safetensors, single file or sharded).")]
OutDirArg = Annotated[Path, typer.Argument(metavar="OUT_DIR", help="Where to write the Marlin checkpoint (absent or empty; --overwrite replaces a previous output).")]
OverwriteOpt = Annotated[bool, typer.Option(
    "--overwrite", help="Replace OUT_DIR if it is a previous output (its marlin_manifest.json, and only the files "
    "that manifest lists); another non-empty directory is never replaced.")]
SkipOpt = Annotated[bool, typer.Option(
    "--skip-incompatible", help="Keep the layers Marlin has no form for in their source form and list them (the "
    "output then says checkpoint_format 'marlin-partial'), instead of stopping before anything is written: bits "
    "other than 4 and 8 (2/3-bit), group sizes other than -1, 32, 64, 128 or >= K, zero points that contradict "
    "'sym: true' or that Marlin cannot hold; compressed-tensors also activation quantization, float weights, other "
    "scale strategies. A config whose bits or group size the stored tensors' shapes contradict is a malformed "
    "checkpoint: it always stops the run, as does a checkpoint with no layer to convert.")]
StackOpt = Annotated[bool, typer.Option(
    "--stack-experts", help="Fuse per-expert keys '<base>.experts.<e>.<proj>' into one stacked tensor per projection "
    "and layer: '<base>.experts.<proj>.B' [E, K_pad/16, N_pad*bits/2] and '.s' [E, groups, N_pad] (+ zp, "
    "perm/g_idx [E, K_pad]; README, Output format). Every expert of a set must be quantized alike: a set where a "
    "dynamic rule leaves an expert unquantized or gives it other settings is refused, naming the expert.")]
DryRunOpt = Annotated[bool, typer.Option(
    "--dry-run", help="Show the plan (like 'inspect') and write nothing; exits 2 where the same command without "
    "--dry-run would stop before writing (OUT_DIR not usable: not empty, inside IN_DIR, a mount point, or in a "
    "directory that cannot be written; too little free disk space for the tensors; a file it copies that cannot be "
    "read; layers with no Marlin form).")]
JsonOpt = Annotated[Optional[str], typer.Option("--json", metavar="FILE", help="Also write the report as JSON to this file ('-': print it on stdout instead of the table).")]
WorkersOpt = Annotated[int, typer.Option(
    "--workers", metavar="N", help=f"Worker processes that repack, hash and copy tensors, 1 to {MAX_WORKERS} (default: one "
    "per core this process may run on, within its CPU quota, at most 8).")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="No progress bar and no per-layer table: only the summary lines (and errors).")]


def _before_publish() -> None:
    """The output is complete: from here on signals are only noted (:func:`._signals.defer_signals`). A signal
    taken before, whose exception Python dropped (raised inside an at-fork hook: :mod:`._signals`), stops the
    conversion here, before anything is published."""
    raise_if_signalled(Interrupted)
    defer_signals()


def convert(
    in_dir: InDirArg,
    out_dir: OutDirArg,
    overwrite: OverwriteOpt = False,
    skip_incompatible: SkipOpt = False,
    stack_experts: StackOpt = False,
    dry_run: DryRunOpt = False,
    json_file: JsonOpt = None,
    workers: WorkersOpt = DEFAULT_WORKERS,
    quiet: QuietOpt = False,
) -> None:
    """Repack every quantized linear of IN_DIR into Marlin tiles and write OUT_DIR with a manifest.

    Every other tensor is copied bit for bit; shards keep their grouping; configs say checkpoint_format
    "marlin". Nothing is left at OUT_DIR unless the whole conversion succeeded.
    """
    started = time.perf_counter()
    check_json_path(json_file, in_dir, out_dir)
    check_workers(workers)
    check_in_dir(in_dir)
    check_out_dir(in_dir, Path(os.path.abspath(out_dir)), overwrite)  # before the plan, which reads every header
    plan = build_plan(in_dir, skip_incompatible=skip_incompatible or dry_run, stack_experts=stack_experts)
    if dry_run:
        refusal = plan_refusal(plan, skip_incompatible)
        output = plan_output(plan, quiet=quiet, refusing=refusal is not None)
        output.lines.append(f"dry run: nothing written ({out_dir} left as it was)")
        if refusal is None:  # the real run's last checks before it writes: the files it copies, the free space
            try:
                select_extra_files(in_dir, produced_names(plan))  # (an unreadable one, a broken link: it stops there)
                check_free_space(Path(os.path.abspath(out_dir)), plan.tensor_bytes_out)
            except (InputError, OutputError) as exc:
                refusal = exc
        output.set_outcome(0 if refusal is None else 2)
        if refusal is not None:  # the plan, and why the run would stop, as a failed run's report says it
            output.data.update(error=refusal.message, hint=refusal.hint)
        output.write_json(json_file)  # first: a closed stdout must not lose it
        # refused layers: the plan shows them; the conversion itself would stop (exit 2, even with stdout closed)
        output.render_then_raise(refusal)
        return
    with byte_progress(plan.work_bytes, "converting", enabled=not quiet) as advance:
        report = run_conversion(in_dir, out_dir, overwrite=overwrite, skip_incompatible=skip_incompatible,
                                stack_experts=stack_experts, workers=workers, progress=advance, plan=plan,
                                before_publish=_before_publish)
    output_in_place()  # (a second signal noted while the output was flushed and moved ends the process now)
    report.seconds = time.perf_counter() - started  # the whole command: planning (headers, small tensors) included
    output = Output(f"Converted {in_dir} -> {out_dir}", report.to_dict())
    output.set_outcome(0)
    if not quiet:
        add_layer_rows(output, plan.layers, plain_counts=plain_expert_counts(plan))
    rate = report.bytes_in / report.seconds if report.seconds else 0.0
    form = FORM_NAMES[report.source_format]
    output.lines += [
        counts_line(report.converted_layers, len(report.layers), len(report.skipped), form,
                    report.passthrough_tensors, report.kept_tensors, report.shards, done=True),
        f"checkpoint_format: {report.checkpoint_format}"
        + (f" (partly converted: the configs list the modules still in {form} form)" if report.skipped else ""),
        f"{human_bytes(report.bytes_in)} in, {human_bytes(report.bytes_out)} out, "
        f"{report.seconds:.1f} s ({human_bytes(rate)}/s, {report.workers} worker(s), "
        f"peak RSS {human_bytes(report.peak_rss_bytes)} summed over processes)",
        *(f"note: {note}" for note in report.notes),
        f"manifest: {report.manifest}",
        f"manifest {report.manifest_sha256} (keep it apart from the checkpoint: 'verify --manifest-sha256' "
        "checks it)",
    ]
    # first: a closed stdout must not lose it (one that cannot be written: OUT_DIR is in place all the same)
    output.write_json_once_done(json_file, f"the conversion itself is complete: {out_dir} is finished and in place",
                                hint="keep the manifest digest above; 'marlin-convert verify' checks the output")
    output.render()
    signum = deferred_signal()
    if signum is not None:  # arrived while the finished output was moved into place, or after
        raise InterruptedAfterPublish(signum, str(out_dir))
