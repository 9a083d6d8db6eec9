"""compile(): the drop-in module, its parameters, state_dict, and the errors a user can cause."""

from __future__ import annotations

import copy
import importlib
import os
import time

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
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, tracer=frontend),
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


def test_export_pipeline_refuses_a_mode_it_was_not_traced_in():
    pipe = fxpipe.compile(ResNet(), fxpipe.Plan(stages=2, tracer="export"),
                          example_inputs=(torch.randn(2, 3, 32, 32),))
    pipe.train()  # same mode: fine
    with pytest.raises(fxpipe.FxpipeError, match=r"traced in training mode and torch.export "
                                                 r"fixes BatchNorm and dropout"):
        pipe.eval()


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
    from fxpipe.compile import front

    given = []
    fit = front.fit_to_flops
    monkeypatch.setattr(front, "fit_to_flops",
                        lambda cost, flops, loss=None: given.append(loss) or fit(cost, flops, loss))
    x, y = torch.randn(16, 32), torch.randn(16, 10)
    fxpipe.compile(MLP(), fxpipe.Plan(stages=2, micro_batches=2, costs="fit",
                                      loss_fn=F.mse_loss),
                   example_inputs=(x,), example_target=y, cache=False)
    assert given  # again where the stages then run on one thread, timed afresh (retime)
    for loss in given:
        assert loss is not None and all(len(t) == 2 and (t > 0).all() for t in loss)  # 2 sizes


def test_retime_scores_the_compiled_partition_with_fresh_timings():
    model, x = MLP(), torch.randn(16, 32)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=4), example_inputs=(x,),
                          cache=False)
    fresh = fxpipe.retime(pipe, x)
    assert fresh.bounds == pipe.partition.bounds
    assert fresh.micro_batches == pipe.partition.micro_batches == 4
    assert all(s.f > 0 and s.b > 0 for s in fresh.stages)
    assert fresh.stages != pipe.partition.stages  # timed again, not read back
    assert pipe.predicted_timeline(fresh).makespan > 0


@pytest.mark.parametrize("under_torchrun", [False, True])
def test_retime_times_each_stage_as_a_run_of_its_own_where_a_rank_holds_one(monkeypatch,
                                                                             under_torchrun):
    retime_module = importlib.import_module("fxpipe.compile.retime")  # the function shadows it
    profile_module = importlib.import_module("fxpipe.passes.analysis.profile")
    model, x = MLP(), torch.randn(16, 32)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, micro_batches=4), example_inputs=(x,),
                          cache=False)
    timed, fused = set(), profile_module._fused

    def recorded(table, modules, run):  # each run of units the profile times on its own
        timed.add((run.start, run.stop))
        return fused(table, modules, run)

    monkeypatch.setattr(profile_module, "_fused", recorded)
    monkeypatch.setattr(retime_module, "launched", lambda: under_torchrun)
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", lambda shared, src: None)
    fresh = fxpipe.retime(pipe, x)
    (a, b, c) = pipe.partition.bounds
    assert timed == ({(0, a), (a, b), (b, c)} if under_torchrun else {(0, c)})
    assert fresh.bounds == pipe.partition.bounds and all(s.f > 0 for s in fresh.stages)


def test_retime_with_a_target_times_the_loss_on_the_last_stage():
    model, x, y = MLP(), torch.randn(16, 32), torch.randint(0, 10, (16,))

    def slow_loss(output, target):  # 20 ms a micro-batch: far above the units' timing noise
        time.sleep(0.02)
        return F.cross_entropy(output, target)

    plan = fxpipe.Plan(stages=2, micro_batches=4, loss_fn=slow_loss)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), cache=False)
    with_loss = fxpipe.retime(pipe, x, target=y, warmup=0, repeats=1)
    assert with_loss.stages[-1].f >= 0.02 > with_loss.stages[0].f


@pytest.mark.parametrize("plan, target, message", [
    (fxpipe.Plan(stages=2, micro_batches=4), torch.zeros(16, dtype=torch.long),
     r"retime\(target=...\) times the loss, which needs the plan's loss: give "
     r"Plan\(loss_fn=...\)"),
    (fxpipe.Plan(stages=2, micro_batches=4, loss_fn=F.cross_entropy),
     torch.zeros(15, dtype=torch.long), "one row per sample of the inputs \\(16\\), got 15 rows"),
    (fxpipe.Plan(stages=2, micro_batches=4, loss_fn=F.cross_entropy), [0] * 16,
     r"needs a tensor \(or a tuple, list or dict of them\) with one row per sample of the "
     "inputs, got list"),
])
def test_retime_refuses_a_loss_it_cannot_time(plan, target, message):
    model, x = MLP(), torch.randn(16, 32)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), cache=False)
    with pytest.raises(FxpipeError, match=message):
        fxpipe.retime(pipe, x, target=target)


def test_compile_with_a_target_plans_with_the_loss_on_the_last_stage():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(6)])
    x, y = torch.randn(16, 32), torch.randint(0, 32, (16,))

    def slow_loss(output, target):  # 20 ms a micro-batch: far above the units' timing noise
        time.sleep(0.02)
        return F.cross_entropy(output, target)

    plan = fxpipe.Plan(stages=2, micro_batches=4, loss_fn=slow_loss, partitioner="balanced")
    blind = fxpipe.compile(model, plan, example_inputs=(x,), cache=False)
    seeing = fxpipe.compile(model, plan, example_inputs=(x,), example_target=y, cache=False)
    assert (seeing.cost.f[:, -1] >= 0.02).all() and (blind.cost.f[:, -1] < 0.02).all()
    assert seeing.partition.sizes[-1] < blind.partition.sizes[-1]  # the loss's stage lighter
    assert seeing.partition.stages[-1].f >= 0.02 > seeing.partition.stages[0].f


def test_a_target_of_several_tensors_is_timed_and_trained_as_pipe_step_cuts_it():
    model, x = MLP(), torch.randn(16, 32)
    target = {"labels": torch.randint(0, 10, (16,)), "weights": torch.rand(16)}
    sizes = []

    def weighted(output, target):  # the micro-batch's rows of both tensors
        sizes.append((len(target["labels"]), len(target["weights"])))
        per_sample = F.cross_entropy(output, target["labels"], reduction="none")
        return (per_sample * target["weights"]).mean()

    plan = fxpipe.Plan(stages=2, micro_batches=4, loss_fn=weighted)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), example_target=target, cache=False)
    assert sizes and set(sizes) == {(4, 4)}  # timed on micro-batches of 4 rows
    fresh = fxpipe.retime(pipe, x, target=target)
    assert fresh.stages[-1].f > 0
    sizes.clear()
    pipe.step(x, target)
    assert sizes == [(4, 4)] * 4


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
    local = importlib.import_module("fxpipe.compile.local")

    def trace_and_cut(*args):  # every refusal comes before the model is traced
        raise AssertionError("traced before the target was checked")

    if "rows" not in message:  # the row count needs the traced inputs' batch dimension
        monkeypatch.setattr(local, "trace_and_cut", trace_and_cut)
    with pytest.raises(FxpipeError, match=message):
        fxpipe.compile(MLP(), plan, example_inputs=(torch.randn(16, 32),), example_target=target,
                       cache=False)


def test_the_units_are_timed_beside_every_stage_thread_on_the_cpu():
    """However many cores there are: the threads beyond them share the cores in the simulator."""
    from fxpipe.compile.front import busy_stages
    assert busy_stages(["cpu"] * 4096) == 4096
    assert busy_stages(["cpu", "cuda:0", "cpu"]) == 2
    assert busy_stages(["cuda:0", "cuda:1"]) == 1


@pytest.mark.parametrize("cores, stages, costs, measured", [
    (1, 2, "measure", True), (2, 2, "measure", True), (4, 2, "measure", True),
    (2, 1, "measure", False), (1, 2, "none", False)])
def test_compile_measures_the_thread_capacity_of_two_or_more_stage_threads(
        monkeypatch, cores, stages, costs, measured):
    """How much work one thread and as many as the stages get through is measured wherever two
    or more stage threads compute, past the cores or not (with one core, one thread is as many
    as the cores; with more, as many as the stages); with one stage, or nothing timed, it is
    not."""
    import importlib

    front = importlib.import_module("fxpipe.compile.front")
    monkeypatch.setattr(front, "usable_cores", lambda: cores)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(8, 8)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=stages, micro_batches=2, costs=costs),
                          example_inputs=(x,), cache=False)
    if measured:
        capacity = pipe.thread_capacity
        assert (capacity.cores, capacity.stages) == (cores, stages)
        assert capacity.at_stages > 0
        assert capacity.at_cores == (1.0 if cores == 1 else capacity.at_stages)
        assert capacity.past_the_cores == (stages > cores)
    else:
        assert pipe.thread_capacity is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="binding stage threads to cores needs 2 CPUs and Linux")
@pytest.mark.parametrize("affinity, mostly_cores, bound", [
    ("auto", True, True), ("auto", False, False), ("none", True, False)])
def test_stage_threads_past_the_cores_are_bound_round_them(monkeypatch, affinity,
                                                           mostly_cores, bound):
    """Three stage threads on 2 CPUs: bound round them, each stage's forward runs there, and
    the prediction shares each core between its stages, only with cpu_affinity="auto" and
    where what they share is mostly the cores."""
    from fxpipe.passes.analysis.capacity import ThreadCapacity

    local = importlib.import_module("fxpipe.compile.local")
    at_stages = 1.2 if mostly_cores else 0.9  # of one thread's work, against BIND_FROM 1.0
    monkeypatch.setattr(local, "measure_thread_capacity",
                        lambda *args, **kwargs: ThreadCapacity(2, 3, 1.5, at_stages))
    where = os.sched_getaffinity
    cpus = sorted(where(0))[:2]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 4))
    x = torch.randn(8, 8)
    # even: a Linear in every stage, whatever the timings (a timed partition may give a stage
    # a ReLU alone)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, micro_batches=2, cpu_affinity=affinity,
                                             partitioner="even"),
                          example_inputs=(x,), cache=False)
    ran_on = {}
    for s, stage in enumerate(pipe.stages):  # each stage's first layer says where it runs
        layer = next(m for m in stage.modules() if isinstance(m, nn.Linear))
        layer.register_forward_pre_hook(
            lambda module, args, s=s: ran_on.__setitem__(s, where(0)))
    try:
        pipe(x).sum().backward()
        placed, seen, shown = pipe.bound_cores(), dict(ran_on), repr(pipe)
        simulated = []  # what the prediction gives the simulator
        monkeypatch.setattr(fxpipe.pipeline, "simulate",
                            lambda *args, **kwargs: simulated.append(kwargs["bound"]))
        pipe.predicted_timeline()
        pipe.executor.driver.bind({})  # a stage left out runs where the process could
        ran_on.clear()
        pipe(x)
        let_go = dict(ran_on)
    finally:
        monkeypatch.undo()  # the real sched_getaffinity again, and every stage let go
        everywhere = os.sched_getaffinity(0)
        pipe.executor.driver.bind({s: everywhere for s in range(3)})
        pipe(x)  # its workers let go of their cores
    if bound:
        assert seen == {0: {cpus[0]}, 1: {cpus[1]}, 2: {cpus[0]}}
        assert placed == simulated[0] == {0: 0, 1: 1, 2: 0}
        assert let_go == {s: set(cpus) for s in range(3)}
        assert (f"stage threads bound to cores (Plan(cpu_affinity='auto'), as they outnumber "
                f"the cores): stage 0 on CPU {cpus[0]}, stage 1 on CPU {cpus[1]}, stage 2 on "
                f"CPU {cpus[0]}; the prediction shares each core") in shown
    else:
        assert placed is None and simulated == [None] and "bound to cores" not in shown
        assert all(len(c) >= 2 for c in seen.values())


def test_a_stage_run_on_the_callers_thread_is_never_bound():
    """One stage here (as under torchrun, one per rank) runs inline, on the caller's thread,
    which binding a stage must leave where it is."""
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(8, 8)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=1, micro_batches=2), example_inputs=(x,),
                          cache=False)
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    pipe.executor.driver.bind({0: [0]})
    pipe(x).sum().backward()
    assert pipe.executor.driver.cores_of == {} and pipe.bound_cores() is None
    if before is not None:
        assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("threads, at_stages, shared, timed_beside", [
    ("auto", 0.7, [(2, 1, 0)], 1), ("auto", 1.2, [], 3), ("stage", 0.7, [], 3),
    (2, 1.2, [(2, 0)], 2)])
def test_stages_run_on_one_thread_where_the_interpreter_lock_sets_their_pace(
        monkeypatch, threads, at_stages, shared, timed_beside):
    """Three stage threads on 2 cores: with stage_threads="auto", on one thread only where
    as many threads got through less than one thread's work at once; with a number, on that
    many. The units are timed beside as many busy threads, a thread's actions never overlap,
    its stages' messages to each other take no time in the prediction, and the output is the
    model's."""
    from fxpipe.passes.analysis.capacity import ThreadCapacity

    local = importlib.import_module("fxpipe.compile.local")
    monkeypatch.setattr(local, "measure_thread_capacity",
                        lambda *args, **kwargs: ThreadCapacity(2, 3, 1.0, at_stages))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 4))
    x = torch.randn(8, 8)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, micro_batches=2, partitioner="even",
                                             cpu_affinity="none", stage_threads=threads),
                          example_inputs=(x,), cache=False)
    assert pipe.shared_threads() == shared
    assert pipe.timing.concurrency == timed_beside
    on_shared = {s for group in shared for s in group}
    assert set(pipe.thread_costs) == on_shared
    for s, costs in pipe.thread_costs.items():  # a figure where the stage has such actions
        assert costs.between > 0
        assert (costs.send_f > 0, costs.recv_b > 0) == (s < 2, s < 2)
        assert (costs.recv_f > 0, costs.send_b > 0) == (s > 0, s > 0)
    torch.testing.assert_close(pipe(x), model(x))
    timeline = pipe.predicted_timeline()
    for group in shared:
        done = sorted((e for e in timeline.events if e.stage in group),
                      key=lambda e: (e.start, e.end))
        assert all(a.end <= b.start + 1e-12 for a, b in zip(done, done[1:]))
    for transfer in timeline.transfers:  # a message's time on the link
        src, dst = transfer.action.stage, transfer.action.peer
        same = any(src in group and dst in group for group in shared)
        assert (transfer.duration == 0) == same
    assert ("stage threads: one thread runs the 3 stages" in repr(pipe)) == (threads == "auto"
                                                                            and bool(shared))


@pytest.mark.parametrize("at_stages, shared", [(0.7, [(1, 0)]), (1.2, [])])
def test_two_stage_threads_within_the_cores_run_on_one_where_the_lock_sets_their_pace(
        monkeypatch, at_stages, shared):
    """Two stage threads on 2 cores: on one thread where two got through less than one
    thread's work at once, timed beside no other then; a core each is never bound (nothing
    to share), and the output is the model's either way."""
    from fxpipe.passes.analysis.capacity import ThreadCapacity

    local = importlib.import_module("fxpipe.compile.local")
    monkeypatch.setattr(local, "measure_thread_capacity",
                        lambda *args, **kwargs: ThreadCapacity(2, 2, at_stages, at_stages))
    monkeypatch.setattr(local, "usable_cpus", lambda: [0, 1])
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(8, 8)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, partitioner="even"),
                          example_inputs=(x,), cache=False)
    assert pipe.shared_threads() == shared
    assert pipe.timing.concurrency == (1 if shared else 2)
    assert pipe.bound_cores() is None
    torch.testing.assert_close(pipe(x), model(x))
    assert ("stage threads: one thread runs the 2 stages" in repr(pipe)) == bool(shared)


def test_stages_on_one_thread_must_share_a_device():
    from fxpipe.compile.local import check_stage_threads, deal_stages

    assert deal_stages(range(5), 2) == [(4, 2, 0), (3, 1)]
    assert deal_stages(range(2), 3) == [(0,), (1,)]
    check_stage_threads(fxpipe.Plan(stages=2, stage_threads=1), ["cpu", "cpu"])
    with pytest.raises(fxpipe.PlanError, match=r"runs stages \[0, 1\] on one thread, but they "
                                               r"are on cpu, cuda:0; one thread runs"):
        check_stage_threads(fxpipe.Plan(stages=2, stage_threads=1), ["cpu", "cuda:0"])


def test_a_shared_threads_sends_and_receives_take_what_they_took_on_it(monkeypatch):
    """Each SEND and RECV of a stage on a shared thread takes, in the prediction, its own
    figure for its direction and the thread's time between actions, and so does every
    compute beside the units' time and the runtime's per action; the stage's first forward
    and first backward in its list also take its figures for them."""
    from fxpipe.passes.analysis.capacity import ThreadCapacity
    from fxpipe.runtime.executor import ThreadCosts
    from fxpipe.schedules import ActionKind as K

    local = importlib.import_module("fxpipe.compile.local")
    monkeypatch.setattr(local, "measure_thread_capacity",
                        lambda *args, **kwargs: ThreadCapacity(2, 3, 1.0, 0.7))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 4))
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=3, micro_batches=2, partitioner="even",
                                             schedule="1f1b", cpu_affinity="none"),
                          example_inputs=(torch.randn(8, 8),), cache=False)
    assert pipe.shared_threads() == [(2, 1, 0)]
    costs = {s: ThreadCosts(*(k * (s + 1) * 1e-3 for k in (1, 10, 20, 30, 40, 50, 60)))
             for s in range(3)}
    vars(pipe).update(thread_costs=costs, forward_switch=(0.0,) * 3,  # no switches: each
                      backward_switch=(0.0,) * 3)  # compute at its own figures
    figure = {K.SEND_F: "send_f", K.SEND_B: "send_b", K.RECV_F: "recv_f", K.RECV_B: "recv_b"}
    first = {K.F: "first_f", K.B: "first_b"}
    stages = pipe.partition.stages
    compute = {K.F: lambda s: stages[s].f + pipe.forward_overhead[s],
               K.B: lambda s: stages[s].b + pipe.backward_overhead[s]}
    timeline = pipe.predicted_timeline()
    firsts = {next(a for a in actions if a.kind is kind)
              for actions in timeline.schedule.actions for kind in first}
    for e in timeline.events:
        c = costs[e.stage]
        own = (getattr(c, figure[e.action.kind]) if e.action.kind in figure
               else compute[e.action.kind](e.stage))
        own += getattr(c, first[e.action.kind]) if e.action in firsts else 0.0
        assert e.duration == pytest.approx(own + c.between, rel=1e-6), e.action


def test_a_shared_threads_first_computes_of_a_step_are_measured_apart(monkeypatch):
    """A stage on a shared thread whose first forward of each step runs 20 ms longer than
    its others: its first_f figure is that much, its first_b and the other stages' as they
    were."""
    from fxpipe.passes.analysis.capacity import ThreadCapacity

    local = importlib.import_module("fxpipe.compile.local")
    monkeypatch.setattr(local, "measure_thread_capacity",
                        lambda *args, **kwargs: ThreadCapacity(2, 2, 0.7, 0.7))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x, p, slowed = torch.randn(8, 8), 4, 1
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=p, partitioner="even",
                                             schedule="1f1b"),
                          example_inputs=(x,), cache=False)
    assert pipe.shared_threads() == [(1, 0)]
    plain = pipe.measure_thread_costs(x)
    calls = []

    def slow_first_of_each_step(module, args):
        calls.append(None)
        if len(calls) % p == 1:  # each step runs the stage's p forwards
            time.sleep(0.02)

    hook = pipe.executor.runners[slowed].stage.module.register_forward_pre_hook(
        slow_first_of_each_step)
    try:
        slower = pipe.measure_thread_costs(x)
    finally:
        hook.remove()
    assert len(calls) % p == 0 and calls
    assert slower[slowed].first_f - plain[slowed].first_f == pytest.approx(0.02, abs=5e-3)
    assert slower[slowed].first_b == pytest.approx(plain[slowed].first_b, abs=5e-3)
    assert slower[1 - slowed].first_f == pytest.approx(plain[1 - slowed].first_f, abs=5e-3)


def test_a_number_of_stage_threads_is_refused_under_torchrun():
    """Each rank runs its one stage on a thread of its own: a number of threads for several
    stages would be silently ignored there, so it fails first."""
    from fxpipe.compile.distributed import compile_distributed

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(fxpipe.PlanError, match=r"Plan\(stage_threads=1\) runs several stages "
                                               r"of one process on a thread; under torchrun"):
        compile_distributed(model, fxpipe.Plan(stages=2, stage_threads=1),
                            (torch.randn(4, 8),), {}, None)
