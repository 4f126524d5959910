"""The output as a whole against ``verify --source``: what converting the source makes, nothing more or less.

:mod:`marlin_convert.verify` rebuilds each converted layer and compares it with the source's tensors; this module
plans the conversion of the source again with the converter's own functions (:func:`marlin_convert.convert.build_plan`
with ``--skip-incompatible``, and ``--stack-experts`` where the manifest stacked per-expert layers; nothing is written)
and holds the output to it:

- every tensor of the source is accounted for in the role the plan gives it: a source tensor of a converted layer
  (a manifest layer's ``sources``), a tensor of a layer kept in its source form (``kept``), or a passthrough tensor;
- every copied tensor (passthrough, kept) has the source's dtype, shape and bytes;
- every file the conversion copies from the source is in the output and equal to it, and the output holds no other
  file than those and what the converter writes (shards, index, configs);
- the configs are equal to what the converter writes from the source's configs
  (:func:`marlin_convert.convert.output_configs`), key for key (``4.0`` is not ``4``);
- every converted layer's entry says what converting the source records for it (settings, shapes, names and each
  source's record, its g_idx kind among them), field for field: :func:`layer_problems`, by layer;
- what the manifest records of the source's configs (``quantization_defaults``, ``source.quantization_config``) is
  what converting the source records.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .audit import read_config
from .convert import ConversionPlan, build_plan, layer_entry, output_configs, produced_names
from .fileio import hash_file, hash_range
from .gptq import CONFIG_FILE, INDEX_FILE, QUANTIZE_CONFIG_FILE, Checkpoint
from .outfiles import select_extra_files
from .safetensors_io import open_as_read

#: problems of one kind named at the most (a source of another model would list every tensor)
MAX_NAMED = 10


def plan_source(source: Checkpoint, manifest: dict) -> ConversionPlan:
    """The conversion of ``source`` as the output was made: layers with no Marlin form kept, per-expert layers
    stacked where the manifest has a layer entry of several sources. Raises :class:`InputError` for a source that
    cannot be converted at all."""
    stacked = any(len(entry["sources"]) > 1 for entry in manifest["layers"])
    return build_plan(source.path, skip_incompatible=True, stack_experts=stacked, checkpoint=source)


def _describe(role: tuple[str, str | None]) -> str:
    kind, layer = role
    return {"layer": f"a source tensor of converted layer '{layer}'",
            "kept": f"a tensor of layer '{layer}', kept in its source form",
            "passthrough": "a passthrough tensor"}[kind]


def _plan_roles(plan: ConversionPlan) -> dict[str, tuple[str, str | None]]:
    roles = {name: ("layer", member.prefix) for output in plan.outputs for member in output.sources
             for name in member.source_names.values()}
    roles.update({name: ("kept", layer.prefix) for layer in plan.refused for name in layer.kept_names.values()})
    return roles


def _manifest_roles(manifest: dict) -> dict[str, tuple[str, str | None]]:
    roles = {name: ("passthrough", None) for name in (entry["name"] for entry in manifest["passthrough"])}
    roles.update({name: ("kept", entry["name"]) for entry in manifest["kept"] for name in entry["tensors"].values()})
    roles.update({name: ("layer", src["name"]) for entry in manifest["layers"] for src in entry["sources"]
                  for name in src["tensors"].values()})
    return roles


def _capped(problems: list[str], what: str) -> list[str]:
    if len(problems) <= MAX_NAMED:
        return problems
    return problems[:MAX_NAMED] + [f"(and {len(problems) - MAX_NAMED} more {what})"]


def accounting_problems(plan: ConversionPlan, manifest: dict) -> list[str]:
    """Every tensor of the source in the manifest, in the role the plan gives it; tensors of one layer that the
    manifest accounts for nowhere are named together."""
    made, stated = _plan_roles(plan), _manifest_roles(manifest)
    nowhere: dict[tuple[str, str | None], list[str]] = {}
    problems = []
    for name, file in plan.checkpoint.location.items():
        role, said = made.get(name, ("passthrough", None)), stated.get(name)
        if said is None:
            nowhere.setdefault(role if role[0] != "passthrough" else (name, file.path.name), []).append(name)
        elif said != role:
            problems.append(f"--source tensor '{name}' is {_describe(said)} in OUT_DIR; converting --source makes "
                            f"it {_describe(role)}")
    missing = []
    for (kind, owner), names in nowhere.items():
        listed = ", ".join(f"'{name}'" for name in names)
        if kind == "layer":
            missing.append(f"converted layer '{owner}' of --source: tensor(s) {listed} accounted for nowhere in "
                           "OUT_DIR (no manifest layer lists them)")
        elif kind == "kept":
            missing.append(f"layer '{owner}' of --source, kept in its source form: tensor(s) {listed} accounted for "
                           "nowhere in OUT_DIR (not in the manifest's kept)")
        else:
            missing.append(f"--source tensor '{kind}' ({owner}) accounted for nowhere in OUT_DIR (a passthrough "
                           "tensor: not in the manifest's passthrough)")
    return _capped(missing, "unaccounted") + _capped(problems, "in another role")


def _first_difference(said, made, path: str, source=None):
    """(key path, output's value, converter's value) of the first difference, else None; ``...`` for absent.
    ``source`` is the same part of the source's config (None where it has none): a key the converter adds that the
    source does not have and the output lacks is no difference (an earlier release of the converter may not have
    written it, as before 2026-11-26 the ``-:`` rules for modules compressed-tensors ignores; what loaders act on is
    the audit's to check, which runs with ``--source`` too: an MoE expert passed through beside converted experts
    must be excluded, ``dynamic`` stated or not, :func:`marlin_convert.audit._plain_expert_problems`)."""
    if isinstance(said, dict) and isinstance(made, dict):
        for key in [*made, *(key for key in said if key not in made)]:
            where = f"{path}.{key}" if path else key
            in_source = isinstance(source, dict) and key in source
            if key not in said and not in_source:
                continue
            if key not in said or key not in made:
                return where, said.get(key, ...), made.get(key, ...)
            found = _first_difference(said[key], made[key], where, source[key] if in_source else None)
            if found is not None:
                return found
        return None
    if isinstance(said, list) and isinstance(made, list) and len(said) == len(made):
        return next((found for i, (a, b) in enumerate(zip(said, made))
                     if (found := _first_difference(a, b, f"{path}[{i}]", _item(source, i))) is not None), None)
    return None if json.dumps(said) == json.dumps(made) else (path, said, made)  # as JSON: 4.0 is not 4


def _item(source, i: int):
    return source[i] if isinstance(source, list) and i < len(source) else None


def config_problems(plan: ConversionPlan, out_dir: Path) -> list[str]:
    """config.json and quantize_config.json against what the converter writes from the source's configs (keys the
    converter adds that the source lacks may be absent: :func:`_first_difference`)."""
    problems = []
    expected = output_configs(plan)
    source_configs = {CONFIG_FILE: plan.checkpoint.config_json, QUANTIZE_CONFIG_FILE: plan.checkpoint.quantize_json}
    for name in (CONFIG_FILE, QUANTIZE_CONFIG_FILE):
        path = out_dir / name
        if not path.exists() and not path.is_symlink():
            if name in expected:
                problems.append(f"{name} is missing; converting --source writes one")
            continue
        if name not in expected:
            problems.append(f"{name}: converting --source writes none (the source has no {name})")
            continue
        data, problem = read_config(path)
        if problem is not None:  # (the audit names it)
            continue
        if json.dumps(data) == json.dumps(expected[name]):  # (as JSON: 4.0 is not 4)
            continue
        try:
            found = _first_difference(data, expected[name], "", source_configs[name])
        except RecursionError:  # (nested deeper than the walk can follow: JSON allows about as deep as Python recurses)
            problems.append(f"{name}: differs from what converting --source writes (nested too deeply to name where)")
            continue
        if found is not None:
            key, said, made = found
            problems.append(f"{name}: {key or 'the whole file'} is {_shown(said)}, converting --source writes "
                            f"{_shown(made)}")
    return problems


def _shown(value) -> str:
    """A config value in a problem: its JSON, cut at 80 characters; ``...`` (absent) as ``absent``."""
    return json.dumps(value)[:80] if value is not ... else "absent"


def manifest_record_problems(plan: ConversionPlan, manifest: dict) -> list[str]:
    """The manifest's record of the source's configs against what converting the source records: its
    ``quantization_defaults`` (the config's global settings as read) and ``source.quantization_config`` (the config
    files read), and ``source.bytes`` (the source's shards' bytes). A reader of the manifest may take the defaults from
    there; a manifest edited to say 8 bits where the source says 4 passed ``--source``."""
    config = plan.checkpoint.config
    problems = []
    for key, said, made in (("quantization_defaults", manifest["quantization_defaults"], config.defaults()),
                            ("source.quantization_config", manifest["source"]["quantization_config"],
                             config.sources),
                            ("source.bytes", manifest["source"]["bytes"], plan.bytes_in)):
        if json.dumps(said) == json.dumps(made):  # (as JSON: 4.0 is not 4)
            continue
        try:
            found = _first_difference(said, made, key, made) or (key, said, made)
        except RecursionError:  # (nested too deeply to walk: named as a whole)
            found = (key, said, made)
        where, said_value, made_value = found
        problems.append(f"the manifest's {where} is {_shown(said_value)}, converting --source records "
                        f"{_shown(made_value)}")
    return problems


def layer_problems(plan: ConversionPlan, manifest: dict) -> dict[int, list[str]]:
    """Each manifest layer against the entry converting the source writes for the layer of that name (every field
    the plan decides: all but the shards and the digests, which the data pass checks), by manifest layer index.
    A layer the plan does not make is left to :func:`accounting_problems` (its tensors are in another role)."""
    made = {output.prefix: layer_entry(output) for output in plan.outputs}
    found: dict[int, list[str]] = {}
    for i, entry in enumerate(manifest["layers"]):
        record = made.get(entry["name"])
        if record is None:
            continue
        said = {key: entry[key] for key in record if key in entry}
        if len(entry["sources"]) == len(record["sources"]):
            said["sources"] = [{key: src[key] for key in want if key in src}
                               for src, want in zip(entry["sources"], record["sources"])]
        # (``record`` as the "source" too: every key the re-planned entry has is one the manifest must have; keys it
        # lacks, such as shards and digests, were left out of ``said`` above)
        difference = _first_difference(said, record, "", record)
        if difference is not None:
            where, said_value, made_value = difference
            found[i] = [f"the manifest's {where} is {_shown(said_value)}, converting --source records "
                        f"{_shown(made_value)}"]
    return found


def file_problems(plan: ConversionPlan, source_dir: Path, manifest: dict) -> tuple[list[str], int]:
    """The files of the output against what converting the source writes and copies: the shards, the index, each
    copied file present and equal to the source's, no other file. Returns the problems and the files compared."""
    produced = produced_names(plan)
    copied = select_extra_files(source_dir, produced).copy
    listed = manifest["files"]
    problems, compared = [], 0
    shards = [shard.file_name for shard in plan.shards]
    if sorted(manifest["shards"]) != sorted(shards):
        problems.append(f"the manifest's shards are {json.dumps(manifest['shards'])[:200]}, converting --source "
                        f"writes {json.dumps(shards)[:200]}")
    if (INDEX_FILE in listed) != (plan.checkpoint.index_json is not None):
        problems.append(f"{INDEX_FILE}: " + ("in OUT_DIR, but --source has none" if INDEX_FILE in listed
                                             else "--source has one, OUT_DIR none"))
    for name in sorted(set(copied) - set(listed)):
        problems.append(f"file {name} of --source is not in OUT_DIR (the conversion copies it)")
    for name, record in listed.items():
        if name in produced:
            continue
        path = Path(source_dir) / name
        if not path.is_file():
            problems.append(f"file {name} (copied into OUT_DIR) is not a file of --source {source_dir}")
            continue
        if name not in copied:
            problems.append(f"file {name} is in OUT_DIR, but converting --source does not copy it")
            continue
        compared += 1
        try:
            size, digest = hash_file(path)
        except OSError as exc:
            problems.append(f"{path}: cannot read: {exc.strerror or exc}")
            continue
        if (size, digest) != (record["bytes"], record["sha256"]):
            problems.append(f"file {name} differs from --source's")
    return problems, compared


def tensor_copy_problems(source: Checkpoint, source_dir: Path, manifest: dict, headers: dict) -> tuple[list[str], int]:
    """Every passthrough tensor and every tensor of a kept layer against the same-named tensor of the source: dtype,
    shape, and its bytes against the digest the manifest recorded (which the output's own bytes were checked
    against). ``headers``: the output shards' (a kept tensor's dtype and shape are its header's; a passthrough
    tensor's, the manifest's, which the audit held its header to). Returns the problems and the tensors compared."""
    problems, compared = [], 0
    wanted = [(e["name"], e["sha256"], e["dtype"], e["shape"]) for e in manifest["passthrough"]]
    for kept in manifest["kept"]:
        for kind, name in kept["tensors"].items():
            header = headers.get(kept["shards"].get(kind))
            info = header.tensors.get(name) if header is not None else None  # (missing: the audit says so)
            wanted.append((name, kept["digests"][kind], *((info.dtype, list(info.shape)) if info else (None, None))))
    descriptors: dict[Path, int] = {}
    try:
        for name, digest, dtype, shape in wanted:
            file = source.location.get(name)
            if file is None:
                problems.append(f"tensor '{name}' (copied into OUT_DIR) is not in --source {source_dir}")
                continue
            info = file.tensors[name]
            compared += 1
            if dtype is not None and (info.dtype, list(info.shape)) != (dtype, shape):
                problems.append(f"tensor '{name}': {info.dtype} {list(info.shape)} in --source ({file.path.name}), "
                                f"{dtype} {shape} in OUT_DIR")
                continue
            try:
                if file.path not in descriptors:
                    descriptors[file.path] = open_as_read(file.path, file.identity)
                same = hash_range(descriptors[file.path], info.begin, info.nbytes) == digest
            except OSError as exc:
                problems.append(f"{file.path}: cannot read tensor '{name}': {exc.strerror or exc}")
                continue
            if not same:
                problems.append(f"tensor '{name}' differs from --source's ({file.path.name})")
    finally:
        for fd in descriptors.values():
            os.close(fd)
    return problems, compared


def compare_with_source(plan: ConversionPlan, source_dir: Path, out_dir: Path, manifest: dict,
                        headers: dict) -> tuple[list[str], int]:
    """Everything above (the module docstring). Returns the problems and the copied tensors and files compared."""
    problems, tensors = tensor_copy_problems(plan.checkpoint, source_dir, manifest, headers)
    found, files = file_problems(plan, source_dir, manifest)
    return (accounting_problems(plan, manifest) + problems + found + config_problems(plan, out_dir)
            + manifest_record_problems(plan, manifest), tensors + files)


__all__ = ["compare_with_source", "layer_problems", "plan_source"]
