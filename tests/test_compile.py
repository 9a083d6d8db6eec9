"""compile(): the drop-in module, its parameters, state_dict, and the errors a user can cause."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.errors import FxpipeError
from fxpipe.models import GPT, MLP, ResNet


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_tied_embedding_stays_one_parameter_with_the_summed_gradient(frontend):
    model = GPT(layers=2).double()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 128, (2, 16))
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, tracer=frontend), example_inputs=(idx,))
    first, last = pipe.stages[0].module, pipe.stages[-1].module
    tied = [p for p in last.parameters() if p is model.wte.weight]
    assert tied and any(p is model.wte.weight for p in first.parameters())
    assert sum(p is model.wte.weight for p in pipe.parameters()) == 1
    assert pipe.shared_parameters() == {"wte.weight": [0, 2]}
    assert "shared parameter wte.weight: used by stages 0, 2" in repr(pipe)
    pipe(idx).square().mean().backward()
    reference(idx).square().mean().backward()
    torch.testing.assert_close(model.wte.weight.grad, reference.wte.weight.grad,
                               rtol=1e-12, atol=1e-14)


def test_parameters_are_the_models_own_objects_and_names():
    model = ResNet()
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2), example_inputs=(torch.randn(2, 3, 32, 32),))
    assert [(n, id(p)) for n, p in pipe.named_parameters()] == \
        [(n, id(p)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_state_dict_round_trips_between_plain_and_compiled(frontend):
    model, other = ResNet(), ResNet()
    # one micro-batch: the export graph is in training mode, where BatchNorm's statistics are
    # a micro-batch's
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, tracer=frontend, micro_batches=1),
                          example_inputs=(torch.randn(2, 3, 32, 32),))
    assert pipe.state_dict().keys() == model.state_dict().keys()
    other.load_state_dict(pipe.state_dict())
    for key, value in other.state_dict().items():
        assert torch.equal(value, model.state_dict()[key])
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    pipe.load_state_dict(other.state_dict())
    x = torch.randn(2, 3, 32, 32)
    pipe.eval() if frontend == "fx" else None
    other.train(pipe.training)
    torch.testing.assert_close(pipe(x), other(x))


def _seven_layers():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("change, name", [
    (lambda model, pipe: model.__setitem__(6, nn.Linear(8, 3)), "6"),
    (lambda model, pipe: setattr(model[0], "weight", nn.Parameter(torch.randn(8, 4))),
     "0.weight"),
    (lambda model, pipe: setattr(model[2], "bias", None), "2.bias"),
    (lambda model, pipe: model.append(nn.ReLU()), "7"),
    (lambda model, pipe: model.__delitem__(6), "6"),
    (lambda model, pipe: setattr(pipe, "6", nn.Linear(8, 3)), "6"),
])
def test_a_model_changed_after_compile_is_refused_before_any_work(change, name):
    """The stages hold the submodules and parameters compile saw: a run (or a save) after one
    is replaced would silently use the old one."""
    model = _seven_layers()
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, loss_fn=nn.MSELoss(),
                                             costs="none"), example_inputs=(x,))
    pipe(x).sum().backward()  # unchanged: runs
    pipe.zero_grad(set_to_none=True)
    change(model, pipe)
    message = (rf"Sequential's {re.escape(name)} changed after compile \(replaced, added or "
               r"removed\), and the pipeline's stages still run what compile saw; compile "
               "again after changing the model")
    for run in (lambda: pipe(x), lambda: pipe.step(x, y), pipe.state_dict,
                lambda: pipe.run_sequential(x)):
        with pytest.raises(FxpipeError, match=message):
            run()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("after", ["to", "double", "load_state_dict"])
def test_a_replaced_submodule_is_refused_also_after_to_or_a_load(after):
    """.to() and load_state_dict(assign=True) take the model's tensors into the stages again;
    a submodule replaced before them is still refused, not hidden."""
    model = _seven_layers()
    x = torch.randn(8, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, costs="none"),
                          example_inputs=(x,))
    model[2] = nn.Linear(8, 8)
    with pytest.raises(FxpipeError, match=r"Sequential's 2 changed after compile"):
        {"to": lambda: pipe.to(torch.float32), "double": pipe.double,
         "load_state_dict": lambda: pipe.load_state_dict(model.state_dict(), assign=True)
         }[after]()


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_buffer_assigned_after_compile_is_what_the_stages_use(frontend):
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).eval()
    x = torch.randn(8, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, costs="none",
                                             tracer=frontend), example_inputs=(x,))
    model[1].running_mean = torch.randn(8)
    torch.testing.assert_close(pipe(x), model(x))
    model.double()  # replaces every buffer
    x = x.double()
    torch.testing.assert_close(pipe(x), model(x))


def test_to_keeps_stages_on_the_models_buffers():
    model = ResNet()
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, tracer="export"),
                          example_inputs=(torch.randn(2, 3, 32, 32),))
    pipe.to(torch.float64)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    pipe(x)  # trains BatchNorm statistics: they must land in the model's buffers
    buffers = dict(pipe.named_buffers())
    for stage in pipe.stages:
        for name, buffer in stage.module.named_buffers():
            if name in buffers:
                assert buffer is buffers[name]
    assert model.stem[1].running_mean.dtype == torch.float64


def test_compiling_leaves_the_model_and_rng_untouched():
    model = ResNet()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 3, 32, 32)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    fxpipe.compile(model, fxpipe.Plan(stages=2), example_inputs=(x,))
    assert torch.equal(torch.rand(3), expected)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: neither fx nor export can trace it
            return x
        return -x


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.fc(x))


def test_untraceable_model_names_module_line_and_fixes():
    with pytest.raises(fxpipe.FxpipeTraceError) as err:
        fxpipe.compile(Untraceable(), fxpipe.Plan(stages=2), example_inputs=(torch.randn(2, 4),))
    message = str(err.value)
    assert "could not turn Untraceable into a graph (tried: fx, export)" in message
    assert "module 'gate' (Gate)" in message
    assert "test_compile.py" in message and "if x.sum() > 0:" in message
    assert "Plan(leaf_modules=" in message and "Plan(tracer='export')" in message


def test_leaf_module_makes_an_untraceable_model_traceable():
    model = Untraceable()
    plan = fxpipe.Plan(stages=2, tracer="fx", leaf_modules=[Gate])
    pipe = fxpipe.compile(model, plan, example_inputs=(torch.randn(2, 4),))
    assert [u.name for u in pipe.units] == ["fc", "gate"]
    x = torch.randn(2, 4)
    torch.testing.assert_close(pipe(x), model(x))


def test_more_stages_than_units_says_how_many_units():
    with pytest.raises(fxpipe.PlanError, match=r"cuts into 9 units \(0, 1, 2, .*use stages <= 9"):
        fxpipe.compile(MLP(), fxpipe.Plan(stages=12), example_inputs=(torch.randn(2, 32),))


def test_stage_sizes_that_do_not_cover_the_units():
    with pytest.raises(fxpipe.PlanError, match=r"covers 5 units, but MLP has 9 units; make the "
                                               r"sizes add up to 9"):
        fxpipe.compile(MLP(), fxpipe.Plan(stages=2, partitioner=[2, 3]),
                       example_inputs=(torch.randn(2, 32),))


def test_unavailable_cuda_device():
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 CUDA devices")
    plan = fxpipe.Plan(stages=2, devices=["cpu", "cuda:7"])
    with pytest.raises(fxpipe.PlanError, match=r"names 'cuda:7', but this machine has \d+ CUDA "
                                               r"device.*devices=\['cpu', 'cpu'\]"):
        fxpipe.compile(MLP(), plan, example_inputs=(torch.randn(2, 32),))


def test_missing_example_inputs():
    with pytest.raises(fxpipe.FxpipeError, match=r"needs one example batch.*example_inputs=\(x,\)"):
        fxpipe.compile(MLP(), fxpipe.Plan(stages=2))


def test_export_pipeline_runs_the_other_mode_through_the_model_traced_in_it():
    model = ResNet()
    x = torch.randn(2, 3, 32, 32)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, tracer="export", costs="none"),
                          example_inputs=(x,))
    pipe.train()  # same mode: the graph as traced
    pipe(x)  # BatchNorm's running statistics move, in the model's own buffers
    pipe.eval()
    torch.testing.assert_close(pipe(x), model.eval()(x))
    torch.testing.assert_close(pipe.run_sequential(x), model(x))
    assert pipe.twin.partition.sizes == pipe.partition.sizes  # the same stages
    with pytest.raises(FxpipeError, match=r"pipe.step_many runs the graph traced in training "
                                          r"mode, and the pipeline is in eval mode; call "
                                          r"pipe.train\(True\) first, or use pipe.step"):
        pipe.step_many([(x, torch.randint(0, 10, (2,)))])


def test_print_shows_stage_table_and_graph_with_send_recv_and_hooks():
    pipe = fxpipe.compile(ResNet(), fxpipe.Plan(stages=2),
                          example_inputs=(torch.randn(2, 3, 32, 32),))
    table = repr(pipe)
    assert "CompiledPipeline(ResNet): traced with fx, 20 units in 2 stages" in table
    assert "boundary values (shapes at the example batch):" in table
    graph = pipe.format_graph(stages=True)
    for word in ("hook0", "hook1", "stage0(hook0)", "send(", "recv(", "stage 1:", "def forward"):
        assert word in graph


def test_pipeline_groups_need_torchrun():
    with pytest.raises(fxpipe.PlanError, match=r"Plan\(groups=2\) replicates the pipeline over "
                                               r"ranks of a torchrun job; launch with torchrun "
                                               r"--nproc-per-node 4"):
        fxpipe.compile(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
                       fxpipe.Plan(stages=2, groups=2, costs="none"),
                       example_inputs=(torch.randn(4, 4),))


def test_more_micro_batches_than_example_samples():
    with pytest.raises(fxpipe.PlanError, match=r"splits the example batch of 4 samples into "
                                               r"more micro-batches than samples"):
        fxpipe.compile(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
                       fxpipe.Plan(stages=2, micro_batches=8, partitioner="even"),
                       example_inputs=(torch.randn(4, 4),))


def test_example_inputs_the_model_itself_rejects():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(fxpipe.FxpipeError, match=r"the example inputs do not run through "
                                                 r"Sequential itself \(RuntimeError: mat1"):
        fxpipe.compile(model, fxpipe.Plan(stages=2, costs="none"),
                       example_inputs=(torch.randn(4, 5),))


def test_a_planner_that_cannot_balance_this_model_says_so():
    model = nn.Sequential(nn.ReLU(), nn.Tanh(), nn.ReLU(), nn.Sigmoid())
    with pytest.raises(fxpipe.PlanError, match=r"Plan\(partitioner='params'\) cannot partition "
                                               r"Sequential: the cost table holds no parameter"):
        fxpipe.compile(model, fxpipe.Plan(stages=2, partitioner="params", costs="none"),
                       example_inputs=(torch.randn(4, 4),))


def test_step_without_a_target_says_where_the_target_goes():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(4, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, costs="none",
                                             loss_fn=torch.nn.functional.mse_loss),
                          example_inputs=(x,))
    with pytest.raises(fxpipe.FxpipeError, match=r"then the target as its last positional "
                                                 r"argument: pipe.step\(x, target\)"):
        pipe.step(x)


def test_costs_fit_times_two_sizes_and_models_time_by_flops():
    model = MLP()
    x = torch.randn(16, 32)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, costs="fit"),
                          example_inputs=(x,), cache=False)
    assert {4.0, 8.0} <= set(pipe.cost.sizes.tolist())  # measured at 8 and 4 samples
    assert len(pipe.cost.sizes) > 2  # tabulated at every B/p
    assert pipe.partition.predicted_time > 0
    torch.testing.assert_close(pipe(x), model(x))


def test_costs_fit_is_given_the_timed_loss_to_fit_apart_from_the_last_unit(monkeypatch):
    from fxpipe.compiler import passes

    given = []
    fit = passes.fit_to_flops
    monkeypatch.setattr(passes, "fit_to_flops",
                        lambda cost, flops, loss=None: given.append(loss) or fit(cost, flops, loss))
    x, y = torch.randn(16, 32), torch.randn(16, 10)
    fxpipe.compile(MLP(), fxpipe.Plan(stages=2, micro_batches=2, costs="fit",
                                      loss_fn=F.mse_loss),
                   example_inputs=(x,), example_target=y, cache=False)
    assert len(given) == 1
    loss = given[0]
    assert loss is not None and all(len(t) == 2 and (t > 0).all() for t in loss)  # 2 sizes


def test_compile_with_a_target_plans_with_the_loss_on_the_last_stage(monkeypatch):
    """On a timer that charges every unit's forward and backward 1 ms and the loss's forward
    20 ms (its backward 1 ms): the loss counts in the last unit, which lightens the last
    stage."""
    from fxpipe.passes.analysis import profile as profile_module

    def timer(device):
        def timed(fn, *args, **kwargs):  # the loss's forward is the only other call
            unit = isinstance(fn, torch.nn.Module) or getattr(fn, "__name__", "") == "backward"
            return fn(*args, **kwargs), 1e-3 if unit else 0.02
        return timed

    monkeypatch.setattr(profile_module, "_timer", timer)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(6)])
    x, y = torch.randn(16, 32), torch.randint(0, 32, (16,))
    plan = fxpipe.Plan(stages=2, micro_batches=4, loss_fn=F.cross_entropy,
                       partitioner="balanced")
    blind = fxpipe.compile(model, plan, example_inputs=(x,), cache=False)
    seeing = fxpipe.compile(model, plan, example_inputs=(x,), example_target=y, cache=False)
    assert (blind.cost.f == 1e-3).all() and (seeing.cost.f[:, :-1] == 1e-3).all()
    np.testing.assert_allclose(seeing.cost.f[:, -1], 1e-3 + 0.02)
    np.testing.assert_allclose(seeing.cost.b[:, -1], blind.cost.b[:, -1] + 1e-3)
    assert seeing.partition.sizes[-1] < blind.partition.sizes[-1] == 6  # the loss's stage lighter
    assert seeing.partition.stages[-1].f >= 0.02 > seeing.partition.stages[0].f


def test_a_target_of_several_tensors_is_timed_and_trained_as_pipe_step_cuts_it():
    model, x = MLP(), torch.randn(16, 32)
    target = {"labels": torch.randint(0, 10, (16,)), "weights": torch.rand(16)}
    sizes = []

    def weighted(output, target):  # the micro-batch's rows of both tensors
        sizes.append((len(output), len(target["labels"]), len(target["weights"])))
        per_sample = F.cross_entropy(output, target["labels"], reduction="none")
        return (per_sample * target["weights"]).mean()

    plan = fxpipe.Plan(stages=2, micro_batches=4, loss_fn=weighted)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), example_target=target, cache=False)
    assert sizes and set(sizes) == {(4, 4, 4)}  # timed on micro-batches of 4 rows
    sizes.clear()
    pipe.step(x, target)  # and on the first micro-batch's halves: is the loss a mean or a sum?
    assert sizes == [(4, 4, 4), (2, 2, 2), (2, 2, 2)] + [(4, 4, 4)] * 3


@pytest.mark.parametrize("plan, target, message", [
    (fxpipe.Plan(stages=2, micro_batches=4), torch.zeros(16, dtype=torch.long),
     r"compile\(example_target=...\) times the loss, which needs the plan's loss: give "
     r"Plan\(loss_fn=...\), or leave out the target"),
    (fxpipe.Plan(stages=2, micro_batches=4, loss_fn=F.cross_entropy),
     torch.zeros(15, dtype=torch.long), r"compile\(example_target=...\) needs a tensor with "
     r"one row per sample of the inputs \(16\), got 15 rows"),
    (fxpipe.Plan(stages=2, micro_batches=4, loss_fn=F.cross_entropy), torch.tensor(3),
     "one row per sample of the inputs, got a 0-d tensor"),
    (fxpipe.Plan(stages=2, micro_batches=4, loss_fn=F.cross_entropy), [0] * 16,
     "one row per sample of the inputs, got list"),
    (fxpipe.Plan(stages=2, costs="none", loss_fn=F.cross_entropy),
     torch.zeros(16, dtype=torch.long), r"Plan\(costs='none'\) times nothing: leave out the "
     "target"),
    (fxpipe.Plan(stages=2, loss_fn=F.cross_entropy, intra_layer=2),
     torch.zeros(16, dtype=torch.long), r"leave out the target with intra_layer"),
])
def test_compile_refuses_a_loss_it_cannot_time(plan, target, message, monkeypatch):
    from fxpipe.compiler import passes

    def trace(*args, **kwargs):  # every refusal comes before the model is traced
        raise AssertionError("traced before the target was checked")

    def profile_units(*args, **kwargs):  # the row count needs the traced batch, not timings
        raise AssertionError("timed before the target was checked")

    monkeypatch.setattr(passes, "profile_units", profile_units)
    if "rows" not in message:
        monkeypatch.setattr(passes, "trace", trace)
    with pytest.raises(FxpipeError, match=message):
        fxpipe.compile(MLP(), plan, example_inputs=(torch.randn(16, 32),), example_target=target,
                       cache=False)


def test_a_loss_that_takes_the_models_probabilities_only_is_timed_on_them():
    """The loss is timed on the model's own outputs: binary cross-entropy refuses values
    outside [0, 1], which a sigmoid's output never is."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1), nn.Sigmoid())
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16, 1)).float()
    plan = fxpipe.Plan(stages=2, micro_batches=2, loss_fn=F.binary_cross_entropy)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), example_target=y, cache=False)
    assert "with the loss timed on the last unit" in repr(pipe)
    torch.testing.assert_close(pipe.step(x, y), F.binary_cross_entropy(model(x), y))


@pytest.mark.parametrize("plan, message", [
    (fxpipe.Plan(stages=2, partitioner=[1, 2]), r"covers 3 units, but MLP has \d+ units"),
    (fxpipe.Plan(stages=2, micro_batches=32),
     r"splits the example batch of 16 samples into more micro-batches than samples"),
])
def test_plans_that_do_not_fit_the_model_are_refused_before_any_timing(plan, message,
                                                                        monkeypatch):
    from fxpipe.compiler import passes

    def profile_units(*args, **kwargs):
        raise AssertionError("timed before the plan was checked against the model")

    monkeypatch.setattr(passes, "profile_units", profile_units)
    with pytest.raises(fxpipe.PlanError, match=message):
        fxpipe.compile(MLP(), plan, example_inputs=(torch.randn(16, 32),), cache=False)


def _with_batch_norm():
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _pipe(model, x, **plan):
    return fxpipe.compile(model, fxpipe.Plan(stages=2, costs="none", **plan),
                          example_inputs=(x,))


_X, _Y = torch.randn(8, 4), torch.randn(8, 3)


@pytest.mark.parametrize("run, message", [
    (lambda model: fxpipe.Plan(stages=2, loss_fn=lambda output: output.sum()),
     r"Plan\(loss_fn=...\) cannot take the model's output and the target \(too many "
     r"positional arguments\); give loss_fn\(output, target\)"),
    (lambda model: fxpipe.compile(model, fxpipe.Plan(
        stages=2, micro_batches=2, loss_fn=nn.MSELoss(reduction="none")), example_inputs=(_X,),
        example_target=_Y, cache=False),
     r"Plan\(loss_fn=...\) must return one number, a 0-d tensor, and returned a tensor of "
     r"shape \[4, 3\]; reduce it over the samples: a mean \(e.g. "
     r"nn.MSELoss\(reduction='mean'\)\) or a sum \(reduction='sum'\)"),
    (lambda model: _pipe(model, _X, micro_batches=2, loss_fn=nn.MSELoss(reduction="none")
                         ).step(_X, _Y),
     r"must return one number, a 0-d tensor, and returned a tensor of shape \[4, 3\]"),
    (lambda model: _pipe(model, _X, micro_batches=2, loss_fn=lambda o, t: (o - t).abs().max()
                         ).step(_X, _Y),
     r"Plan\(loss_fn=...\) is neither a mean nor a sum over samples: on 4 samples it gives "
     r"[\d.]+, on 2 and 2 of them [\d.]+ and [\d.]+, so micro-batches' losses cannot make the "
     r"mini-batch's. Make it one .*or use micro_batches=1 and groups=1"),
    (lambda model: _pipe(model, _X, micro_batches=8, loss_fn=lambda o, t: (
        o - t).square().sum() / len(o) ** 0.5).step(_X, _Y),
     r"is neither a mean nor a sum over samples: on 2 samples it gives [\d.]+, on 1 and 1 of "
     r"them"),
    (lambda model: fxpipe.compile(_with_batch_norm(), fxpipe.Plan(stages=2, micro_batches=8),
                                  example_inputs=(_X,), cache=False),
     r"the batch norm layer '1' cannot train on a micro-batch of one sample: it normalises "
     r"each channel over the micro-batch, and gets one value per channel from a sample; "
     r"compile's example of 8, timed on micro-batches of \[1\] samples, makes micro-batches "
     r"of 1: use micro_batches <= 4, a larger batch, or eval mode"),
    (lambda model: fxpipe.compile(_with_batch_norm(), fxpipe.Plan(stages=2, micro_batches="auto"),
                                  example_inputs=(_X,), cache=False),
     r"timed on micro-batches of \[1, 2, 4, 8\] samples, makes micro-batches of 1"),
    (lambda model: _pipe(_with_batch_norm(), _X, micro_batches=4, loss_fn=nn.MSELoss()
                         ).step(_X[:5], _Y[:5]),
     r"the batch norm layer '1' cannot train on a micro-batch of one sample.*; this batch of 5 "
     r"makes micro-batches of 1: use micro_batches <= 2, a larger batch, or eval mode"),
    (lambda model: _pipe(_with_batch_norm(), _X, micro_batches=4)(_X[:4]),
     r"this batch of 4 makes micro-batches of 1: use micro_batches <= 2"),
    (lambda model: _pipe(model, _X, micro_batches=2)(_X[:0]),
     r"the batch is empty \(its inputs have 0 rows\); pass at least one sample"),
    (lambda model: _pipe(model, _X, loss_fn=nn.MSELoss()).step(_X[:0], _Y[:0]),
     r"the batch is empty \(its inputs have 0 rows\); pass at least one sample"),
    (lambda model: fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2),
                                  example_inputs=(_X[:0],), cache=False),
     r"compile's example batch is empty \(its inputs have 0 rows\); give one mini-batch of "
     r"samples as the example"),
])
def test_mistakes_are_named_with_their_fix_before_any_work(run, message):
    model = _seven_layers()
    with pytest.raises(FxpipeError, match=message):
        run(model)
    assert all(p.grad is None for p in model.parameters())


def test_a_batch_norm_layer_with_several_values_per_channel_trains_on_one_sample():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 3))
    x = torch.randn(4, 3, 8, 8)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=4), example_inputs=(x,),
                          cache=False)
    assert pipe.batch_norm is None
    pipe(x).sum().backward()


@pytest.mark.parametrize("stages, batch, expected", [(3, 8, 3), (3, 2, 2), (2, 1, 1)])
def test_by_default_compile_splits_one_micro_batch_per_stage_up_to_the_batch(
        capsys, stages, batch, expected):
    model = MLP()
    x, y = torch.randn(batch, 32), torch.randint(0, 10, (batch,))
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=stages, costs="none", dump=True,
                                             loss_fn=F.cross_entropy), example_inputs=(x,))
    assert pipe.plan.micro_batches == pipe.partition.micro_batches == expected
    dumped = capsys.readouterr().out
    assert f"{expected} micro-batches" in dumped  # the partition pass's line
    assert f"), {expected} micro-batch" in repr(pipe).splitlines()[0]
    pipe.step(x, y)
    forwards = [e.action.mb for e in pipe.last_trace() if e.stage == 0
                and e.action.kind is fxpipe.schedules.ActionKind.F]
    assert sorted(forwards) == list(range(expected))  # the schedule ran that many


@pytest.mark.parametrize("batch, expected", [(2, 1), (3, 1), (4, 2), (8, 2)])
def test_the_default_keeps_two_samples_a_micro_batch_for_a_batch_norm(batch, expected):
    """A batch norm layer that gets one value per channel from a sample cannot train on one
    sample, so the default count leaves it two, and the pipeline trains."""
    x = torch.randn(batch, 4)
    pipe = fxpipe.compile(_with_batch_norm(), fxpipe.Plan(stages=2), example_inputs=(x,),
                          cache=False)
    assert pipe.plan.micro_batches == expected
    pipe(x).sum().backward()
