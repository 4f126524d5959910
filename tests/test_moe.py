"""Mixture-of-experts checkpoints: per-expert keys, stacked 3-D experts, and --stack-experts."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from make_gptq_checkpoint import CheckpointSpec, LinearSpec, TensorSpec, mixtral_like, qwen3_moe, write_checkpoint

from marlin_convert import layout
from marlin_convert.cli.app import main
from marlin_convert.convert import build_plan, convert
from marlin_convert.errors import InputError
from marlin_convert.manifest import load_manifest
from marlin_convert.safetensors_io import read_header, read_tensor
from marlin_convert.verify import verify


def _tensors(directory):
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        header = read_header(path)
        out.update({name: read_tensor(header, name) for name in header.tensors})
    return out


def _small_qwen(**kw):
    base = dict(num_layers=2, num_experts=64, hidden=128, expert_intermediate=64, group_size=32)
    base.update(kw)
    return qwen3_moe(**base)


def test_per_expert_keys_convert_like_any_linear_and_routers_pass_through(tmp_path):
    src = write_checkpoint(tmp_path / "in", _small_qwen(shards=3))
    out = tmp_path / "out"
    convert(src, out)
    source, converted = _tensors(src), _tensors(out)
    for e in (0, 17, 63):
        p = f"model.layers.1.mlp.experts.{e}.down_proj"
        assert np.array_equal(converted[f"{p}.B"], layout.gptq_to_marlin_weight(source[f"{p}.qweight"]))
    router = "model.layers.0.mlp.gate.weight"
    assert converted[router].tobytes() == source[router].tobytes()
    manifest = load_manifest(out)
    names = [entry["name"] for entry in manifest["layers"]]
    assert sum(".experts." in n for n in names) == 2 * 64 * 3
    groups = {(g["base"], g["projection"]): g for g in manifest["expert_groups"]}
    down = groups[("model.layers.1.mlp.experts", "down_proj")]
    assert (down["num_experts"], down["in_features"], down["out_features"]) == (64, 64, 128)
    assert down["layers"][17] == "model.layers.1.mlp.experts.17.down_proj"
    assert len(groups) == 2 * 3
    assert verify(out, gpus=None, source_dir=src).failures == []


def test_mixtral_names_and_shared_experts(tmp_path):
    spec = mixtral_like(num_layers=1, num_experts=8, hidden=128, intermediate=256)
    spec.linears.append(LinearSpec("model.layers.0.mlp.shared_expert.up_proj", 128, 256))
    src = write_checkpoint(tmp_path / "in", spec)
    plan = build_plan(src, stack_experts=True)
    prefixes = sorted(o.prefix for o in plan.outputs)
    assert "model.layers.0.block_sparse_moe.experts.w1" in prefixes
    assert "model.layers.0.mlp.shared_expert.up_proj" in prefixes
    assert all(".experts.0." not in p for p in prefixes)


def test_stacked_3d_experts_are_repacked_expert_by_expert(tmp_path):
    src = write_checkpoint(tmp_path / "in", _small_qwen(num_experts=8, stacked=True, act_order=True))
    out = tmp_path / "out"
    convert(src, out)
    source, converted = _tensors(src), _tensors(out)
    p = "model.layers.0.mlp.experts.gate_up_proj"
    qweight, g_idx, scales = source[f"{p}.qweight"], source[f"{p}.g_idx"], source[f"{p}.scales"]
    b, s, perm = converted[f"{p}.B"], converted[f"{p}.s"], converted[f"{p}.perm"]
    experts, k8, n = qweight.shape
    assert b.shape == (experts, k8 // 2, 2 * n) and s.shape == scales.shape and perm.shape == g_idx.shape
    for e in range(experts):
        expected_perm = np.argsort(g_idx[e], kind="stable")
        assert np.array_equal(perm[e], expected_perm)
        assert np.array_equal(b[e], layout.gptq_to_marlin_weight(qweight[e], expected_perm))
        assert np.array_equal(s[e], layout.permute_scales(scales[e]))
    entry = next(x for x in load_manifest(out)["layers"] if x["name"] == p)
    assert entry["num_experts"] == experts
    assert entry["expert_stride_int32"] == entry["in_features"] * entry["out_features"] // 8
    assert entry["workspace"]["per_expert"] is True
    assert verify(out, gpus=None, source_dir=src).failures == []


def test_stack_experts_fuses_per_expert_keys_and_records_which_key_fed_which_slice(tmp_path):
    src = write_checkpoint(tmp_path / "in", _small_qwen(num_experts=16, shards=2))
    out = tmp_path / "out"
    assert main([str(src), str(out), "--stack-experts", "-q"]) == 0
    source, converted = _tensors(src), _tensors(out)
    fused = "model.layers.1.mlp.experts.up_proj"
    assert converted[f"{fused}.B"].shape == (16, 128 // 16, 2 * 64)
    for e in range(16):
        key = f"model.layers.1.mlp.experts.{e}.up_proj"
        assert np.array_equal(converted[f"{fused}.B"][e], layout.gptq_to_marlin_weight(source[f"{key}.qweight"]))
        assert np.array_equal(converted[f"{fused}.s"][e], layout.permute_scales(source[f"{key}.scales"]))
        assert f"{key}.qweight" not in converted
    entry = next(x for x in load_manifest(out)["layers"] if x["name"] == fused)
    assert [src_entry["slices"] for src_entry in entry["sources"]] == [[e, e + 1] for e in range(16)]
    assert entry["sources"][5]["tensors"]["qweight"] == "model.layers.1.mlp.experts.5.up_proj.qweight"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert f"{fused}.B" in index
    assert verify(out, gpus=None, source_dir=src).failures == []


@pytest.mark.parametrize("stacked", [None, True])
def test_stack_experts_with_nothing_to_stack_says_so(tmp_path, stacked):
    """--stack-experts on a dense model, or on one whose experts are stacked in the source already, was accepted
    without a word: a user could not tell it had done nothing. A note says so (and the plan is otherwise the same)."""
    spec = _small_qwen(num_experts=4, stacked=True) if stacked else _small_qwen(num_experts=0)
    src = write_checkpoint(tmp_path / "in", spec)
    plain, stacking = build_plan(src), build_plan(src, stack_experts=True)
    expected = "--stack-experts: no per-expert layers here, nothing to stack" + (
        " (the source's experts are stacked already)" if stacked else "")
    assert expected in stacking.notes and not any("--stack-experts" in note for note in plain.notes)
    assert [o.prefix for o in stacking.outputs] == [o.prefix for o in plain.outputs]
    per_expert = build_plan(write_checkpoint(tmp_path / "per", _small_qwen(num_experts=4)), stack_experts=True)
    assert not any("nothing to stack" in note for note in per_expert.notes)


def test_a_flipped_bit_in_one_stacked_expert_is_reported_with_its_index(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "in", _small_qwen(num_experts=8))
    out = tmp_path / "out"
    convert(src, out, stack_experts=True)
    entry = next(x for x in load_manifest(out)["layers"] if x["name"].endswith("layers.0.mlp.experts.down_proj"))
    shard = out / entry["shards"]["B"]
    info = read_header(shard).tensors[entry["outputs"]["B"]]
    data = bytearray(shard.read_bytes())
    data[info.begin + 5 * info.nbytes // 8 + 3] ^= 0x01  # expert 5 of 8
    shard.write_bytes(bytes(data))
    failures = verify(out, gpus=None).failures
    assert [(f.name, f.expert) for f in failures] == [(entry["name"], 5)]
    assert main(["verify", str(out), "--skip-kernel", "-q"]) == 1
    assert "model.layers.0.mlp.experts.down_proj[expert 5]" in capsys.readouterr().err


def test_missing_expert_is_an_error_naming_the_layer(tmp_path):
    spec = _small_qwen(num_experts=64, num_layers=1)
    spec.linears = [lin for lin in spec.linears if ".experts.17." not in lin.name]
    src = write_checkpoint(tmp_path / "in", spec)
    with pytest.raises(InputError, match=r"layer 'model.layers.0.mlp.experts': expert\(s\) 17 of 0..63 missing"):
        build_plan(src)


def test_stacked_expert_counts_that_disagree_are_an_error(tmp_path):
    from safetensors.numpy import save_file

    src = write_checkpoint(tmp_path / "in", _small_qwen(num_experts=8, stacked=True, num_layers=1))
    path = next(src.glob("*.safetensors"))
    tensors = {name: read_tensor(read_header(path), name) for name in read_header(path).tensors}
    p = "model.layers.0.mlp.experts.down_proj"
    tensors[f"{p}.scales"] = tensors[f"{p}.scales"][:7].copy()
    save_file(tensors, str(path))
    with pytest.raises(InputError, match=rf"{p}.scales.*7 experts.*qweight has 8"):
        build_plan(src)


def test_mixed_group_sizes_across_experts_are_an_error(tmp_path):
    spec = CheckpointSpec(
        linears=[LinearSpec(f"model.layers.0.mlp.experts.{e}.up_proj", 256, 64) for e in range(4)],
        extras=[TensorSpec("model.layers.0.mlp.gate.weight", (4, 256), "float16")], group_size=64)
    src = write_checkpoint(tmp_path / "in", spec)
    from safetensors.numpy import save_file

    path = src / "model.safetensors"
    header = read_header(path)
    tensors = {name: read_tensor(header, name) for name in header.tensors}
    p = "model.layers.0.mlp.experts.2.up_proj"
    tensors[f"{p}.scales"] = np.repeat(tensors[f"{p}.scales"], 2, axis=0)  # as if group size 32
    tensors[f"{p}.qzeros"] = np.repeat(tensors[f"{p}.qzeros"], 2, axis=0)
    save_file(tensors, str(path))
    with pytest.raises(InputError, match=rf"{p}.scales.*8 rows.*group size 32.*config says group size 64"):
        build_plan(src)


def test_stack_experts_leaves_a_single_expert_as_it_is_and_it_verifies(tmp_path):
    """A group of one expert has nothing to stack: it is written under its own name (stacking it gave an entry
    whose one sliced source looked like a 3-D stacked tensor, which verify then failed)."""
    src = write_checkpoint(tmp_path / "in", qwen3_moe(num_layers=1, num_experts=1, hidden=128, expert_intermediate=64,
                                                      group_size=32))
    convert(src, tmp_path / "out", workers=1, stack_experts=True)
    names = {entry["name"] for entry in load_manifest(tmp_path / "out")["layers"]}
    assert "model.layers.0.mlp.experts.0.down_proj" in names
    assert not any(name.endswith("experts.down_proj") for name in names)
    for extra in ([], ["--source", str(src)]):
        assert main(["verify", str(tmp_path / "out"), "--skip-kernel", "-q", *extra]) == 0


def test_a_stacked_source_with_other_experts_fails_those_layers(tmp_path, capsys):
    """--source whose stacked tensors hold more experts than were converted differs from the output: the stacked
    layers fail, exit 1 (it was exit 2, blaming the source, as a tampered manifest num_experts was too)."""
    small = write_checkpoint(tmp_path / "in4", qwen3_moe(num_layers=1, num_experts=4, hidden=128,
                                                         expert_intermediate=64, group_size=32, stacked=True))
    big = write_checkpoint(tmp_path / "in8", qwen3_moe(num_layers=1, num_experts=8, hidden=128,
                                                       expert_intermediate=64, group_size=32, stacked=True))
    convert(small, tmp_path / "out", workers=1)
    assert main(["verify", str(tmp_path / "out"), "--skip-kernel", "-q", "--source", str(big)]) == 1
    assert ("the manifest says 4 stacked experts, --source's tensor 'model.layers.0.mlp.experts.down_proj.qweight' "
            "has shape [8, ") in capsys.readouterr().out


@pytest.mark.parametrize("stacked", [False, True])
def test_experts_missing_at_the_end_are_named_by_the_configs_count(tmp_path, capsys, stacked):
    """config.json says 4 experts, the last is not stored at all: no gap to see in 0..2, so only the stated count
    tells (it was converted, --stack-experts writing 3 experts where an engine routes to 4)."""
    src = write_checkpoint(tmp_path / "in", qwen3_moe(num_layers=1, num_experts=4, hidden=128, expert_intermediate=64,
                                                      vocab=256, stacked=stacked))
    config = json.loads((src / "config.json").read_text())
    config["num_experts"] = 5
    (src / "config.json").write_text(json.dumps(config))
    assert main([str(src), str(tmp_path / "out"), "-q", "--stack-experts"]) == 2
    err = capsys.readouterr().err
    config_path = src / "config.json"  # (named whole, as every other error names its file)
    expected = f"4 stacked experts, {config_path} says num_experts = 5" if stacked else \
        f"experts 0..3 stored, {config_path} says num_experts = 5 (expert(s) 4..4 missing)"
    assert expected in err, err
    assert not (tmp_path / "out").exists()


def _with_expert_count(tmp_path, value, num_layers: int = 1):
    """A Qwen3-MoE source of 4 experts per layer whose config.json states num_experts = ``value``."""
    src = write_checkpoint(tmp_path / "in", qwen3_moe(num_layers=num_layers, num_experts=4, hidden=128,
                                                      expert_intermediate=64, vocab=256))
    config = json.loads((src / "config.json").read_text())
    config["num_experts"] = value
    (src / "config.json").write_text(json.dumps(config))
    return src


@pytest.mark.parametrize("value, fragment", [("5", '"5"'), (5.0, "5.0"), (True, "true"), (-1, "-1")])
def test_an_expert_count_of_another_type_is_refused_not_ignored(tmp_path, capsys, value, fragment):
    src = _with_expert_count(tmp_path, value)
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"{src / 'config.json'}: 'num_experts' must be" in err and fragment in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("counts, missing_at_the_end", [([4, 4], False), ([4, 4, 5], False), ([5, 5], True),
                                                         ([], False)])
def test_an_expert_count_per_layer_is_read_as_a_list(tmp_path, capsys, counts, missing_at_the_end):
    """transformers' HunYuan configs state num_experts as "int or List" (one per layer): a false-positive hunt found
    such a checkpoint refused ("must be a JSON integer"), a dense one too. Equal counts state that count (5 where 4
    are stored: the last expert missing); differing ones, or none, state no count."""
    src = _with_expert_count(tmp_path, counts, num_layers=2)
    out = tmp_path / "out"
    if missing_at_the_end:
        assert main([str(src), str(out), "-q"]) == 2
        assert "says num_experts = 5 (expert(s) 4..4 missing)" in capsys.readouterr().err
        return
    assert main([str(src), str(out), "-q"]) == 0
    assert main(["verify", str(out), "--skip-kernel", "-q"]) == 0
    assert main(["verify", str(out), "--skip-kernel", "--source", str(src), "-q"]) == 0


@pytest.mark.parametrize("counts", [[4, "4"], [4, -1], [[4]]])
def test_a_per_layer_expert_count_of_another_type_is_refused(tmp_path, capsys, counts):
    src = _with_expert_count(tmp_path, counts)
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    assert "'num_experts' must be a JSON integer >= 0 (the number of experts) or a list of them" in \
        capsys.readouterr().err


def test_a_stacked_expert_whose_g_idx_label_contradicts_its_data_fails(tmp_path):
    """--stack-experts with act-order experts: relabelling one expert's source g_idx "act_order" as "trivial" left the
    layer act-order through its other experts; the label is now held to the rebuilt g_idx."""
    src = write_checkpoint(tmp_path / "in", _small_qwen(num_experts=4, num_layers=1, act_order=True))
    out = tmp_path / "out"
    convert(src, out, stack_experts=True, workers=1)
    manifest = load_manifest(out)
    index, entry = next((i, x) for i, x in enumerate(manifest["layers"]) if len(x["sources"]) == 4)
    assert entry["sources"][2]["g_idx"] == "act_order"
    manifest["layers"][index]["sources"][2]["g_idx"] = "trivial"
    (out / "marlin_manifest.json").write_text(json.dumps(manifest))
    failures = verify(out, gpus=None, workers=1).failures
    assert [(f.name, f.expert) for f in failures] == [(entry["name"], 2)]
    assert any("says its g_idx is trivial, the rebuilt g_idx is not trivial" in p
               for p in failures[0].integrity_problems)


def test_a_2d_scales_beside_a_stacked_qweight_says_which_is_3d(tmp_path):
    """An attack helper: 2-D scales [1, N] beside a 3-D qweight read "1 experts, but qweight has 1"."""
    from safetensors.numpy import save_file

    src = write_checkpoint(tmp_path / "in", _small_qwen(num_experts=2, stacked=True, num_layers=1))
    path = next(src.glob("*.safetensors"))
    tensors = {name: read_tensor(read_header(path), name) for name in read_header(path).tensors}
    p = "model.layers.0.mlp.experts.down_proj"
    tensors[f"{p}.scales"] = tensors[f"{p}.scales"][0].copy()
    save_file(tensors, str(path))
    with pytest.raises(InputError, match=rf"'{p}.scales' has shape \[2, 128\]: 2-D, but {p}.qweight is 3-D "
                                         r"\(stacked, 2 experts\), so scales must be 3-D"):
        build_plan(src)


def _descriptors_on(directory) -> list[str]:
    """The files under ``directory`` this process holds open (Linux: /proc/self/fd)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (the listing's own descriptor, closed since)
            continue
        if target.startswith(f"{directory}{os.sep}"):
            found.append(target)
    return found


def test_planning_opens_each_shard_once_however_many_tensors_it_reads(tmp_path, monkeypatch):
    """Planning reads every layer's g_idx and qzeros, 3 x (4 + 3 x 16) layers over 3 shards here: each read is still
    a checked open's (inside IN_DIR, the file whose header was read), but one open per shard serves them all, beside
    the header's (it was one open per tensor: 24,704 for 16 layers of 256 experts), and none is left open."""
    import marlin_convert.gptq as gptq
    import marlin_convert.safetensors_io as safetensors_io

    src = write_checkpoint(tmp_path / "in", _small_qwen(num_layers=3, num_experts=16, vocab=128, shards=3,
                                                        act_order=True))
    opens, reads = Counter(), Counter()
    open_inside, read_tensor_ = safetensors_io.open_inside, gptq.read_tensor

    def counted_open(path, root=None):
        opens[Path(path).name] += 1
        return open_inside(path, root)

    def counted_read(file, name, *args):
        reads[file.path.name] += 1
        return read_tensor_(file, name, *args)

    monkeypatch.setattr(safetensors_io, "open_inside", counted_open)
    monkeypatch.setattr(gptq, "read_tensor", counted_read)
    plan = build_plan(src)
    shards = sorted(path.name for path in src.glob("*.safetensors"))
    assert len(shards) == 3 and sum(reads.values()) == 2 * len(plan.layers) == 2 * 3 * (4 + 3 * 16)
    assert sorted(reads) == shards and all(count > 10 for count in reads.values())  # many reads of every shard
    assert opens == {name: 2 for name in shards}  # its header, then every read
    assert _descriptors_on(src) == [] and plan.checkpoint.held is None


def _change_in_place(shard, truncate=False):
    """Overwrite ``shard``'s last 8 bytes (or, ``truncate``, cut them off), its modification time put back."""
    before = os.stat(shard)
    with open(shard, "r+b") as f:
        if truncate:
            f.truncate(before.st_size - 8)
        else:
            f.seek(-8, os.SEEK_END)
            f.write(b"\x00" * 8)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_shard_written_to_while_planning_holds_it_open_is_refused_at_its_next_read(tmp_path, monkeypatch):
    """The descriptor planning keeps open is held to the shard's header before every read: a write after the first
    layer's reads (its modification time put back) stops the plan at the next one, naming the file, and the
    descriptors are closed on the way out."""
    import marlin_convert.gptq as gptq

    src = write_checkpoint(tmp_path / "in", _small_qwen(num_experts=2, num_layers=1, act_order=True))
    shard = src / "model.safetensors"
    checked = gptq.check_g_idx

    def check_then_write(checkpoint, name, *args):
        result = checked(checkpoint, name, *args)
        _change_in_place(shard)
        return result

    monkeypatch.setattr(gptq, "check_g_idx", check_then_write)
    with pytest.raises(InputError, match=r"model\.safetensors: changed since its header was read: it was written to"):
        build_plan(src)
    assert _descriptors_on(src) == []


def test_held_shards_keep_at_most_their_limit_open_and_read_the_same_bytes(tmp_path):
    from marlin_convert.safetensors_io import HeldShards

    src = write_checkpoint(tmp_path / "in", _small_qwen(num_experts=4, num_layers=1, shards=3))
    headers = [read_header(path) for path in sorted(src.glob("*.safetensors"))]
    with HeldShards(limit=2) as held:
        for header in headers * 2:  # round robin over 3 shards: each read evicts the one read least recently
            for name in list(header.tensors)[:3]:
                assert read_tensor(header, name, held=held).tobytes() == read_tensor(header, name).tobytes()
            assert len(_descriptors_on(src)) <= 2
    assert _descriptors_on(src) == []


def test_planning_under_a_low_descriptor_limit_holds_fewer_shards_open_instead_of_failing(tmp_path):
    """`ulimit -n 10` leaves a few descriptors beside the standard ones: one open per read fitted, and so must
    planning that holds shards open: where an open runs out of descriptors (EMFILE) the held shards give way
    (`inspect` of 20 shards failed with "cannot read tensor ...: Too many open files", exit 2, blaming a shard)."""
    import resource
    import subprocess
    import sys

    src = write_checkpoint(tmp_path / "in", _small_qwen(num_layers=24, num_experts=2, shards=20, act_order=True))
    assert len(list(src.glob("*.safetensors"))) == 20
    code = "import sys; from marlin_convert.cli.app import main; sys.exit(main(sys.argv[1:]))"

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (10, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    for args in (["inspect", str(src)], [str(src), str(tmp_path / "out"), "--dry-run"]):
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                              preexec_fn=limit)
        assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "out").exists()


def test_held_shards_give_way_where_the_process_runs_out_of_descriptors(tmp_path, monkeypatch):
    """An open that fails with EMFILE closes held shards (least recently read first) and is tried again, the limit
    brought down with a descriptor to spare; with none held, the error is the open's, as before."""
    import errno

    import marlin_convert.safetensors_io as safetensors_io
    from marlin_convert.safetensors_io import HeldShards

    src = write_checkpoint(tmp_path / "in", _small_qwen(num_experts=4, num_layers=4, shards=6))
    headers = [read_header(path) for path in sorted(src.glob("*.safetensors"))]
    expected = [read_tensor(header, next(iter(header.tensors))).tobytes() for header in headers]
    open_as_read = safetensors_io.open_as_read
    room = [4]  # descriptors this "process" may still open for shards

    def limited_open(path, identity):
        if len(_descriptors_on(src)) >= room[0]:
            raise OSError(errno.EMFILE, "Too many open files")
        return open_as_read(path, identity)

    monkeypatch.setattr(safetensors_io, "open_as_read", limited_open)
    with HeldShards() as held:
        for header, data in zip(headers * 2, expected * 2):
            assert read_tensor(header, next(iter(header.tensors)), held=held).tobytes() == data
        assert held.limit == 3 and len(_descriptors_on(src)) == 3  # (4 held when the open failed)
        room[0] = 0
        with pytest.raises(InputError, match="Too many open files"):
            for header in headers:
                read_tensor(header, next(iter(header.tensors)), held=held)
    assert _descriptors_on(src) == []


@pytest.mark.parametrize("how, said", [("renamed over", "another file is now at its path"),
                                       ("linked out", "another file is now at its path"),
                                       ("moved away", "it can no longer be read at its path: No such file")])
def test_a_shard_replaced_while_planning_holds_it_open_is_refused_as_replaced(tmp_path, monkeypatch, how, said):
    """A shard replaced at its path after the first layer's reads (a copy renamed over it, a link to a copy outside
    IN_DIR, or moved away) is refused at the next read of the descriptor planning holds, saying what happened at the
    path, as a fresh open said: the held file's status-change time moved with the rename, which alone read "it was
    written to, or its times were reset"."""
    import shutil

    import marlin_convert.gptq as gptq

    src = write_checkpoint(tmp_path / "in", _small_qwen(num_experts=2, num_layers=1, act_order=True))
    shard = src / "model.safetensors"
    (tmp_path / "outside").mkdir()
    checked, done = gptq.check_g_idx, []

    def check_then_replace(checkpoint, name, *args):
        result = checked(checkpoint, name, *args)
        if not done:
            done.append(name)
            copy = tmp_path / "outside" / shard.name
            shutil.copy2(shard, copy)
            if how == "renamed over":
                os.replace(copy, shard)
            elif how == "linked out":
                shard.unlink()
                shard.symlink_to(copy)
            else:
                os.replace(shard, tmp_path / "moved.safetensors")
        return result

    monkeypatch.setattr(gptq, "check_g_idx", check_then_replace)
    with pytest.raises(InputError, match=rf"model\.safetensors: changed since its header was read: {said}"):
        build_plan(src)
    assert done and _descriptors_on(src) == [] and _descriptors_on(tmp_path) == []


def _log_opens_and_reads(monkeypatch, src, log):
    """From the end of planning on, append ``<pid> open|read <shard>`` to ``log`` for every open and every tensor
    read of a shard of ``src``, in whichever process (forked workers inherit the patches, and the file is shared)."""
    import marlin_convert.convert as convert_module
    import marlin_convert.gptq as gptq
    import marlin_convert.safetensors_io as safetensors_io

    open_inside, read_tensor_, planned = safetensors_io.open_inside, gptq.read_tensor, convert_module.plan_layers

    def note(what, path):
        if log.exists() and Path(path).parent == src:
            with open(log, "a", encoding="utf-8") as f:
                f.write(f"{os.getpid()} {what} {Path(path).name}\n")

    def counted_open(path, root=None):
        note("open", path)
        return open_inside(path, root)

    def counted_read(file, name, *args):
        note("read", file.path)
        return read_tensor_(file, name, *args)

    def plan_then_count(checkpoint):
        layers = planned(checkpoint)
        log.touch()
        return layers

    monkeypatch.setattr(safetensors_io, "open_inside", counted_open)
    monkeypatch.setattr(gptq, "read_tensor", counted_read)
    monkeypatch.setattr(convert_module, "plan_layers", plan_then_count)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_conversion_opens_each_shard_once_per_batch_of_jobs_not_once_per_job(tmp_path, monkeypatch, workers):
    """A worker runs jobs in batches (up to BATCH_TASKS, 256): each shard is opened once for all the reads of a
    batch, in the process that reads it, not once per job (24,756 checked opens for 16 layers of 256 experts, most
    of the conversion's time after planning). Copies of passthrough tensors still open their shard each; nothing is
    left open."""
    import marlin_convert.convert as convert_module

    src = write_checkpoint(tmp_path / "in", _small_qwen(num_layers=3, num_experts=16, vocab=128, shards=3,
                                                        act_order=True))
    copies = Counter(job.source_path.name for shard in build_plan(src).shards for job in shard.jobs
                     if job.kind == "copy")
    batches, batched = [], convert_module._batches

    def counted_batches(tasks):
        batches.extend(batched(tasks))
        return batches

    monkeypatch.setattr(convert_module, "_batches", counted_batches)
    log = tmp_path / "opens.log"
    _log_opens_and_reads(monkeypatch, src, log)
    convert(src, tmp_path / "out", workers=workers)
    events = Counter(tuple(line.split()) for line in log.read_text().splitlines())
    pids = {pid for pid, _, _ in events}
    assert (pids == {str(os.getpid())}) == (workers == 1)
    shards = sorted(path.name for path in src.glob("*.safetensors"))
    for shard in shards:
        opens = sum(count for (_, what, name), count in events.items() if what == "open" and name == shard)
        reads = sum(count for (_, what, name), count in events.items() if what == "read" and name == shard)
        assert opens - copies[shard] <= len(batches) < reads // 10, (shard, opens, reads, len(batches))
    assert _descriptors_on(src) == []


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("how, said", [("renamed over", "another file is now at its path"),
                                       ("truncated", "its size went from"),
                                       ("written to", "it was written to, or its times were reset"),
                                       ("moved away", "it can no longer be read at its path: No such file")])
def test_a_shard_changed_while_a_worker_holds_it_open_stops_the_conversion(tmp_path, monkeypatch, workers, how,
                                                                           said):
    """A shard replaced, truncated or written to (its modification time put back) after a worker's first job, while
    the worker holds it open for the rest of its batch: the next read refuses it, in the words a fresh open used,
    and nothing is published. Moved away, it is refused as planning refuses it (a fresh open said "cannot read
    tensor ...: No such file or directory")."""
    import shutil

    import marlin_convert.convert as convert_module

    src = write_checkpoint(tmp_path / "in", _small_qwen(num_experts=8, num_layers=2, act_order=True))
    shard = src / "model.safetensors"
    ran, done = convert_module.run_job, []

    def run_then_change(job, checkpoint, writer):
        result = ran(job, checkpoint, writer)
        if not done and job.kind != "copy":
            done.append(job)
            if how == "renamed over":
                copy = tmp_path / "copy.safetensors"
                shutil.copy2(shard, copy)
                os.replace(copy, shard)
            elif how == "moved away":
                os.replace(shard, tmp_path / "moved.safetensors")
            else:
                _change_in_place(shard, truncate=how == "truncated")
        return result

    monkeypatch.setattr(convert_module, "run_job", run_then_change)
    with pytest.raises(InputError, match=rf"model\.safetensors: changed since its header was read: {said}"):
        convert(src, tmp_path / "out", workers=workers)
    assert not (tmp_path / "out").exists() and _descriptors_on(src) == []


def test_a_conversion_whose_worker_holds_shards_still_copies_where_descriptors_run_out(tmp_path, monkeypatch):
    """A copy job opens its shard itself, beside the ones its worker holds for the batch: where that open runs out of
    descriptors (EMFILE: `ulimit -n 14` for 8 shards, which one open per job fitted) the held shards give way to it as
    they do to one of their own (it failed: "cannot read: Too many open files", exit 2)."""
    import errno

    import marlin_convert.safetensors_io as safetensors_io

    src = write_checkpoint(tmp_path / "in", _small_qwen(num_experts=4, num_layers=3, shards=4))
    open_as_read = safetensors_io.open_as_read

    def one_at_a_time(path, identity):  # (what one open per read needed: a single shard open at a time)
        if _descriptors_on(src):
            raise OSError(errno.EMFILE, "Too many open files")
        return open_as_read(path, identity)

    monkeypatch.setattr(safetensors_io, "open_as_read", one_at_a_time)
    report = convert(src, tmp_path / "out", workers=1)
    assert report.passthrough_tensors and _descriptors_on(src) == []
