"""Plan validation: every mistake is caught at construction, with the fix in the message."""

from __future__ import annotations

import pytest

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
])
def test_bad_plans_say_what_to_change(kwargs, message):
    with pytest.raises(PlanError, match=message):
        Plan(**kwargs)


def test_plan_is_frozen_and_normalised():
    plan = Plan(stages=2, partitioner=[1, 2], devices=["cpu", "cpu"])
    assert plan.sizes == (1, 2) and plan.devices == ("cpu", "cpu")
    with pytest.raises(AttributeError):
        plan.stages = 3
