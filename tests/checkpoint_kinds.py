"""Small checkpoints of every kind the converter supports, for the tests of ``verify`` (CPU and GPU)."""

from __future__ import annotations

from make_gptq_checkpoint import CheckpointSpec, LinearSpec

#: name -> CheckpointSpec settings; "padded" picks shapes that do not tile (K = N = 1000, N = 200)
KINDS = {
    "8-bit g128": dict(bits=8, group_size=128),
    "8-bit act-order g64": dict(bits=8, group_size=64, act_order=True),
    "asym v1 g64": dict(sym=False, group_size=64),
    "asym v2 act-order": dict(sym=False, group_size=128, act_order=True, zero_format="v2",
                              checkpoint_format_label="gptq_v2"),
    "8-bit asym channelwise": dict(bits=8, sym=False, group_size=-1),
    "bf16 scales": dict(group_size=64, scale_dtype="bfloat16"),
    "fp32 scales": dict(group_size=128, scale_dtype="float32"),
    "padded 1000 x 1000": dict(group_size=128, padded=True),
    "padded act-order asym": dict(group_size=128, padded=True, act_order=True, sym=False),
    "padded 8-bit channelwise": dict(bits=8, group_size=-1, padded=True),
}


def kind_spec(name: str, small: bool = True) -> CheckpointSpec:
    """Two linears of kind ``name`` (``small``: shapes for CPU tests; else larger ones for the GPU)."""
    kind = dict(KINDS[name])
    if kind.pop("padded", False):
        shapes = [(1000, 1000), (256 if small else 4096, 200)]
    else:
        shapes = [(256, 384), (128, 256)] if small else [(512, 1536), (1536, 512)]
    linears = [LinearSpec(f"model.layers.0.mlp.p{i}", k, n) for i, (k, n) in enumerate(shapes)]
    return CheckpointSpec(linears=linears, extras=[], **kind)
