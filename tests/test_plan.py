"""Plan validation: every mistake is caught at construction, with the fix in the message."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from fxpipe import Plan, PlanError


@pytest.mark.parametrize("kwargs, message", [
    ({"stages": 0}, r"Plan\(stages=0\) must be a positive integer"),
    ({"stages": 2, "partitioner": "fastest"}, r"Plan\(partitioner='fastest'\) is not known; "
                                              r"choose one of 'even'"),
    ({"stages": 2, "partitioner": [3]}, r"gives 1 stage sizes for stages=2; give exactly one"),
    ({"stages": 2, "partitioner": [3, 0]}, r"must list a positive number of units per stage"),
    ({"stages": 2, "schedule": "zigzag"}, r"Plan\(schedule='zigzag'\) is not known"),
    ({"stages": 2, "micro_batches": 0}, r"Plan\(micro_batches=0\) must be a positive integer"),
    ({"stages": 2, "devices": ["cpu"]}, r"names 1 devices for stages=2; give one device per "
                                        r"stage, e.g. \['cpu', 'cpu'\]"),
    ({"stages": 2, "devices": ["cpu", "gpu0"]}, r"holds 'gpu0', which is not a device; use "
                                                r"strings such as 'cpu' or 'cuda:0'"),
    ({"stages": 2, "consistency": "stash"}, r"only applies to asynchronous pipelines; use "
                                            r"schedule='async-1f1b'"),
    ({"stages": 2, "tracer": "jit"}, r"Plan\(tracer='jit'\) is not known"),
    ({"stages": 2, "leaf_modules": [3]}, r"give nn.Module classes or qualified module names"),
    ({"stages": 2, "loss_fn": "mse"}, r"must be callable\(output, target\)"),
    ({"stages": 2, "timeout": 0}, r"Plan\(timeout=0\) must be a number of seconds > 0"),
    ({"stages": 2, "timeout": "1m"}, r"Plan\(timeout='1m'\) must be a number of seconds"),
    ({"stages": 2, "micro_batches": "auto", "costs": "none"},
     r"chooses the count from measured times, but costs='none' measures nothing"),
    ({"stages": 2, "partitioner": "csimd", "micro_batches": 4},
     r"chooses the micro-batch count itself, so micro_batches=4 would be ignored"),
    ({"stages": 2, "groups": 2, "schedule": "async-1f1b"},
     r"cannot run schedule='async-1f1b'.*use groups=1"),
    ({"stages": 2, "partitioner": "csimd", "micro_batches": 1},
     r"chooses the micro-batch count itself, so micro_batches=1 would be ignored"),
    ({"stages": 2, "dump": "yes"}, r"Plan\(dump='yes'\) must be True or False"),
])
def test_bad_plans_say_what_to_change(kwargs, message):
    with pytest.raises(PlanError, match=message):
        Plan(**kwargs)


def test_plan_is_frozen_and_normalised():
    plan = Plan(stages=2, partitioner=[1, 2], devices=["cpu", "cpu"])
    assert plan.sizes == (1, 2) and plan.devices == ("cpu", "cpu")
    with pytest.raises(AttributeError):
        plan.stages = 3


def test_single_values_where_lists_go_are_read_as_one_item():
    plan = Plan(stages=3, devices="cpu", leaf_modules="blocks.0",
                intra_layer={"shards": 2, "layers": "features.3"})
    assert plan.devices == ("cpu", "cpu", "cpu")
    assert plan.leaf_modules == ("blocks.0",)
    assert plan.intra_layer["layers"] == ["features.3"]


def test_csimd_chooses_the_micro_batch_count():
    assert Plan(stages=2, partitioner="csimd").micro_batches == "auto"


@settings(max_examples=40, deadline=None)
@given(stages=st.integers(1, 8), batch=st.integers(1, 40), groups=st.integers(1, 3),
       given_count=st.one_of(st.none(), st.integers(1, 8)))
def test_the_default_micro_batch_count_fills_the_pipeline_as_far_as_the_batch_allows(
        stages, batch, groups, given_count):
    plan = Plan(stages=stages, groups=groups, micro_batches=given_count).for_batch(batch)
    p = plan.micro_batches
    if given_count is not None:
        assert p == given_count  # the user's count is kept as given
    else:
        assert 1 <= p <= stages
        assert p * groups <= batch or p == 1  # every group's micro-batches hold a sample each
        assert p == stages or (p + 1) * groups > batch  # fewer than one per stage: batch too small
    assert Plan(stages=stages).micro_batches is None  # chosen at compile, from the example


def test_save_and_load_round_trip(tmp_path):
    import json

    plan = Plan(stages=3, partitioner=[2, 2, 1], schedule="1f1b", micro_batches=4,
                devices=["cpu"] * 3, link=(1e-5, 1e9, 1e-6), leaf_modules=["blocks.0"])
    path = tmp_path / "plan.json"
    plan.save(path, predicted_step_seconds=0.1)
    assert Plan.load(path) == plan
    Plan(stages=2, dump=True).save(path)  # how compile prints is no part of the plan
    assert "dump" not in json.loads(path.read_text())["plan"]
    assert Plan.load(path, micro_batches=8).micro_batches == 8


def test_load_refuses_other_files_and_versions(tmp_path):
    import json

    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "something"}))
    with pytest.raises(PlanError, match="is not an fxpipe plan file"):
        Plan.load(path)
    path.write_text(json.dumps({"format": "fxpipe.plan", "version": 99, "plan": {}}))
    with pytest.raises(PlanError, match="plan format version 99; this fxpipe reads versions 1 "
                                        "and 2"):
        Plan.load(path)
    path.write_text(json.dumps({"format": "fxpipe.plan", "version": 1, "plan": {
        "stages": 2, "cpu_affinity": "auto", "cpu_memory": "keep", "stage_threads": "auto"}}))
    assert Plan.load(path) == Plan(stages=2)  # an earlier fxpipe's plan, its CPU fields unset
    path.write_text(json.dumps({"format": "fxpipe.plan", "version": 1,
                                "plan": {"stages": 2, "stage_threads": 1}}))
    with pytest.raises(PlanError, match=r"sets stage_threads, which fxpipe no longer has: the "
                                        r"CPU's threads and binding are the user's to set"):
        Plan.load(path)
    path.write_text(json.dumps({"format": "fxpipe.plan", "version": 2,
                                "plan": {"stages": 2, "stage_threads": 1}}))
    with pytest.raises(PlanError, match=r"sets \['stage_threads'\], which this fxpipe's Plan "
                                        r"does not have; remove them from the file"):
        Plan.load(path)


def test_timed_partitioner_needs_measured_costs():
    with pytest.raises(PlanError, match=r"balances measured times, but costs='none'"):
        Plan(stages=2, partitioner="balanced", costs="none")


def test_bad_link():
    with pytest.raises(PlanError, match=r"must be \(latency in seconds >= 0, bandwidth"):
        Plan(stages=2, link=(1e-5, 0))


def test_every_partitioner_a_plan_accepts_can_run():
    from fxpipe.compiler.partitioning import PARTITIONERS as RUNNABLE
    from fxpipe.plan import PARTITIONERS, TIMED_PARTITIONERS

    assert set(PARTITIONERS) == set(RUNNABLE)
    assert set(TIMED_PARTITIONERS) < set(PARTITIONERS)
