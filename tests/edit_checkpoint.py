"""Edits the tests make to a written checkpoint (or a converted one): the same change in both quantization configs."""

from __future__ import annotations

import json
from pathlib import Path


def set_quant_config(directory: Path, **changes) -> None:
    """Update ``config.json``'s ``quantization_config`` and ``quantize_config.json`` alike with ``changes``."""
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"].update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    quantize = json.loads((directory / "quantize_config.json").read_text())
    quantize.update(changes)
    (directory / "quantize_config.json").write_text(json.dumps(quantize))
