"""``verify`` on the GPU: the bundled kernel against the fp32 reference on converted checkpoints of every kind.

Skipped, with the reason, where the kernel cannot run (no CUDA build of torch, no GPU, compute capability < 8.0,
no nvcc or ninja).
"""

from __future__ import annotations

import json

import pytest
from checkpoint_kinds import KINDS, kind_spec
from make_gptq_checkpoint import qwen3_moe, tiny_llama, write_checkpoint

from marlin_convert.cli.app import main
from marlin_convert.convert import convert
from marlin_convert.kernel import unavailable_reason
from marlin_convert.verify import RELATIVE_ERROR_BOUND, verify

_REASON = unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=f"GPU kernel unavailable: {_REASON}")]


def _assert_all_pass(report, batches, count):
    assert report.kernel_checked and len(report.results) == count and report.ok, \
        [(r.label, r.integrity_problems, [c.problem for c in r.kernel]) for r in report.failures] + report.problems
    for result in report.results:
        assert [c.batch for c in result.kernel] == batches
        for check in result.kernel:
            print(result.label, check.batch, f"{check.relative_error:.2e}")
            assert check.ok and check.relative_error < check.bound
            assert check.bound == RELATIVE_ERROR_BOUND or report.activation_dtype == "bfloat16"


@pytest.mark.parametrize("group_size, act_order", [(128, False), (128, True), (-1, False), (32, True)])
def test_every_layer_passes_at_every_batch_size(tmp_path, group_size, act_order):
    spec = tiny_llama(num_layers=1, hidden=512, intermediate=1536, group_size=group_size, act_order=act_order)
    src = write_checkpoint(tmp_path / "in", spec)
    convert(src, tmp_path / "out", workers=1)
    report = verify(tmp_path / "out", gpus=[0], batch_sizes=[1, 7, 16, 128], workers=2)
    _assert_all_pass(report, [1, 7, 16, 128], 7)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_kind_passes(tmp_path, name):
    src = write_checkpoint(tmp_path / "in", kind_spec(name, small=False))
    convert(src, tmp_path / "out", workers=1)
    _assert_all_pass(verify(tmp_path / "out", gpus=[0], batch_sizes=[1, 16, 128], workers=2), [1, 16, 128], 2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bf16_models_and_the_dtype_override(tmp_path, dtype):
    spec = tiny_llama(num_layers=1, hidden=256, intermediate=512, group_size=64, scale_dtype="bfloat16",
                      extra_dtype="bfloat16", config_extra={"torch_dtype": "bfloat16"})
    src = write_checkpoint(tmp_path / "in", spec)
    convert(src, tmp_path / "out", workers=1)
    report = verify(tmp_path / "out", gpus=[0], batch_sizes=[1, 16], dtype=None if dtype == "bfloat16" else dtype)
    assert report.activation_dtype == dtype
    _assert_all_pass(report, [1, 16], 7)


def test_stacked_experts_are_checked_expert_by_expert(tmp_path):
    spec = qwen3_moe(num_layers=1, num_experts=8, hidden=256, expert_intermediate=128, stacked=True,
                     act_order=True, group_size=64)
    src = write_checkpoint(tmp_path / "in", spec)
    convert(src, tmp_path / "out", workers=1)
    report = verify(tmp_path / "out", gpus=[0], batch_sizes=[1, 16], workers=2)
    experts = [r.expert for r in report.results if r.name.endswith("experts.down_proj")]
    assert experts == list(range(8))
    assert report.ok and all(len(r.kernel) == 2 for r in report.results)


def test_one_worker_and_many_slices_do_not_wait_on_each_other(tmp_path):
    """With no worker processes, a stacked layer of more experts than staging slots still completes."""
    spec = qwen3_moe(num_layers=1, num_experts=32, hidden=256, expert_intermediate=128, stacked=True, group_size=64)
    src = write_checkpoint(tmp_path / "in", spec)
    convert(src, tmp_path / "out", workers=1)
    report = verify(tmp_path / "out", gpus=[0], batch_sizes=[1], workers=1)
    assert report.ok and sum(r.name.endswith("experts.gate_up_proj") for r in report.results) == 32


def test_the_cli_runs_the_kernel_in_worker_processes_and_exits_zero(tmp_path, capsys):
    """`verify --gpu 0 --workers 2` from the CLI: every layer checked by the kernel at both batch sizes, exit 0. (A GPU
    given twice, `--gpu 0,0`, is refused: tests/test_cli.py; spreading over two GPUs needs two, below.)"""
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=2, hidden=256, intermediate=512, group_size=64))
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    assert main(["verify", str(out), "--gpu", "0", "--workers", "2", "--batch", "1,16", "-q",
                 "--json", str(tmp_path / "v.json")]) == 0
    assert "passed: 14/14 layers ok" in capsys.readouterr().out
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["kernel_checked"] and len(report["results"]) == 14
    assert all(len(layer["kernel"]) == 2 and layer["device"] == "cuda:0" for layer in report["results"])


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


@pytest.mark.skipif(_gpu_count() < 2, reason="needs two CUDA GPUs (--gpu 0,1 spreads layers over them)")
def test_two_gpus_share_the_layers_and_every_one_passes(tmp_path):
    """--gpu 0,1: layers go round-robin to both GPUs (the report names each one's device) and all pass, a MoE model's
    experts included."""
    spec = qwen3_moe(num_layers=1, num_experts=4, hidden=256, expert_intermediate=128, group_size=64)
    src = write_checkpoint(tmp_path / "in", spec)
    convert(src, tmp_path / "out", workers=1)
    report = verify(tmp_path / "out", gpus=[0, 1], batch_sizes=[1, 16], workers=2)
    _assert_all_pass(report, [1, 16], len(report.results))
    assert {r.device for r in report.results} == {"cuda:0", "cuda:1"}
    assert set(report.gpu_peak_bytes) == {"cuda:0", "cuda:1"}
