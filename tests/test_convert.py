"""Conversion, end to end: what a converted directory holds, tensor by tensor, and that it round-trips."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from make_gptq_checkpoint import CheckpointSpec, LinearSpec, TensorSpec, tiny_llama, write_checkpoint
from safetensors import safe_open

from marlin_convert import layout
from marlin_convert.convert import build_plan, convert
from marlin_convert.errors import InputError, UnsupportedLayerError
from marlin_convert.manifest import MANIFEST_FILE, load_manifest
from marlin_convert.safetensors_io import read_header, read_tensor
from marlin_convert.verify import verify


def _all_tensors(directory):
    """name -> (numpy array of raw values, safetensors dtype) over every shard of a directory."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        header = read_header(path)
        for name, info in header.tensors.items():
            out[name] = (read_tensor(header, name), info.dtype)
    return out


def _linear_spec(k=256, n=128, **kw):
    return CheckpointSpec(
        linears=[LinearSpec("model.layers.0.mlp.down_proj", k, n, bias=True)],
        extras=[TensorSpec("model.embed_tokens.weight", (64, n), "float16")],
        **kw,
    )


def test_every_output_reads_back_with_safetensors_and_matches_the_layout_functions(tmp_path):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=2, shards=3, group_size=64))
    out = tmp_path / "out"
    report = convert(src, out)
    source, converted = _all_tensors(src), _all_tensors(out)

    for path in out.glob("*.safetensors"):  # the reference reader accepts our streaming writer's files
        with safe_open(str(path), "np") as f:
            for name in f.keys():
                assert np.array_equal(f.get_tensor(name).view(np.uint8), converted[name][0].view(np.uint8))

    prefixes = [n[: -len(".qweight")] for n in source if n.endswith(".qweight")]
    assert len(report.layers) == len(prefixes) == 14
    for prefix in prefixes:
        assert np.array_equal(converted[f"{prefix}.B"][0], layout.gptq_to_marlin_weight(source[f"{prefix}.qweight"][0]))
        assert np.array_equal(converted[f"{prefix}.s"][0], layout.permute_scales(source[f"{prefix}.scales"][0]))
        for gone in ("qweight", "qzeros", "scales", "g_idx"):
            assert f"{prefix}.{gone}" not in converted
    for name, (values, dtype) in source.items():
        if not any(name.startswith(p + ".") and not name.endswith(".bias") for p in prefixes):
            assert converted[name][1] == dtype
            assert converted[name][0].tobytes() == values.tobytes(), name


def test_shards_keep_their_grouping_and_the_index_is_rewritten(tmp_path):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=2, shards=3))
    out = tmp_path / "out"
    convert(src, out)
    in_index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    out_index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted({*out_index["weight_map"].values()}) == sorted({*in_index.values()})
    for name, shard in out_index["weight_map"].items():
        assert name in read_header(out / shard).tensors
        source_name = name[:-2] + ".qweight" if name.endswith(".B") else name[:-2] + ".scales" if name.endswith(".s") else name
        assert in_index[source_name] == shard
    data_bytes = sum(read_header(p).data_bytes for p in out.glob("*.safetensors"))
    assert out_index["metadata"]["total_size"] == data_bytes


def _autogptq_sharded(directory, base="gptq_model-4bit-128g"):
    """Rename a sharded checkpoint as AutoGPTQ's ``save_quantized(max_shard_size=...)`` writes it (and GPTQModel
    before 1.0): shards ``<base>-0000N-of-0000M.safetensors`` and the index ``<base>.safetensors.index.json``, the
    base name quantize_config.json's ``model_file_base_name`` (``gptq_model-4bit-128g`` where none was given)."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    renamed = {shard: shard.replace("model", base, 1) for shard in set(index["weight_map"].values())}
    for shard, name in renamed.items():
        (directory / shard).rename(directory / name)
    index["weight_map"] = {tensor: renamed[shard] for tensor, shard in index["weight_map"].items()}
    (directory / "model.safetensors.index.json").unlink()
    (directory / f"{base}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    quantize = json.loads((directory / "quantize_config.json").read_text())
    (directory / "quantize_config.json").write_text(json.dumps({**quantize, "model_file_base_name": base}))
    return index


def test_autogptq_sharded_checkpoint_with_its_named_index_converts(tmp_path):
    """AutoGPTQ names a sharded checkpoint's index after its base name, not model.safetensors.index.json; it was
    refused ("2 .safetensors files and no model.safetensors.index.json"). The output's index is the usual one, the
    source's named index is replaced by it (not copied, no note), and verify --source holds."""
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=2, shards=2, config_location="quantize_config"))
    in_index = _autogptq_sharded(src)["weight_map"]
    out = tmp_path / "out"
    report = convert(src, out)
    assert not (out / "gptq_model-4bit-128g.safetensors.index.json").exists()
    assert not any("index.json" in note for note in report.notes)
    out_index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted({*out_index.values()}) == sorted({*in_index.values()})
    assert verify(out, gpus=None, workers=1, source_dir=src).ok


def test_two_named_indexes_and_no_model_index_are_refused(tmp_path):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, shards=2, config_location="quantize_config"))
    _autogptq_sharded(src)
    (src / "other.safetensors.index.json").write_text("{}")
    with pytest.raises(InputError, match="2 other safetensors indexes"):
        convert(src, tmp_path / "out")


def test_configs_say_marlin_and_keep_the_quantization_settings(tmp_path):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, group_size=32, config_location="both"))
    out = tmp_path / "out"
    convert(src, out)
    for config in (json.loads((out / "config.json").read_text())["quantization_config"],
                   json.loads((out / "quantize_config.json").read_text())):
        assert config["checkpoint_format"] == "marlin"
        assert config["is_marlin_format"] is True
        assert (config["bits"], config["group_size"], config["desc_act"], config["sym"]) == (4, 32, False, True)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()


def test_quantize_config_alone_is_enough(tmp_path):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, config_location="quantize_config"))
    convert(src, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "quantize_config.json").read_text())["checkpoint_format"] == "marlin"


@pytest.mark.parametrize("group_size", [-1, 32, 64, 128, 256])
def test_group_sizes_and_group_equal_to_k(tmp_path, group_size):
    src = write_checkpoint(tmp_path / "in", _linear_spec(k=256, n=192, group_size=group_size))
    out = tmp_path / "out"
    convert(src, out)
    entry = load_manifest(out)["layers"][0]
    rows = 1 if group_size in (-1, 256) else 256 // group_size
    assert entry["num_groups"] == rows
    s = read_tensor(read_header(out / "model.safetensors"), entry["outputs"]["s"])
    scales = read_tensor(read_header(src / "model.safetensors"), "model.layers.0.mlp.down_proj.scales")
    assert np.array_equal(s, layout.permute_scales(scales))
    assert verify(out, gpus=None).failures == []


def test_act_order_stores_perm_and_sorted_g_idx(tmp_path):
    src = write_checkpoint(tmp_path / "in", _linear_spec(k=512, n=128, group_size=128, act_order=True))
    out = tmp_path / "out"
    convert(src, out)
    source, converted = _all_tensors(src), _all_tensors(out)
    p = "model.layers.0.mlp.down_proj"
    g_idx = source[f"{p}.g_idx"][0]
    perm, sorted_g_idx = converted[f"{p}.perm"][0], converted[f"{p}.g_idx"][0]
    assert np.array_equal(perm, np.argsort(g_idx, kind="stable"))
    assert np.array_equal(sorted_g_idx, g_idx[perm]) and (np.diff(sorted_g_idx) >= 0).all()
    assert np.array_equal(converted[f"{p}.B"][0], layout.gptq_to_marlin_weight(source[f"{p}.qweight"][0], perm))
    assert converted[f"{p}.bias"][0].tobytes() == source[f"{p}.bias"][0].tobytes()
    entry = load_manifest(out)["layers"][0]
    assert entry["act_order"] is True and entry["outputs"]["perm"] == f"{p}.perm"


def test_desc_act_with_trivial_g_idx_is_not_act_order(tmp_path):
    src = write_checkpoint(tmp_path / "in", _linear_spec(act_order=False, desc_act_label=True))
    out = tmp_path / "out"
    convert(src, out)
    entry = load_manifest(out)["layers"][0]
    assert entry["act_order"] is False and entry["sources"][0]["g_idx"] == "trivial"
    assert "model.layers.0.mlp.down_proj.perm" not in _all_tensors(out)
    # the configs keep desc_act true (GPTQModel's static_groups writes such checkpoints): the notes say what a loader
    # going by that key would do
    assert json.loads((out / "quantize_config.json").read_text())["desc_act"] is True
    assert [note for note in build_plan(src).notes if "desc_act true" in note] == [
        "1 layer(s) have desc_act true in the config but a g_idx in order (GPTQModel's static_groups, or none stored): "
        "converted without act-order (no perm); the configs keep desc_act true, so a loader that goes by desc_act "
        "alone would look for perm, and the legacy Marlin loaders refuse the checkpoint"]
    plain = write_checkpoint(tmp_path / "plain", _linear_spec(act_order=False))
    assert not [note for note in build_plan(plain).notes if "desc_act" in note]


def test_bf16_extras_and_scales_keep_their_dtype(tmp_path):
    spec = _linear_spec(scale_dtype="bfloat16")
    spec.extras = [TensorSpec("model.norm.weight", (128,), "bfloat16"), TensorSpec("lm_head.weight", (64, 128), "float32")]
    src = write_checkpoint(tmp_path / "in", spec)
    out = tmp_path / "out"
    convert(src, out)
    converted, source = _all_tensors(out), _all_tensors(src)
    assert converted["model.layers.0.mlp.down_proj.s"][1] == "BF16"
    assert converted["model.norm.weight"][1] == "BF16"
    assert converted["model.norm.weight"][0].tobytes() == source["model.norm.weight"][0].tobytes()
    assert converted["lm_head.weight"][1] == "F32"
    assert verify(out, gpus=None, source_dir=src).failures == []


@pytest.mark.parametrize("label, stored, decided", [(None, "v1", "v1"), ("gptq", "v1", "v1"),
                                                     ("gptq_v2", "v2", "v2"), ("gptq", "v2", "v2")])
def test_zero_format_is_decided_from_the_values_and_reported(tmp_path, label, stored, decided):
    src = write_checkpoint(tmp_path / "in", _linear_spec(zero_format=stored, checkpoint_format_label=label))
    plan = build_plan(src)
    assert plan.layers[0].spec.zero_format == decided
    if label == "gptq" and stored == "v2":
        assert any("treated as v2" in note for note in plan.notes)
    else:
        assert not any("treated as" in note for note in plan.notes)
    out = tmp_path / "out"
    convert(src, out)
    assert load_manifest(out)["layers"][0]["sources"][0]["zero_format"] == decided
    assert verify(out, gpus=None, source_dir=src).failures == []


def test_unsupported_layers_stop_the_run_before_anything_is_written(tmp_path):
    src = write_checkpoint(tmp_path / "in", _linear_spec(bits=2))
    with pytest.raises(UnsupportedLayerError, match="model.layers.0.mlp.down_proj: 2-bit"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in"]


def _one_layer_refused(**layer_kw) -> CheckpointSpec:
    """down_proj with ``layer_kw`` (GPTQModel's ``dynamic``; no Marlin form), up_proj at the defaults."""
    spec = _linear_spec()
    spec.linears.append(LinearSpec("model.layers.0.mlp.up_proj", 128, 256))
    for key, value in layer_kw.items():
        setattr(spec.linears[0], key, value)
    spec.dynamic = {"+:.*down_proj": dict(layer_kw)}
    return spec


@pytest.mark.parametrize("spec_kw, reason", [({"bits": 2}, "2-bit"), ({"group_size": 48}, "group size 48")])
def test_skip_incompatible_keeps_layers_in_gptq_form_and_lists_them(tmp_path, spec_kw, reason):
    src = write_checkpoint(tmp_path / "in", _one_layer_refused(**spec_kw))
    out = tmp_path / "out"
    report = convert(src, out, skip_incompatible=True)
    assert [layer["name"] for layer in report.layers] == ["model.layers.0.mlp.up_proj"]
    assert report.skipped[0]["name"] == "model.layers.0.mlp.down_proj"
    assert reason in report.skipped[0]["reason"]
    kept = load_manifest(out)["kept"][0]
    assert kept["name"] == "model.layers.0.mlp.down_proj" and reason in kept["reason"]
    source, converted = _all_tensors(src), _all_tensors(out)
    copied = {n for n in source if not n.startswith("model.layers.0.mlp.up_proj.")}
    assert copied <= set(converted)
    assert all(converted[n][0].tobytes() == source[n][0].tobytes() for n in copied)
    assert set(kept["tensors"]) == {"qweight", "qzeros", "scales", "g_idx"}
    for kind, name in kept["tensors"].items():
        assert kept["shards"][kind] == "model.safetensors"
        assert kept["digests"][kind] == "sha256:" + hashlib.sha256(converted[name][0].tobytes()).hexdigest()


@pytest.mark.parametrize("spec_kw", [{"bits": 2}, {"group_size": 48}])
def test_skip_incompatible_with_no_layer_to_convert_stops_before_anything_is_written(tmp_path, spec_kw):
    """The output would be the source checkpoint relabelled: an error naming the layers, as without the option."""
    src = write_checkpoint(tmp_path / "in", _linear_spec(**spec_kw))
    with pytest.raises(UnsupportedLayerError, match="none of the 1 quantized layers can be converted: "
                                                   "model.layers.0.mlp.down_proj: "):
        convert(src, tmp_path / "out", skip_incompatible=True)
    assert [p.name for p in tmp_path.iterdir()] == ["in"]


def test_shapes_that_do_not_tile_are_padded_and_both_shapes_recorded(tmp_path):
    src = write_checkpoint(tmp_path / "in", _linear_spec(k=1000, n=96, group_size=128))
    layer = build_plan(src).layers[0]
    assert layer.convertible and layer.spec.padded_shape == (1024, 128) and layer.spec.num_groups == 8
    out = tmp_path / "out"
    convert(src, out)
    entry = load_manifest(out)["layers"][0]
    assert (entry["in_features"], entry["out_features"]) == (1000, 96)
    assert (entry["padded_in_features"], entry["padded_out_features"]) == (1024, 128)
    assert entry["shapes"] == {"B": [64, 256], "s": [8, 128]}


def test_manifest_records_shapes_group_workspace_and_digests(tmp_path):
    src = write_checkpoint(tmp_path / "in", _linear_spec(k=512, n=256, group_size=128))
    out = tmp_path / "out"
    convert(src, out)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert (manifest["format"], manifest["version"], manifest["checkpoint_format"]) == \
        ("marlin-convert-manifest", 2, "marlin")
    assert manifest["source"]["format"] == "gptq" and manifest["model_dtype"] == "float16"
    assert manifest["quantization_defaults"] == {"bits": 4, "group_size": 128, "desc_act": False, "sym": True,
                                                 "checkpoint_format": None, "dynamic": None}
    assert manifest["kept"] == [] and manifest["expert_groups"] == []
    entry = manifest["layers"][0]
    assert (entry["in_features"], entry["out_features"], entry["bits"], entry["group_size"]) == (512, 256, 4, 128)
    assert (entry["padded_in_features"], entry["padded_out_features"], entry["num_groups"]) == (512, 256, 4)
    assert (entry["sym"], entry["zero_format"], entry["act_order"], entry["scale_dtype"]) == (True, "v1", False,
                                                                                               "float16")
    assert (entry["num_experts"], entry["source_format"]) == (0, "gptq") and "expert_stride_int32" not in entry
    assert entry["shapes"] == {"B": [32, 512], "s": [4, 256]}
    assert entry["workspace"] == {"rule": "(N / 64) * 16", "ints": 64}
    source = entry["sources"][0]
    assert (source["zero_format"], source["zero_stored"], source["g_idx"]) == ("v1", 7, "trivial")
    assert source["tensors"]["qweight"] == "model.layers.0.mlp.down_proj.qweight" and source["slices"] is None
    qweight = read_tensor(read_header(src / "model.safetensors"), source["tensors"]["qweight"])
    assert source["digests"]["qweight"] == "sha256:" + hashlib.sha256(qweight.tobytes()).hexdigest()
    assert set(source["digests"]) == {"qweight", "scales", "qzeros", "g_idx"}


def test_the_manifest_has_a_line_per_top_level_key_and_per_layer_entry(tmp_path):
    """A reader can take the file apart with line tools: each top-level key on a line, each entry of a top-level list
    of objects (the layers, the tensors passed through) whole on a line of its own."""
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=2))
    out = tmp_path / "out"
    convert(src, out, workers=1)
    text = (out / MANIFEST_FILE).read_text()
    manifest = json.loads(text)
    rebuilt: dict = {}
    key = None
    for line in text.splitlines()[1:-1]:
        if line.startswith("  {"):  # an entry of the list that `key` opened
            rebuilt[key].append(json.loads(line.strip().rstrip(",")))
        elif line.startswith(' "'):
            key, _, value = line[1:].rstrip(",").partition(": ")
            key = json.loads(key)
            rebuilt[key] = [] if value == "[" else json.loads(value)
        else:
            assert line.rstrip(",") == " ]" and isinstance(rebuilt[key], list), line
    assert rebuilt == manifest and len(manifest["layers"]) == 14


@pytest.mark.parametrize("missing", ["group_size", "bits"])
def test_a_layout_setting_only_one_source_config_states_is_written_in_both(tmp_path, missing):
    """config.json's quantization_config without group_size (or bits), quantize_config.json with it: the reader
    merges them, and each output config states it, so a loader reading either file gets the settings the layers
    were converted with (verify, which resolves each file, failed: 'group_size -1 (the config)')."""
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, group_size=64))
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"][missing]
    (src / "config.json").write_text(json.dumps(config))
    convert(src, tmp_path / "out", workers=1)
    written = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert written[missing] == {"group_size": 64, "bits": 4}[missing]
    assert verify(tmp_path / "out", gpus=None, workers=1, source_dir=src).ok


@pytest.mark.parametrize("overwrite", [False, True])
def test_the_output_is_flushed_to_disk_before_it_is_moved_into_place(tmp_path, monkeypatch, overwrite):
    """Every file and directory of the output is fsync'ed while it is still the hidden partial directory, and
    OUT_DIR's parent after the rename: after a crash OUT_DIR is absent or complete, never a manifest beside
    truncated shards."""
    import os

    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1, hidden=256, intermediate=512, vocab=128,
                                                       shards=2))
    out = tmp_path / "out"
    if overwrite:
        convert(src, out)
    real_fsync = os.fsync
    synced = []  # (path, whether OUT_DIR held this run's output then)

    def recording_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        synced.append((path, (out / "marlin_manifest.json").exists() and not overwrite))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    convert(src, out, overwrite=overwrite)
    partial = [path for path, _ in synced if "/.out.partial-" in path]
    names = {os.path.relpath(path, partial[-1]) for path in partial if os.path.basename(path) != ""}
    written = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert written and written <= names, written - names
    assert any(path.endswith(".out.partial-" + str(os.getpid())) for path in partial)  # the directory itself
    assert not any(done for path, done in synced if "/.out.partial-" in path)  # all before the move
    assert synced[-1][0] == str(tmp_path)  # OUT_DIR's parent, after the move


LEGACY_SCOPE = ("symmetric 4-bit, fp16 scales, group size 128 or -1, no act-order, K a multiple of 128, N of 256, "
                "no padding, 2-D")


def legacy_note(count: str, reasons: str) -> str:
    return (f"{count} converted layer(s) are outside what the legacy Marlin loaders take ({LEGACY_SCOPE}): {reasons}; "
            "load them with a reader of the manifest (README: Who loads the output)")


def test_a_note_names_the_layers_legacy_marlin_loaders_cannot_take(tmp_path):
    """The configs say checkpoint_format "marlin" (the layout) whatever the layers' settings; where some are outside
    what the legacy loaders know (LEGACY_SCOPE), a note says how many and why. A checkpoint inside that scope gets
    no such note."""
    down = LinearSpec("model.layers.0.mlp.down_proj", 256, 256)
    down.bits = 8
    o_proj = LinearSpec("model.layers.0.self_attn.o_proj", 256, 256)
    o_proj.group_size = 64
    spec = CheckpointSpec(linears=[LinearSpec("model.layers.0.mlp.up_proj", 256, 256), down, o_proj,
                                   LinearSpec("model.layers.0.mlp.gate_proj", 256, 1000)],  # N = 1000: padded
                          extras=[], group_size=128,
                          dynamic={"+:.*down_proj": {"bits": 8}, "+:.*o_proj": {"group_size": 64}})
    src = write_checkpoint(tmp_path / "in", spec)
    notes = [note for note in build_plan(src).notes if "legacy Marlin loaders" in note]
    assert notes == [legacy_note("3 of 4", "1 8-bit, 1 group size 64, 1 padded")], notes
    plain = write_checkpoint(tmp_path / "plain", CheckpointSpec(linears=[LinearSpec("model.layers.0.mlp.up_proj",
                                                                                    256, 256)], extras=[],
                                                                group_size=128))
    assert not [note for note in build_plan(plain).notes if "legacy" in note]


def test_the_legacy_loader_note_names_act_order_layers(tmp_path):
    """The legacy Marlin loaders have no act-order form (AutoGPTQ's Marlin check refuses desc_act; the legacy layout
    stores no perm): symmetric 4-bit group 128 layers with a non-trivial g_idx are outside their scope, and the note
    says so. desc_act with a trivial g_idx is stored without perm and its layers stay inside (the config's desc_act
    has a note of its own: test_desc_act_with_trivial_g_idx_is_not_act_order)."""
    spec = CheckpointSpec(linears=[LinearSpec("model.layers.0.mlp.up_proj", 256, 256)], extras=[], group_size=128,
                          act_order=True)
    notes = [note for note in build_plan(write_checkpoint(tmp_path / "in", spec)).notes if "legacy" in note]
    assert notes == [legacy_note("1 of 1", "1 act-order")], notes
    trivial = CheckpointSpec(linears=[LinearSpec("model.layers.0.mlp.up_proj", 256, 256)], extras=[], group_size=128,
                             act_order=False, desc_act_label=True)
    assert not [note for note in build_plan(write_checkpoint(tmp_path / "trivial", trivial)).notes
                if "outside what the legacy" in note]


def test_the_legacy_loader_note_names_layers_whose_scales_are_not_fp16(tmp_path):
    """IST-DASLab's Marlin kernel, and the legacy loaders built on it, take fp16 scales only (vLLM's MarlinConfig:
    activations torch.half): bf16 (or fp32) scales are outside their scope even on symmetric 4-bit group 128."""
    spec = CheckpointSpec(linears=[LinearSpec("model.layers.0.mlp.up_proj", 256, 256)], extras=[], group_size=128,
                          scale_dtype="bfloat16")
    notes = [note for note in build_plan(write_checkpoint(tmp_path / "in", spec)).notes if "legacy" in note]
    assert notes == [legacy_note("1 of 1", "1 bfloat16 scales")], notes


def test_the_legacy_loader_note_names_unpadded_layers_whose_k_is_not_a_multiple_of_128(tmp_path):
    """The legacy loaders take K in multiples of 128 (vLLM's MarlinConfig min_k_threads, IST-DASLab's and AutoGPTQ's
    Marlin layer; the generator's test_default_presets_fit_the_legacy_shape_limits): a channelwise layer with
    K = 1008 tiles for this converter (K % 16 == 0, not padded) but is outside their scope, and the note says so."""
    spec = CheckpointSpec(linears=[LinearSpec("model.layers.0.mlp.down_proj", 1008, 256)], extras=[], group_size=-1)
    notes = [note for note in build_plan(write_checkpoint(tmp_path / "in", spec)).notes if "legacy" in note]
    assert notes == [legacy_note("1 of 1", "1 K not a multiple of 128")], notes


def test_the_legacy_loader_note_names_stacked_experts(tmp_path):
    """The legacy loaders take one 2-D matrix per linear: stacked 3-D experts, stored so or fused by --stack-experts,
    are outside their scope (each expert counted); per-expert keys written per expert are not."""
    from make_gptq_checkpoint import qwen3_moe

    def legacy(src, **kw):
        return [note for note in build_plan(src, **kw).notes if "legacy" in note]

    shape = dict(num_layers=1, num_experts=4, hidden=256, expert_intermediate=256, vocab=64)
    stacked = write_checkpoint(tmp_path / "stacked", qwen3_moe(stacked=True, **shape))
    assert legacy(stacked) == [legacy_note("8 of 12", "8 stacked experts")]
    per_expert = write_checkpoint(tmp_path / "per_expert", qwen3_moe(**shape))
    assert legacy(per_expert) == []
    assert legacy(per_expert, stack_experts=True) == [legacy_note("12 of 16", "12 stacked experts")]


def test_the_legacy_loader_note_names_unpadded_layers_whose_n_is_not_a_multiple_of_256(tmp_path):
    """IST-DASLab's Marlin layer, AutoGPTQ's Marlin QuantLinear and TGI's MarlinLinear refuse out_features not
    divisible by 256 ('`infeatures` must be divisible by 128 and `outfeatures` by 256'): Qwen2.5-0.5B's q_proj
    (N = 896) or k_proj (N = 128), symmetric 4-bit group 128, tile for this converter (N % 64 == 0, not padded) but
    converted with no note."""
    spec = CheckpointSpec(linears=[LinearSpec("model.layers.0.self_attn.q_proj", 896, 896),
                                   LinearSpec("model.layers.0.self_attn.k_proj", 896, 128),
                                   LinearSpec("model.layers.0.mlp.up_proj", 896, 4864)], extras=[], group_size=128)
    notes = [note for note in build_plan(write_checkpoint(tmp_path / "in", spec)).notes if "legacy" in note]
    assert notes == [legacy_note("2 of 3", "2 N not a multiple of 256")], notes


def test_names_that_are_not_utf8_do_not_make_a_manifest_verify_refuses(tmp_path):
    """IN_DIR's path and a file beside the shards with bytes that are not UTF-8: the conversion succeeded, then
    verify refused the manifest (a lone surrogate in JSON). The path is recorded with \\xNN escapes, the file is not
    copied (a note says why), and verify, with and without --source, passes."""
    import os
    import shutil as sh
    from pathlib import Path

    example = Path(__file__).parent.parent / "examples" / "tiny-gptq"
    src = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/src\xff"))
    sh.copytree(example, src)
    (src / os.fsdecode(b"odd\xffname.txt")).write_text("x")
    out = tmp_path / "out"
    report = convert(src, out, workers=1)
    assert any("odd\\xffname.txt: a name that is not UTF-8" in note for note in report.notes), report.notes
    assert load_manifest(out)["source"]["path"].endswith("src\\xff")
    assert verify(out, gpus=None, workers=1).ok
    assert verify(out, gpus=None, workers=1, source_dir=src).ok


# Every dtype the safetensors format defines, with its bits per element (the reference library's list, 0.8).
SAFETENSORS_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
                          "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16,
                          "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64}


def _append_raw_tensors(path, tensors):
    """Add ``tensors`` (name -> (dtype, shape, bytes)) after the data of the safetensors file ``path``, as written
    by hand: dtypes numpy has no type for (F4, F8_E8M0, ...) are raw bytes."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    data = raw[8 + length:]
    for name, (dtype, shape, payload) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


def test_passthrough_tensors_of_every_safetensors_dtype_are_copied_byte_for_byte(tmp_path):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=1))
    rng = np.random.default_rng(5)
    extra = {}
    for dtype, bits in SAFETENSORS_DTYPE_BITS.items():
        shape = [4, 6]  # 24 elements: whole bytes at 4 and 6 bits too
        extra[f"extra.{dtype.lower()}"] = (dtype, shape, rng.bytes(24 * bits // 8))
    _append_raw_tensors(src / "model.safetensors", extra)
    out = tmp_path / "out"
    convert(src, out)
    assert verify(out, gpus=None, source_dir=src).failures == []
    header = {}
    for shard in out.glob("*.safetensors"):
        raw = shard.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        for name, entry in json.loads(raw[8:8 + length]).items():
            if name.startswith("extra."):
                begin, end = entry["data_offsets"]
                header[name] = (entry["dtype"], entry["shape"], raw[8 + length + begin:8 + length + end])
    assert header == extra
    # and the reference library reads those headers back
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "np") as f:
            assert f.keys()


def test_every_safetensors_dtype_has_a_name_for_messages_and_the_manifest():
    """A review helper: a kept layer's F8_E8M0 scales (an mxfp4 group) were described as float32, because the
    dtype had no name (DTYPE_NAMES), and messages fell back to the safetensors code."""
    from marlin_convert.safetensors_io import DTYPE_BITS, DTYPE_NAMES
    assert set(DTYPE_NAMES) == set(DTYPE_BITS) == set(SAFETENSORS_DTYPE_BITS)
    assert len(set(DTYPE_NAMES.values())) == len(DTYPE_NAMES)
