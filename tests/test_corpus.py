"""Third-party models (timm, Hugging Face transformers) replayed against eager PyTorch.

Each schedule is solved at the store-all peak, halfway, and near the smallest feasible
budget, replayed through ScheduleWrapper, and compared with an eager step from the
same state: outputs, gradients and buffers bitwise equal where the same kernels run
(within `verify.VARIANT_TOLERANCE` of eager running the same convolution algorithms
otherwise), and the CPU allocator's peak within the prediction and the budget. The
cases below run in the default suite; `pytest -m corpus` runs the whole corpus in
both modes (scripts/bench_corpus.py writes its table to docs/).
"""

from __future__ import annotations

import pytest
import torch

from monet_like.models.corpus import BY_NAME, CORPUS
from monet_like.verify import replay_entry

FULL = "inplace_conv_multiway_newnode"


def replay_at_budgets(name: str, mode: str, tmp_path, fractions=(1.0, 0.5, 0.1), autocast=None):
    entry = BY_NAME[name]
    # 20 s per search: the tests check exactness, not optimality (a search stopped at its
    # limit returns its best schedule, and the smallest budget found so far). 0.1, not
    # 0.0: at the smallest budget found the start heuristics often find nothing, and a
    # solve stopped within seconds may have no schedule.
    return replay_entry(
        entry.expression, entry.input_shape, entry.batch, mode, tmp_path, fractions, autocast, 20
    )


def assert_exact_and_within(rows) -> None:
    for row in rows:
        where = f"{row.solution.model} {row.solution.mode} at fraction {row.fraction}"
        assert row.exact(), (where, row.comparison)
        assert row.fits(), (where, row.measured_peak_bytes, row.solution.predicted_peak_bytes)
    # A schedule peaks below store-all (by recomputation, or by leaner kernels alone: ResNet-D
    # in the full mode), unless none can (ViT in the normal mode: its peak is the patch
    # embedding's backward, where nothing recomputable is alive).
    below = any(
        row.solution.predicted_peak_bytes < row.solution.store_all_peak_bytes for row in rows
    )
    assert below or rows[-1].min_budget_bytes == rows[-1].solution.store_all_peak_bytes


# In-place SiLU whose input autograd clones (read before the write: the recomputation
# used to read the SiLU's output: gradients 2.2 relative off), drop_path, SE gates.
def test_efficientnet_with_drop_path_replays_exactly(tmp_path):
    assert_exact_and_within(replay_at_budgets("efficientnet", "normal", tmp_path))


# A Hugging Face GPT-2: its logits, the step's largest tensor, are held by the loop
# through the backward pass and counted in the budget.
def test_hf_gpt2_replays_exactly_with_its_logits_in_the_budget(tmp_path):
    assert_exact_and_within(replay_at_budgets("gpt2", "normal", tmp_path))


# ConvNeXt in the full mode: its convolutions read channels-last inputs, which im2col
# cannot take (the first step used to fail in slow_conv2d), and its downsampling
# convolutions' weight gradients come back channels-last, which AccumulateGrad copies.
# (tests/test_exactness.py has the same constructs in a small net, in the default suite)
@pytest.mark.corpus
def test_convnext_in_the_full_mode_replays_within_tolerance(tmp_path):
    rows = replay_at_budgets("convnext", FULL, tmp_path, fractions=(0.5, 0.1))
    assert_exact_and_within(rows)


@pytest.mark.corpus
@pytest.mark.parametrize("mode", ["normal", FULL])
@pytest.mark.parametrize("name", [e.name for e in CORPUS])
def test_whole_corpus(name, mode, tmp_path):
    assert_exact_and_within(replay_at_budgets(name, mode, tmp_path))


@pytest.mark.parametrize("name", ["gpt2", "resnet_d"])
def test_autocast_bfloat16_replays_exactly_within_budget(name, tmp_path):
    """The forward pass under torch.autocast(bfloat16): its casts are captured as ops;
    BatchNorm's float32 statistics of a bfloat16 input are counted at their real size."""
    rows = replay_at_budgets(name, "normal", tmp_path, (0.5,), autocast=torch.bfloat16)
    assert_exact_and_within(rows)
    assert rows[0].solution.autocast == "bfloat16"
