"""Split-and-merge keeps the model's numerics, its parameters and its state_dict."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn

from fxpipe.passes.rewrite.split_merge import (
    GATHER,
    SHARD,
    ShardGroup,
    outline_shards,
    overlap_cost,
    split_merge,
    splittable_layers,
)

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BATCH_NORM = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
POOL = {"max": {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d},
        "avg": {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d},
        "adaptive": {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}}
ACTIVATIONS = (nn.ReLU, nn.Tanh, nn.GELU, nn.Sigmoid)
SIZE = {1: 8, 2: 6, 3: 4}


class Affine(nn.Module):
    """A per-channel scale and shift written as broadcasting elementwise ops."""

    def __init__(self, channels: int, dims: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(channels, *[1] * dims))
        self.shift = nn.Parameter(torch.randn(channels, *[1] * dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


class Stack(nn.Module):
    """Conv(-BN)-activation(-affine)(-pool) blocks, some residual, then flatten and a Linear."""

    def __init__(self, dims: int, channels: list[int], blocks: list[dict]) -> None:
        super().__init__()
        size, self.residual = SIZE[dims], []
        self.blocks = nn.ModuleList()
        for c_in, c_out, block in zip(channels, channels[1:], blocks):
            layers = [CONV[dims](c_in, c_out, 3, padding=1)]
            if block["bn"]:
                layers.append(BATCH_NORM[dims](c_out))
            layers.append(ACTIVATIONS[block["act"]]())
            if block["affine"]:
                layers.append(Affine(c_out, dims))
            pooled = block["pool"] is not None and size >= 2
            if pooled:
                layers.append(POOL[block["pool"]][dims](1 if block["pool"] == "adaptive" else 2))
                size = 1 if block["pool"] == "adaptive" else size // 2
            self.blocks.append(nn.Sequential(*layers))
            self.residual.append(block["residual"] and c_in == c_out and not pooled)
        self.head = nn.Linear(channels[-1] * size**dims, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, residual in zip(self.blocks, self.residual):
            x = block(x) + x if residual else block(x)
        return self.head(torch.flatten(x, 1))


class LinearStack(nn.Sequential):
    def __init__(self, widths: list[int], blocks: list[dict]) -> None:
        layers: list[nn.Module] = []
        for w_in, w_out, block in zip(widths, widths[1:], blocks):
            layers.append(nn.Linear(w_in, w_out))
            if block["bn"]:
                layers.append(nn.BatchNorm1d(w_out))
            layers += [ACTIVATIONS[block["act"]](), nn.Dropout(0.0)]
        super().__init__(*layers, nn.Linear(widths[-1], 2))


@st.composite
def models(draw, min_channels: int = 1, kinds=(1, 2, 3, "linear")):
    """A random float64 network, an input for it, and a device count."""
    kind = draw(st.sampled_from(kinds))
    depth = draw(st.integers(1, 3))
    widths = draw(st.lists(st.integers(min_channels, 6), min_size=depth + 1,
                           max_size=depth + 1))
    blocks = [{
        "bn": draw(st.booleans()),
        "act": draw(st.integers(0, len(ACTIVATIONS) - 1)),
        "affine": draw(st.booleans()),
        "pool": draw(st.sampled_from([None, "max", "avg", "adaptive"])),
        "residual": draw(st.booleans()),
    } for _ in range(depth)]
    batch = draw(st.integers(2, 3))
    torch.manual_seed(draw(st.integers(0, 2**16)))  # weights and input belong to the example
    if kind == "linear":
        model, x = LinearStack(widths, blocks), torch.randn(batch, widths[0])
    else:
        model = Stack(kind, widths, blocks)
        x = torch.randn(batch, widths[0], *[SIZE[kind]] * kind)
    devices = draw(st.integers(1, 4))
    return model.double().train(), x.double(), devices


def _rewrite(model, x, n, outlined=False, frontend="fx", **options):
    if frontend == "fx":
        gm = fx.symbolic_trace(model)
    else:
        gm = torch.export.export(model, (x,), strict=False).module()
    result = split_merge(gm, options.pop("layers", None), ["cpu"] * n, example_inputs=(x,),
                         **options)
    return result, outline_shards(result.gm) if outlined else result.gm


def _assert_same_step(model, reference, run, x):
    """One train-mode forward and backward: outputs, gradients and buffers agree."""
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = run(ours), reference(theirs)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-12)
    # a bias before a train-mode BatchNorm has gradient 0: both sides hold rounding noise
    # scaled by 1/sqrt(var), so the absolute tolerance follows the gradients' size
    scale = max(q.grad.abs().max().item() for q in reference.parameters())
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12 * (1 + scale),
                                   msg=lambda m, name=name: f"{name}: {m}")
    for (name, b), c in zip(model.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-10, atol=1e-12, msg=name)  # BatchNorm stats


@given(models(), st.booleans())
def test_outputs_gradients_and_running_stats_match_the_unsplit_model(case, outlined):
    model, x, n = case
    reference = copy.deepcopy(model)
    result, gm = _rewrite(model, x, n, outlined)
    _assert_same_step(model, reference, gm, x)
    for layer in result.layers:
        assert layer.shards == min(layer.channels, n)


@settings(max_examples=min(6, settings().max_examples))
@given(models(kinds=(2, 3)))
def test_exported_graphs_split_and_match_the_unsplit_model(case):
    model, x, n = case
    reference = copy.deepcopy(model)
    result, gm = _rewrite(model, x, max(n, 2), frontend="export")
    assert result.layers, "torch.export's aten.conv/aten.linear calls are splittable"
    _assert_same_step(model, reference, gm, x)


@given(models(min_channels=2))
def test_one_gather_per_merged_chain_and_no_more_than_mixing_ops(case):
    model, x, n = case
    n = max(n, 2)
    gm = fx.symbolic_trace(model)
    result = split_merge(gm, None, ["cpu"] * n, example_inputs=(x,))
    gathers = [node for node in result.gm.graph.nodes if GATHER in node.meta]
    assert len(gathers) == len(result.gathers)
    layers = {node.name for node in gm.graph.nodes if node.op == "call_module"
              and isinstance(gm.get_submodule(node.target), (nn.Conv1d, nn.Conv2d, nn.Conv3d,
                                                             nn.Linear))}
    flattens = [node for node in gm.graph.nodes if node.target is torch.flatten]
    assert len(gathers) <= len(layers) + len(flattens) + 1  # + the graph output
    if not any(getattr(model, "residual", ())):
        # without skips each chain's last value is the only one read whole: one gather per
        # chain, where gathering after every layer would take one per merged op
        assert all(len(chain.gathers) == 1 for chain in result.chains)
    merged = {op for chain in result.chains for op in chain.ops}
    per_channel = {node.name for node in gm.graph.nodes if node.op == "call_module"
                   and node.name not in layers and not isinstance(
                       gm.get_submodule(node.target), nn.Flatten)}
    per_channel |= {node.name for node in gm.graph.nodes
                    if node.op == "call_function" and node.target is not torch.flatten}
    assert per_channel <= merged, "every per-channel op after a split layer runs on shards"


@given(models())
def test_state_dict_is_unchanged_and_round_trips_into_the_plain_model(case):
    model, x, n = case
    keys = {k: v.shape for k, v in model.state_dict().items()}
    _, gm = _rewrite(model, x, n, outlined=True)
    assert list(gm.state_dict()) == list(keys)
    assert {k: v.shape for k, v in gm.state_dict().items()} == keys
    assert all(p is q for p, q in zip(gm.parameters(), model.parameters(), strict=True))
    with torch.no_grad():
        for p in gm.parameters():
            p.add_(torch.randn_like(p))
    plain = copy.deepcopy(model)
    plain.load_state_dict(gm.state_dict())
    plain.eval()
    gm.eval()
    torch.testing.assert_close(gm(x), plain(x), rtol=1e-10, atol=1e-12)


@given(models(), st.integers(1, 3), st.booleans())
def test_sgd_training_reaches_the_same_parameters(case, steps, outlined):
    model, x, n = case
    reference = copy.deepcopy(model)
    _, gm = _rewrite(model, x, n, outlined)
    for net, params in ((gm, model.parameters()), (reference, reference.parameters())):
        optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        for step in range(steps):
            optimizer.zero_grad()
            out = net(x + step)
            (out[0] if isinstance(out, tuple) else out).square().mean().backward()
            optimizer.step()
    for (name, p), q in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=name)


def test_more_devices_than_channels_uses_one_shard_per_channel():
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.ReLU(), nn.Conv2d(2, 5, 1)).double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    reference = copy.deepcopy(model)
    result = split_merge(fx.symbolic_trace(model), None, ["cpu"] * 4, example_inputs=(x,))
    assert [layer.shards for layer in result.layers] == [2, 4]
    assert [len(chain.devices) for chain in result.chains] == [2, 4]
    shards = {node.meta[SHARD].shard for node in result.gm.graph.nodes if SHARD in node.meta}
    assert shards == {0, 1, 2, 3}
    _assert_same_step(model, reference, result.gm, x)


def test_a_layer_that_does_not_exist_is_named_with_the_splittable_ones():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2))
    x = torch.randn(1, 3, 4, 4)
    gm = fx.symbolic_trace(model)
    assert splittable_layers(gm, (x,)) == ("0", "3")
    with pytest.raises(ValueError, match=r"names \['conv9'\].*splittable layers: 0, 3"):
        split_merge(gm, ["conv9"], ["cpu", "cpu"], example_inputs=(x,))
    with pytest.raises(ValueError, match="either layers"):
        split_merge(gm, ["0"], ["cpu"], threshold=0.3, costs={"0": 1.0}, example_inputs=(x,))
    with pytest.raises(ValueError, match="costs="):
        split_merge(gm, None, ["cpu"], threshold=0.3, example_inputs=(x,))
    with pytest.raises(ValueError, match="example_inputs"):
        split_merge(gm, None, ["cpu", "cpu"])


@given(st.lists(st.floats(0.01, 10.0), min_size=4, max_size=4), st.floats(0.05, 0.6))
def test_threshold_splits_the_layers_above_their_share_of_the_costs(times, threshold):
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.Linear(6, 3))
    names = ["0", "1", "2", "3"]  # "1" (ReLU) has a cost but cannot be split
    costs = dict(zip(names, times))
    result = split_merge(fx.symbolic_trace(model), None, ["cpu", "cpu"], threshold=threshold,
                         costs=costs, example_inputs=(torch.randn(2, 4),))
    expected = {n for n in ("0", "2", "3") if costs[n] / sum(times) > threshold}
    assert {layer.name for layer in result.layers} == expected


class Squeeze(nn.Module):
    """Depthwise conv, a per-channel gate computed from the chain itself, and a shortcut."""

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
        self.bn = nn.BatchNorm2d(4, momentum=momentum)
        self.depthwise = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.fc = nn.Linear(4, 4)
        self.shortcut = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.depthwise(F.relu(self.bn(self.conv(x))))
        gate = torch.sigmoid(self.fc(y.mean((2, 3))))
        return F.relu(y * gate[:, :, None, None] + self.shortcut(x))


@pytest.mark.parametrize("devices", [("cpu", "cpu"), ("cpu", "cpu:0")])
@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_depthwise_gate_and_shortcut_merge_and_match(devices, frontend):
    # torch.export cannot trace momentum=None (a cumulative average needs float(count))
    model = Squeeze(momentum=None if frontend == "fx" else 0.1).double()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    gm = fx.symbolic_trace(model) if frontend == "fx" else \
        torch.export.export(model, (x,), strict=False).module()
    result = split_merge(gm, None, devices, example_inputs=(x,))
    first = result.chains[0]
    assert len(first.layers) == 3  # conv, depthwise conv and shortcut share one chain
    assert len(first.gathers) == 2  # y for the gate's mean, and the output
    moves = [n for n in result.gm.graph.nodes
             if n.target in ("to", torch.ops.aten._to_copy.default)]
    assert bool(moves) == (devices[1] != "cpu")
    outlined = outline_shards(result.gm)
    assert {"chain0_0", "chain0_1"} <= set(dict(outlined.named_children()))
    for run in (result.gm, outlined):
        model.zero_grad()
        reference.zero_grad()
        _assert_same_step(model, reference, run, x)


def test_shard_groups_run_on_threads_and_keep_the_callers_grad_mode():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    gm = outline_shards(split_merge(fx.symbolic_trace(model), None, ["cpu"] * 3,
                                    example_inputs=(x,)).gm)
    groups = [m for m in gm.modules() if isinstance(m, ShardGroup)]
    assert len(groups) == 2 and all(g.concurrent and len(g.shards) == 3 for g in groups)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        assert not gm(x).requires_grad
    assert all(g._pool is not None for g in groups)
    clone = pickle.loads(pickle.dumps(gm))
    torch.testing.assert_close(clone(x), model(x), rtol=1e-12, atol=1e-12)


@given(st.integers(1, 16), st.floats(0, 10), st.floats(0, 10), st.floats(0, 10))
def test_overlap_cost_model_bounds(n, t_f, t_b, t_c):
    cost = overlap_cost(n, t_f, t_b, t_c)
    step = t_f + t_b + 2 * t_c
    if step == 0:
        return
    assert cost.t_no == pytest.approx(n * n * step)
    assert cost.t_o >= n * step - 1e-9 and cost.t_o <= cost.t_no + 1e-9
    assert 1 - 1e-9 <= cost.speedup <= n + 1e-9  # overlap never slows down, at most n-fold
    if n == 1:
        assert cost.speedup == pytest.approx(1.0)


def test_report_names_every_split_layer_and_chain():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16, 2))
    result = split_merge(fx.symbolic_trace(model), None, ["cpu", "cpu"],
                         example_inputs=(torch.randn(2, 3, 4, 4),))
    text = result.format()
    assert "2 layer(s) split, 2 merged chain(s), 2 gather(s)" in text
    assert "_0 -> _1 -> _2" in text
    assert result.chains[0].ops == ("_1", "_2")
    predicted = result.predict(1.0, 2.0, 0.5)
    assert predicted.n == 2 and predicted.speedup > 1


def test_rewritten_graph_still_cuts_into_the_same_units_and_stages():
    from fxpipe.passes.rewrite.stages import split_stages
    from fxpipe.units import cut_units

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16, 2)).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    gm = fx.symbolic_trace(model)
    units = cut_units(gm)
    result = split_merge(gm, None, ["cpu", "cpu"], example_inputs=(x,))
    for node in result.gm.graph.nodes:
        if node.op not in ("placeholder", "get_attr", "output"):
            assert "fxpipe.unit" in node.meta, f"{node.name} lost its unit"
    pipeline, _ = split_stages(result.gm, units, [2, len(units)], ["cpu", "cpu"])
    torch.testing.assert_close(pipeline(x), model(x), rtol=1e-12, atol=1e-12)
