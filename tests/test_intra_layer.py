"""Plan(intra_layer=...): heavy layers split over shards inside their stage, same numbers."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.models import VGG, ResNet


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_split_stages_train_like_the_plain_model(frontend, schedule):
    torch.manual_seed(0)
    model = ResNet().double()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 3, 32, 32, dtype=torch.float64)
    y = torch.randint(0, 10, (6,))
    plan = fxpipe.Plan(stages=2, schedule=schedule, tracer=frontend, loss_fn=F.cross_entropy,
                       intra_layer={"shards": 2, "threshold": 0.1},
                       micro_batches=1)  # BatchNorm: the whole batch's statistics, as the model's
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    assert pipe.intra_layer and all(split.result.layers for split in pipe.intra_layer)
    loss = pipe.step(x, y)
    expected = F.cross_entropy(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
    for a, b in zip(pipe.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(a, b)
    assert pipe.state_dict().keys() == reference.state_dict().keys()


def test_named_layers_are_split_and_reported():
    model = VGG()
    plan = fxpipe.Plan(stages=2, costs="none", partitioner=[11, 11],
                       intra_layer={"layers": ["features.13", "classifier.1"], "shards": 2})
    assert [u.name for u in fxpipe.units_of(model, (torch.randn(4, 3, 32, 32),))][10:14] == [
        "features.10", "features.11", "features.12", "features.13"]
    pipe = fxpipe.compile(model, plan, example_inputs=(torch.randn(4, 3, 32, 32),))
    (split,) = pipe.intra_layer
    assert split.stage == 1
    assert [layer.name for layer in split.result.layers] == ["features.13", "classifier.1"]
    text = repr(pipe)
    assert "split features.13 (Conv2d, 64 channels) -> 2 shards of [32, 32]" in text
    assert "eqs. 11-13 (n=2)" in text and "gather(s)" in text
    model.eval()
    x = torch.randn(4, 3, 32, 32)
    pipe.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))


@pytest.mark.parametrize("spec, message", [
    (1, r"asks for 1 shards; splitting a layer needs at least 2"),
    ({"shards": 2, "threshold": 1.5}, r"must be a share of the stage's time between 0 and 1"),
    ({"shards": 2, "colour": 1}, r"unknown keys \['colour'\]"),
    ({"devices": [["cpu", "cpu"]]}, r"gives 1 device lists for stages=2"),
    ("two", r"must be a shard count such as 2"),
])
def test_bad_intra_layer_specs(spec, message):
    with pytest.raises(fxpipe.PlanError, match=message):
        fxpipe.Plan(stages=2, intra_layer=spec)


def test_threshold_needs_measured_costs():
    with pytest.raises(fxpipe.PlanError, match=r"picks layers by their measured share"):
        fxpipe.Plan(stages=2, costs="none", intra_layer=2)


def test_a_split_output_layer_calibrates_and_reports():
    """A split layer's output is gathered under a new name; the steps' loss and the report
    take the model's output from the rewritten graph's names."""
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    plan = fxpipe.Plan(stages=2, micro_batches=2, loss_fn=F.cross_entropy, partitioner=[11, 11],
                       intra_layer={"layers": ["classifier.6"], "shards": 2})
    pipe = fxpipe.compile(VGG(), plan, example_inputs=(x,), cache=False)
    assert [layer.name for split in pipe.intra_layer for layer in split.result.layers] == [
        "classifier.6"]
    calibration = fxpipe.calibrate(pipe, x, target=y, steps=2, warmup=0)
    pipe.step(x, y)
    assert "calibrated" in pipe.report(file=io.StringIO(), calibration=calibration)
