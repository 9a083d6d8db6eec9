"""Plan(memory_limit=..., optimizer=..., recompute=...): parsing, errors that say the fix,
save/load, and compile honouring the cap."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import fxpipe
from fxpipe import Plan
from fxpipe.errors import PlanError
from fxpipe.memory_spec import optimizer_slots, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * 2**30), ("512MB", 512e6), ("1.5 GiB", 1.5 * 2**30), ("2 kib", 2048),
    ("100", 100), ("1e3KB", 1e6), (4096, 4096), (2.5e9, 2.5e9),
])
def test_memory_limit_reads_bytes_and_binary_and_decimal_units(text, expected):
    assert parse_bytes(text) == expected
    assert Plan(stages=2, memory_limit=text).memory_limit == expected


@pytest.mark.parametrize("value, message", [
    ("8 gigs", "not an amount of memory.*'8GiB'"),
    ("GiB", "not an amount of memory"),
    (True, "not an amount of memory"),
    (0, "more than 0 bytes"),
    (-5, "more than 0 bytes"),
    (float("inf"), "finite"),
    ({"a": 1}, "not an amount of memory"),
])
def test_bad_memory_limits_say_how_to_give_one(value, message):
    with pytest.raises(PlanError, match=message):
        Plan(stages=2, memory_limit=value)


def test_a_cap_without_measured_costs_is_refused():
    with pytest.raises(PlanError, match="costs='none' measures nothing"):
        Plan(stages=2, memory_limit="1GiB", costs="none", partitioner="even")


def test_one_memory_limit_per_device():
    plan = Plan(stages=4, memory_limit=["1GiB", "2GiB", 3e9, "4 GB"])
    assert plan.memory_limit == (2**30, 2**31, 3e9, 4e9)
    with pytest.raises(PlanError, match=r"gives 3 caps for the plan's 4 device.*one per device"):
        Plan(stages=4, memory_limit=["1GiB"] * 3)
    # two stages per device: one cap per device
    plan = Plan(stages=4, stages_per_device=2, schedule="interleaved-1f1b", micro_batches=2,
                memory_limit=["1GiB", "2GiB"])
    assert plan.memory_limit == (2**30, 2**31)
    with pytest.raises(PlanError, match="gives 4 caps for the plan's 2 device"):
        Plan(stages=4, stages_per_device=2, schedule="interleaved-1f1b", micro_batches=2,
             memory_limit=["1GiB"] * 4)


def test_optimizer_slots_by_name_or_number():
    assert optimizer_slots(None) == 2  # Adam's two moments unless told otherwise
    assert [optimizer_slots(n) for n in ("adam", "AdamW", "sgd", "sgd-momentum")] == [2, 2, 0, 1]
    assert optimizer_slots(3) == 3.0
    with pytest.raises(PlanError, match=r"optimizer='lbfgs'.*'adam'.*Adam: 2"):
        Plan(stages=2, optimizer="lbfgs")
    with pytest.raises(PlanError, match="optimizer=-1"):
        Plan(stages=2, optimizer=-1)


def test_recompute_values_and_their_errors():
    assert Plan(stages=2, recompute=[True, False]).recompute == (True, False)
    with pytest.raises(PlanError, match=r"gives 1 values for stages=2; give exactly one"):
        Plan(stages=2, recompute=[True])
    with pytest.raises(PlanError, match=r"recompute='sometimes'\) is not known.*'auto'"):
        Plan(stages=2, recompute="sometimes")
    # "auto" without a cap: every stage fits, so none recomputes (fxpipe.recompute_spec)
    assert Plan(stages=2, recompute="auto").recompute == "auto"


def test_save_and_load_keep_the_memory_fields(tmp_path):
    plan = Plan(stages=2, memory_limit=["1.5GiB", 1e9], optimizer="sgd-momentum",
                recompute="auto")
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan
    assert (loaded.memory_limit, loaded.optimizer, loaded.recompute) == (
        (1.5 * 2**30, 1e9), "sgd-momentum", "auto")


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])


def test_compile_honours_the_cap_and_prints_it():
    x = torch.randn(4, 32)
    weights = 32 * 33 * 4 * 4  # bytes per layer: weights, gradients, Adam's two moments
    limit = 2.5 * weights  # two layers and their few activation bytes fit, three do not
    plan = Plan(stages=2, partitioner=[3, 1], memory_limit=limit)
    with pytest.raises(PlanError, match=r"your stage sizes \(3\+1 .* stage 0 .* honours the cap"):
        fxpipe.compile(_model(), plan, example_inputs=(x,))
    pipe = fxpipe.compile(_model(), Plan(stages=2, memory_limit=limit), example_inputs=(x,))
    assert pipe.partition.sizes == (2, 2)
    assert all(s.memory <= limit for s in pipe.partition.stages)
    assert "memory cap (Plan(memory_limit))" in str(pipe) and " / " in str(pipe)


def test_compile_with_a_cap_too_small_for_any_plan_names_the_smallest():
    x = torch.randn(8, 32)
    weights = 32 * 33 * 4 * 4  # bytes per layer: weights, gradients, Adam's two moments
    limit = 2 * weights + 16  # two layers' parameters fit (checked before profiling), but
    with pytest.raises(PlanError, match=r"cannot partition Sequential: no partition into 2 "
                       r"stages fits .* give memory_limit=\d+ bytes"):  # not their activations
        fxpipe.compile(_model(), Plan(stages=2, memory_limit=limit), example_inputs=(x,))


@pytest.mark.parametrize("plan, least", [
    (Plan(stages=2, memory_limit="1KiB"), 2 * 16896),  # 2+2 layers of 16896 bytes with Adam
    (Plan(stages=2, memory_limit=[10**6, 1024], partitioner=[3, 1]), [10**6, 16896]),
    (Plan(stages=4, memory_limit=8000, optimizer="sgd"), 8448),  # a layer a stage, no slots
])
def test_a_cap_too_small_for_the_parameters_is_refused_before_profiling(monkeypatch, plan,
                                                                          least):
    import fxpipe.compiler.passes

    def profiled(*args, **kwargs):
        raise AssertionError("profiled a plan whose parameters cannot fit")

    monkeypatch.setattr(fxpipe.compiler.passes, "profile_units", profiled)
    with pytest.raises(PlanError, match=r"cannot hold Sequential's parameters, before any "
                       r"activation") as refused:
        fxpipe.compile(_model(), plan, example_inputs=(torch.randn(8, 32),))
    named = re.search(r"give memory_limit=(\d+|\[[\d, ]+\]) bytes .* at least",
                      str(refused.value)).group(1)
    assert json.loads(named) == least
    fits = dataclasses.replace(plan, memory_limit=least)  # the cap named passes the check
    with pytest.raises(AssertionError, match="profiled a plan"):
        fxpipe.compile(_model(), fits, example_inputs=(torch.randn(8, 32),))


def test_with_several_stages_per_device_the_smallest_cap_named_is_a_devices_and_fits():
    import re

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(8)))
    x = torch.randn(16, 64)
    plan = Plan(stages=4, stages_per_device=2, schedule="interleaved-1f1b", micro_batches=4)
    layers = 2 * 2 * 64 * 65 * 4 * 4  # a device's: two stages of two layers' parameters,
    with pytest.raises(PlanError, match="equal share of its cap") as refused:  # with Adam
        fxpipe.compile(model, dataclasses.replace(plan, memory_limit=layers + 1024),
                       example_inputs=(x,))
    smallest = int(re.search(r"memory_limit=(\d+) bytes", str(refused.value)).group(1))
    pipe = fxpipe.compile(model, dataclasses.replace(plan, memory_limit=smallest),
                          example_inputs=(x,))  # fits: the device's cap, not a stage's
    assert len(pipe.partition.stages) == 4


def test_auto_recomputes_only_the_stage_that_needs_it_to_fit():
    # eight Linear(8, 8): each saves its 1024-row input (32 KiB per micro-batch); under 1f1b
    # stage 0 holds two micro-batches in flight, stage 1 one, so only stage 0 is over the cap
    # (each stage also holds its messages and backward workspace, and recomputing, what its
    # checkpoints keep: no split needs less than 2+6 units' 323 KiB on stage 0 without
    # recomputing; recomputing it needs 278 KiB, and stage 1 295 KiB)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(8)])
    x = torch.randn(2048, 8)
    plan = Plan(stages=2, schedule="1f1b", micro_batches=2, memory_limit=300 * 1024)
    with pytest.raises(PlanError, match=r"no partition .* recompute='auto'"):
        fxpipe.compile(model, plan, example_inputs=(x,))
    pipe = fxpipe.compile(model, dataclasses.replace(plan, recompute="auto"),
                          example_inputs=(x,))
    assert pipe.partition.recompute == (True, False)
    # what enters a stage, per micro-batch: the profile's bytes crossing the cut before it
    assert list(pipe.cost.input_bytes(2)) == [0.0] + [1024 * 8 * 4] * 7 + [0.0]
    assert all(s.memory <= 300 * 1024 for s in pipe.partition.stages)
    assert "recomputing the forward in backward: stage 0" in str(pipe)


def test_schedules_compared_under_a_cap_say_which_do_not_fit():
    from fxpipe.compiler.partitioning import compare_schedules, evaluate_for_plan

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(m for _ in range(4) for m in (torch.nn.Linear(256, 256),
                                                                 torch.nn.ReLU())))
    x = torch.randn(64, 256)  # activations outweigh the weights: gpipe holds 8, 1f1b 2
    plan = Plan(stages=2, micro_batches=8, schedule="1f1b")
    cost = fxpipe.compile(model, plan, example_inputs=(x,)).cost
    # the least any split needs under each schedule (bytes: the same however units time)
    need = {name: min(max(s.memory for s in evaluate_for_plan(
                cost, (cut, cost.units), 8, "any",
                dataclasses.replace(plan, schedule=name)).stages)
                for cut in range(1, cost.units))
            for name in ("gpipe", "1f1b")}
    assert need["1f1b"] < need["gpipe"]
    cap = (need["1f1b"] + need["gpipe"]) / 2
    capped = dataclasses.replace(plan, memory_limit=cap)
    found = compare_schedules(fxpipe.compile(model, capped, example_inputs=(x,)),
                              ["gpipe", "1f1b"])
    assert found["gpipe"] is None  # no partition fits under gpipe: said, not raised
    assert max(s.memory for s in found["1f1b"].stages) <= cap


def _saving_table():
    """Four units whose saved activations grow with the micro-batch size and whose times do
    not: the fewer micro-batches, the shorter the step and the more memory under 1f1b."""
    import numpy as np

    from fxpipe.cost import CostTable

    sizes = [1, 2, 4, 8]
    f = np.full((4, 4), 1e-3)
    return CostTable.from_arrays(f, 2 * f, sizes=sizes, batch=8, params=[10] * 4,
                                 activation_bytes=1e5 * np.asarray(sizes, float)[:, None]
                                 * np.ones(4))


@pytest.mark.parametrize("partitioner", ["even", "params"])
def test_auto_finds_the_count_a_fixed_split_fits_at(partitioner):
    from fxpipe.compiler.partitioning import (
        PARTITIONERS,
        choose_partition_of,
        evaluate_for_plan,
        memory_budget,
    )

    cost = _saving_table()
    plan = Plan(stages=2, partitioner=partitioner, schedule="1f1b", micro_batches="auto",
                memory_limit=1.25e6)
    chosen = PARTITIONERS["csimd"](cost, 2, schedule="1f1b", memory=memory_budget(plan, None))
    assert chosen.sizes == (1, 3)  # csimd's own split fits at its count, 2 ...
    with pytest.raises(PlanError, match=r"\(2\+2 units per stage\) leaves stage 0"):
        choose_partition_of("M", dataclasses.replace(plan, micro_batches=2), cost)  # ... 2+2 not
    part = choose_partition_of("M", plan, cost)
    assert part.sizes == (2, 2) and all(s.memory <= 1.25e6 for s in part.stages)
    fitting = {}
    for q in (1, 2, 4, 8):
        scored = evaluate_for_plan(cost, (2, 4), q, partitioner, plan)
        if max(s.memory for s in scored.stages) <= 1.25e6:
            fitting[q] = scored.predicted_time
    assert set(fitting) == {4, 8}  # where the split fits; the shortest step of them chosen
    assert part.micro_batches == min(fitting, key=fitting.get)
    assert part.predicted_time == pytest.approx(min(fitting.values()))


def test_auto_refuses_a_fixed_split_that_fits_at_no_count():
    from fxpipe.compiler.partitioning import choose_partition_of

    plan = Plan(stages=2, partitioner="even", schedule="1f1b", micro_batches="auto",
                memory_limit=3.5e5)  # 1+3 fits at 8 micro-batches of one sample; 2+2 never
    with pytest.raises(PlanError, match=r"partitioner 'even''s fixed rule \(2\+2 units per "
                       r"stage\) .* at no micro-batch count of the batch of 8 either"):
        choose_partition_of("M", plan, _saving_table())
