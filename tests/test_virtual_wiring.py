"""Several stages per device, end to end: Plan(stages_per_device=v) with interleaved-1f1b,
looped-bfs, zbv and dualpipev trains like the plain model, one worker thread per device (several
stages per rank under torchrun: tests/runtime/test_distributed.py)."""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_zero_bubble import _case

import fxpipe
from fxpipe.cost import Partition
from fxpipe.distributed import RankLayout, rank_layout
from fxpipe.errors import PlanError
from fxpipe.schedules import (
    interleaved_one_f_one_b,
    looped_bfs,
    one_f_one_b,
    round_robin,
    v_shape,
)

# (schedule, stages per device): every schedule that places stages itself, as Plan takes it
CASES = [("interleaved-1f1b", 1), ("interleaved-1f1b", 2), ("looped-bfs", 1), ("looped-bfs", 2),
         ("zbv", 2), ("dualpipev", 2)]


def _plan(schedule, v, n, p, loss_fn, **extra):
    return fxpipe.Plan(stages=n * v, stages_per_device=v, schedule=schedule, micro_batches=p,
                       loss_fn=loss_fn, costs="none", devices=["cpu"] * n, **extra)


def _assert_grads_like(pipe, reference, what):
    names = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():  # tied weights: one Parameter, summed
        torch.testing.assert_close(param.grad, names[name].grad, rtol=1e-10, atol=1e-12,
                                   msg=f"{what}: {name}")


@st.composite
def cases(draw: st.DrawFn):
    schedule, v = draw(st.sampled_from(CASES))
    n = 2
    # interleaved-1f1b with v >= 2 runs micro-batches in groups of one per device, dualpipev
    # at least one per stage
    p = draw(st.sampled_from([2, 4]) if schedule == "interleaved-1f1b" and v > 1
             else st.integers(n * v, 6) if schedule == "dualpipev" else st.integers(1, 5))
    return schedule, v, n, p


@settings(max_examples=12, deadline=None)
@given(case=cases(), name=st.sampled_from(["skipnet", "gpt"]), seed=st.integers(0, 2**16))
def test_virtual_stages_train_like_the_plain_model(case, name, seed):
    """pipe.step and the drop-in forward/backward give the plain model's loss, output and
    gradients (float64; GPT's tied weights summed over its stages), and hold nothing after."""
    schedule, v, n, p = case
    model, x, y, loss_fn = _case(name, 6, seed)
    reference = copy.deepcopy(model)
    pipe = fxpipe.compile(model, _plan(schedule, v, n, p, loss_fn), example_inputs=(x,))
    lowered = pipe.executor.schedule
    assert lowered.devices == n and lowered.name == schedule
    assert list(pipe.devices) == ["cpu"] * (n * v)
    placement = v_shape(n * v) if schedule in ("zbv", "dualpipev") else round_robin(n * v, n)
    assert lowered.placement == placement

    loss = pipe.step(x, y)
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    _assert_grads_like(pipe, reference, "step")
    assert pipe.executor.in_flight() == [0] * (n * v)

    for module in (pipe, reference):
        module.zero_grad()
    out = pipe(x)
    torch.testing.assert_close(out, reference(x), rtol=1e-12, atol=1e-12)
    loss_fn(out, y).backward()
    loss_fn(reference(x), y).backward()
    _assert_grads_like(pipe, reference, "drop-in")
    assert pipe.executor.in_flight() == [0] * (n * v)


@pytest.mark.parametrize(("schedule", "v"), [("interleaved-1f1b", 2), ("zbv", 2)])
def test_a_devices_stages_run_on_one_worker_thread(schedule, v):
    model, x, y, loss_fn = _case("skipnet", 6, 0)
    pipe = fxpipe.compile(model, _plan(schedule, v, 2, 2, loss_fn), example_inputs=(x,))
    threads = defaultdict(set)
    for stage in pipe.stages:
        stage.module.register_forward_hook(
            lambda module, args, out, s=stage.index: threads[s].add(threading.get_ident()))
    pipe.step(x, y)
    lowered = pipe.executor.schedule
    assert sorted(threads) == list(range(4))
    assert all(len(idents) == 1 for idents in threads.values())
    per_device = [{next(iter(threads[s])) for s in lowered.stages_on(d)} for d in range(2)]
    assert all(len(idents) == 1 for idents in per_device)  # a device's stages: one thread
    assert per_device[0] != per_device[1]  # the two devices: two threads, at once


def test_the_pipeline_says_which_device_each_stage_is_on():
    model, x, _, loss_fn = _case("skipnet", 6, 0)
    pipe = fxpipe.compile(model, _plan("zbv", 2, 2, 2, loss_fn), example_inputs=(x,))
    text = repr(pipe)
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert [row[:4] for row in rows] == [[str(s), "cpu", "(device", f"{d})"]
                                         for s, d in enumerate(v_shape(4))]
    assert "zbv runs 4 stages on 2 devices, one worker each: device 0 stages 0, 3; " \
           "device 1 stages 1, 2" in text
    assert "on 2 devices (stage: device 0:0 1:1 2:1 3:0)" in str(pipe.passes)


def test_the_predicted_step_runs_a_devices_stages_one_at_a_time():
    """With measured costs, the simulator's timeline of the compiled schedule never overlaps
    two compute actions of one device."""
    model, x, y, loss_fn = _case("skipnet", 6, 0)
    plan = fxpipe.Plan(stages=4, stages_per_device=2, schedule="looped-bfs",
                       micro_batches=2, loss_fn=loss_fn, partitioner="even")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), example_target=y, cache=False)
    timeline = pipe.predicted_timeline()
    assert timeline.schedule.placement == round_robin(4, 2)
    for d in range(2):
        computes = sorted((e.start, e.end) for e in timeline.events
                          if e.action.kind.is_compute and timeline.schedule.device(e.stage) == d)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(computes, computes[1:]))
        assert sum(e - s for s, e in computes) > 0
    # the memory estimate counts each stage's micro-batches in flight under this schedule
    # (every stage holds both, where 1F1B's last stage would hold one; without the messages,
    # which 1F1B's last stage holds more of: it sends gradients before its last forward)
    scored = Partition.evaluate(pipe.cost, pipe.partition.bounds, 2, "even",
                                schedule=looped_bfs(4, 2, devices=2))
    assert pipe.partition.stages == scored.stages
    unsent = dataclasses.replace(pipe.cost, boundary_bytes=None, boundary_grad_bytes=None,
                                 boundary_saved_bytes=None)
    assert Partition.evaluate(unsent, pipe.partition.bounds, 2, "even", schedule=looped_bfs(
        4, 2, devices=2)).stages[3].memory > Partition.evaluate(
        unsent, pipe.partition.bounds, 2, "even", schedule="1f1b").stages[3].memory


def test_a_users_schedule_with_a_placement_trains_and_is_saved_with_it(tmp_path):
    model, x, y, loss_fn = _case("skipnet", 6, 1)
    reference = copy.deepcopy(model)
    mine = interleaved_one_f_one_b(4, 2, devices=2)
    plan = fxpipe.Plan(stages=4, stages_per_device=2, schedule=mine, loss_fn=loss_fn,
                       costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    loss = pipe.step(x, y)
    expected = loss_fn(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    _assert_grads_like(pipe, reference, "user schedule")
    plan.save(tmp_path / "plan.json")
    loaded = fxpipe.Plan.load(tmp_path / "plan.json", loss_fn=loss_fn)
    assert loaded.schedule == mine and loaded.device_count == 2


def test_interleaved_picks_a_default_micro_batch_count_of_whole_device_groups():
    plan = fxpipe.Plan(stages=6, stages_per_device=2, schedule="interleaved-1f1b", costs="none")
    assert plan.device_count == 3
    assert [plan.for_batch(b).micro_batches for b in (3, 5, 6, 64)] == [3, 3, 6, 6]
    # a batch of one sample makes one micro-batch, which cannot fill the device groups
    with pytest.raises(PlanError, match=r"micro_batches=1 must be a multiple of the 3 devices; "
                       r"give micro_batches=3"):
        plan.for_batch(1)


# --- refusals, at Plan construction (or compile's first check) ----------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"stages": 5, "stages_per_device": 2, "schedule": "interleaved-1f1b"},
     r"the 5 stages do not split evenly over devices of 2 stages each; give stages_per_device "
     r"in \[1, 5\]"),
    ({"stages": 6, "stages_per_device": 3, "schedule": "zbv"},
     r"zbv places exactly two stages on each device .* give stages_per_device=2"),
    ({"stages": 4, "schedule": "zbv"}, r"zbv places exactly two stages on each device"),
    ({"stages": 4, "stages_per_device": 2, "schedule": "1f1b"},
     r"'1f1b' runs one stage per device; with several stages per device pick a schedule that "
     r"interleaves them: 'interleaved-1f1b', 'looped-bfs', 'zbv' or 'dualpipev'"),
    ({"stages": 4, "stages_per_device": 2}, r"'gpipe' runs one stage per device"),
    ({"stages": 4, "stages_per_device": 2, "schedule": "zb-h1"}, r"'zb-h1' runs one stage"),
    ({"stages": 4, "stages_per_device": 2, "schedule": "async-1f1b"}, r"'async-1f1b' runs one"),
    ({"stages": 4, "stages_per_device": 2, "schedule": "interleaved-1f1b", "micro_batches": 3},
     r"micro_batches=3 must be a multiple of the 2 devices; give micro_batches=2 or 4"),
    ({"stages": 4, "stages_per_device": 2, "schedule": "looped-bfs", "micro_batches": "auto"},
     r"cannot be chosen"),
    ({"stages": 4, "stages_per_device": 2, "schedule": "zbv", "devices": ["cpu"] * 4},
     r"names 4 devices for stages=4 on 2 devices; give one device per 2 stages "
     r"\(stages_per_device\), e.g. \['cpu', 'cpu'\]"),
    ({"stages": 4, "stages_per_device": 0}, r"stages_per_device=0\) must be a positive integer"),
    ({"stages": 4, "stages_per_device": 2, "schedule": one_f_one_b(4, 2)},
     r"runs one stage per device \(it has no placement\) but Plan\(stages_per_device=2\); give "
     r"stages_per_device=1"),
    ({"stages": 4, "schedule": interleaved_one_f_one_b(4, 2, devices=2)},
     r"places \[2, 2\] stages on its 2 devices but Plan\(stages_per_device=1\); give "
     r"stages_per_device=2"),
])
def test_wrong_combinations_are_refused_with_the_fix(kwargs, message):
    with pytest.raises(PlanError, match=message):
        fxpipe.Plan(**kwargs)


def test_a_rank_runs_the_stages_the_placement_puts_on_its_device():
    layout = RankLayout(rank=1, world=2, stages=4, groups=1, placement=v_shape(4))
    assert (layout.devices, layout.device, layout.held, layout.stage) == (2, 1, (1, 2), 1)
    assert layout.pipeline_ranks == [0, 1, 1, 0]
    plain = RankLayout(rank=5, world=6, stages=3, groups=2)  # one stage per rank, as before
    assert (plain.held, plain.group, plain.rank_of(0)) == ((2,), 1, 3)


def test_a_job_of_the_wrong_size_names_the_ranks_the_plan_needs(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    plan = fxpipe.Plan(stages=4, stages_per_device=2, schedule="zbv", costs="none")
    with pytest.raises(PlanError, match=r"the job has 4 ranks but Plan\(stages=4, "
                       r"stages_per_device=2, groups=1\) needs 2; launch with torchrun "
                       r"--nproc-per-node 2"):
        rank_layout(plan)


def test_replicating_a_pipeline_of_several_stages_per_rank_is_refused(monkeypatch):
    import fxpipe.compiler.passes as passes

    monkeypatch.setattr(passes, "launched", lambda: True)
    model, x, _, loss_fn = _case("skipnet", 4, 0)
    with pytest.raises(PlanError, match=r"Plan\(groups=2\) replicates a pipeline whose ranks "
                       r"run several stages each; .* Use groups=1 with several stages per rank, "
                       r"or stages_per_device=1"):
        fxpipe.compile(model, _plan("zbv", 2, 2, 2, loss_fn, groups=2), example_inputs=(x,))
