"""``verify`` on the GPU: the bundled kernel against the fp32 reference on converted checkpoints.

Skipped, with the reason, where the kernel cannot run (no CUDA build of torch, no GPU, compute capability < 8.0,
no nvcc or ninja).
"""

from __future__ import annotations

import pytest
from make_gptq_checkpoint import qwen3_moe, tiny_llama, write_checkpoint

from marlin_convert.cli.app import main
from marlin_convert.convert import convert
from marlin_convert.kernel import unavailable_reason
from marlin_convert.verify import RELATIVE_ERROR_BOUND, verify

_REASON = unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=f"GPU kernel unavailable: {_REASON}")]


@pytest.mark.parametrize("group_size, act_order", [(128, False), (128, True), (-1, False), (32, True)])
def test_every_layer_passes_at_every_batch_size(tmp_path, group_size, act_order):
    spec = tiny_llama(num_layers=1, hidden=512, intermediate=1536, group_size=group_size, act_order=act_order)
    src = write_checkpoint(tmp_path / "in", spec)
    convert(src, tmp_path / "out", workers=1)
    report = verify(tmp_path / "out", gpus=[0], batch_sizes=[1, 7, 16, 128])
    assert report.kernel_checked and len(report.results) == 7
    for result in report.results:
        assert [c.batch for c in result.kernel] == [1, 7, 16, 128]
        for check in result.kernel:
            print(result.label, check.batch, f"{check.relative_error:.2e}")
            assert check.ok and check.relative_error < RELATIVE_ERROR_BOUND


def test_stacked_experts_are_checked_expert_by_expert_in_place(tmp_path):
    spec = qwen3_moe(num_layers=1, num_experts=8, hidden=256, expert_intermediate=128, stacked=True,
                     act_order=True, group_size=64)
    src = write_checkpoint(tmp_path / "in", spec)
    convert(src, tmp_path / "out", workers=1)
    report = verify(tmp_path / "out", gpus=[0], batch_sizes=[1, 16])
    experts = [r.expert for r in report.results if r.name.endswith("experts.down_proj")]
    assert experts == list(range(8))
    assert report.failures == []


def test_gpu_list_spreads_layers_and_the_cli_exits_zero(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "in", tiny_llama(num_layers=2, hidden=256, intermediate=512, group_size=64))
    out = tmp_path / "out"
    assert main([str(src), str(out), "-q"]) == 0
    assert main(["verify", str(out), "--gpu", "0,0", "--batch", "1,16", "-q", "--json", str(tmp_path / "v.json")]) == 0
    assert "14/14 passed" in capsys.readouterr().out
