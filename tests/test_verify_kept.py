"""Layers kept in GPTQ form (``--skip-incompatible``) under plain ``verify`` (no ``--source``).

A kept layer's tensors are copied as they are, and its manifest entry records no bits or group size. Plain verify
held their bytes to the entry's digests only, so a forger who re-recorded the digests could give a kept layer other
settings in the configs (``bits: 3`` for a 2-bit layer: a loader would unpack it wrongly), move one of its tensors
out of the entry, or relabel one in the shard header, and the output passed. Now the kept tensors are held to the
settings each output config gives their module, as the converter checked them in the source, and the entry to the
tensors its layer stores. Each tamper here passed plain verify before; every legitimate kind of kept layer still
verifies, plainly and with ``--source``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from make_gptq_checkpoint import qwen3_moe, tiny_llama, with_quantized_lm_head, write_checkpoint
from safetensors.torch import load_file, save_file
from test_verify_source import edit_manifest, problems_of, resign, rewrite_shard

from marlin_convert.convert import convert
from marlin_convert.manifest import load_manifest
from marlin_convert.safetensors_io import read_header
from marlin_convert.verify import verify

DOWN = "model.layers.0.mlp.down_proj"
O_PROJ = "model.layers.0.self_attn.o_proj"
CONFIGS = ("config.json", "quantize_config.json")


def _add_three_bit_layer(src, prefix: str, k: int, n: int, group_size: int) -> None:
    """Add a 3-bit GPTQ linear to ``src``'s single shard (the generator writes no 3-bit layers): qweight
    [K*3/32, N] and qzeros [G, ceil(N*3/32)] of random words (32 values across three words; nothing unpacks a kept
    layer), scales [G, N], a trivial g_idx [K]."""
    path = src / "model.safetensors"
    tensors = load_file(str(path))
    groups = -(-k // group_size)
    rng = np.random.default_rng(3)
    tensors[f"{prefix}.qweight"] = torch.from_numpy(rng.integers(-2**31, 2**31, (k * 3 // 32, n), dtype=np.int32))
    tensors[f"{prefix}.qzeros"] = torch.from_numpy(rng.integers(-2**31, 2**31, (groups, -(-n * 3 // 32)),
                                                                dtype=np.int32))
    tensors[f"{prefix}.scales"] = torch.from_numpy(rng.uniform(0.001, 0.02, (groups, n)).astype(np.float16))
    tensors[f"{prefix}.g_idx"] = torch.from_numpy((np.arange(k) // group_size).astype(np.int32))
    save_file(tensors, str(path), metadata={"format": "pt"})


def _two_and_three_bit(tmp_path):
    """down_proj 2-bit and o_proj 3-bit (both kept), the other projections 4-bit g64 (converted)."""
    spec = tiny_llama(num_layers=1, group_size=64)
    spec.linears = [lin for lin in spec.linears if lin.name != O_PROJ]
    next(lin for lin in spec.linears if lin.name == DOWN).bits = 2
    spec.dynamic = {r"+:.*down_proj": {"bits": 2}, r"+:.*o_proj": {"bits": 3}}
    src = write_checkpoint(tmp_path / "in", spec)
    _add_three_bit_layer(src, O_PROJ, 128, 128, 64)
    return src


def _one_kept(tmp_path, **kw):
    """down_proj 2-bit (kept), the rest 4-bit g64; ``kw`` for the checkpoint (act-order, asym, no g_idx)."""
    spec = tiny_llama(num_layers=1, group_size=64, **kw)
    next(lin for lin in spec.linears if lin.name == DOWN).bits = 2
    spec.dynamic = {r"+:.*down_proj": {"bits": 2}}
    return write_checkpoint(tmp_path / "in", spec)


def _asym_group_48(tmp_path):
    """Asymmetric: down_proj at group size 48 (no Marlin form: kept), the rest g64 (converted with zp)."""
    spec = tiny_llama(num_layers=1, group_size=64, sym=False)
    next(lin for lin in spec.linears if lin.name == DOWN).group_size = 48
    spec.dynamic = {r"+:.*down_proj": {"group_size": 48}}
    return write_checkpoint(tmp_path / "in", spec)


def _lm_head_kept(tmp_path):
    """A quantized lm_head at group size 16 (no Marlin form: kept), lm_head: true and GPTQModel's rule for it."""
    return write_checkpoint(tmp_path / "in", with_quantized_lm_head(tiny_llama(num_layers=1, vocab=256),
                                                                    group_size=16))


def _stacked_experts_kept(tmp_path):
    """Stacked 3-D experts: down_proj 2-bit act-order (kept), the rest 4-bit (converted)."""
    spec = qwen3_moe(num_layers=1, num_experts=4, hidden=128, expert_intermediate=64, stacked=True, vocab=256,
                     group_size=32, act_order=True)
    next(lin for lin in spec.linears if lin.name.endswith("experts.down_proj")).bits = 2
    spec.dynamic = {r"+:.*experts\.down_proj": {"bits": 2}}
    return write_checkpoint(tmp_path / "in", spec)


SOURCES = {
    "2-bit and 3-bit": (_two_and_three_bit, [DOWN, O_PROJ]),
    "2-bit act-order": (lambda tmp_path: _one_kept(tmp_path, act_order=True), [DOWN]),
    "2-bit without g_idx": (lambda tmp_path: _one_kept(tmp_path, include_g_idx=False), [DOWN]),
    "2-bit v2 asym": (lambda tmp_path: _one_kept(tmp_path, sym=False, zero_format="v2",
                                                 checkpoint_format_label="gptq_v2"), [DOWN]),
    "asym group 48": (_asym_group_48, [DOWN]),
    "lm_head group 16": (_lm_head_kept, ["lm_head"]),
    "stacked experts 2-bit act-order": (_stacked_experts_kept, ["model.layers.0.mlp.experts.down_proj"]),
}


def _converted(tmp_path, kind: str):
    make, kept = SOURCES[kind]
    src = make(tmp_path)
    out = tmp_path / "out"
    convert(src, out, workers=1, skip_incompatible=True)
    assert sorted(entry["name"] for entry in load_manifest(out)["kept"]) == sorted(kept)
    return src, out


@pytest.mark.parametrize("kind", SOURCES)
def test_every_kind_of_kept_layer_verifies_plainly_and_with_its_source(tmp_path, kind):
    src, out = _converted(tmp_path, kind)
    for source_dir in (None, src):
        report = verify(out, gpus=None, workers=1, source_dir=source_dir)
        assert report.ok, problems_of(report)
        assert len(report.kept) == len(SOURCES[kind][1]) and all(k.ok for k in report.kept)


def _forge_configs(out, **changes) -> None:
    """Change both output configs' quantization settings and the manifest's record of them alike, then re-record
    every file's digest: what the audit compared before (configs against the manifest) agrees."""
    for name in CONFIGS:
        config = json.loads((out / name).read_text())
        (config.get("quantization_config") if name == "config.json" else config).update(changes)
        (out / name).write_text(json.dumps(config))
    edit_manifest(out, lambda m: m["quantization_defaults"].update(
        {key: value for key, value in changes.items() if key in m["quantization_defaults"]}))
    resign(out)


def _plain_fails(out, *fragments) -> list[str]:
    report = verify(out, gpus=None, workers=1)
    found = problems_of(report)
    assert not report.ok, "passed"
    for fragment in fragments:
        assert any(fragment in problem for problem in found), (fragment, found)
    return found


@pytest.mark.parametrize("kind, changes, layer, fragments", [
    ("2-bit and 3-bit", {"dynamic": {r"+:.*down_proj": {"bits": 3}, r"+:.*o_proj": {"bits": 3}}}, DOWN,
     ["not a whole number of 3-bit values", 'dynamic rule "+:.*down_proj" in quantize_config.json says bits = 3',
      "what 16 rows hold at 2 bits"]),
    ("2-bit and 3-bit", {"dynamic": {r"+:.*down_proj": {"bits": 2}, r"+:.*o_proj": {"bits": 2}}}, O_PROJ,
     ["qweight's 12 rows of packed 2-bit values are K = 192", "what 12 rows hold at 3 bits"]),
    ("2-bit without g_idx", {"dynamic": {r"+:.*down_proj": {"bits": 4}}}, DOWN,
     ["has 4 rows: that is group size 32 for K = 128", "says group size 64 (2 rows)"]),
    ("2-bit act-order", {"dynamic": {r"+:.*down_proj": {"bits": 2, "group_size": 80}}}, DOWN,
     ["g_idx is unbalanced", "group size 80"]),
    ("2-bit without g_idx", {"dynamic": {r"+:.*down_proj": {"bits": 2, "group_size": 32}}}, DOWN,
     ["has 4 rows: that is group size 64 for K = 256", "says group size 32 (8 rows)"]),
    ("2-bit act-order", {"dynamic": {r"-:.*down_proj": {}}}, DOWN,
     ['dynamic rule "-:.*down_proj" in quantize_config.json says this module is not quantized']),
    ("lm_head group 16", {"dynamic": {"lm_head": {"bits": 8, "group_size": 32}}}, "lm_head",
     ["has 8 rows: that is group size 16 for K = 128", "says group size 32 (4 rows)"]),
    ("stacked experts 2-bit act-order", {"dynamic": {r"+:.*experts\.down_proj": {"bits": 4}}},
     "model.layers.0.mlp.experts.down_proj", ["g_idx' has shape [4, 64], expected [4, 32]"]),
])
def test_configs_that_give_a_kept_layer_settings_its_tensors_contradict_fail(tmp_path, kind, changes, layer,
                                                                               fragments):
    """The configs (and the manifest's record of them) forged to other bits, group size or a ``-:`` rule for a kept
    layer, every digest re-recorded: plain verify fails naming the config file, the layer and both values; --source
    failed already (the configs differ from what converting the source writes)."""
    src, out = _converted(tmp_path, kind)
    _forge_configs(out, **changes)
    for name in CONFIGS:
        _plain_fails(out, f"{name}: layer '{layer}', kept in GPTQ form, ", *fragments)
    # the kept layer itself fails (a review found it reported ok, the contradiction only on the config files)
    assert [kept.name for kept in verify(out, gpus=None, workers=1).kept if not kept.ok] == [layer]
    assert not verify(out, gpus=None, workers=1, source_dir=src).ok


def test_a_kept_tensor_moved_out_of_its_entry_fails(tmp_path):
    """The kept layer's g_idx recorded as a passthrough tensor instead (digest and all): every tensor was accounted
    for once, so it passed; an engine reading the entry would take the layer for one without g_idx."""
    src, out = _converted(tmp_path, "2-bit act-order")

    def move(manifest):
        (entry,) = manifest["kept"]
        tensor, shard, digest = (entry[key].pop("g_idx") for key in ("tensors", "shards", "digests"))
        info = read_header(out / shard).tensors[tensor]
        manifest["passthrough"].append({"name": tensor, "shard": shard, "dtype": info.dtype,
                                        "shape": list(info.shape), "sha256": digest})

    edit_manifest(out, move)
    _plain_fails(out, f"kept '{DOWN}': the entry lists ['qweight', 'qzeros', 'scales'], the layer stores "
                      "['g_idx', 'qweight', 'qzeros', 'scales'] in OUT_DIR")
    assert [k.name for k in verify(out, gpus=None, workers=1).kept if not k.ok] == [DOWN]
    assert not verify(out, gpus=None, workers=1, source_dir=src).ok


def test_kept_tensor_names_swapped_between_two_layers_fail_both(tmp_path):
    """Two kept layers' qweight names (and digests) swapped: each tensor was still claimed once with its own
    digest, so it passed; the entry's tensors are its layer's own, ``NAME.qweight``."""
    src, out = _converted(tmp_path, "2-bit and 3-bit")

    def swap(manifest):
        first, second = manifest["kept"]
        for key in ("tensors", "shards", "digests"):
            first[key]["qweight"], second[key]["qweight"] = second[key]["qweight"], first[key]["qweight"]

    edit_manifest(out, swap)
    _plain_fails(out, f"kept '{DOWN}': its qweight is '{O_PROJ}.qweight', not '{DOWN}.qweight'",
                 f"kept '{O_PROJ}': its qweight is '{DOWN}.qweight', not '{O_PROJ}.qweight'")


@pytest.mark.parametrize("tensor, relabel, fragment", [
    ("qzeros", {"dtype": "F32"}, "has dtype float32, expected int32"),
    ("qweight", {"shape": [256, 8]}, f"tensor '{DOWN}.g_idx' has shape [256], expected [4096]"),
])
def test_a_kept_tensor_relabelled_in_the_header_fails_plain_verify(tmp_path, tensor, relabel, fragment):
    """The same bytes under another dtype or shape in the shard header, files re-signed: --source caught it (the
    source's header differs), plain verify did not (only the bytes' digest was compared)."""
    src, out = _converted(tmp_path, "2-bit act-order")
    rewrite_shard(out / "model.safetensors", relabel={f"{DOWN}.{tensor}": relabel})
    resign(out)
    _plain_fails(out, f"layer '{DOWN}', kept in GPTQ form, ", fragment)
    assert not verify(out, gpus=None, workers=1, source_dir=src).ok
