"""What the producer-fixture scripts share: tiny random models, a tokenizer, calibration ids, reference rows.

Used by ``make_gptqmodel_fixtures.py`` and ``make_llmcompressor_fixtures.py``, each run in the producer's own
virtual environment (torch, transformers and tokenizers come from there; marlin-convert needs none of this).
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 256
HIDDEN = 128
FULL_REFERENCE_ELEMENTS = 16384
SUBSET_RANDOM_ROWS = 56
SUBSET_TAIL_ROWS = 8
REFERENCE_LAYOUT = (
    "P.weight float32 [R, N]: rows P.rows of the dequantized W[K, N] (K = in_features, N = out_features)"
)


def build_model(arch: str, intermediate_size: int, dtype_name: str, seed: int, num_layers: int = 1):
    """A transformers causal LM with random weights from ``seed``: hidden 128, 4 heads (2 KV), vocab 256.

    ``arch`` "llama" uses ``intermediate_size`` for the MLP; "qwen3_moe" uses it per expert (4 experts, top 2,
    every layer sparse). The model is cast to ``dtype_name`` ("float16" or "bfloat16").
    """
    import torch

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=1,
    )
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(intermediate_size=intermediate_size, **common))
    elif arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            intermediate_size=256,
            moe_intermediate_size=intermediate_size,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    return model.to(getattr(torch, dtype_name))


def save_source(directory: Path, arch: str, intermediate_size: int, dtype_name: str, seed: int) -> None:
    """Write the random model and a word-level tokenizer ("t0".."t255") as a Hugging Face directory.

    The producers' loaders insist on a tokenizer; calibration never uses it (it feeds token ids).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    build_model(arch, intermediate_size, dtype_name, seed).save_pretrained(directory)
    backend = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="t0", pad_token="t1", bos_token="t2", eos_token="t3"
    )
    tokenizer.save_pretrained(directory)


def random_token_ids(seed: int, samples: int = 16, length: int = 64) -> list[list[int]]:
    """``samples`` rows of ``length`` random token ids in 4..255 (never the special tokens 0..3)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (length,), generator=generator).tolist() for _ in range(samples)]


def reference_rows(k: int, n: int, seed: int):
    """Rows of W[K, N] kept in a reference: all K when K * N <= 16384, else 56 random ones plus the last 8.

    The last 8 rows are always in the subset because the last group is the one that is partial when the group
    size does not divide K. Returns a sorted int64 numpy array.
    """
    import numpy as np

    if k * n <= FULL_REFERENCE_ELEMENTS:
        return np.arange(k, dtype=np.int64)
    rng = np.random.default_rng(seed)
    head = rng.choice(k - SUBSET_TAIL_ROWS, size=SUBSET_RANDOM_ROWS, replace=False)
    tail = np.arange(k - SUBSET_TAIL_ROWS, k)
    return np.sort(np.concatenate([head, tail])).astype(np.int64)


def reference_entries(name: str, weight_k_n, seed: int) -> dict:
    """``{name.weight: rows of W, name.rows: their indices}`` for a float32 torch tensor W[K, N]."""
    import torch

    k, n = weight_k_n.shape
    rows = torch.from_numpy(reference_rows(k, n, seed))
    return {f"{name}.weight": weight_k_n[rows].to(torch.float32).contiguous(), f"{name}.rows": rows}


def fresh_work_dirs(work: Path, case_name: str) -> tuple[Path, Path]:
    """Empty ``(source, quantized)`` paths under ``work`` for one case (neither exists afterwards)."""
    import shutil

    source, quantized = work / f"{case_name}-source", work / f"{case_name}-quantized"
    for directory in (source, quantized):
        shutil.rmtree(directory, ignore_errors=True)
    return source, quantized


def keep_loader_files(quantized: Path, target: Path, kept_names: tuple[str, ...]) -> None:
    """Recreate ``target`` with the producer's safetensors (and shard index) plus the files in ``kept_names``."""
    import shutil

    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for path in sorted(quantized.iterdir()):
        if path.name.endswith((".safetensors", ".safetensors.index.json")) or path.name in kept_names:
            shutil.copy2(path, target / path.name)


def dir_size(directory: Path) -> int:
    """Bytes in the files directly under ``directory``."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def save_reference(path: Path, tensors: dict, provenance: dict) -> None:
    """Write ``reference_dequant.safetensors`` with ``provenance`` (plus the layout) as one JSON metadata entry.

    One entry with sorted keys, because safetensors writes several metadata entries in no fixed order and the
    file would then differ from run to run.
    """
    import json

    from safetensors.torch import save_file

    entry = json.dumps({**provenance, "layout": REFERENCE_LAYOUT}, sort_keys=True)
    save_file(tensors, str(path), metadata={"reference": entry})


def run_cases(argv: list[str] | None, description: str, cases, default_out: Path, make_case) -> int:
    """The scripts' command line: ``--out``, ``--case NAME`` (repeatable), ``--seed``; runs ``make_case`` on each
    chosen case inside a temporary work directory (also the current directory meanwhile: the producers write
    log folders there) and prints each fixture's size to stderr."""
    import argparse
    import contextlib
    import sys
    import tempfile

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default_out, help="fixture root (default: %(default)s)")
    parser.add_argument("--case", action="append", choices=[c.name for c in cases], help="only these (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out_root = args.out.resolve()
    chosen = [c for c in cases if args.case is None or c.name in args.case]
    with tempfile.TemporaryDirectory(prefix="producer-fixtures-") as work, contextlib.chdir(work):
        for case in chosen:
            target = make_case(case, out_root, Path(work), args.seed)
            print(f"{case.name}: {target} ({dir_size(target) / 1024:.0f} KiB)", file=sys.stderr)
    return 0
