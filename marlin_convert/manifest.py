"""The manifest written beside a converted checkpoint (``marlin_manifest.json``).

It records, per converted layer, everything an engine needs to load it without guessing (bits, group size, zero
points, act-order, logical and padded shapes, the workspace rule and size) and everything
:mod:`marlin_convert.verify` needs to prove the conversion lossless later (the SHA-256 of every source tensor, and
how the tensors that Marlin does not store are rebuilt: the zero format and the g_idx kind); per layer kept in
GPTQ form, its tensors and their digests. Version 2 (CONTRACT C); the README documents each field.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ManifestError

MANIFEST_FILE = "marlin_manifest.json"
MANIFEST_VERSION = 2


def layer_outputs_names(prefix: str, act_order: bool, zero_points: bool = False) -> dict[str, str]:
    """Names of the Marlin tensors of layer ``prefix``: ``B``, ``s``, with zero points ``zp`` and, with
    act-order, ``perm``/``g_idx``."""
    names = {"B": f"{prefix}.B", "s": f"{prefix}.s"}
    if zero_points:
        names["zp"] = f"{prefix}.zp"
    if act_order:
        names.update(perm=f"{prefix}.perm", g_idx=f"{prefix}.g_idx")
    return names


def write_manifest(directory: Path, manifest: dict) -> Path:
    path = Path(directory) / MANIFEST_FILE
    path.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return path


def load_manifest(directory: Path) -> dict:
    """Read and sanity-check ``directory/marlin_manifest.json``. Raises :class:`ManifestError`."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(
            f"{directory}: no {MANIFEST_FILE}: not a directory written by marlin-convert",
            hint="run 'marlin-convert IN_DIR OUT_DIR' first, then verify OUT_DIR",
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"{path}: unreadable: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != "marlin-convert-manifest":
        raise ManifestError(f"{path}: not a marlin-convert manifest")
    if manifest.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"{path}: manifest version {manifest.get('version')!r}, this tool reads {MANIFEST_VERSION}")
    for key in ("layers", "kept"):
        if not isinstance(manifest.get(key), list):
            raise ManifestError(f"{path}: field '{key}' is missing or not a list")
    return manifest
