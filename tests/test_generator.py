"""The GPTQ checkpoint generator (``scripts/make_gptq_checkpoint.py``) writes what ``shared/FORMAT.md`` section 1
describes, and the bundled ``examples/tiny-gptq`` is exactly what its recorded command produces."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from make_gptq_checkpoint import (
    CheckpointSpec,
    LinearSpec,
    TensorSpec,
    main,
    mixtral_like,
    qwen3_moe,
    tiny_llama,
    with_quantized_lm_head,
    write_checkpoint,
)
from safetensors import safe_open

from marlin_convert import layout

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "tiny-gptq"


def _read_all(directory: Path) -> dict[str, tuple[torch.Tensor, str]]:
    """name -> (tensor, file name) over every ``*.safetensors`` file, read with the reference reader."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert name not in out, f"{name} is in two shards"
                out[name] = (f.get_tensor(name), path.name)
    return out


def _linear(k=256, n=128, **kw) -> CheckpointSpec:
    spec_kw = dict(group_size=64)
    spec_kw.update(kw)
    return CheckpointSpec(linears=[LinearSpec("model.layers.0.mlp.down_proj", k, n, bias=True)],
                          extras=[TensorSpec("model.norm.weight", (n,), "float16")], **spec_kw)


def _stored_zeros(qzeros: torch.Tensor, n: int) -> np.ndarray:
    return layout.unpack_gptq_qzeros(qzeros.numpy(), n)


# ---------------------------------------------------------------------------------------------------------
# tensors: names, dtypes, shapes, values


def test_tiny_llama_has_format_md_tensors(tiny_checkpoint):
    tensors = _read_all(tiny_checkpoint)
    k_n = {"q_proj": (128, 128), "k_proj": (128, 128), "v_proj": (128, 128), "o_proj": (128, 128),
           "gate_proj": (128, 256), "up_proj": (128, 256), "down_proj": (256, 128)}
    g = 64
    for i in range(2):
        for proj, (k, n) in k_n.items():
            block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            p = f"model.layers.{i}.{block}.{proj}"
            qweight, qzeros, scales, g_idx = (tensors[f"{p}.{t}"][0] for t in ("qweight", "qzeros", "scales", "g_idx"))
            assert (qweight.dtype, tuple(qweight.shape)) == (torch.int32, (k // 8, n))
            assert (qzeros.dtype, tuple(qzeros.shape)) == (torch.int32, (k // g, n // 8))
            assert (scales.dtype, tuple(scales.shape)) == (torch.float16, (k // g, n))
            assert (g_idx.dtype, tuple(g_idx.shape)) == (torch.int32, (k,))
            assert g_idx.tolist() == [row // g for row in range(k)]
            assert (qzeros.numpy().view(np.uint32) == 0x77777777).all()  # symmetric v1: z - 1 = 7
            assert ((scales > 0) & (scales < 0.021)).all()
            assert f"{p}.bias" not in tensors
            assert tensors[f"{p}.qweight"][1] == tensors[f"{p}.scales"][1]  # one layer, one shard
    for name, shape in [("model.embed_tokens.weight", (512, 128)), ("lm_head.weight", (512, 128)),
                        ("model.norm.weight", (128,)), ("model.layers.1.input_layernorm.weight", (128,))]:
        assert (tensors[name][0].dtype, tuple(tensors[name][0].shape)) == (torch.float16, shape)
    assert sum(name.endswith(".qweight") for name in tensors) == 14


def test_random_codes_cover_all_sixteen_values(tiny_checkpoint):
    qweight = _read_all(tiny_checkpoint)["model.layers.0.mlp.down_proj.qweight"][0].numpy()
    counts = np.bincount(layout.unpack_gptq_qweight(qweight).ravel(), minlength=16)
    assert len(counts) == 16 and counts.min() > 0.8 * counts.mean()  # roughly uniform


@pytest.mark.parametrize("zero_format, word", [("v1", 0x77777777), ("v2", 0x88888888)])
def test_symmetric_zeros_v1_store_7_and_v2_store_8(tmp_path, zero_format, word):
    tensors = _read_all(write_checkpoint(tmp_path, _linear(zero_format=zero_format)))
    qzeros = tensors["model.layers.0.mlp.down_proj.qzeros"][0]
    assert (_stored_zeros(qzeros, 128) == (7 if zero_format == "v1" else 8)).all()
    assert (qzeros.numpy().view(np.uint32) == word).all()


def test_eight_bit_packs_four_values_per_word(tmp_path):
    tensors = _read_all(write_checkpoint(tmp_path, _linear(bits=8)))
    p = "model.layers.0.mlp.down_proj"
    assert tuple(tensors[f"{p}.qweight"][0].shape) == (256 // 4, 128)
    assert tuple(tensors[f"{p}.qzeros"][0].shape) == (256 // 64, 128 // 4)
    assert (tensors[f"{p}.qzeros"][0].numpy().view(np.uint32) == 0x7F7F7F7F).all()  # 128 - 1
    assert json.loads((tmp_path / "quantize_config.json").read_text())["bits"] == 8


@pytest.mark.parametrize("zero_format, stored", [("v1", range(15)), ("v2", range(16))])
def test_asymmetric_zeros_are_random_true_zero_points_in_the_zero_format(tmp_path, zero_format, stored):
    tensors = _read_all(write_checkpoint(tmp_path, _linear(sym=False, zero_format=zero_format)))
    zeros = _stored_zeros(tensors["model.layers.0.mlp.down_proj.qzeros"][0], 128)
    assert np.unique(zeros).tolist() == list(stored)  # v1 stores zero - 1 and cannot hold zero 0 (stored 15)


def test_per_layer_settings_dynamic_rules_and_a_quantized_lm_head(tmp_path):
    spec = tiny_llama(num_layers=1, group_size=64, vocab=256, dynamic={"+:.*down_proj": {"bits": 8}})
    spec.linears = [LinearSpec(x.name, x.in_features, x.out_features, bits=8 if "down_proj" in x.name else None)
                    for x in spec.linears]
    write_checkpoint(tmp_path, with_quantized_lm_head(spec))
    tensors = _read_all(tmp_path)
    down = "model.layers.0.mlp.down_proj"
    assert tuple(tensors[f"{down}.qweight"][0].shape) == (256 // 4, 128)
    assert (tensors[f"{down}.qzeros"][0].numpy().view(np.uint32) == 0x7F7F7F7F).all()
    assert tuple(tensors["lm_head.qweight"][0].shape) == (128 // 4, 256)
    assert tuple(tensors["lm_head.scales"][0].shape) == (128 // 32, 256) and "lm_head.weight" not in tensors
    quant = json.loads((tmp_path / "quantize_config.json").read_text())
    assert quant["dynamic"] == {"+:.*down_proj": {"bits": 8}, "lm_head": {"bits": 8, "group_size": 32}}
    assert quant["lm_head"] is True and quant["bits"] == 4


def test_k_not_a_multiple_of_the_group_size_and_n_not_of_the_pack_factor(tmp_path):
    tensors = _read_all(write_checkpoint(tmp_path, _linear(k=200, n=100, group_size=64, act_order=True)))
    p = "model.layers.0.mlp.down_proj"
    assert tuple(tensors[f"{p}.scales"][0].shape) == (4, 100)
    assert tuple(tensors[f"{p}.qzeros"][0].shape) == (4, 13)  # ceil(100 / 8)
    assert np.bincount(tensors[f"{p}.g_idx"][0].numpy()).tolist() == [64, 64, 64, 8]
    assert tensors[f"{p}.qzeros"][0].numpy().view(np.uint32)[:, -1].tolist() == [0x7777] * 4  # 4 slots used


def test_bias_scale_dtype_and_extra_dtype(tmp_path):
    spec = _linear(scale_dtype="bfloat16")
    spec.extras = [TensorSpec("model.norm.weight", (128,), "bfloat16"),
                   TensorSpec("lm_head.weight", (64, 128), "float32")]
    tensors = _read_all(write_checkpoint(tmp_path, spec))
    p = "model.layers.0.mlp.down_proj"
    assert tensors[f"{p}.scales"][0].dtype == torch.bfloat16
    assert (tensors[f"{p}.bias"][0].dtype, tuple(tensors[f"{p}.bias"][0].shape)) == (torch.float16, (128,))
    assert tensors["model.norm.weight"][0].dtype == torch.bfloat16
    assert tensors["lm_head.weight"][0].dtype == torch.float32
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("group_size, rows", [(-1, 1), (256, 1), (128, 2), (32, 8)])
def test_group_sizes(tmp_path, group_size, rows):
    tensors = _read_all(write_checkpoint(tmp_path, _linear(group_size=group_size)))
    p = "model.layers.0.mlp.down_proj"
    assert tuple(tensors[f"{p}.scales"][0].shape) == (rows, 128)
    assert tuple(tensors[f"{p}.qzeros"][0].shape) == (rows, 16)
    g = 256 if group_size == -1 else group_size
    assert tensors[f"{p}.g_idx"][0].tolist() == [k // g for k in range(256)]


def test_no_g_idx_when_asked(tmp_path):
    tensors = _read_all(write_checkpoint(tmp_path, _linear(include_g_idx=False)))
    assert "model.layers.0.mlp.down_proj.g_idx" not in tensors


# ---------------------------------------------------------------------------------------------------------
# act-order


def _assert_balanced_and_shuffled(g_idx: np.ndarray, k: int, g: int) -> None:
    assert g_idx.shape == (k,)
    assert np.bincount(g_idx, minlength=k // g).tolist() == [g] * (k // g)  # exactly g rows per group
    assert not np.array_equal(g_idx, np.arange(k) // g)


def test_act_order_g_idx_is_balanced_and_not_trivial(tmp_path):
    tensors = _read_all(write_checkpoint(tmp_path, _linear(k=512, group_size=128, act_order=True)))
    _assert_balanced_and_shuffled(tensors["model.layers.0.mlp.down_proj.g_idx"][0].numpy(), 512, 128)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["desc_act"] is True


def test_stacked_experts_have_a_leading_dimension_and_their_own_g_idx(tmp_path):
    spec = qwen3_moe(num_layers=1, num_experts=4, hidden=256, expert_intermediate=128, stacked=True,
                     act_order=True, group_size=64, vocab=64)
    tensors = _read_all(write_checkpoint(tmp_path, spec))
    p = "model.layers.0.mlp.experts"
    for name, (k, n) in {"gate_up_proj": (256, 256), "down_proj": (128, 256)}.items():
        got = {t: tensors[f"{p}.{name}.{t}"][0] for t in ("qweight", "qzeros", "scales", "g_idx")}
        assert tuple(got["qweight"].shape) == (4, k // 8, n)
        assert tuple(got["qzeros"].shape) == (4, k // 64, n // 8)
        assert tuple(got["scales"].shape) == (4, k // 64, n)
        assert tuple(got["g_idx"].shape) == (4, k)
        for e in range(4):
            _assert_balanced_and_shuffled(got["g_idx"][e].numpy(), k, 64)
        assert not torch.equal(got["g_idx"][0], got["g_idx"][1])
    assert tuple(tensors["model.layers.0.mlp.gate.weight"][0].shape) == (4, 256)
    assert not any(".experts.0." in name for name in tensors)


def test_desc_act_label_can_differ_from_the_g_idx(tmp_path):
    write_checkpoint(tmp_path, _linear(act_order=False, desc_act_label=True))
    assert json.loads((tmp_path / "quantize_config.json").read_text())["desc_act"] is True
    assert _read_all(tmp_path)["model.layers.0.mlp.down_proj.g_idx"][0].tolist() == [k // 64 for k in range(256)]


# ---------------------------------------------------------------------------------------------------------
# configs


@pytest.mark.parametrize("location, files", [("config", {"config"}), ("quantize_config", {"quantize_config"}),
                                             ("both", {"config", "quantize_config"})])
def test_config_location(tmp_path, location, files):
    write_checkpoint(tmp_path, _linear(config_location=location))
    config = json.loads((tmp_path / "config.json").read_text())
    found = set()
    if "quantization_config" in config:
        found.add("config")
        quant = config["quantization_config"]
        assert quant["quant_method"] == "gptq"
    if (tmp_path / "quantize_config.json").exists():
        found.add("quantize_config")
        quant = json.loads((tmp_path / "quantize_config.json").read_text())
    assert found == files
    assert {k: quant[k] for k in ("bits", "group_size", "desc_act", "sym", "true_sequential", "static_groups")} == \
        {"bits": 4, "group_size": 64, "desc_act": False, "sym": True, "true_sequential": True, "static_groups": False}
    assert config["model_type"] == "llama" and config["hidden_size"] == 256


@pytest.mark.parametrize("label", [None, "gptq", "gptq_v2"])
def test_checkpoint_format_label_is_written_only_when_given(tmp_path, label):
    write_checkpoint(tmp_path, _linear(checkpoint_format_label=label, zero_format="v2"))
    for name in ("config.json", "quantize_config.json"):
        data = json.loads((tmp_path / name).read_text())
        quant = data.get("quantization_config", data)
        assert quant.get("checkpoint_format") == label
    # a v1 label over v2 values is possible on purpose: the values stay v2
    assert (_stored_zeros(_read_all(tmp_path)["model.layers.0.mlp.down_proj.qzeros"][0], 128) == 8).all()


def test_side_files(tiny_checkpoint, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        json.loads((tiny_checkpoint / name).read_text())
    write_checkpoint(tmp_path, _linear(extra_files=False))
    assert not (tmp_path / "tokenizer.json").exists()


# ---------------------------------------------------------------------------------------------------------
# shards


def test_shards_and_index_are_consistent(tmp_path):
    spec = tiny_llama(num_layers=4, shards=3, group_size=64)
    write_checkpoint(tmp_path, spec)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    tensors = _read_all(tmp_path)
    assert index["weight_map"] == {name: where for name, (_, where) in tensors.items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t, _ in tensors.values())
    for i in range(4):  # a layer's tensors stay together
        assert len({where for name, (_, where) in tensors.items() if name.startswith(f"model.layers.{i}.")}) == 1
    shard_of = [tensors[f"model.layers.{i}.mlp.up_proj.qweight"][1] for i in range(4)]
    order = [int(re.search(r"0000(\d)-of", name).group(1)) for name in shard_of]
    assert order == sorted(order)  # in order
    sizes = [(tmp_path / f).stat().st_size for f in files]
    assert max(sizes) < 2 * min(sizes)  # roughly equal


def test_values_do_not_depend_on_the_shard_count_but_on_the_seed(tmp_path):
    one = _read_all(write_checkpoint(tmp_path / "one", tiny_llama(num_layers=2, shards=1)))
    three = _read_all(write_checkpoint(tmp_path / "three", tiny_llama(num_layers=2, shards=3)))
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    assert one.keys() == three.keys()
    assert all(torch.equal(one[name][0], three[name][0]) for name in one)
    other = _read_all(write_checkpoint(tmp_path / "other", tiny_llama(num_layers=2, seed=1)))
    assert not torch.equal(one["model.layers.0.mlp.up_proj.qweight"][0], other["model.layers.0.mlp.up_proj.qweight"][0])


def test_more_shards_than_layers_is_an_error(tmp_path):
    spec = _linear(shards=3)  # two groups: the layer and model.norm
    with pytest.raises(ValueError, match="shards = 3 but only 2"):
        write_checkpoint(tmp_path, spec)


def test_unsupported_bits_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="bits = 3"):
        write_checkpoint(tmp_path, _linear(bits=3))


# ---------------------------------------------------------------------------------------------------------
# MoE presets


def test_qwen3_per_expert_names(tmp_path):
    spec = qwen3_moe(num_layers=1, num_experts=4, hidden=128, expert_intermediate=128, vocab=64)
    tensors = _read_all(write_checkpoint(tmp_path, spec))
    for e in range(4):
        for proj, shape in (("gate_proj", (16, 128)), ("up_proj", (16, 128)), ("down_proj", (16, 128))):
            assert tuple(tensors[f"model.layers.0.mlp.experts.{e}.{proj}.qweight"][0].shape) == shape
    assert "model.layers.0.self_attn.q_proj.qweight" in tensors
    assert "model.layers.0.mlp.gate.weight" in tensors and "model.layers.0.mlp.gate.qweight" not in tensors


def test_mixtral_names(tmp_path):
    spec = mixtral_like(num_layers=1, num_experts=2, hidden=128, intermediate=256)
    tensors = _read_all(write_checkpoint(tmp_path, spec))
    p = "model.layers.0.block_sparse_moe"
    assert tuple(tensors[f"{p}.experts.1.w1.qweight"][0].shape) == (128 // 8, 256)
    assert tuple(tensors[f"{p}.experts.1.w2.qweight"][0].shape) == (256 // 8, 128)
    assert tuple(tensors[f"{p}.experts.1.w3.qweight"][0].shape) == (128 // 8, 256)
    assert tuple(tensors[f"{p}.gate.weight"][0].shape) == (2, 128)


def test_default_presets_fit_the_legacy_shape_limits():
    for spec in (tiny_llama(), qwen3_moe(), qwen3_moe(stacked=True), mixtral_like()):
        for lin in spec.linears:
            assert lin.in_features % 128 == 0 and lin.out_features % 64 == 0, lin.name


# ---------------------------------------------------------------------------------------------------------
# CLI and the bundled example


def _example_command() -> list[str]:
    text = (REPO / "examples" / "README.md").read_text()
    prefix = "python scripts/make_gptq_checkpoint.py examples/tiny-gptq"
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, "examples/README.md must record exactly one command for tiny-gptq"
    return shlex.split(lines[0])[2:]  # drop "python scripts/make_gptq_checkpoint.py"


def test_the_bundled_example_is_what_its_recorded_command_writes(tmp_path, capsys):
    argv = _example_command()
    assert argv[0] == "examples/tiny-gptq"
    assert main([str(tmp_path / "regen"), *argv[1:]]) == 0
    assert "bytes" in capsys.readouterr().out
    regenerated = sorted(p.name for p in (tmp_path / "regen").iterdir())
    assert sorted(p.name for p in EXAMPLE.iterdir()) == regenerated
    for name in regenerated:
        assert (EXAMPLE / name).read_bytes() == (tmp_path / "regen" / name).read_bytes(), name
    total = sum(p.stat().st_size for p in EXAMPLE.iterdir())
    assert total < 1 << 20, f"examples/tiny-gptq is {total} bytes"


def test_cli_rejects_options_that_do_not_apply(tmp_path):
    with pytest.raises(SystemExit, match="--experts"):
        main([str(tmp_path), "--preset", "tiny", "--experts", "4"])
    with pytest.raises(SystemExit, match="--stacked"):
        main([str(tmp_path), "--preset", "mixtral", "--stacked"])


def test_cli_sizes_give_shapes_that_do_not_tile(tmp_path, capsys):
    """--hidden / --intermediate set the layers' shapes (1000: neither 64 nor 128 divides it, so the converter pads);
    qwen3-moe's --intermediate is each expert's; llama-7b keeps its own and a size <= 0 is refused."""
    assert main([str(tmp_path / "dense"), "--hidden", "1000", "--intermediate", "1000", "--layers", "1",
                 "--vocab", "64"]) == 0
    tensors = _read_all(tmp_path / "dense")
    assert tuple(tensors["model.layers.0.self_attn.q_proj.qweight"][0].shape) == (1000 // 8, 1000)
    assert tuple(tensors["model.layers.0.mlp.down_proj.qweight"][0].shape) == (1000 // 8, 1000)
    assert main([str(tmp_path / "moe"), "--preset", "qwen3-moe", "--layers", "1", "--experts", "2", "--stacked",
                 "--hidden", "320", "--intermediate", "200", "--vocab", "64"]) == 0
    tensors = _read_all(tmp_path / "moe")
    assert tuple(tensors["model.layers.0.mlp.experts.down_proj.qweight"][0].shape) == (2, 200 // 8, 320)
    with pytest.raises(SystemExit, match="--hidden does not apply to the llama-7b preset"):
        main([str(tmp_path / "big"), "--preset", "llama-7b", "--hidden", "1000"])
    for option, value in (("--intermediate", "0"), ("--layers", "0"), ("--layers", "-1"), ("--vocab", "0")):
        with pytest.raises(SystemExit, match=f"{option} {value}: expected a positive size"):
            main([str(tmp_path / "zero"), option, value])
    with pytest.raises(SystemExit, match="--experts 0: expected a positive size"):
        main([str(tmp_path / "zero"), "--preset", "qwen3-moe", "--experts", "0"])
    assert not (tmp_path / "big").exists() and not (tmp_path / "zero").exists()


def test_cli_moe_preset(tmp_path, capsys):
    assert main([str(tmp_path), "--preset", "qwen3-moe", "--layers", "1", "--experts", "2", "--stacked",
                 "--act-order", "--label", "gptq_v2", "--zero-format", "v2", "--scale-dtype", "bfloat16",
                 "--vocab", "64", "--group-size", "128"]) == 0
    assert "6 quantized linears" in capsys.readouterr().out
    tensors = _read_all(tmp_path)
    assert tuple(tensors["model.layers.0.mlp.experts.down_proj.qweight"][0].shape) == (2, 768 // 8, 2048)
    assert tensors["model.layers.0.mlp.experts.down_proj.scales"][0].dtype == torch.bfloat16
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert quant["checkpoint_format"] == "gptq_v2" and quant["desc_act"] is True


def test_cli_refuses_a_non_empty_directory_and_leaves_nothing_when_it_fails(tmp_path, capsys):
    """A second checkpoint written into the first's directory mixed their shards and indexes; a spec the generator
    refuses after creating its directory left that directory behind, empty."""
    first = tmp_path / "first"
    assert main([str(first), "--vocab", "64"]) == 0
    before = sorted(p.name for p in first.iterdir())
    assert main([str(first), "--preset", "qwen3-moe", "--layers", "1", "--experts", "2"]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in first.iterdir()) == before
    assert main([str(tmp_path / "new"), "--shards", "150"]) == 2
    assert "shards = 150" in capsys.readouterr().err and not (tmp_path / "new").exists()
