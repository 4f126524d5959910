"""The source formats a conversion reads, and which one a directory is in.

GPTQ (:mod:`marlin_convert.gptq`) and compressed-tensors ``pack-quantized`` (:mod:`marlin_convert.compressed_tensors`)
both give one :class:`~marlin_convert.gptq.LayerPlan` per quantized linear, with the same
:class:`~marlin_convert.spec.QuantSpec`. Everything after planning is blind to the format, except where a worker
reads a tensor (``LayerPlan.roles`` and ``LayerPlan.as_gptq``), where ``verify`` rebuilds the stored tensors, and
where the output config is written.
"""

from __future__ import annotations

from pathlib import Path

from . import compressed_tensors, gptq
from .errors import InputError
from .gptq import Checkpoint, LayerPlan

#: how reports name the form a layer kept unconverted stays in
FORM_NAMES = {"gptq": "GPTQ", compressed_tensors.QUANT_METHOD: "compressed-tensors"}
#: key of the output configs listing the modules a partly converted checkpoint keeps in their source form
KEPT_MODULES_KEYS = {"gptq": "modules_in_gptq_form",
                     compressed_tensors.QUANT_METHOD: "modules_in_compressed_tensors_form"}
#: keys of the config of a checkpoint converted from compressed-tensors: the source format and its config as read
SOURCE_FORMAT_KEY = "source_format"
SOURCE_CONFIG_KEY = "source_quantization_config"


def _reader(checkpoint: Checkpoint):
    return compressed_tensors if checkpoint.source_format == compressed_tensors.QUANT_METHOD else gptq


def check_in_dir(in_dir: Path) -> None:
    """Raise :class:`InputError` when ``in_dir`` is not a directory (missing, a file); before OUT_DIR is checked, so
    that a mistyped IN_DIR is reported as such, not as a problem of OUT_DIR's."""
    in_dir = Path(in_dir)
    if not in_dir.is_dir():
        raise InputError(f"{in_dir}: {'not a directory' if in_dir.exists() else 'does not exist'}")


def open_checkpoint(in_dir: Path) -> Checkpoint:
    """Open ``in_dir`` as compressed-tensors when its config.json says so, else as GPTQ. Raises :class:`InputError`."""
    in_dir = Path(in_dir)
    check_in_dir(in_dir)
    config_json = compressed_tensors.detect(in_dir)
    if config_json is not None:
        return compressed_tensors.open_checkpoint(in_dir, config_json)
    return gptq.open_checkpoint(in_dir)


def plan_layers(checkpoint: Checkpoint) -> list[LayerPlan]:
    """A checked plan for every quantized linear of ``checkpoint``, by the reader of its format; the small tensors
    planning reads (g_idx, qzeros, weight_shape: one or more per layer) through each shard opened once."""
    with checkpoint.shards_held_open():
        return _reader(checkpoint).plan_layers(checkpoint)


def plan_notes(checkpoint: Checkpoint, layers: list[LayerPlan]) -> list[str]:
    """What reading ``checkpoint`` decided (zero formats, ...), for the report and the manifest."""
    return _reader(checkpoint).plan_notes(checkpoint, layers)


def quantized_by_config(checkpoint: Checkpoint, modules: list[str]) -> dict[str, tuple[bool, str]]:
    """Per module of ``modules``: whether ``checkpoint``'s config quantizes it, and what in the config says so."""
    return _reader(checkpoint).quantized_by_config(checkpoint, modules)
