"""Graph capture: every torchvision classification model, plus structural facts."""

import pytest
import torch
from torch import nn

from monet_like.graph import BACKWARD, FORWARD, GRADIENT, PARAM, capture
from monet_like.memory import fixed_bytes, store_all_peak
from monet_like.models import classification_models, parse_model


@pytest.mark.parametrize("name", classification_models())
def test_capture_every_torchvision_classifier(name):
    spec = parse_model(f"torchvision.models.{name}()")
    model = spec.build("meta")
    graph = capture(model, spec.default_input_shape(), 2, model_name=spec.expression)
    assert graph.nodes and graph.backward_start < len(graph.ops)
    n_params = sum(p.numel() for p in model.parameters())
    assert graph.param_bytes == 4 * n_params
    assert graph.grad_bytes == 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert store_all_peak(graph) > fixed_bytes(graph).total
    # Backward compute ops are attributed to the forward node they differentiate; the
    # adds autograd uses to sum the gradients of a value with several readers are no
    # node's backward.
    backward = [
        o
        for o in graph.ops
        if o.phase == BACKWARD and o.role != "view" and o.target != "aten.add.Tensor"
    ]
    attributed = [o for o in backward if o.node is not None]
    assert len(attributed) >= 0.95 * len(backward)
    assert all(o.index in graph.nodes[o.node].backward_ops for o in attributed)


def test_nodes_know_bytes_params_consumers_and_saved_values():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    graph = capture(model, (8,), 5)
    by_kind = {n.kind: n for n in graph.nodes}
    first, relu = graph.nodes[0], by_kind["relu"]
    assert first.kind == "addmm" and first.output_bytes == 5 * 16 * 4
    assert set(first.params) == {"0.weight", "0.bias"}
    assert relu.id in first.consumers and first.id in relu.inputs
    # ReLU's backward reads its own output (threshold_backward on the result).
    assert set(relu.outputs) <= set(relu.saved)
    # The second Linear's weight gradient needs the ReLU output: saved for its backward.
    second = [n for n in graph.nodes if n.kind == "addmm"][1]
    assert set(relu.outputs) <= set(second.saved)
    assert all(op.phase in (FORWARD, BACKWARD) for op in graph.ops)
    assert {s.kind for s in graph.storages} >= {PARAM, GRADIENT}


def test_batch_is_a_parameter_not_a_guess():
    """Bytes scale with the batch we give; a dimension that happens to equal it does not."""
    model = nn.Sequential(nn.Linear(23, 23), nn.ReLU())
    g1, g2 = capture(model, (23,), 23), capture(model, (23,), 46)
    act = [n.output_bytes for n in g1.nodes if n.kind == "addmm"][0]
    assert [n.output_bytes for n in g2.nodes if n.kind == "addmm"][0] == 2 * act
    assert g1.param_bytes == g2.param_bytes == 4 * (23 * 23 + 23)


def test_inplace_ops_stay_inplace_and_views_fold():
    model = parse_model("torchvision.models.resnet18()").build("meta")
    graph = capture(model, (3, 32, 32), 2)
    relus = [n for n in graph.nodes if n.kind == "relu_"]
    assert relus and all(n.inplace and n.output_bytes == 0 for n in relus)
    assert not any(graph.ops[i].role == "view" for n in graph.nodes for i in (n.op,))
    assert {n.module for n in graph.nodes} >= {"conv1", "layer1.0.conv1", "fc"}


def test_dtype_changes_bytes():
    model = nn.Sequential(nn.Linear(8, 8))
    g32 = capture(model, (8,), 4, torch.float32)
    g16 = capture(model, (8,), 4, torch.bfloat16)
    assert g16.param_bytes * 2 == g32.param_bytes
    assert g16.fingerprint != g32.fingerprint


def test_fingerprint_is_stable_and_shape_sensitive():
    model = parse_model("torchvision.models.resnet18()").build("meta")
    a, b = capture(model, (3, 32, 32), 2), capture(model, (3, 32, 32), 2)
    c = capture(model, (3, 64, 64), 2)
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_capture_of_large_batch_allocates_nothing():
    """ResNet-50 at batch 184: the graph of a 15 GB step, captured on fake tensors."""
    model = parse_model("torchvision.models.resnet50()").build("meta")
    graph = capture(model, (3, 224, 224), 184)
    assert graph.batch == 184 and len(graph.nodes) > 200


def test_capture_on_another_device_than_the_model():
    """A step captured for another device (`solve.py --device cuda` with the model built on
    the CPU; "meta" stands in for a GPU here) puts every tensor the step makes there: the
    incoming gradients and the channels-last weight-gradient copies included."""
    spec = parse_model("torchvision.models.resnet18()")
    model = spec.build("cpu").to(memory_format=torch.channels_last)
    on_meta = capture(model, (3, 32, 32), 2, device="meta")
    # kernels differ by device (layouts of weight gradients, CPU's pooling decomposition),
    # so the two graphs' ops differ; what they hold does not
    assert on_meta.grad_bytes == capture(model, (3, 32, 32), 2).grad_bytes
    devices = {
        n.meta["val"].device.type
        for n in on_meta.fx.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor)
    }
    assert devices == {"meta"}
