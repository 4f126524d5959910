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

from ..convert import ConversionPlan, build_plan, plan_refusal
from ..sources import FORM_NAMES
from ._errors import Interrupted
from ._output import Output, check_json_path, human_bytes
from ._render import add_layer_rows, counts_line, layer_dict, plain_expert_counts
from ._signals import raise_if_signalled

InDirArg = Annotated[Path, typer.Argument(metavar="IN_DIR", help="GPTQ or compressed-tensors (pack-quantized) checkpoint directory (safetensors, single file or sharded).")]
JsonOpt = Annotated[Optional[str], typer.Option("--json", metavar="FILE", help="Also write the plan as JSON to this file ('-': print it on stdout instead of the table).")]
JsonStdoutOpt = Annotated[bool, typer.Option("--json-stdout", help="Print the plan as JSON instead of a table.")]


def plan_output(plan: ConversionPlan, as_json: bool = False, quiet: bool = False, refusing: bool = False,
                describe_options: bool = False) -> Output:
    """The plan for people (a table of layers unless ``quiet``, then summary lines) and as JSON data. ``refusing``:
    the layers with no Marlin form stop the run (a dry run without ``--skip-incompatible``, or any run where no layer
    converts), so the table and the summary call them refused, not kept, and the JSON has no output format and no
    kept layers or tensors (its other counts are the plan's).
    ``describe_options`` (``inspect``, which runs with no conversion options): where such layers are kept, a line
    says that the conversion keeps them only with ``--skip-incompatible`` and stops at them without it. The JSON's
    ``stops_without_skip_incompatible`` / ``stops_with_skip_incompatible`` say whether a conversion would stop."""
    config = plan.checkpoint.config
    source_format = plan.checkpoint.source_format
    form = FORM_NAMES[source_format]
    refused = len(plan.refused)
    data = {
        "in_dir": str(plan.checkpoint.path),
        "source_format": source_format,
        "checkpoint_format": None if refusing else plan.checkpoint_format,
        "quantization_defaults": {**config.resolved_defaults(), "sources": config.sources},
        "model_dtype": plan.checkpoint.model_dtype,
        "shards": [shard.file_name for shard in plan.shards],
        "layers": [layer_dict(layer) for layer in plan.layers],
        "converted": len(plan.converted),
        "converted_layers": plan.converted_layers,
        "marlin_entries": len(plan.outputs),
        "kept_gptq": 0 if refusing else refused,
        "refused": refused if refusing else 0,
        "stops_without_skip_incompatible": plan_refusal(plan, False) is not None,
        "stops_with_skip_incompatible": plan_refusal(plan, True) is not None,
        "passthrough_tensors": plan.passthrough_tensors,
        "kept_tensors": 0 if refusing else plan.kept_tensors,
        "bytes_in": plan.bytes_in,
        "tensor_bytes_out": plan.tensor_bytes_out,
        "notes": plan.notes,
    }
    output = Output(f"Plan for {plan.checkpoint.path}", data, as_json=as_json)
    if not quiet:
        add_layer_rows(output, plan.layers, refusing=refusing, plain_counts=plain_expert_counts(plan))
    output.lines.append(
        counts_line(data["converted_layers"], data["marlin_entries"], refused, form, data["passthrough_tensors"],
                    data["kept_tensors"], len(plan.shards), done=False, refusing=refusing))
    if describe_options and refused and not refusing:
        output.lines.append(f"convert keeps the {refused} layer(s) with no Marlin form in {form} form only with "
                            "--skip-incompatible; without it the conversion stops at them (exit 2)")
    output.lines += [
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
    # where no layer converts, the conversion stops with --skip-incompatible too: the plan calls the layers refused
    output = plan_output(plan, as_json=json_stdout, refusing=plan_refusal(plan, True) is not None,
                         describe_options=True)
    output.set_outcome(0)
    raise_if_signalled(Interrupted)  # (a signal whose exception Python dropped: no report of success)
    output.write_json(json_file)  # first: a closed stdout must not lose it
    output.render()
