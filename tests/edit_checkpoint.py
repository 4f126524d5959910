"""Edits the tests make to a written checkpoint (or a converted one): the same change in both quantization configs."""

from __future__ import annotations

import hashlib
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


def rerecord(out: Path, name: str) -> None:
    """Record file ``name`` of the converted ``out`` again in its manifest (size and SHA-256), as a careful forger
    would after editing it."""
    path = out / "marlin_manifest.json"
    manifest = json.loads(path.read_text())
    data = (out / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": "sha256:" + hashlib.sha256(data).hexdigest()}
    path.write_text(json.dumps(manifest, indent=2))
