"""The manifest written beside a converted checkpoint (``marlin_manifest.json``).

It records, per converted layer, everything an engine needs to load it without guessing (bits, group size, zero
points, act-order, logical and padded shapes, the workspace rule and size) and everything
:mod:`marlin_convert.verify` needs to prove the conversion lossless later (the SHA-256 of every source tensor, and
how the tensors that Marlin does not store are rebuilt: the zero format and the g_idx kind); per layer kept in
GPTQ form, its tensors and their digests. Version 2 (CONTRACT C); the README documents each field.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from . import strict_json
from .compressed_tensors import MIXED, PACKED, QUANT_METHOD, STORED_KIND
from .errors import InputError, ManifestError, VerificationFailed
from .fileio import dead_link, digest_text, outside_link, read_inside
from .gptq import GPTQ_BITS, ZERO_FORMAT_OF_LABEL, parse_dynamic, parse_extra_config

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


def layer_count(entry: dict) -> int:
    """The layers a ``layers`` entry holds, counted as ``convert`` and ``verify`` count them: each expert one."""
    return entry["num_experts"] or 1


def manifest_text(manifest: dict) -> str:
    """The manifest as JSON text: a top-level key per line, and each entry of a top-level list of objects (``layers``,
    the kept tensors) on a line of its own. Each line comes from json's C encoder, which an ``indent`` turns off: the
    pure-Python encoder took 0.61 s for the 12,352 layer entries of a 16-layer x 256-expert model, this 0.19 s."""
    def value_text(value) -> str:
        if isinstance(value, list) and value and all(isinstance(entry, dict) for entry in value):
            return "[\n" + ",\n".join("  " + json.dumps(entry) for entry in value) + "\n ]"
        return json.dumps(value)

    return "{\n" + ",\n".join(f" {json.dumps(key)}: {value_text(value)}" for key, value in manifest.items()) + "\n}\n"


def write_manifest(directory: Path, manifest: dict) -> Path:
    path = Path(directory) / MANIFEST_FILE
    path.write_text(manifest_text(manifest), encoding="utf-8")
    return path


def load_manifest(directory: Path, expect_digest: str | None = None) -> dict:
    """Read ``directory/marlin_manifest.json`` and check every field's JSON type and value (:func:`check_manifest`).

    Raises :class:`ManifestError` naming the file and the field (``layers[3].bits``) on the first problem, and
    :class:`VerificationFailed` when ``expect_digest`` is given and differs (see :func:`read_manifest`).
    """
    return read_manifest(directory, expect_digest)[0]


def read_manifest(directory: Path, expect_digest: str | None = None) -> tuple[dict, str]:
    """The manifest as :func:`load_manifest` reads it, and the ``sha256:`` digest of the bytes it was parsed from.

    ``expect_digest`` (64 hex digits, ``sha256:`` optional): those bytes' digest is compared before anything is
    parsed, so a manifest that is not the one recorded is refused before any of its fields is believed.
    """
    path = Path(directory) / MANIFEST_FILE
    target = outside_link(path, Path(directory))
    if target is not None:
        raise ManifestError(f"{path}: a link to {target}, outside {directory}: not read")
    if not Path(directory).is_dir():
        raise ManifestError(f"{directory}: " + ("not a directory" if Path(directory).exists() else "does not exist"),
                            hint="give the OUT_DIR a conversion wrote ('marlin-convert IN_DIR OUT_DIR')")
    if not os.path.lexists(path):
        raise ManifestError(
            f"{directory}: no {MANIFEST_FILE}: not a directory written by marlin-convert",
            hint="run 'marlin-convert IN_DIR OUT_DIR' first, then verify OUT_DIR",
        )
    if not path.is_file():  # (never opened: a FIFO would block)
        raise ManifestError(f"{path}: {_what_is(path)}, not a regular file: not read",
                            hint="the manifest a conversion writes is a regular file")
    try:
        content = read_inside(path)
    except OSError as exc:
        raise ManifestError(f"{path}: unreadable: {exc.strerror or exc}") from exc
    digest = digest_text(hashlib.sha256(content))
    if expect_digest is not None and expect_digest.lower().removeprefix("sha256:") != digest.removeprefix("sha256:"):
        raise VerificationFailed(f"{path}: SHA-256 is {digest}, expected {expect_digest}: not the manifest whose "
                                 "digest was recorded; nothing else was checked",
                                 hint="a changed manifest can describe changed files: find out who changed it")
    try:
        manifest = strict_json.loads(content)
    except ValueError as exc:
        raise ManifestError(f"{path}: unreadable: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != "marlin-convert-manifest":
        raise ManifestError(f"{path}: not a marlin-convert manifest")
    version = manifest.get("version")
    if type(version) is not int or version != MANIFEST_VERSION:  # (2.0 and true are not 2)
        raise ManifestError(f"{path}: manifest version {json.dumps(version)[:60]}, this tool reads {MANIFEST_VERSION}")
    try:
        check_manifest(manifest)
    except _FieldError as exc:
        raise ManifestError(f"{path}: field {exc.args[0]}") from None
    return manifest, digest


def _what_is(path: Path) -> str:
    """What the entry ``path``, which is not a regular file, is: ``a directory``, ``a FIFO``, ... or a dead link."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "a " + dead_link(path) if os.path.islink(path) else "unreadable"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def manifest_digest(directory: Path) -> str:
    """``sha256:`` of the manifest file's bytes (what ``verify`` reports, so a recorded value shows tampering)."""
    return "sha256:" + hashlib.sha256(read_inside(Path(directory) / MANIFEST_FILE)).hexdigest()


# ------------------------------------------------------------------------------------- field types and values


class _FieldError(ValueError):
    """``args[0]``: the field's path and what is wrong with it."""


def _kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    return {str: "a string", list: "a list", dict: "an object", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _get(obj: dict, key: str, where: str, kind, *, null: bool = False, choices=None, minimum=None):
    """``obj[key]`` checked: ``kind`` is int (never bool), bool, str, list or dict."""
    field = f"{where}.{key}" if where else key
    if key not in obj:
        raise _FieldError(f"'{field}' is missing")
    value = obj[key]
    if value is None and null:
        return None
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        expected = {int: "an integer", bool: "a boolean", str: "a string", list: "a list", dict: "an object"}[kind]
        shown = "" if value is None else f" {json.dumps(value)[:60]}"  # (null is its own value: not "null null")
        raise _FieldError(f"'{field}': expected {expected}{' or null' if null else ''}, got {_kind(value)}{shown}")
    if choices is not None and value not in choices:
        raise _FieldError(f"'{field}': {json.dumps(value)[:60]} is not one of {', '.join(map(json.dumps, choices))}")
    if minimum is not None and value < minimum:
        raise _FieldError(f"'{field}': {value} is below {minimum}")
    return value


def _strings(obj: dict, key: str, where: str) -> list[str]:
    items = _get(obj, key, where, list)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise _FieldError(f"'{where + '.' if where else ''}{key}[{i}]': expected a string, got {_kind(item)}")
    return items


def _string_map(obj: dict, key: str, where: str, keys: tuple[str, ...]) -> dict[str, str]:
    """An object whose keys come from ``keys`` and whose values are strings."""
    mapping = _get(obj, key, where, dict)
    for name, value in mapping.items():
        if name not in keys:
            raise _FieldError(f"'{where}.{key}': unknown key {json.dumps(name)} (expected {', '.join(keys)})")
        if not isinstance(value, str):
            raise _FieldError(f"'{where}.{key}.{name}': expected a string, got {_kind(value)}")
    return mapping


def _digest_map(obj: dict, key: str, where: str, keys: tuple[str, ...]) -> dict[str, str]:
    mapping = _string_map(obj, key, where, keys)
    for name, value in mapping.items():
        if not is_digest(value):
            raise _FieldError(f"'{where}.{key}.{name}': expected \"sha256:\" and 64 hex digits, got {json.dumps(value)}")
    return mapping


def _object(value, where: str) -> None:
    if not isinstance(value, dict):
        raise _FieldError(f"'{where}': expected an object, got {_kind(value)}")


def _is_shape(value: list) -> bool:
    return all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value)


def _sha256(record: dict, where: str) -> None:
    if not is_digest(_get(record, "sha256", where, str)):
        raise _FieldError(f"'{where}.sha256': expected \"sha256:\" and 64 hex digits")


def is_digest(value) -> bool:
    """Whether ``value`` is a digest as the manifest writes it: ``sha256:`` and 64 lowercase hex digits."""
    return (isinstance(value, str) and value.startswith("sha256:") and len(value) == 71
            and all(c in "0123456789abcdef" for c in value[7:]))


#: tensors of a converted layer (CONTRACT C) and of the source layer it came from, per source format
MARLIN_KINDS = ("B", "s", "zp", "perm", "g_idx")
SOURCE_KINDS = {"gptq": ("qweight", "scales", "qzeros", "g_idx"), QUANT_METHOD: tuple(STORED_KIND.values())}
SCALE_DTYPES = ("float16", "bfloat16", "float32")


def _check_layer(entry, where: str) -> None:
    _object(entry, where)
    _get(entry, "name", where, str)
    for key in ("outputs", "shards"):
        _string_map(entry, key, where, MARLIN_KINDS)
    shapes = _get(entry, "shapes", where, dict)
    for kind, shape in shapes.items():
        if kind not in MARLIN_KINDS or not isinstance(shape, list) or not _is_shape(shape):
            raise _FieldError(f"'{where}.shapes.{kind}': expected a list of non-negative integers")
    _get(entry, "bits", where, int, choices=(4, 8))
    group_size = _get(entry, "group_size", where, int)
    if group_size != -1 and group_size < 1:
        raise _FieldError(f"'{where}.group_size': {group_size} is neither -1 (channelwise) nor positive")
    _get(entry, "sym", where, bool)
    _get(entry, "zero_format", where, str, choices=("v1", "v2"))
    _get(entry, "act_order", where, bool)
    for key in ("num_groups", "in_features", "out_features", "padded_in_features", "padded_out_features"):
        _get(entry, key, where, int, minimum=1)
    _get(entry, "scale_dtype", where, str, choices=SCALE_DTYPES)
    experts = _get(entry, "num_experts", where, int, minimum=0)
    if experts:
        _get(entry, "expert_stride_int32", where, int, minimum=1)
    workspace = _get(entry, "workspace", where, dict)
    _get(workspace, "rule", f"{where}.workspace", str)
    _get(workspace, "ints", f"{where}.workspace", int, minimum=0)
    if "per_expert" in workspace:
        _get(workspace, "per_expert", f"{where}.workspace", bool)
    source_format = _get(entry, "source_format", where, str, choices=tuple(SOURCE_KINDS))
    sources = _get(entry, "sources", where, list)
    for i, source in enumerate(sources):
        _check_source(source, f"{where}.sources[{i}]", source_format)
    _check_expert_count(experts, shapes, len(sources), where)


def _check_expert_count(experts: int, shapes: dict, source_count: int, where: str) -> None:
    """``num_experts`` against what holds the experts: the leading dimension of every stacked tensor, and one source
    (a plain layer, or a stacked source) or one per expert (``--stack-experts``). Checked here, before anything
    (the audit, the results) is sized by the count: a count the entry itself does not bear out is refused."""
    for kind, shape in shapes.items():
        if experts and (not shape or shape[0] != experts):
            raise _FieldError(f"'{where}.num_experts': {experts} experts, but shapes.{kind} is {json.dumps(shape)} "
                              "(a stacked tensor leads with its experts)")
    if source_count != 1 and source_count != (experts or 1):
        expected = f"1 or {experts} (one per expert)" if experts > 1 else "1"
        raise _FieldError(f"'{where}.sources': {source_count} source(s) for {experts} expert(s), expected {expected}")


def _check_source(source, where: str, source_format: str) -> None:
    _object(source, where)
    _get(source, "name", where, str)
    _string_map(source, "tensors", where, SOURCE_KINDS[source_format])
    slices = _get(source, "slices", where, list, null=True)
    if slices is not None and (len(slices) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                                             for v in slices) or not 0 <= slices[0] < slices[1]):
        raise _FieldError(f"'{where}.slices': expected [first, stop] with 0 <= first < stop, got {json.dumps(slices)}")
    _get(source, "g_idx", where, str, choices=("act_order", "trivial", "absent"))
    _get(source, "zero_format", where, str, choices=("v1", "v2"))
    _get(source, "zero_stored", where, int, null=True, minimum=0)
    _digest_map(source, "digests", where, SOURCE_KINDS[source_format])
    if source_format == QUANT_METHOD:
        shape = _get(source, "weight_shape", where, list)
        if len(shape) != 2 or not _is_shape(shape):
            raise _FieldError(f"'{where}.weight_shape': expected [N, K], got {json.dumps(shape)[:60]}")


def _check_kept(entry, where: str) -> None:
    _object(entry, where)
    _get(entry, "name", where, str)
    _get(entry, "reason", where, str)
    tensors = _get(entry, "tensors", where, dict)
    for key in ("tensors", "shards"):
        _string_map(entry, key, where, tuple(tensors))
    _digest_map(entry, "digests", where, tuple(tensors))


def _check_passthrough(entry, where: str) -> None:
    _object(entry, where)
    for key in ("name", "shard", "dtype"):
        _get(entry, key, where, str)
    if not _is_shape(_get(entry, "shape", where, list)):
        raise _FieldError(f"'{where}.shape': expected a list of non-negative integers")
    _sha256(entry, where)


def _check_defaults(defaults: dict, source_format: str) -> None:
    """``quantization_defaults``: the config's global settings as it states them (null where absent), with the
    types and values the converter accepted them with (:func:`marlin_convert.gptq.load_quant_config`,
    :func:`marlin_convert.compressed_tensors.load_config`)."""
    where = "quantization_defaults"
    if source_format == QUANT_METHOD:
        _get(defaults, "format", where, str, choices=(PACKED, MIXED))
        if not _get(defaults, "config_groups", where, dict):
            raise _FieldError(f"'{where}.config_groups': empty (a compressed-tensors config has at least one group)")
        for name, group in defaults["config_groups"].items():
            _object(group, f"{where}.config_groups.{name}")
        if _get(defaults, "ignore", where, list, null=True) is not None:
            _strings(defaults, "ignore", where)
        return
    _get(defaults, "bits", where, int, choices=GPTQ_BITS)
    group_size = _get(defaults, "group_size", where, int, null=True)
    if group_size is not None and group_size != -1 and group_size < 1:
        raise _FieldError(f"'{where}.group_size': {group_size} is neither -1 (channelwise) nor positive")
    for key in ("desc_act", "sym"):
        _get(defaults, key, where, bool, null=True)
    label = _get(defaults, "checkpoint_format", where, str, null=True)
    if label is not None and label.lower() not in ZERO_FORMAT_OF_LABEL:
        raise _FieldError(f"'{where}.checkpoint_format': {json.dumps(label)[:60]} is not one of "
                          f"{', '.join(map(json.dumps, ZERO_FORMAT_OF_LABEL))} (any case)")
    dynamic = _get(defaults, "dynamic", where, dict, null=True)
    try:
        parse_dynamic(dynamic, f"'{where}.dynamic'")  # (the rules' types, values and regexes, as a config's)
        if "extra_config" in defaults:  # (AutoRound's; recorded only where the source's config states it)
            parse_extra_config(_get(defaults, "extra_config", where, dict, null=True), f"'{where}.extra_config'",
                               defaults["bits"])
    except InputError as exc:
        raise _FieldError(exc.message) from None


def check_manifest(manifest: dict) -> None:
    """Check the JSON type (and, where the contract fixes it, the value) of every field verify reads.

    Raises ``_FieldError`` naming the first bad field; consistency between fields and with the files is
    :mod:`marlin_convert.verify`'s job (it reports each mismatch by name instead of stopping).
    """
    _get(manifest, "tool", "", str)
    _get(manifest, "created", "", str)
    source = _get(manifest, "source", "", dict)
    _get(source, "path", "source", str)
    _get(source, "bytes", "source", int, minimum=0)
    source_format = _get(source, "format", "source", str, choices=tuple(SOURCE_KINDS))
    _strings(source, "quantization_config", "source")
    _get(manifest, "checkpoint_format", "", str, choices=("marlin", "marlin-partial"))
    _get(manifest, "model_dtype", "", str, null=True)
    _check_defaults(_get(manifest, "quantization_defaults", "", dict), source_format)
    _strings(manifest, "notes", "")
    _strings(manifest, "shards", "")
    for key, check in (("layers", _check_layer), ("kept", _check_kept), ("passthrough", _check_passthrough)):
        for i, entry in enumerate(_get(manifest, key, "", list)):
            check(entry, f"{key}[{i}]")
    files = _get(manifest, "files", "", dict)
    for name, record in files.items():
        where = f"files[{json.dumps(name)}]"
        _object(record, where)
        _get(record, "bytes", where, int, minimum=0)
        _sha256(record, where)

