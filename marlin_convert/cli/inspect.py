"""Show what converting a GPTQ (or compressed-tensors) checkpoint would do, without writing anything.

Usage examples:
    marlin-convert inspect ./Llama-2-7B-GPTQ
    marlin-convert inspect ./Qwen3-30B-A3B-GPTQ --json plan.json
    marlin-convert ./Llama-2-7B-GPTQ ./out --dry-run        # the same plan, from convert
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..convert import ConversionPlan, build_plan
from ..sources import FORM_NAMES
from ._errors import Interrupted
from ._output import Output, check_json_path, human_bytes
from ._render import add_layer_rows, counts_line, layer_dict
from ._signals import raise_if_signalled

InDirArg = Annotated[Path, typer.Argument(metavar="IN_DIR", help="GPTQ or compressed-tensors (pack-quantized) checkpoint directory (safetensors, single file or sharded).")]
JsonOpt = Annotated[Optional[str], typer.Option("--json", metavar="FILE", help="Also write the plan as JSON to this file ('-': print it on stdout instead of the table).")]
JsonStdoutOpt = Annotated[bool, typer.Option("--json-stdout", help="Print the plan as JSON instead of a table.")]


def plan_output(plan: ConversionPlan, as_json: bool = False, quiet: bool = False, refusing: bool = False) -> Output:
    """The plan for people (a table of layers unless ``quiet``, then summary lines) and as JSON data. ``refusing``:
    the layers with no Marlin form stop the run (a dry run without ``--skip-incompatible``), so the table and the
    summary call them refused, not kept."""
    config = plan.checkpoint.config
    source_format = plan.checkpoint.source_format
    data = {
        "in_dir": str(plan.checkpoint.path),
        "source_format": source_format,
        "checkpoint_format": plan.checkpoint_format,
        "quantization_defaults": {**config.resolved_defaults(), "sources": config.sources},
        "model_dtype": plan.checkpoint.model_dtype,
        "shards": [shard.file_name for shard in plan.shards],
        "layers": [layer_dict(layer) for layer in plan.layers],
        "converted": len(plan.converted),
        "converted_layers": plan.converted_layers,
        "marlin_entries": len(plan.outputs),
        "kept_gptq": len(plan.refused),
        "passthrough_tensors": plan.passthrough_tensors,
        "kept_tensors": plan.kept_tensors,
        "bytes_in": plan.bytes_in,
        "tensor_bytes_out": plan.tensor_bytes_out,
        "notes": plan.notes,
    }
    output = Output(f"Plan for {plan.checkpoint.path}", data, as_json=as_json)
    if not quiet:
        add_layer_rows(output, plan.layers, refusing=refusing)
    output.lines += [
        counts_line(data["converted_layers"], data["marlin_entries"], data["kept_gptq"], FORM_NAMES[source_format],
                    data["passthrough_tensors"], data["kept_tensors"], len(plan.shards), done=False,
                    refusing=refusing),
        f"bytes in: {human_bytes(plan.bytes_in)}   tensor bytes out: {human_bytes(plan.tensor_bytes_out)}",
        f"{config.describe()} (from {', '.join(config.sources)}); each layer's own settings are in the table",
        *(f"note: {note}" for note in plan.notes),
    ]
    return output


def inspect(in_dir: InDirArg, json_file: JsonOpt = None, json_stdout: JsonStdoutOpt = False) -> None:
    """Show the conversion plan: layers found, shapes, group size, what is converted or kept and why, bytes."""
    # (--json-stdout alone: a failure's JSON report goes to stdout, as with --json -)
    check_json_path("-" if json_stdout and json_file is None else json_file, in_dir)
    plan = build_plan(in_dir, skip_incompatible=True)
    output = plan_output(plan, as_json=json_stdout)
    output.set_outcome(0)
    raise_if_signalled(Interrupted)  # (a signal whose exception Python dropped: no report of success)
    output.write_json(json_file)  # first: a closed stdout must not lose it
    output.render()
