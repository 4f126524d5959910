"""``examples/run_marlin_layer.py``, the README's consumer recipe (Who loads the output), on the CPU: the steps it
takes with a converted layer (the manifest's tensors, ``A`` zero-padded to ``K_pad``, ``perm``, ``zp``, the expert's
slice, ``C[:, :N]``) give ``A @ W`` of the GPTQ source, with a CPU stand-in for the kernel that computes what
:func:`marlin_convert.kernel.marlin_gemm` is documented to compute. With the kernel itself: the GPU test at the end
(skipped without a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from make_gptq_checkpoint import qwen3_moe, tiny_llama, write_checkpoint
from safetensors.torch import load_file

from marlin_convert.convert import convert
from marlin_convert.gpu_check import reference_weight
from marlin_convert.kernel import required_workspace_ints, unavailable_reason
from marlin_convert.manifest import load_manifest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "run_marlin_layer.py"
_spec = importlib.util.spec_from_file_location("run_marlin_layer", EXAMPLE)
run_marlin_layer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_marlin_layer)


def cpu_gemm(A, B, s, workspace, perm=None, zp=None, bits=4):
    """What marlin_gemm computes (its docstring), in fp32 on the CPU: ``A[:, perm] @ W``, ``W[k] = (q[k] - z[g]) s[g]``
    with ``g = k // (K / G)`` (B's rows are in the sorted order), ``z = 2^(bits-1)`` without ``zp``."""
    assert A.shape[1] == B.shape[0] * 16 and workspace.dtype == torch.int32 and not workspace.any()
    n = B.shape[1] * 2 // bits
    # the rest of marlin_gemm's contract that the kernel checks (a recipe breaking it fails only there, on a GPU)
    assert workspace.numel() >= required_workspace_ints(n), (workspace.numel(), n)
    assert s.dtype == A.dtype and s.shape[1] == n and A.shape[1] % s.shape[0] == 0, (s.dtype, s.shape, A.dtype)
    assert B.dtype == torch.int32 and B.is_contiguous() and A.is_contiguous()
    assert perm is None or (perm.dtype == torch.int32 and perm.shape == (A.shape[1],))
    assert zp is None or (zp.dtype == torch.int32 and zp.shape == (s.shape[0], n * bits // 32))
    return (A[:, perm.long()] if perm is not None else A) @ run_marlin_layer.marlin_weight(B, s, zp, bits)


def source_weights(source: dict, names: dict, bits: int, zero_format: str, expert: int | None) -> torch.Tensor:
    """``W [K, N]`` in fp32 from the GPTQ source tensors (verify's own reference), expert ``expert`` of stacked ones."""
    q, s, z, g = ((source[names[kind]][expert] if expert is not None else source[names[kind]])
                  for kind in ("qweight", "scales", "qzeros", "g_idx"))
    return reference_weight(q, s, z, g, bits, zero_format)


CASES = {
    "padded act-order asymmetric": (tiny_llama, dict(num_layers=1, hidden=1000, intermediate=200, vocab=64,
                                                     group_size=128, act_order=True, sym=False)),
    "8-bit channelwise": (tiny_llama, dict(num_layers=1, hidden=256, intermediate=192, vocab=64, group_size=-1,
                                           bits=8)),
    "stacked experts, act-order": (qwen3_moe, dict(num_layers=1, num_experts=3, hidden=256, expert_intermediate=128,
                                                   vocab=64, stacked=True, act_order=True, group_size=64)),
}


@pytest.mark.parametrize("case", CASES)
def test_the_consumer_recipe_gives_the_source_product(tmp_path, case):
    make, kw = CASES[case]
    src = write_checkpoint(tmp_path / "in", make(**kw))
    out = tmp_path / "out"
    convert(src, out, workers=1)
    source = {name: tensor for path in src.glob("*.safetensors") for name, tensor in load_file(path).items()}
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for entry in load_manifest(out)["layers"]:
        names = entry["sources"][0]["tensors"]
        experts = range(entry["num_experts"]) if entry["num_experts"] else [None]
        for expert in experts:
            _, tensors = run_marlin_layer.load_layer(out, entry["name"], expert)
            A = torch.randn(5, entry["in_features"], generator=generator)
            C = run_marlin_layer.marlin_linear(A, entry, tensors, gemm=cpu_gemm)
            W = source_weights(source, names, entry["bits"], entry["zero_format"], expert)
            assert C.shape == (5, entry["out_features"]), entry["name"]
            torch.testing.assert_close(C, A @ W, rtol=1e-4, atol=1e-4, msg=f"{entry['name']} expert {expert}")
            # and the example's own reference (its --gpu check's) agrees, padded rows and columns zero
            torch.testing.assert_close(run_marlin_layer.reference(A, entry, tensors), A @ W, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 7


def test_the_example_refuses_a_wrong_layer_or_expert(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "in", qwen3_moe(num_layers=1, num_experts=2, hidden=256,
                                                       expert_intermediate=128, vocab=64, stacked=True))
    out = tmp_path / "out"
    convert(src, out, workers=1)
    with pytest.raises(KeyError, match="not a converted layer"):
        run_marlin_layer.load_layer(out, "model.layers.9.mlp.down_proj")
    with pytest.raises(ValueError, match="a stacked layer of 2 experts"):
        run_marlin_layer.load_layer(out, "model.layers.0.mlp.experts.down_proj", 2)
    with pytest.raises(ValueError, match="not a stacked layer"):
        run_marlin_layer.load_layer(out, "model.layers.0.self_attn.q_proj", 0)
    assert run_marlin_layer.main([str(out), "model.layers.0.mlp.experts.down_proj"]) == 2
    assert "give an expert index" in capsys.readouterr().err


_REASON = unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_REASON is not None, reason=f"GPU kernel unavailable: {_REASON}")
@pytest.mark.parametrize("case", CASES)
def test_the_example_runs_the_kernel(tmp_path, capsys, case):
    """The example as a user runs it, on the GPU: every layer (each expert) within the kernel's error bound."""
    import json

    make, kw = CASES[case]
    src = write_checkpoint(tmp_path / "in", make(**kw))
    out = tmp_path / "out"
    convert(src, out, workers=1)
    for entry in load_manifest(out)["layers"]:
        for expert in range(entry["num_experts"]) if entry["num_experts"] else [None]:
            argv = [str(out), entry["name"], "--m", "16"] + ([] if expert is None else ["--expert", str(expert)])
            assert run_marlin_layer.main(argv) == 0
            report = json.loads(capsys.readouterr().out)
            assert report["C"] == [16, entry["out_features"]] and report["max_relative_error"] < 1e-2, report
