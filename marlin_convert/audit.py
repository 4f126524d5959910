"""Check a converted directory's manifest against its files, before any tensor data is read.

The manifest (types already checked by :func:`marlin_convert.manifest.load_manifest`) must describe the
directory exactly: every tensor of every shard is a converted layer's output, a passthrough tensor or a tensor
of a layer kept in GPTQ form, once, with the dtype and shape the layer's K, N, bits and groups imply; every
layer entry agrees with itself (groups, padded shape, workspace, expert stride, sources); every kept entry lists
its layer's own tensors, all of them; the shard files hold nothing beyond their tensors; the configs and the index
say what the manifest says, and the configs give each layer kept in GPTQ form settings its tensors bear out; the
files on disk are the files the manifest lists. Each mismatch is reported by name; none stops the audit.

Header only, but for the layers kept in GPTQ form: their g_idx and qzeros are read, as the converter read them in
the source (:func:`marlin_convert.gptq.plan_layer`), since a kept entry records no settings of its own.

What is left for the data pass (:mod:`marlin_convert.verify`) comes back as :class:`Audit`: the checked layers,
and per file the byte ranges whose digests to check while the file is hashed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from . import compressed_tensors, layout, strict_json
from .errors import InputError
from .experts import (SetGap, expert_group_summary, group_experts, plain_experts, set_problems, split_expert_key,
                      stacked_count_problems, stated_expert_count)
from .fileio import outside_link, read_inside
from .gptq import (AUTOROUND_PACKING_KEYS, AUTOROUND_SOURCE_KEYS, CONFIG_FILE, GPTQ_BITS, INDEX_FILE, LAYER_KINDS,
                   QUANTIZE_CONFIG_FILE, Checkpoint, QuantConfig, is_lm_head, lm_head_contradiction, parse_dynamic,
                   parse_extra_config, plan_layer)
from .manifest import MANIFEST_FILE, layer_outputs_names
from .rebuild import MarlinLayer
from .safetensors_io import SHARD_METADATA, SafetensorsFile, read_header
from .sources import KEPT_MODULES_KEYS, SOURCE_CONFIG_KEY, SOURCE_FORMAT_KEY
from .spec import QuantSpec


@dataclass(frozen=True)
class DigestRange:
    """Bytes ``[begin, end)`` of a file whose SHA-256 must be ``digest``; ``label`` names them in a report."""

    label: str
    begin: int
    end: int
    digest: str


@dataclass
class FileCheck:
    """One file of the output: its expected size and digest, and the tensor ranges inside it to hash too."""

    name: str
    size: int
    digest: str
    ranges: list[DigestRange] = field(default_factory=list)


@dataclass
class Audit:
    """The result: ``layers[i]`` is the checked view of manifest layer ``i`` (None when its entry is unusable),
    ``layer_problems[i]`` what is wrong with it; ``problems`` the checkpoint-level mismatches; ``kept_problems``
    per kept layer name; ``files`` what to hash."""

    headers: dict[str, SafetensorsFile]
    layers: list[MarlinLayer | None]
    layer_problems: list[list[str]]
    kept_problems: dict[str, list[str]]
    problems: list[str]
    files: list[FileCheck]


def _safe_relative(name: str) -> bool:
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts and "\\" not in name


def _layer_view(entry: dict) -> tuple[MarlinLayer | None, list[str]]:
    """Build the checked view of one layer entry; problems where the entry disagrees with itself."""
    try:
        spec = QuantSpec.create(bits=entry["bits"], group_size=entry["group_size"], sym=entry["sym"],
                                zero_format=entry["zero_format"], act_order=entry["act_order"],
                                in_features=entry["in_features"], out_features=entry["out_features"],
                                scale_dtype=entry["scale_dtype"], num_experts=entry["num_experts"],
                                source_format=entry["source_format"])
        padded = spec.padded_shape
    except ValueError as exc:
        return None, [f"manifest entry is not a valid layer: {exc}"]
    problems = []
    recorded = (entry["padded_in_features"], entry["padded_out_features"])
    if recorded != padded:
        problems.append(f"manifest says padded shape {list(recorded)}, K = {spec.in_features}, N = "
                        f"{spec.out_features}, group {spec.group_size} give {list(padded)}")
    if entry["num_groups"] != spec.num_groups:
        problems.append(f"manifest says {entry['num_groups']} groups, K = {spec.in_features} with group "
                        f"{spec.group_size} has {spec.num_groups}")
    layer = MarlinLayer(entry["name"], spec, padded[0], padded[1],
                        {kind: (entry["shards"].get(kind), name) for kind, name in entry["outputs"].items()})
    expected = set(layer.expected_kinds)
    for key in ("outputs", "shards", "shapes"):
        if set(entry[key]) != expected:
            problems.append(f"manifest '{key}' lists {sorted(entry[key])}, this layer has {sorted(expected)}")
    # the names tie the entry to its tensors: an engine loads layer NAME from NAME.B, NAME.s, ...
    names = layer_outputs_names(entry["name"], spec.act_order, zero_points=not spec.sym)
    for kind in sorted(expected & set(entry["outputs"])):
        if entry["outputs"][kind] != names[kind]:
            problems.append(f"manifest output {kind} is '{entry['outputs'][kind]}', layer '{entry['name']}' writes "
                            f"'{names[kind]}'")
    lead = [spec.num_experts] if spec.num_experts else []
    for kind in sorted(expected & set(entry["shapes"])):
        if entry["shapes"][kind] != lead + list(layer.shape(kind)):
            problems.append(f"manifest shape of {kind} {entry['shapes'][kind]} is not {lead + list(layer.shape(kind))}")
    workspace = entry["workspace"]
    if workspace["ints"] != layout.workspace_ints(padded[1]) or workspace["rule"] != layout.WORKSPACE_RULE:
        problems.append(f"manifest workspace {workspace['ints']} ints ({workspace['rule']!r}) is not "
                        f"{layout.workspace_ints(padded[1])} ({layout.WORKSPACE_RULE!r})")
    if workspace.get("per_expert", False) != bool(spec.num_experts):
        problems.append("manifest workspace.per_expert does not match num_experts")
    if spec.num_experts and entry["expert_stride_int32"] != padded[0] * padded[1] * spec.bits // 32:
        problems.append(f"manifest expert_stride_int32 {entry['expert_stride_int32']} is not K_pad * N_pad * b / 32 "
                        f"= {padded[0] * padded[1] * spec.bits // 32}")
    problems += _source_problems(entry, spec)
    return (None if problems else layer), problems


def _needed_source_kinds(spec: QuantSpec, source: dict) -> set[str]:
    """The source tensors a source layer of this kind has (and the manifest must record, each with its digest):
    GPTQ's qweight, scales, qzeros (+ g_idx); compressed-tensors stores the same roles (``STORED_KIND``) plus
    weight_shape, and zero points only when asymmetric."""
    roles = {"qweight", "scales"} | ({"g_idx"} if source["g_idx"] != "absent" else set())
    if spec.source_format != compressed_tensors.QUANT_METHOD:
        return roles | {"qzeros"}
    return {compressed_tensors.STORED_KIND[role] for role in roles | {"shape"} | (set() if spec.sym else {"qzeros"})}


def _source_problems(entry: dict, spec: QuantSpec) -> list[str]:
    sources, experts = entry["sources"], spec.num_experts
    problems = []
    if experts == 0:
        wanted = [None]
    elif len(sources) == 1:
        wanted = [[0, experts]]
    else:
        wanted = [[e, e + 1] for e in range(experts)]
    if [s["slices"] for s in sources] != wanted:
        problems.append(f"manifest sources cover slices {[s['slices'] for s in sources]}, expected {wanted}")
    # the layer's zero_format is its source's (a stacked layer's: its first expert's, whose settings it took)
    if sources and entry["zero_format"] != sources[0]["zero_format"]:
        problems.append(f"manifest zero_format {entry['zero_format']} is not its source's, "
                        f"{sources[0]['zero_format']}")
    # act_order (perm, g_idx) is true when a source's g_idx is not trivial (a stacked set: any expert's); each source's
    # own label is then held to its rebuilt g_idx (in :mod:`marlin_convert.verify`'s data pass)
    if spec.act_order and sources and not any(source["g_idx"] == "act_order" for source in sources):
        labels = sorted({source["g_idx"] for source in sources})
        problems.append(f"manifest act_order is true (perm, g_idx), but its source's g_idx is {' / '.join(labels)}, "
                        "not act_order")
    base, _, projection = entry["name"].rpartition(".")
    for position, source in enumerate(sources):
        where = f"source '{source['name']}'"
        # one source: the layer itself; one per expert (--stack-experts): '<base>.<e>.<projection>'
        if len(sources) == 1 and source["name"] != entry["name"]:
            problems.append(f"{where}: expected the source of layer '{entry['name']}' to be '{entry['name']}'")
        elif len(sources) > 1 and split_expert_key(source["name"]) != (base, position, projection):
            problems.append(f"{where}: expected expert {position} of layer '{entry['name']}', "
                            f"'{base}.{position}.{projection}'")
        for kind, tensor in source["tensors"].items():
            if tensor != f"{source['name']}.{kind}":
                problems.append(f"{where}: its {kind} is named '{tensor}', not '{source['name']}.{kind}'")
        kinds = set(source["tensors"])
        needed = _needed_source_kinds(spec, source)
        if kinds != needed or set(source["digests"]) != kinds:
            problems.append(f"{where}: tensors {sorted(kinds)} / digests {sorted(source['digests'])}, expected "
                            f"{sorted(needed)}")
        if source["g_idx"] == "act_order" and not spec.act_order:
            problems.append(f"{where}: act-order source in a layer without perm")
        if spec.sym:
            stored = (1 << (spec.bits - 1)) - (1 if source["zero_format"] == "v1" else 0)
            if source["zero_stored"] != stored:
                problems.append(f"{where}: zero_stored {source['zero_stored']} is not the symmetric {spec.bits}-bit "
                                f"{source['zero_format']} value {stored}")
        elif source["zero_stored"] is not None:
            problems.append(f"{where}: zero_stored {source['zero_stored']} on an asymmetric layer (expected null)")
        if spec.source_format == compressed_tensors.QUANT_METHOD:
            if source["zero_format"] != "v2":
                problems.append(f"{where}: zero_format {source['zero_format']} (compressed-tensors stores the zero "
                                "point itself: v2)")
            if source["weight_shape"] != [spec.out_features, spec.in_features]:
                problems.append(f"{where}: weight_shape {source['weight_shape']} is not [N, K] = "
                                f"{[spec.out_features, spec.in_features]}")
    return problems


def audit(out_dir: Path, manifest: dict) -> Audit:
    """Check ``manifest`` against the files of ``out_dir`` (see the module docstring)."""
    out_dir = Path(out_dir)
    problems: list[str] = []
    shard_names = manifest["shards"]
    if len(set(shard_names)) != len(shard_names):
        problems.append(f"manifest lists shard(s) {sorted({n for n in shard_names if shard_names.count(n) > 1})} "
                        "more than once")
    named: dict[str, str] = {}  # every shard name the manifest gives -> the first field giving it
    for i, name in enumerate(shard_names):
        named.setdefault(name, f"shards[{i}]")
    for i, entry in enumerate(manifest["passthrough"]):
        named.setdefault(entry["shard"], f"passthrough[{i}].shard")
    for key in ("layers", "kept"):
        for i, entry in enumerate(manifest[key]):
            for kind, name in entry["shards"].items():
                if isinstance(name, str):
                    named.setdefault(name, f"{key}[{i}].shards.{kind}")
    for name, where in named.items():
        if not _safe_relative(name) or "/" in name:
            raise InputError(f"{out_dir / MANIFEST_FILE}: {where}: shard name {name!r} is not a file name in the "
                             "directory")
    for name in manifest["files"]:
        if not _safe_relative(name):
            raise InputError(f"{out_dir / MANIFEST_FILE}: files[{name!r}]: file name {name!r} is not inside the "
                             "directory")

    headers: dict[str, SafetensorsFile] = {}
    for name in dict.fromkeys(shard_names):
        path = out_dir / name
        if outside_link(path, out_dir) is not None:  # (into the Hugging Face cache's blobs only)
            problems.append(f"shard {name}: a link out of {out_dir}, not read")
            continue
        try:  # checks the header and that the tensors tile the data exactly, nothing after them
            headers[name] = read_header(path)
        except InputError as exc:
            problems.append(f"shard {name}: {exc.message}")
            continue
        if headers[name].metadata != SHARD_METADATA:  # (loaders read its format)
            said = json.dumps(headers[name].metadata) if headers[name].metadata else "absent"
            problems.append(f"shard {name}: __metadata__ is {said[:200]}, the converter writes "
                            f"{json.dumps(SHARD_METADATA)}")

    # every tensor of every shard, claimed once: (shard, tensor) -> (who, dtype, shape) (None: not recorded)
    claims: dict[tuple[str, str], tuple[str, str | None, tuple | None]] = {}
    claim_problems: dict[str, list[str]] = {}

    def claim(owner: str, shard: str | None, tensor: str, dtype: str | None, shape) -> None:
        key = (shard, tensor)
        if key in claims:
            claim_problems.setdefault(owner, []).append(f"tensor '{tensor}' is also claimed by {claims[key][0]}")
        claims[key] = (owner, dtype, shape)

    layers, layer_problems = [], []
    for entry in manifest["layers"]:
        layer, found = _layer_view(entry)
        for kind, tensor in entry["outputs"].items():
            shape = tuple(entry["shapes"].get(kind, ()))
            claim(f"layer '{entry['name']}'", entry["shards"].get(kind), tensor, "I32" if kind != "s" else None, shape)
        layers.append(layer)
        layer_problems.append(found)
    for entry in manifest["passthrough"]:
        claim(f"passthrough '{entry['name']}'", entry["shard"], entry["name"], entry["dtype"], tuple(entry["shape"]))
    for entry in manifest["kept"]:
        for kind, tensor in entry["tensors"].items():
            claim(f"kept layer '{entry['name']}'", entry["shards"].get(kind), tensor, None, None)

    owner_problems: dict[str, list[str]] = dict(claim_problems)
    for (shard, tensor), (owner, dtype, shape) in claims.items():
        header = headers.get(shard)
        if shard not in headers:
            why = "which the manifest's shard list does not name" if shard not in shard_names else "which is unreadable"
            owner_problems.setdefault(owner, []).append(f"tensor '{tensor}' is in shard {shard!r}, {why}")
            continue
        info = header.tensors.get(tensor)
        if info is None:
            owner_problems.setdefault(owner, []).append(f"tensor '{tensor}' is missing from shard {shard}")
        elif (dtype is not None and info.dtype != dtype) or (shape is not None and info.shape != shape):
            owner_problems.setdefault(owner, []).append(
                f"tensor '{tensor}' in {shard} is {info.dtype}{list(info.shape)}, the manifest says "
                f"{dtype or info.dtype}{list(shape) if shape is not None else list(info.shape)}")
    for shard, header in headers.items():
        for tensor in header.tensors:
            if (shard, tensor) not in claims:
                problems.append(f"shard {shard}: tensor '{tensor}' is not accounted for by the manifest")
    for i, (entry, layer) in enumerate(zip(manifest["layers"], layers)):
        found = owner_problems.pop(f"layer '{entry['name']}'", [])
        if layer is not None and layer.spec.scale_dtype:
            shard, tensor = entry["shards"].get("s"), entry["outputs"].get("s")
            info = headers.get(shard).tensors.get(tensor) if shard in headers else None
            if info is not None and info.dtype != layer.dtype("s"):
                found.append(f"tensor '{tensor}' is {info.dtype}, scale_dtype says {entry['scale_dtype']}")
        if found:
            layer_problems[i] += found
            layers[i] = None
    kept_problems = {entry["name"]: owner_problems.pop(f"kept layer '{entry['name']}'", [])
                     for entry in manifest["kept"]}
    problems += [f"{owner}: {p}" for owner, found in owner_problems.items() for p in found]
    if len(headers) == len(set(shard_names)):  # (an unreadable shard is named above: its tensors are unknown here)
        stored = {tensor for header in headers.values() for tensor in header.tensors}
        for entry in manifest["kept"]:
            kept_problems[entry["name"]] += _kept_entry_problems(entry, stored, manifest["source"]["format"])

    problems += _format_problems(manifest)
    problems += _expert_set_problems(out_dir, manifest)
    problems += _config_problems(out_dir, manifest, headers, kept_problems)
    problems += _index_problems(out_dir, headers, len(shard_names))
    files, file_problems = _file_checks(out_dir, manifest, headers, kept_problems)
    problems += file_problems
    return Audit(headers, layers, layer_problems, kept_problems, problems, files)


def _kept_entry_problems(entry: dict, stored: set[str], source_format: str) -> list[str]:
    """A kept entry against the tensors of its layer ``NAME`` that the output stores (``stored``: every tensor name of
    the shards): it lists each of them, ``NAME.<kind>`` (GPTQ: qweight, scales, qzeros and g_idx where stored;
    compressed-tensors: every ``weight*`` tensor), and nothing else, as the converter copies them. One moved to
    ``passthrough``, or named after another layer, would leave an engine reading the entry with another layer."""
    name = entry["name"]
    kinds = compressed_tensors.LAYER_KINDS if source_format == compressed_tensors.QUANT_METHOD else LAYER_KINDS
    listed, held = set(entry["tensors"]), {kind for kind in kinds if f"{name}.{kind}" in stored}
    problems = []
    if listed != held:
        problems.append(f"the entry lists {sorted(listed)}, the layer stores {sorted(held)} in OUT_DIR")
    for kind, tensor in entry["tensors"].items():
        if tensor != f"{name}.{kind}":
            problems.append(f"its {kind} is '{tensor}', not '{name}.{kind}'")
    return problems


def _format_problems(manifest: dict) -> list[str]:
    problems = []
    partial = bool(manifest["kept"])
    label = manifest["checkpoint_format"]
    if (label == "marlin-partial") != partial:
        problems.append(f"manifest checkpoint_format is {label!r} with {len(manifest['kept'])} layer(s) kept in "
                        "their source form")
    source_format = manifest["source"]["format"]
    for entry in manifest["layers"]:
        if entry["source_format"] != source_format:
            problems.append(f"layer '{entry['name']}': source_format {entry['source_format']!r}, the manifest's "
                            f"source is {source_format!r}")
    stated, expected = manifest.get("expert_groups"), expert_group_summary(manifest["layers"], manifest["kept"],
                                                                     manifest["passthrough"])

    def as_json(value) -> str:  # compared as JSON: 4.0 is not 4
        return json.dumps(value, sort_keys=True)

    if as_json(stated) != as_json(expected):  # what an engine reads to find (and order) the experts of a layer
        if not isinstance(stated, list):
            found = f"is {json.dumps(stated)[:40]}"
        else:
            first = next((i for i, (a, b) in enumerate(zip(stated, expected)) if as_json(a) != as_json(b)), None)
            found = (f"has {len(stated)} group(s), the layers make {len(expected)}" if first is None else
                     f"[{first}] is {json.dumps(stated[first])[:80]}, the layers make "
                     f"{json.dumps(expected[first])[:80]}")
        problems.append(f"manifest expert_groups {found}")
    return problems


def read_config(path: Path) -> tuple[dict | None, str | None]:
    if outside_link(path, path.parent) is not None:  # (into the Hugging Face cache's blobs only)
        return None, f"{path.name}: a link out of {path.parent}, not read"
    if not path.is_file():  # a FIFO would block
        return None, f"{path.name}: not a regular file"
    try:
        data = strict_json.loads(read_inside(path))
    except OSError as exc:
        return None, f"{path.name}: unreadable: {exc.strerror or exc}"
    except ValueError as exc:
        return None, f"{path.name}: unreadable: {exc}"
    return (data, None) if isinstance(data, dict) else (None, f"{path.name}: not a JSON object")


def _config_problems(out_dir: Path, manifest: dict, headers: dict[str, SafetensorsFile],
                     kept_problems: dict[str, list[str]]) -> list[str]:
    """config.json's quantization_config (when the file exists) and quantize_config.json (always written) must say
    what the manifest says: format, Marlin or not, the source format, the modules kept in their source form, each
    layer's settings (those kept in GPTQ form held to their tensors in the shards of ``headers``: a contradiction is
    that kept layer's problem, in ``kept_problems``)."""
    planned: dict[tuple, str | None] = {}  # (_kept_settings_problems: each kept layer read once per settings)
    beside = _plain_experts_beside_converted(manifest)  # (the same for every config)
    label = manifest["checkpoint_format"]
    source_format = manifest["source"]["format"]
    kept_key = KEPT_MODULES_KEYS[source_format]
    kept = sorted(entry["name"] for entry in manifest["kept"])
    problems, sections = [], []
    for name, required in ((CONFIG_FILE, False), (QUANTIZE_CONFIG_FILE, True)):
        path = out_dir / name
        if not path.exists():
            if required:
                problems.append(f"{name} is missing")
            continue
        data, problem = read_config(path)
        if problem:
            problems.append(problem)
            continue
        if name == CONFIG_FILE:
            dtype = data.get("torch_dtype", data.get("dtype"))
            if dtype != manifest["model_dtype"]:
                problems.append(f"{name}: torch_dtype {dtype!r}, the manifest's model_dtype is "
                                f"{manifest['model_dtype']!r}")
            data = data.get("quantization_config")
            if not isinstance(data, dict):
                problems.append(f"{name}: no quantization_config object")
                continue
        sections.append((name, data))
    for name, section in sections:
        said = {key: section.get(key) for key in ("quant_method", "checkpoint_format", "is_marlin_format")}
        wanted = {"quant_method": "gptq", "checkpoint_format": label, "is_marlin_format": label == "marlin"}
        for key in wanted:
            if said[key] != wanted[key]:
                problems.append(f"{name}: {key} is {json.dumps(said[key])}, expected {json.dumps(wanted[key])} "
                                f"(manifest: {label})")
        if "format" in section and section["format"] != label:
            problems.append(f"{name}: format is {json.dumps(section['format'])}, expected {json.dumps(label)}")
        for key in AUTOROUND_PACKING_KEYS:  # (an AutoRound source's packing key says the Marlin label as well)
            if key in manifest["quantization_defaults"] and section.get(key) != label:
                problems.append(f"{name}: {key} is {json.dumps(section.get(key))}, expected {json.dumps(label)}")
        if section.get(SOURCE_FORMAT_KEY, "gptq") != source_format:
            problems.append(f"{name}: {SOURCE_FORMAT_KEY} is {json.dumps(section.get(SOURCE_FORMAT_KEY))}, the "
                            f"manifest's source is {json.dumps(source_format)}")
        listed = section.get(kept_key)
        if (sorted(listed) if isinstance(listed, list) and all(isinstance(m, str) for m in listed) else listed) != \
                (kept or None):
            problems.append(f"{name}: {kept_key} is {json.dumps(listed)[:80]}, the manifest keeps "
                            f"{len(kept)} layer(s) in their source form")
        try:  # (resolving a module can fail too: dynamic and extra_config that disagree, an ambiguous entry)
            config = _section_config(name, section)
            problems += _settings_problems(name, config, manifest, beside)
            problems += _plain_expert_problems(name, config, beside)
            _kept_settings_problems(name, config, manifest, out_dir, headers, kept_problems, planned)
        except InputError as exc:
            problems.append(f"{name}: {exc.message}")
        problems += _lm_head_problems(name, section, manifest)
        problems += _defaults_problems(name, section, manifest)
    return problems


def _defaults_problems(name: str, section: dict, manifest: dict) -> list[str]:
    """The manifest's ``quantization_defaults`` (the source config's global settings as read) against the output
    config, which keeps them as read: a GPTQ source's ``bits``, ``group_size``, ``desc_act``, ``sym`` and ``dynamic``
    (the same rules, in any order, none as null or {}: what the order decides, :func:`_settings_problems` holds;
    ``checkpoint_format`` is rewritten there, so not compared), a compressed-tensors source's every default under
    ``source_quantization_config``. A key the output config does not state is not compared, except from an AutoRound
    source (``quant_method`` among the defaults), whose outputs state every key its config stated."""
    defaults = manifest["quantization_defaults"]
    if manifest["source"]["format"] == compressed_tensors.QUANT_METHOD:
        written = section.get(SOURCE_CONFIG_KEY)
        written, where = (written if isinstance(written, dict) else {}), f"{SOURCE_CONFIG_KEY}."
        keys = list(defaults)
    else:
        written, where = section, ""
        keys = [key for key in defaults if key != "checkpoint_format"]
    autoround = "quant_method" in defaults  # (recorded from AutoRound's native format alone)
    problems = []
    for key in keys:
        if autoround and key in AUTOROUND_SOURCE_KEYS:  # (AutoRound's own: kept as source_<key>)
            said, stated = defaults[key], written.get(AUTOROUND_SOURCE_KEYS[key])
            if json.dumps(said) != json.dumps(stated):
                problems.append(f"{name}: {AUTOROUND_SOURCE_KEYS[key]} is {json.dumps(stated)[:80]}, the manifest's "
                                f"quantization_defaults.{key} is {json.dumps(said)[:80]}")
            continue
        if key not in written:  # not stated there (an output of a release before 768ff4f kept config.json's own keys)
            if autoround and defaults[key] is not None:  # (AutoRound's own: none is that old)
                problems.append(f"{name}: {where}{key} is missing, the manifest's quantization_defaults.{key} is "
                                f"{json.dumps(defaults[key])[:80]}")
            continue
        said, stated = defaults[key], written.get(key)
        if key in ("dynamic", "extra_config") and manifest["source"]["format"] != compressed_tensors.QUANT_METHOD:
            said, stated = (json.dumps(value or {}, sort_keys=True) for value in (said, stated))
        if json.dumps(said) != json.dumps(stated):  # (as JSON: 4.0 is not 4)
            problems.append(f"{name}: {where}{key} is {json.dumps(written.get(key))[:80]}, the manifest's "
                            f"quantization_defaults.{key} is {json.dumps(defaults[key])[:80]}")
    return problems


def _lm_head_problems(name: str, section: dict, manifest: dict) -> list[str]:
    """The ``lm_head`` flag (a loader reads it to build the output head quantized or not) against the manifest: false
    with a converted ``lm_head`` (or, from a GPTQ source, one kept in GPTQ form), or true with ``lm_head.weight``
    passed through unquantized and none converted."""
    converted = _converted_modules(manifest)
    flag = section.get("lm_head")
    if manifest["source"]["format"] == compressed_tensors.QUANT_METHOD:  # written by the converter: always stated
        expected = any(is_lm_head(module) for module in converted)
        if flag is not expected:
            shown = json.dumps(flag) if "lm_head" in section else "absent"
            return [f"{name}: lm_head is {shown}, the converter writes {json.dumps(expected)} for these layers"]
        return []
    if "lm_head" in section and not isinstance(flag, bool):
        return [f"{name}: lm_head is {json.dumps(flag)[:80]}, not a JSON boolean"]
    if not isinstance(flag, bool):
        return []
    kept = ([entry["name"] for entry in manifest["kept"]]  # (a layer kept in GPTQ form is stored quantized too)
            if manifest["source"]["format"] != compressed_tensors.QUANT_METHOD else [])
    module = lm_head_contradiction(flag, converted + kept, _plain_linears(manifest))
    if module is None:
        return []
    found = (f"layer '{module}' is {'kept in GPTQ form' if module in kept else 'converted'}" if not flag
             else f"'{module}.weight' is passed through unquantized and no layer '{module}' is converted")
    return [f"{name}: lm_head is {json.dumps(flag)}, but {found}"]


def _section_config(name: str, section: dict) -> QuantConfig:
    """The settings a loader takes from output config ``name`` (its quantization config ``section``): the defaults,
    then the first matching ``dynamic`` rule, GPTQModel's rule, or AutoRound's ``extra_config`` entry (the two must
    agree where both are stated). Values are taken as written (their types are held to the manifest's
    ``quantization_defaults``: :func:`_defaults_problems`). Raises :class:`InputError` for a malformed ``dynamic``
    or ``extra_config``."""
    return QuantConfig(bits=section.get("bits"), group_size=section.get("group_size", -1),
                       desc_act=section.get("desc_act", False), sym=section.get("sym"), checkpoint_format="gptq",
                       dynamic=parse_dynamic(section.get("dynamic"), name), sources=[name], as_read=section,
                       extra_config=parse_extra_config(section.get("extra_config"), name, section.get("bits")))


def _settings_problems(name: str, config: QuantConfig, manifest: dict,
                       beside: dict[str, tuple[str, int, str]]) -> list[str]:
    """Each converted layer's settings as a loader takes them from output config ``name`` (``config``) against the
    layer's entry: bits, group size (exactly) and, where the config states it, sym. A config edited to other settings
    would have an engine size ``B`` and ``s`` wrongly. (desc_act is not compared: a source whose g_idx is not trivial
    is converted with act-order whatever desc_act says.)"""
    section = config.as_read
    problems = []
    for entry in manifest["layers"]:
        for source in entry["sources"]:  # per module, as a loader resolves them (an expert of a stacked entry too)
            module, settings = source["name"], config.settings_for(source["name"])
            # the group size exactly (the field is the one the config gives the layer: 129 on K = 128 is not 128)
            said = {"bits": settings.bits, "group_size": settings.group_size}
            made = {"bits": entry["bits"], "group_size": entry["group_size"]}
            if settings.sym is not None:
                said["sym"], made["sym"] = settings.sym, entry["sym"]
            if not settings.quantized:
                problems.append(f"{name}: says module '{module}' is not quantized ({settings.origin}); it is a "
                                "converted layer")
            elif said != made:
                key = next(k for k in said if said[k] != made[k])
                problems.append(f"{name}: gives module '{module}' {key} {json.dumps(said[key])} ({settings.origin}); "
                                f"it was converted with {json.dumps(made[key])}")
            if len(problems) >= 5:  # a config that says other settings for hundreds of experts: the first few
                return problems + [f"{name}: (and maybe more modules: the first 5 are named)"]
    return problems + _excluded_problems(name, section, config, manifest, beside)


def _kept_settings_problems(name: str, config: QuantConfig, manifest: dict, out_dir: Path,
                            headers: dict[str, SafetensorsFile], kept_problems: dict[str, list[str]],
                            planned: dict[tuple, str | None]) -> None:
    """Each layer kept in GPTQ form against the settings output config ``name`` (``config``) gives its module: its
    tensors in the shards of ``headers`` must be the layer those settings describe, as the converter checked them in
    the source (:func:`marlin_convert.gptq.plan_layer`): qweight's rows hold K (g_idx's length) at that many bits,
    scales and qzeros have one row per group, qzeros ``ceil(N * bits / 32)`` words, g_idx each group's rows, the
    dtypes GPTQ's, and no ``-:`` rule says the module is not quantized. A config that gives a 2-bit layer bits 3
    would have a loader unpack it wrongly. (sym and desc_act are not compared: a layer whose zero points contradict
    ``sym: true`` is kept for that, and the stored g_idx decides act-order whatever desc_act says.) A layer with a
    tensor in an unreadable shard is left out (the shard is named already). Nothing is checked for a checkpoint
    converted from compressed-tensors: its GPTQ-style config describes the converted layers only, and names the kept
    ones apart. A contradiction is the kept layer's problem (``kept_problems``), naming this file; ``planned`` keeps
    each layer's outcome per resolved settings and their origin, so that configs which resolve it alike (by their
    defaults, no rule) read its tensors once."""
    if manifest["source"]["format"] == compressed_tensors.QUANT_METHOD:
        return
    location = {tensor: header for header in headers.values() for tensor in header.tensors}
    output = Checkpoint(path=out_dir, config=config, config_json=None, quantize_json=None,
                        shards=list(headers.values()), index_json=None, location=location)
    for entry in manifest["kept"]:
        module = entry["name"]
        settings = config.settings_for(module)
        bits, group_size = settings.bits, settings.group_size
        if not all(shard in headers for shard in entry["shards"].values()):
            continue
        if not (type(bits) is int and bits in GPTQ_BITS and type(group_size) is int
                and (group_size == -1 or group_size > 0)):
            continue  # (no GPTQ value: the config's defaults are held to quantization_defaults, whose values are
            # checked, and every converted layer's bits and group size to its entry, above)
        # (the origin too: a message names the rule and its file; configs without rules share the defaults' outcome)
        key = (module, bits, group_size, settings.sym, settings.desc_act, settings.quantized, settings.origin)
        if key not in planned:
            try:
                plan_layer(output, module)
                planned[key] = None
            except InputError as exc:
                planned[key] = exc.message
        if planned[key] is not None:
            kept_problems[module].append(f"{name}: layer '{module}', kept in GPTQ form, is not the layer this file's "
                                         f"settings describe ({settings.origin}: {bits}-bit, group size "
                                         f"{group_size}): {planned[key]}")


def _converted_modules(manifest: dict) -> list[str]:
    """The source modules of the converted layers (each expert of a stacked entry by its own name)."""
    return [source["name"] for entry in manifest["layers"] for source in entry["sources"]]


def _plain_linears(manifest: dict) -> list[str]:
    """The modules whose 2-D ``.weight`` is passed through unquantized."""
    return [entry["name"].removesuffix(".weight") for entry in manifest["passthrough"]
            if entry["name"].endswith(".weight") and len(entry["shape"]) == 2]


def _manifest_tensor_names(manifest: dict) -> list[str]:
    """The source checkpoint's tensor names as the manifest records them: passthrough, converted layers' sources,
    kept layers."""
    names = [entry["name"] for entry in manifest["passthrough"]]
    names += [name for entry in manifest["layers"] for source in entry["sources"] for name in source["tensors"].values()]
    names += [name for entry in manifest["kept"] for name in entry["tensors"].values()]
    return names


def _excluded_problems(name: str, section: dict, config: QuantConfig, manifest: dict,
                       beside: dict[str, tuple[str, int, str]]) -> list[str]:
    """The modules passed through unquantized that the source's config excludes must be excluded by ``config`` (an
    output config's rules) too, or a loader would look for their Marlin tensors (an expert beside converted siblings,
    whatever the source's config says: :func:`_plain_expert_problems`): a GPTQ source's modules that its
    ``dynamic`` rules (``quantization_defaults``, in their order) exclude with a ``-:`` rule (the same rules in another
    order can resolve such a module to a ``+:`` rule first) or its ``extra_config`` with an entry of bits 16; a
    compressed-tensors source's plain linears that its config leaves unquantized
    (:func:`marlin_convert.compressed_tensors.not_quantized`), for which the converter writes ``-:`` rules (where
    ``section`` states ``dynamic``)."""
    where = "the manifest's quantization_defaults"
    # (``beside``: the experts held to more than this, by _plain_expert_problems)
    plain = [module for module in _plain_linears(manifest) if module not in beside]
    try:
        if manifest["source"]["format"] == compressed_tensors.QUANT_METHOD:
            # the converter's rule (convert._gptq_settings): a "-:" rule for each plain linear the source's config
            # leaves unquantized; where the output states no rules at all, an output of a release before 2026-11-26,
            # which wrote none (README: what verify proves), not compared
            if "dynamic" not in section:
                return []
            source_config = compressed_tensors.config_from_defaults(manifest["quantization_defaults"], where)
            modules = compressed_tensors.module_names(_manifest_tensor_names(manifest))
            blocks = {compressed_tensors.block_of(module) for module in _converted_modules(manifest)}
            excluded = {module: f"{where}: the source's config leaves it unquantized" for module in plain
                        if not is_lm_head(module)
                        and compressed_tensors.not_quantized(source_config, module, modules, blocks)}
        else:
            defaults = manifest["quantization_defaults"]
            source = QuantConfig(bits=4, group_size=-1, desc_act=False, sym=None, checkpoint_format="gptq",
                                 dynamic=parse_dynamic(defaults.get("dynamic"), where), sources=[where], as_read={},
                                 extra_config=parse_extra_config(defaults.get("extra_config"), where, 4))
            excluded = {module: settings.origin for module in plain
                        if not (settings := source.settings_for(module)).quantized}
    except InputError:
        return []  # (malformed there: the output config's own settings were compared with them above)
    return _first_five(name, (f"{name}: says module '{module}' is quantized ({resolved.origin}); it is passed through "
                              f"unquantized, as the source's rules say ({why})"
                              for module, why in excluded.items()
                              if (resolved := config.settings_for(module)).quantized))


def _first_five(name: str, problems: Iterator[str]) -> list[str]:
    """The first five of config ``name``'s ``problems`` (a generator, consumed no further), and at five a line saying
    there may be more."""
    first = list(islice(problems, 5))
    if len(first) == 5:
        first.append(f"{name}: (and maybe more modules: the first 5 are named)")
    return first


def _plain_experts_beside_converted(manifest: dict) -> dict[str, tuple[str, int, str]]:
    """The experts passed through as a plain 2-D ``.weight`` whose projection has converted experts in the same set
    (each expert of a stacked entry counts by its own name): module -> (base, expert, projection)."""
    groups, _ = group_experts(_converted_modules(manifest))
    return {module: (group.base, expert, projection)
            for module, (group, expert, projection) in plain_experts(groups, _plain_linears(manifest)).items()}


def _plain_expert_problems(name: str, config: QuantConfig, beside: dict[str, tuple[str, int, str]]) -> list[str]:
    """Each expert passed through unquantized beside converted siblings must resolve as not quantized under output
    config ``name`` (``config``): a loader would otherwise look for its Marlin tensors. ``convert`` refuses a source
    whose config quantizes such an expert (:func:`marlin_convert.convert._find_unquantized_experts`); here no
    ``quantization_defaults`` and no absent ``dynamic`` excuses it (a release before 2026-11-29 wrote such an output
    without the ``-:`` rule where the plain expert was the set's last and config.json stated no count; it fails
    here, as a loader would fail on it). ``beside``: those experts (:func:`_plain_experts_beside_converted`)."""
    return _first_five(name, (f"{name}: says expert module '{module}' is quantized "
                              f"({settings.origin if settings.rule is not None else settings.origin + ': no rule'}); "
                              f"'{module}.weight' is passed through unquantized beside converted '{projection}' "
                              "experts, and a loader would look for its Marlin tensors (a '-:' rule must exclude it)"
                              for module, (_, _, projection) in beside.items()
                              if (settings := config.settings_for(module)).quantized))


def _expert_set_problems(out_dir: Path, manifest: dict) -> list[str]:
    """The output's expert sets held to the rule ``convert`` holds a source's to
    (:func:`marlin_convert.experts.set_problems`): every projection of a set has experts 0..E-1, each converted
    (an entry of its own), kept in its source form, or passed through as a plain 2-D ``.weight``, and E (the experts
    stored, and each stacked entry's ``num_experts``) is the number the output's config.json states, where it states
    one. An expert deleted from the output, with its entry, would otherwise leave a loader with a gap."""
    per_expert = [entry["name"] for entry in manifest["layers"] if not entry["num_experts"]]
    groups, _ = group_experts(per_expert + [entry["name"] for entry in manifest["kept"]])
    for module, (group, expert, projection) in plain_experts(groups, _plain_linears(manifest)).items():
        group.unquantized.setdefault(projection, {})[expert] = f"'{module}.weight' passed through"
    stated, problems = None, []
    if (out_dir / CONFIG_FILE).exists():
        data, problem = read_config(out_dir / CONFIG_FILE)  # (a problem is named by _config_problems)
        try:
            stated = stated_expert_count(data, CONFIG_FILE) if problem is None else None
        except InputError as exc:
            problems.append(exc.message)
    stacked = {entry["name"]: entry["num_experts"] for entry in manifest["layers"] if entry["num_experts"]}
    problems += stacked_count_problems(stacked, stated, CONFIG_FILE)
    for group in groups:
        problems += [problem.describe("neither converted, kept in its source form nor passed through as a plain "
                                      ".weight") if isinstance(problem, SetGap) else problem
                     for problem in set_problems(group, stated, CONFIG_FILE)]
    return problems


def _index_problems(out_dir: Path, headers: dict[str, SafetensorsFile], shard_count: int) -> list[str]:
    path = out_dir / INDEX_FILE
    if not path.exists():
        return [f"{INDEX_FILE} is missing ({shard_count} shards)"] if shard_count > 1 else []
    data, problem = read_config(path)
    if problem:
        return [problem]
    weight_map, metadata = data.get("weight_map"), data.get("metadata")
    if not isinstance(weight_map, dict):
        return [f"{INDEX_FILE}: no weight_map object"]
    actual = {tensor: shard for shard, header in headers.items() for tensor in header.tensors}
    problems = []
    for tensor in sorted(set(actual) | set(weight_map)):
        if weight_map.get(tensor) != actual.get(tensor):
            mapped, stored = weight_map.get(tensor), actual.get(tensor)
            problems.append(f"{INDEX_FILE}: '{tensor}' " + (
                f"maps to {json.dumps(mapped)}, but no shard holds it" if stored is None else
                f"is in {json.dumps(stored)}, but the index does not list it" if tensor not in weight_map else
                f"maps to {json.dumps(mapped)}, it is in {json.dumps(stored)}"))
            if len(problems) >= 5:
                problems.append(f"{INDEX_FILE}: (more mismatches not listed)")
                break
    total = sum(header.data_bytes for header in headers.values())
    if not isinstance(metadata, dict) or metadata.get("total_size") != total:
        size = metadata.get("total_size") if isinstance(metadata, dict) else None
        problems.append(f"{INDEX_FILE}: metadata.total_size is {json.dumps(size)}, the shards hold {total} bytes")
    return problems


def _file_checks(out_dir: Path, manifest: dict, headers: dict[str, SafetensorsFile],
                 kept_problems: dict[str, list[str]]) -> tuple[list[FileCheck], list[str]]:
    """The files to hash: those the manifest lists and that exist with the recorded size. Files present but not
    listed, listed but missing, or of another size are problems. Passthrough and kept tensors become ranges."""
    problems = []
    # every entry but directories (FIFOs, sockets and links to directories too); links are not followed
    present = {p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_symlink() or not p.is_dir()}
    present.discard(MANIFEST_FILE)
    listed = manifest["files"]
    for name in sorted(present - set(listed)):
        problems.append(f"file {name} is not listed in the manifest")
    checks: dict[str, FileCheck] = {}
    for name, record in listed.items():
        path = out_dir / name
        if name == MANIFEST_FILE:
            problems.append(f"file {name} is listed in the manifest itself (it cannot hold its own digest)")
        elif name not in present:
            problems.append(f"file {name} listed in the manifest is " + (
                "a directory" if path.is_dir() and not path.is_symlink() else "missing"))
        elif outside_link(path, out_dir) is not None:  # (links are fine into the Hugging Face cache's blobs only)
            problems.append(f"file {name} is a link out of {out_dir}, not read")
        elif not path.is_file():  # a link to a regular file is fine: the Hugging Face cache stores files so
            problems.append(f"file {name} is not a regular file")
        elif path.stat().st_size != record["bytes"]:
            problems.append(f"file {name} has {path.stat().st_size} bytes, the manifest says {record['bytes']}")
        else:
            checks[name] = FileCheck(name, record["bytes"], record["sha256"])
    for shard in headers:
        if shard not in listed:
            problems.append(f"shard {shard} has no digest in the manifest's files")

    def add_range(shard: str, tensor: str, label: str, digest: str) -> None:
        info = headers[shard].tensors.get(tensor) if shard in headers else None
        if info is not None and shard in checks:
            checks[shard].ranges.append(DigestRange(label, info.begin, info.end, digest))

    for entry in manifest["passthrough"]:
        add_range(entry["shard"], entry["name"], f"passthrough '{entry['name']}'", entry["sha256"])
    for entry in manifest["kept"]:
        for kind, tensor in entry["tensors"].items():
            shard = entry["shards"].get(kind)
            if shard not in checks:
                kept_problems[entry["name"]].append(f"{kind} '{tensor}': its shard cannot be hashed")
            add_range(shard, tensor, f"kept '{entry['name']}' {kind}", entry["digests"][kind])
    for check in checks.values():
        check.ranges.sort(key=lambda r: r.begin)
    return list(checks.values()), problems

