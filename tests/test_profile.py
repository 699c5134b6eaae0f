import time

import pandas as pd
import pytest
import torch
from torch import nn

from monet_like.errors import UserError
from monet_like.graph import capture
from monet_like.profile import Profile, profile


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_profile_measures_every_node_and_is_cached(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    graph = capture(model, (3, 16, 16), 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = profile(model, graph, profile_batch=8, repeats=2, progress=False)
    assert not first.cached and not first.scaled
    assert [n.node for n in first.nodes] == [n.id for n in graph.nodes]
    conv = next(n for n in first.nodes if n.kind == "convolution")
    assert conv.forward_s > 0 and conv.backward_s > 0 and conv.recompute_s == conv.forward_s
    assert first.step_time_s >= sum(n.forward_s + n.backward_s for n in first.nodes) * 0.999
    # Profiling must not touch the model: BatchNorm's running stats stay as they were.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    t0 = time.perf_counter()
    second = profile(model, graph, profile_batch=8, repeats=2, progress=False)
    assert second.cached and time.perf_counter() - t0 < 1.0
    assert second.nodes == first.nodes

    df = first.to_dataframe()
    assert isinstance(df, pd.DataFrame) and len(df) == len(graph.nodes)
    assert {"forward_s", "backward_s", "recompute_s", "workspace_bytes"} <= set(df.columns)
    first.to_csv(tmp_path / "p.csv")
    assert len(pd.read_csv(tmp_path / "p.csv")) == len(graph.nodes)
    assert Profile.from_json(first.to_json()).nodes == first.nodes


def test_profile_at_smaller_batch_scales_and_says_so():
    model = Tiny()
    graph = capture(model, (3, 16, 16), 8)
    p = profile(model, graph, profile_batch=2, repeats=1, use_cache=False, progress=False)
    assert p.scaled and p.profile_batch == 2 and p.batch == 8
    # Bytes come from the full-batch graph, exactly.
    assert [n.output_bytes for n in p.nodes] == [n.output_bytes for n in graph.nodes]


@pytest.mark.parametrize("fits", [True, False])
def test_scaled_profile_measures_workspace_at_the_solved_batch_when_it_fits(monkeypatch, fits):
    """Workspace is not linear in the batch: measured at the solved batch when that run
    fits in memory (then equal to a profile taken there), else fitted from two batches."""
    from monet_like import profile as profile_module

    monkeypatch.setattr(profile_module, "_fits_in_memory", lambda graph, device: fits)
    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 1))
    graph = capture(model, (16, 32, 32), 8)
    scaled = profile(model, graph, profile_batch=2, repeats=1, use_cache=False, progress=False)
    if fits:
        assert scaled.workspace_method.endswith("at batch 8")
        direct = profile(model, graph, profile_batch=8, repeats=1, use_cache=False, progress=False)
        assert not direct.scaled and scaled.op_workspace == direct.op_workspace
    else:
        assert scaled.workspace_method.endswith("fitted a + b*batch from batches 2 and 4")
    assert scaled.nodes[0].workspace_bytes > 0


def test_conv_workspace_is_measured_on_cpu():
    """mkldnn convolution allocates scratch on CPU: the profiler must see it."""
    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1))
    graph = capture(model, (16, 32, 32), 4)
    p = profile(model, graph, repeats=1, use_cache=False, progress=False)
    assert p.workspace_method != "unavailable"
    assert p.nodes[0].workspace_bytes > 0


def test_profile_refuses_meta_model():
    model = Tiny().to("meta")
    graph = capture(model, (3, 16, 16), 2)
    with pytest.raises(UserError, match="meta"):
        profile(model, graph, progress=False)


@pytest.mark.parametrize("timing_flops, workspace_flops", [(1e9, 1e10), (1, 1e10), (1, 1)])
def test_convolution_algorithms_workspace_at_the_solved_batch(
    monkeypatch, timing_flops, workspace_flops
):
    """conv mode: each algorithm's workspace is reported at the solved batch, whether its
    layer was timed there (small layers), or timed at the profile batch with workspace
    measured at the solved one, or both fitted from smaller batches (the FLOP limits
    forced down). im2col's workspace is known exactly: the whole batch's columns,
    C*kh*kw x Ho*Wo floats per sample."""
    from monet_like import profile as profile_module
    from monet_like.variants import apply

    monkeypatch.setattr(profile_module, "ALGORITHM_TIMING_FLOPS", timing_flops)
    monkeypatch.setattr(profile_module, "ALGORITHM_WORKSPACE_FLOPS", workspace_flops)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    graph = apply(capture(model, (3, 16, 16), 8), "conv")
    p = profile(model, graph, profile_batch=2, repeats=1, use_cache=False, progress=False)
    first, second = (p.algorithms[site] for site in sorted(p.algorithms))
    for options, channels in ((first, 3), (second, 8)):
        columns = channels * 3 * 3 * 16 * 16 * 8 * 4
        assert dict((a, ws) for a, _, ws in options["forward"])[0] == columns
        assert dict((a, ws) for a, _, ws in options["weight"])[0] == columns
        assert all(t > 0 for rows in options.values() for _, t, _ in rows)
    assert "data" not in first and "data" in second  # the input needs no gradient
