"""Plan(recompute=...): its errors, what each value means per stage, and its round trip."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fxpipe
from fxpipe.errors import PlanError
from fxpipe.recompute_spec import cannot_recompute, stage_recompute


@pytest.mark.parametrize("value, says", [
    ([True], r"Plan\(recompute=\[True\]\) gives 1 values for stages=2; give exactly one "
             r"True/False per stage"),
    ([1, 0], r"Plan\(recompute=\[1, 0\]\) must be True, False, 'auto' or a list of one "
             r"True/False per stage, e.g. \[True, False\]"),
    (1, r"Plan\(recompute=1\) must be True, False, 'auto'"),
    ("yes", r"Plan\(recompute='yes'\) is not known; give True, False, 'auto' or one"),
])
def test_a_wrong_recompute_value_says_what_to_give(value, says):
    with pytest.raises(PlanError, match=says):
        fxpipe.Plan(stages=2, recompute=value)


@pytest.mark.parametrize("consistency", ["none", "predict"])
def test_recompute_under_async_1f1b_needs_a_policy_that_keeps_the_forwards_weights(consistency):
    with pytest.raises(PlanError, match=rf"Plan\(recompute=True\) with schedule='async-1f1b' "
                       rf"needs consistency='stash' or '2bw' \(it is '{consistency}'\)"):
        fxpipe.Plan(stages=2, schedule="async-1f1b", consistency=consistency, recompute=True)
    for kept in ("stash", "2bw"):
        assert cannot_recompute(fxpipe.Plan(stages=2, schedule="async-1f1b",
                                            consistency=kept, recompute=True)) is None


def test_each_value_names_the_stages_that_recompute():
    chosen_none = types.SimpleNamespace(recompute=())
    assert stage_recompute(fxpipe.Plan(stages=3), chosen_none) == (False,) * 3
    assert stage_recompute(fxpipe.Plan(stages=3, recompute=True), None) == (True,) * 3
    listed = fxpipe.Plan(stages=3, recompute=[True, False, True])
    assert stage_recompute(listed, chosen_none) == (True, False, True)
    # "auto" without a memory cap: every stage fits, none recomputes
    assert stage_recompute(fxpipe.Plan(stages=3, recompute="auto"), None) == (False,) * 3
    chosen = types.SimpleNamespace(recompute=(False, True, False))  # the planner's choice
    assert stage_recompute(fxpipe.Plan(stages=3, recompute="auto"), chosen) == chosen.recompute


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_recompute_survives_save_and_load(data, tmp_path_factory):
    stages = data.draw(st.integers(1, 4))
    value = data.draw(st.one_of(st.sampled_from([True, False, "auto"]),
                                st.lists(st.booleans(), min_size=stages, max_size=stages)))
    plan = fxpipe.Plan(stages=stages, recompute=value)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    loaded = fxpipe.Plan.load(path)
    assert loaded == plan
    assert loaded.recompute == (tuple(value) if isinstance(value, list) else value)
