"""Run one converted layer of a marlin-convert output: what an engine does with the Marlin tensors, read from the
manifest, in a few lines.

    python examples/run_marlin_layer.py OUT_DIR model.layers.0.mlp.down_proj --m 16
    python examples/run_marlin_layer.py OUT_DIR model.layers.0.mlp.experts.down_proj --expert 3    # stacked experts

It multiplies random activations ``A [m, K]`` by the layer with this project's kernel
(:func:`marlin_convert.kernel.marlin_gemm`; a CUDA GPU of compute capability >= 8.0, nvcc and ninja) and prints the
largest difference from ``A @ W`` in fp32, where ``W`` is dequantized on the CPU from the same Marlin tensors
(:func:`reference`). The steps, for a layer entry of ``marlin_manifest.json`` (README: Output format):

1. the tensors ``B``, ``s`` and, where the entry has them, ``zp`` and ``perm``, from the shards the entry names
   (expert ``e`` of a stacked layer: index ``[e]`` of each);
2. ``A`` zero-padded from ``in_features`` to ``padded_in_features`` columns (padded weight rows are zero);
3. ``C = marlin_gemm(A, B, s, workspace, perm=perm, zp=zp, bits=bits)`` with ``s`` in ``A``'s dtype, the workspace
   ``workspace.ints`` zeroed int32 words (it is left zeroed: reuse it);
4. ``C[:, :out_features]`` (padded columns are zero), plus the layer's bias ``P.bias`` where the checkpoint has one
   (passed through unchanged, in the manifest's ``passthrough``; not part of this example).

:func:`marlin_linear` is those steps; ``gemm`` may be any function with :func:`marlin_gemm`'s arguments (the tests
pass one that runs on the CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from marlin_convert import layout
from marlin_convert.manifest import load_manifest

#: the Marlin tensors of a layer entry, as ``outputs`` names them
TENSOR_KINDS = ("B", "s", "zp", "perm", "g_idx")


def load_layer(out_dir: Path, name: str, expert: int | None = None, device: str = "cpu") -> tuple[dict, dict]:
    """The manifest entry of layer ``name`` and its tensors (kind -> torch tensor on ``device``); expert ``expert`` of
    a stacked layer (required there). Raises KeyError / ValueError naming what is missing."""
    manifest = load_manifest(out_dir)
    entry = next((layer for layer in manifest["layers"] if layer["name"] == name), None)
    if entry is None:
        raise KeyError(f"{name}: not a converted layer of {out_dir} (the manifest's layers[].name)")
    stacked = entry["num_experts"] > 0
    if stacked and (expert is None or not 0 <= expert < entry["num_experts"]):
        raise ValueError(f"{name}: a stacked layer of {entry['num_experts']} experts: give an expert index below that "
                         f"(got {expert})")
    if not stacked and expert is not None:
        raise ValueError(f"{name}: not a stacked layer, so no expert index")
    tensors = {}
    for kind in TENSOR_KINDS:
        if kind not in entry["outputs"]:
            continue
        with safe_open(str(out_dir / entry["shards"][kind]), framework="pt") as shard:
            tensor = shard.get_tensor(entry["outputs"][kind])
        tensors[kind] = (tensor[expert] if stacked else tensor).contiguous().to(device)
    return entry, tensors


def marlin_linear(A: torch.Tensor, entry: dict, tensors: dict, gemm=None) -> torch.Tensor:
    """``A [m, in_features]`` times the layer: ``[m, out_features]`` in ``A``'s dtype (steps 2-4 of the module
    docstring). ``gemm``: :func:`marlin_convert.kernel.marlin_gemm` unless given."""
    if gemm is None:
        from marlin_convert.kernel import marlin_gemm as gemm
    k, k_pad = entry["in_features"], entry["padded_in_features"]
    if A.shape[-1] != k:
        raise ValueError(f"A has {A.shape[-1]} columns, the layer takes {k}")
    A = torch.nn.functional.pad(A, (0, k_pad - k)).contiguous()
    workspace = torch.zeros(entry["workspace"]["ints"], dtype=torch.int32, device=A.device)
    C = gemm(A, tensors["B"], tensors["s"].to(A.dtype), workspace, perm=tensors.get("perm"), zp=tensors.get("zp"),
             bits=entry["bits"])
    return C[:, :entry["out_features"]]


def marlin_weight(B: torch.Tensor, s: torch.Tensor, zp: torch.Tensor | None, bits: int,
                  g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's weights ``W [K_pad, N_pad]`` in fp32 on the CPU from its Marlin tensors, with the inverse layout
    functions of :mod:`marlin_convert.layout`: ``W[k, n] = (q - z) * s`` of row ``k``'s group, rows in the order ``B``
    holds them (sorted by group when act-order: ``A[:, perm] @ W`` is the product). Row ``k``'s group: ``g_idx[k]``
    (the sorted ``g_idx``) where given, else ``k // (K_pad / G)``, as the kernel takes it."""
    codes = layout.unpack_gptq_qweight(layout.marlin_to_gptq_weight(B.cpu().numpy(), bits=bits), bits)
    k_pad, n_pad = codes.shape
    scales = layout.unpermute_scales(s.cpu().float().numpy())  # [G, n_pad]
    zeros = (layout.marlin_to_zero_points(zp.cpu().numpy(), n_pad, bits).astype(np.float32) if zp is not None
             else np.full_like(scales, 2 ** (bits - 1)))
    groups = (g_idx.cpu().numpy().astype(np.int64) if g_idx is not None
              else np.arange(k_pad) // (k_pad // scales.shape[0]))
    return torch.from_numpy((codes.astype(np.float32) - zeros[groups]) * scales[groups])


def reference(A: torch.Tensor, entry: dict, tensors: dict) -> torch.Tensor:
    """What :func:`marlin_linear` computes, in fp32 on the CPU: ``A`` padded and gathered by ``perm``, times
    :func:`marlin_weight`, ``[:, :out_features]``."""
    A = torch.nn.functional.pad(A.float().cpu(), (0, entry["padded_in_features"] - entry["in_features"]))
    if "perm" in tensors:
        A = A[:, tensors["perm"].cpu().long()]
    W = marlin_weight(tensors["B"], tensors["s"], tensors.get("zp"), entry["bits"], tensors.get("g_idx"))
    return (A @ W)[:, :entry["out_features"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="a directory marlin-convert wrote")
    parser.add_argument("layer", help="a layer's name (the manifest's layers[].name)")
    parser.add_argument("--expert", type=int, help="expert index, for a stacked layer")
    parser.add_argument("--m", type=int, default=16, help="rows of A (batch size), default 16")
    parser.add_argument("--gpu", type=int, default=0)
    args = parser.parse_args(argv)
    from marlin_convert.errors import MarlinConvertError
    from marlin_convert.kernel import unavailable_reason

    try:
        entry, tensors = load_layer(args.out_dir, args.layer, args.expert)
    except (KeyError, ValueError, OSError, MarlinConvertError) as error:
        print(f"Error: {error.args[0] if error.args else error}", file=sys.stderr)
        return 2
    reason = unavailable_reason(args.gpu)
    if reason is not None:
        print(f"Error: the kernel cannot run here: {reason}", file=sys.stderr)
        return 2
    tensors = {kind: tensor.to(f"cuda:{args.gpu}") for kind, tensor in tensors.items()}
    dtype = torch.bfloat16 if entry["scale_dtype"] == "bfloat16" else torch.float16
    A = torch.randn(args.m, entry["in_features"], dtype=dtype, device=f"cuda:{args.gpu}") * 0.1
    C = marlin_linear(A, entry, tensors).float().cpu()
    expected = reference(A, entry, tensors)
    error = ((C - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
    print(json.dumps({"layer": args.layer, "expert": args.expert, "C": list(C.shape), "dtype": str(dtype),
                      "max_relative_error": error}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
