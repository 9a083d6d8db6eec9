"""Your own schedule: Plan(schedule=Schedule | .csv), checked before any work, run like the
plain model; and schedules in PyTorch pipelining's CSV form, read and written both ways."""

from __future__ import annotations

import pathlib
import tempfile
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe import Plan, PlanError
from fxpipe.schedules import (
    Action,
    ActionKind,
    DeadlockError,
    Schedule,
    ScheduleError,
    add_communication,
    add_step,
    async_one_f_one_b,
    check_communication,
    dualpipev,
    gpipe,
    interleaved_one_f_one_b,
    load_csv,
    looped_bfs,
    one_f_one_b,
    save_csv,
    zb_h1,
    zbv,
)

K = ActionKind


def _pytorch_pipelining() -> types.ModuleType:
    """PyTorch's schedules module and the private API these tests read its CSV with."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError as error:
        pytest.fail(f"torch.distributed.pipelining.schedules cannot be imported ({error}); "
                    "the CSV interop tests need it")
    needed = ["_Action", "_ComputationType", "PipelineScheduleMulti", "_PipelineScheduleRuntime",
              "ScheduleInterleaved1F1B", "_add_send_recv"]
    moved = [name for name in needed if not hasattr(schedules, name)]
    if moved:
        pytest.fail(f"PyTorch's pipelining no longer has {moved} in "
                    "torch.distributed.pipelining.schedules (private API, moved or renamed); "
                    "update these tests and fxpipe/schedules/csv_form.py to its new form")
    return schedules


class SkipNet(nn.Module):
    """Linear layers with a skip from the first activation to the last layer, so a stage
    sends to one further on than its neighbour."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.mid = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = first = torch.tanh(self.inp(x))
        for layer in self.mid:
            h = torch.tanh(layer(h))
        return self.out(h + first)


# --- schedules a user might write -------------------------------------------------------------


@st.composite
def user_schedules(draw, stages: int | None = None, p: int | None = None) -> Schedule:
    """A random compute-only schedule that cannot hang: a random execution of one forward order
    and one backward order (any permutations of the micro-batches) on every stage, each stage's
    list being the order it ran its actions in. A forward waits for the stage before, a backward
    for its own forward and the stage after."""
    n = stages or draw(st.integers(2, 3))
    p = p or draw(st.integers(1, 4))
    forward = draw(st.permutations(range(p)))
    backward = draw(st.permutations(range(p)))
    done, lists = set(), [[] for _ in range(n)]
    position = [[0, 0] for _ in range(n)]  # per stage: forwards, backwards run
    while len(done) < 2 * n * p:
        ready = []
        for s in range(n):
            f, b = position[s]
            if f < p and (s == 0 or Action(s - 1, K.F, forward[f]) in done):
                ready.append(Action(s, K.F, forward[f]))
            if b < p and Action(s, K.F, backward[b]) in done and (
                    s == n - 1 or Action(s + 1, K.B, backward[b]) in done):
                ready.append(Action(s, K.B, backward[b]))
        action = ready[draw(st.integers(0, len(ready) - 1))]
        done.add(action)
        lists[action.stage].append(action)
        position[action.stage][action.kind is K.B] += 1
    return Schedule("drawn", n, p, lists)


def _plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list]:
    params = list(model.parameters())
    loss = F.mse_loss(model(x), y)
    return loss.detach(), torch.autograd.grad(loss, params)


def _assert_trains_like_the_model(model: nn.Module, plan: Plan, x: torch.Tensor,
                                  y: torch.Tensor) -> None:
    loss, grads = _plain(model, x, y)
    pipe = fxpipe.compile(model, plan, (x,), cache=False)
    with torch.no_grad():  # the forward alone runs the schedule's forward actions
        torch.testing.assert_close(pipe(x), model(x))
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(pipe.step(x, y), loss)
    for param, grad in zip(model.parameters(), grads):
        torch.testing.assert_close(param.grad, grad)


def _data(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(batch, 4, dtype=torch.float64),
            torch.randn(batch, 2, dtype=torch.float64))


@settings(max_examples=8, deadline=None)
@given(schedule=user_schedules(), via_csv=st.booleans(), lowered=st.booleans())
def test_a_user_schedule_trains_like_the_plain_model(schedule: Schedule, via_csv: bool,
                                                      lowered: bool) -> None:
    torch.manual_seed(0)
    model, (x, y) = SkipNet().double(), _data()
    given_schedule = schedule
    if lowered and schedule.stages == 2:  # two stages: the model's edges are the chain's
        given_schedule = add_communication(schedule)
    with tempfile.TemporaryDirectory() as folder:
        if via_csv:
            path = pathlib.Path(folder) / "mine.csv"
            save_csv(given_schedule, path)
            given_schedule = path
        plan = Plan(stages=schedule.stages, schedule=given_schedule, costs="none",
                    loss_fn=F.mse_loss)
    assert plan.micro_batches == schedule.micro_batches  # set by the schedule
    _assert_trains_like_the_model(model, plan, x, y)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b, zb_h1])  # zb-h1: W split off B
def test_the_built_in_schedules_given_as_data_train_like_their_names(make, tmp_path) -> None:
    model, (x, y) = SkipNet().double(), _data()
    path = tmp_path / "built_in.csv"
    save_csv(make(3, 4), path)
    for schedule in (make(3, 4), path, str(path)):
        plan = Plan(stages=3, schedule=schedule, costs="none", loss_fn=F.mse_loss)
        assert plan.schedule.actions == make(3, 4).actions
        _assert_trains_like_the_model(model, plan, x, y)


def test_a_plan_with_its_own_schedule_saves_and_loads(tmp_path) -> None:
    plan = Plan(stages=2, schedule=one_f_one_b(2, 3), costs="none")
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


# --- refusals, before any work ------------------------------------------------------------------


def test_a_schedule_with_another_stage_count_is_refused() -> None:
    with pytest.raises(PlanError, match=r"has 2 stages .* but Plan\(stages=3\); give stages=2"):
        Plan(stages=3, schedule=gpipe(2, 2))


def test_a_missing_backward_is_named() -> None:
    schedule = Schedule.from_lists([["0F0", "0F1", "0B0"], ["1F0", "1F1", "1B0", "1B1"]])
    with pytest.raises(PlanError, match=r"stage 0 of schedule 'custom' never runs 0B1: every "
                       r"stage runs F and B of each of its 2 micro-batches exactly once"):
        Plan(stages=2, schedule=schedule)


def test_a_duplicate_action_is_refused(tmp_path) -> None:
    lists = [["0F0", "0F0", "0B0"], ["1F0", "1B0"]]
    with pytest.raises(ValueError, match=r"stage 0 of schedule 'custom' lists \['0F0'\] twice"):
        Schedule.from_lists(lists)
    path = tmp_path / "twice.csv"
    path.write_text("0F0,0F0,0B0\n1F0,1B0\n")
    with pytest.raises(PlanError, match=r"twice.csv.*lists \['0F0'\] twice"):
        Plan(stages=2, schedule=path)


def test_a_deadlock_names_the_first_stuck_action_and_the_fix() -> None:
    crossed = Schedule.from_lists([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]])
    with pytest.raises(PlanError, match=r"The first action that cannot proceed is 0B0 on stage "
                       r"0: it needs 1SB0>0, which stage 1 sends only after 1B0, but stage 1 is "
                       r"stuck earlier at 1F1: it needs 0SF1>1, which stage 0 sends only after "
                       r"0F1, behind 0B0\. Fix: on stage 1 run 1B0 before 1F1, or on stage 0 "
                       r"run 0F1 before 0B0") as raised:
        Plan(stages=2, schedule=crossed)
    assert isinstance(raised.value.__cause__, DeadlockError)


def test_a_micro_batch_count_other_than_the_plans_is_refused() -> None:
    with pytest.raises(PlanError, match=r"runs 4 micro-batches but Plan\(micro_batches=2\); "
                       r"drop micro_batches .* or give micro_batches=4"):
        Plan(stages=2, schedule=gpipe(2, 4), micro_batches=2)
    with pytest.raises(PlanError, match=r"fixes the micro-batch count at 4"):
        Plan(stages=2, schedule=gpipe(2, 4), partitioner="csimd")
    assert Plan(stages=2, schedule=gpipe(2, 4), micro_batches=4).micro_batches == 4


@pytest.mark.parametrize(("lists", "message"), [
    ([["0F0", "0W0", "0B0"], ["1F0", "1B0", "1W0"]],
     r"0W0 comes before 0B0 on stage 0 .* move 0W0 after 0B0"),
    ([["0B0", "0F0"], ["1F0", "1B0"]], r"0B0 comes before 0F0 on stage 0"),
    ([["0F0", "0F1", "0B0", "0B1"], ["1F1", "1F0", "1B0", "1B1"]],
     r"stage 0 .* runs its Fs in micro-batch order \[0, 1\], stage 1 in \[1, 0\]"),
    ([["0F0", "0B0", "0AR", "0F1", "0B1"], ["1F0", "1B0", "1F1", "1B1"]],
     r"all-reduces its gradients .* before its last backward"),
])
def test_schedules_the_runtime_cannot_train_with_are_refused(lists, message) -> None:
    with pytest.raises(PlanError, match=message):
        Plan(stages=2, schedule=Schedule.from_lists(lists))


def test_several_stages_per_device_need_plan_stages_per_device() -> None:
    mine = interleaved_one_f_one_b(4, 2, devices=2)
    with pytest.raises(PlanError, match=r"places \[2, 2\] stages on its 2 devices but "
                       r"Plan\(stages_per_device=1\); give stages_per_device=2"):
        Plan(stages=4, schedule=mine)
    assert Plan(stages=4, stages_per_device=2, schedule=mine).device_count == 2


def test_an_allreduce_in_the_schedule_is_refused_where_the_groups_reduce_after_it() -> None:
    closed = add_step(gpipe(2, 2), allreduce=True, step=False)
    with pytest.raises(PlanError, match=r"Plan\(dp_sync='naive'\) all-reduces them after it, "
                       r"a second time; use dp_sync='delayed'"):
        Plan(stages=2, schedule=closed, groups=2, dp_sync="naive")
    assert Plan(stages=2, schedule=closed, groups=2).schedule == closed


def test_a_schedule_stepping_the_optimizer_itself_is_refused() -> None:
    with pytest.raises(PlanError, match=r"steps the optimizer inside the run .* "
                       r"schedule='async-1f1b'"):
        Plan(stages=2, schedule=async_one_f_one_b(2, 2))


def test_unreadable_schedules_are_refused(tmp_path) -> None:
    with pytest.raises(PlanError, match=r"there is no schedule file .*nowhere.csv"):
        Plan(stages=2, schedule=str(tmp_path / "nowhere.csv"))
    with pytest.raises(PlanError, match=r"'zigzag'\) is not known; choose one of 'gpipe', "
                       r"'1f1b', 'async-1f1b', 'zb-h1', 'interleaved-1f1b', 'looped-bfs', "
                       r"'zbv', 'dualpipev', or give your own: a "
                       r"fxpipe.schedules.Schedule or a .csv file"):
        Plan(stages=2, schedule="zigzag")
    with pytest.raises(PlanError, match=r"not int"):
        Plan(stages=2, schedule=3)


def test_a_lowered_schedule_must_send_along_the_models_edges() -> None:
    model, (x, _) = SkipNet().double(), _data()
    plan = Plan(stages=3, schedule=add_communication(gpipe(3, 2)), costs="none",
                loss_fn=F.mse_loss, partitioner=[1, 2, 2])
    with pytest.raises(PlanError, match=r"sends activations along stage pairs \[\(0, 1\), "
                       r"\(1, 2\)\], but the model's stages exchange values along \[\(0, 1\), "
                       r"\(0, 2\), \(1, 2\)\]; give the compute-only schedule"):
        fxpipe.compile(model, plan, (x,), cache=False)


# --- the CSV form -------------------------------------------------------------------------------


@st.composite
def csv_schedules(draw) -> Schedule:
    """Drawn schedules in every form the CSV holds: compute-only, with W split off some
    backwards, lowered on a chain, with a closing all-reduce."""
    schedule = draw(user_schedules())
    if draw(st.booleans()):  # a W of some micro-batches, anywhere after its B
        lists = [list(stage) for stage in schedule.actions]
        for stage in lists:
            for m in draw(st.sets(st.integers(0, schedule.micro_batches - 1))):
                after = stage.index(Action(stage[0].stage, K.B, m))
                stage.insert(draw(st.integers(after + 1, len(stage))),
                             Action(stage[0].stage, K.W, m))
        schedule = schedule._replace(lists)
    if draw(st.booleans()):
        schedule = add_communication(schedule)
    if draw(st.booleans()):
        schedule = add_step(schedule, allreduce=True, step=False)
    return schedule


@settings(max_examples=30, deadline=None)
@given(schedule=csv_schedules())
def test_csv_round_trips(schedule: Schedule) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "s.csv"
        save_csv(schedule, path)
        assert load_csv(path, name=schedule.name) == schedule


# PyTorch's computation type for each fxpipe kind, as its schedules.py documents them
_PYTORCH_TYPES = {K.F: "F", K.W: "W", K.SEND_F: "SEND_F", K.RECV_F: "RECV_F",
                  K.SEND_B: "SEND_B", K.RECV_B: "RECV_B", K.ALLREDUCE: "REDUCE_GRAD"}


def _as_pytorch(schedule: Schedule) -> list[list[tuple[int, str, int | None]]]:
    """What PyTorch should read: a B is its full backward, or its input-gradient-only I where
    a W of that micro-batch follows on the stage."""
    rows = []
    for stage in schedule.actions:
        weighed = {a.mb for a in stage if a.kind is K.W}
        rows.append([(a.stage, ("I" if a.mb in weighed else "B") if a.kind is K.B
                      else _PYTORCH_TYPES[a.kind], a.mb) for a in stage])
    return rows


@settings(max_examples=15, deadline=None)
@given(schedule=csv_schedules())
def test_pytorch_reads_what_save_csv_writes(schedule: Schedule) -> None:
    pts = _pytorch_pipelining()
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "s.csv"
        save_csv(schedule, path)
        rows = path.read_text().splitlines()
        read = [[pts._Action.from_str(cell) for cell in row.split(",") if cell]
                for row in rows]
        assert [[(a.stage_index, a.computation_type.value, a.microbatch_index) for a in row]
                for row in read] == _as_pytorch(schedule)
        if not schedule.lowered and not any(a.kind is K.ALLREDUCE for a in schedule.actions[0]):
            # PyTorch's own loader, with its check that each stage runs F, then B or I, then W
            multi = types.SimpleNamespace(pipeline_order={}, pp_group_size=schedule.stages,
                                          _num_stages=schedule.stages,
                                          _n_microbatches=schedule.micro_batches, _stages=[])
            multi._validate_and_set_stage_mapping = types.MethodType(
                pts.PipelineScheduleMulti._validate_and_set_stage_mapping, multi)
            pts.PipelineScheduleMulti._load_csv(multi, str(path))
            assert multi.pipeline_order == {s: row for s, row in enumerate(read)}
            assert multi.stage_index_to_group_rank == {s: s for s in range(schedule.stages)}


def _placed_schedule(name: str, devices: int, p: int) -> Schedule:
    """A built-in schedule holding two stages per device."""
    if name in ("zbv", "dualpipev"):
        return {"zbv": zbv, "dualpipev": dualpipev}[name](2 * devices, p)
    make = {"interleaved": interleaved_one_f_one_b, "looped-bfs": looped_bfs}[name]
    return make(2 * devices, p, devices=devices)


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(["interleaved", "looped-bfs", "zbv", "dualpipev"]),
       devices=st.integers(1, 3), extra=st.integers(0, 3))
def test_csv_keeps_each_devices_stages_and_order(name: str, devices: int, extra: int) -> None:
    # one row per rank, as PyTorch writes them: the placement and each device's order survive,
    # and PyTorch's loader maps each stage to the rank fxpipe placed it on
    p = 2 * devices + extra if name == "dualpipev" else devices * (1 + extra)
    schedule = _placed_schedule(name, devices, p)
    pts = _pytorch_pipelining()
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "s.csv"
        save_csv(schedule, path)
        assert len(path.read_text().splitlines()) == devices
        assert load_csv(path, name=schedule.name) == schedule
        multi = types.SimpleNamespace(pipeline_order={}, pp_group_size=devices,
                                      _num_stages=schedule.stages, _n_microbatches=p,
                                      _stages=[])
        multi._validate_and_set_stage_mapping = types.MethodType(
            pts.PipelineScheduleMulti._validate_and_set_stage_mapping, multi)
        pts.PipelineScheduleMulti._load_csv(multi, str(path))
        assert multi.stage_index_to_group_rank == dict(enumerate(schedule.placement))


def test_a_v_schedule_saved_as_csv_trains_on_its_devices(tmp_path) -> None:
    path = tmp_path / "zbv.csv"
    save_csv(zbv(4, 4), path)
    plan = Plan(stages=4, stages_per_device=2, schedule=path, costs="none", loss_fn=F.mse_loss)
    assert plan.schedule.placement == (0, 1, 1, 0)
    model, (x, y) = SkipNet().double(), _data(8)
    _assert_trains_like_the_model(model, plan, x, y)


def _pytorch_1f1b(pts: types.ModuleType, stages: int, p: int) -> dict[int, list]:
    """PyTorch's 1F1B order for one stage per rank (its interleaved 1F1B with one local
    stage), computed without building stages or a process group."""
    rounds = max(1, p // stages)
    plan = types.SimpleNamespace(n_local_stages=1, pp_group_size=stages, _n_microbatches=p,
                                 microbatches_per_round=p // rounds)
    return {r: pts.ScheduleInterleaved1F1B._calculate_single_rank_operations(plan, r)
            for r in range(stages)}


def test_pytorchs_own_1f1b_csv_loads_checks_and_trains(tmp_path) -> None:
    pts = _pytorch_pipelining()
    order = _pytorch_1f1b(pts, 2, 4)
    compute = tmp_path / "pytorch_1f1b.csv"
    pts.PipelineScheduleMulti._dump_csv(types.SimpleNamespace(pipeline_order=order), compute)
    schedule = load_csv(compute)
    assert (schedule.stages, schedule.micro_batches) == (2, 4)
    assert [[str(a) for a in stage] for stage in schedule.actions] == [
        [str(a) for a in acts if a is not None] for acts in order.values()]
    check_communication(add_communication(schedule))
    # and PyTorch's own lowering of it, with its sends and receives
    with_comms = pts._add_send_recv({r: [a for a in acts if a is not None]
                                     for r, acts in order.items()}, lambda s: s, 2)
    lowered = tmp_path / "pytorch_1f1b_comms.csv"
    pts._PipelineScheduleRuntime._dump_csv(
        types.SimpleNamespace(pipeline_order_with_comms=with_comms), lowered)
    check_communication(load_csv(lowered))
    model, (x, y) = SkipNet().double(), _data()
    for path in (compute, lowered):
        plan = Plan(stages=2, schedule=path, costs="none", loss_fn=F.mse_loss)
        _assert_trains_like_the_model(model, plan, x, y)


def test_a_hand_written_pytorch_csv_with_bubbles_and_reduce_grad_trains(tmp_path) -> None:
    path = tmp_path / "gpipe.csv"  # as PyTorch's _dump_csv writes a padded order
    path.write_text("0F0,0F1,0F2,,,,0B2,0B1,0B0,0REDUCE_GRAD\n"
                    ",1F0,1F1,1F2,1B2,1B1,1B0,1REDUCE_GRAD\n")
    assert load_csv(path).actions == add_step(gpipe(2, 3), allreduce=True, step=False).actions
    model, (x, y) = SkipNet().double(), _data(6)
    _assert_trains_like_the_model(model, Plan(stages=2, schedule=path, costs="none",
                                              loss_fn=F.mse_loss), x, y)


@pytest.mark.parametrize(("text", "message"), [
    ("0F0,2F1\n", r"no row runs stage\(s\) \[1\]; number the stages 0..2"),
    ("0F0,1F0\n1B0\n", r"stage 1 has actions on rows 0 and 1; a stage runs on one rank"),
    ("0UNSHARD,0F0,0B0\n", r"FSDP parameter unshard"),
    ("0F0,0I0\n", r"0I0 computes micro-batch 0's input gradient alone, but no 0W0"),
    ("0F0,0B0,0W0\n", r"0B0 is a full backward.* write 0I0"),
    ("0F0,0Q0\n", r"cannot read '0Q0' as a PyTorch action"),
    ("(0F1;1B0)OVERLAP_F_B\n", r"overlaps several actions"),
    ("0F0,0RECV_F0\n", r"stage 0 has no stage -1 to talk to"),
    ("", r"holds no rows"),
])
def test_csv_errors_name_the_cell_and_the_fix(tmp_path, text, message) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ScheduleError, match=message):
        load_csv(path)


def test_blank_lines_ending_a_csv_are_no_rank(tmp_path) -> None:
    path = tmp_path / "ends_blank.csv"
    path.write_text("0F0,0B0\n1F0,1B0\n\n\n")
    assert load_csv(path).actions == gpipe(2, 1).actions


def test_save_csv_refuses_what_pytorch_cannot_say(tmp_path) -> None:
    skip = add_communication(gpipe(3, 1), [(0, 1), (0, 2), (1, 2)])
    with pytest.raises(ScheduleError, match=r"0SF0>2 talks to stage 2, but PyTorch's SEND_F "
                       r"only reaches stage 1"):
        save_csv(skip, tmp_path / "skip.csv")
    with pytest.raises(ScheduleError, match=r"streams 2 mini-batches"):
        save_csv(async_one_f_one_b(2, 1), tmp_path / "async.csv")
    with pytest.raises(ScheduleError, match=r"0STEP has no counterpart"):
        save_csv(add_step(gpipe(2, 1)), tmp_path / "step.csv")
