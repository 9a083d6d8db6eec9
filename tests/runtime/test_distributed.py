"""Multi-process pipelines under torchrun (gloo on localhost): training equals one process."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import dist_worker
import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

WORKER = pathlib.Path(dist_worker.__file__)


def torchrun(ranks: int, scenario: str, out: pathlib.Path, timeout: float = 180):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), str(WORKER), scenario, str(out)],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


def _check(result_path: pathlib.Path, scenario: str) -> None:
    result = torch.load(result_path)
    name, stages, schedule, micro_batches = scenario.split(":")
    schedule = schedule.partition("@")[0]  # @rc: recomputing changes nothing
    if name.endswith("-meta"):  # each rank gave storage to its own stage's tensors only
        name = name.removesuffix("-meta")
        for held in result["bytes"]:
            assert held["real"] == held["stage"] < held["model"], held
    if schedule.startswith("async-"):  # the same pipeline, every stage in this one process
        pipe, data = dist_worker.async_pipeline(name, int(stages), schedule[6:],
                                                int(micro_batches))
        losses = [loss.item() for loss in pipe.step_many(data)]
        state = pipe.state_dict()
    else:
        state, losses = dist_worker.reference(name)
    assert list(result["state"]) == list(state)  # the whole model, in the model's order
    for key, value in state.items():
        torch.testing.assert_close(result["state"][key], value, rtol=1e-10, atol=1e-12,
                                   msg=key)
    assert result["losses"] == pytest.approx(losses, rel=1e-12)
    copies: dict[str, list[torch.Tensor]] = {}  # each rank's copy of each tied weight
    for share in result["tied"]:
        for weight, tensor in share.items():
            copies.setdefault(weight, []).append(tensor)
    if "*" not in schedule:  # with several stages per rank, one rank may hold all its users
        assert all(len(same) > 1 for same in copies.values()), list(copies)
    for same in copies.values():  # tied copies stay identical
        assert all(torch.equal(c, same[0]) for c in same)
    model, _, _ = dist_worker.build(name)
    model.load_state_dict(result["state"])  # the gathered state dict loads into the plain model
    _check_binding(result["cpus"])
    for links in result["links"]:  # one group per direction, of its two ranks
        assert set(links["groups"]) == links["needed"] and links["distinct"], links
        assert all(ranks == sorted(links["ranks"][s] for s in pair)  # the ranks of its stages
               for pair, ranks in links["groups"].items()), links


def _check_binding(ranks_threads) -> None:
    """No rank, and no thread of one, was bound to CPUs: each thread may run on every CPU its
    process could when it started."""
    for threads, started_on in ranks_threads:
        assert threads == [tuple(started_on)], (threads, started_on)


@pytest.mark.parametrize("ranks, scenarios", [
    (2, ["skipnet:2:gpipe:3", "skipnet:2:1f1b:3", "gpt:2:1f1b:2", "skipnet:2:async-none:2",
         "skipnet:2:async-stash:2", "skipnet:2:async-2bw:2", "skipnet:2:async-predict:2",
         "gpt-meta:2:1f1b:2", "gpt:2:zb-h1:3",
         # several stages per rank: GPT's tied weight on two ranks, then on rank 0 alone
         "gpt:4:interleaved-1f1b*2:2", "gpt:4:zbv*2:3", "gpt:4:dualpipev*2:4",
         "skipnet:4:looped-bfs*2:3",
         "gpt:2:1f1b@rc:2", "skipnet:2:async-stash@rc:2", "gpt:4:interleaved-1f1b*2@rc:2",
         "gpt:2:zb-h1@rc:3"]),
    (4, ["skipnet:4:1f1b:3", "gpt:4:gpipe:4", "skipnet:4:async-stash:1", "skipnet-meta:4:gpipe:3",
         "repeated:4:1f1b:3"]),  # a weight three ranks hold: all-reduced, not swapped
], ids=["2-ranks", "4-ranks"])
def test_training_across_ranks_matches_one_process(ranks, scenarios, tmp_path):
    out = tmp_path / "result"
    result = torchrun(ranks, "+".join(scenarios), out)
    assert result.returncode == 0, result.stderr[-3000:]
    for index, scenario in enumerate(scenarios):
        _check(pathlib.Path(f"{out}.{index}"), scenario)


def test_recomputing_across_ranks_changes_no_loss_buffer_or_weight(tmp_path):
    """Dropout and BatchNorm in every stage: each rank's recompute draws the masks its forward
    drew, and the running statistics are updated once."""
    result = torchrun(2, "recompute", tmp_path / "result")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = torch.load(tmp_path / "result")
    for schedule in ("interleaved-1f1b", "zbv"):  # two stages per rank
        (losses, state), (again, state_again) = runs[schedule, False], runs[schedule, True]
        assert again == losses, schedule
        assert list(state_again) == list(state)
        for key, value in state.items():
            torch.testing.assert_close(state_again[key], value, rtol=1e-12, atol=0, msg=key)


def test_a_send_completes_once_received_not_at_the_end_of_the_run(tmp_path):
    """Under async-1f1b a rank keeps only the sends (and their buffers) whose message may still
    be on its way (it learns the others arrived from what its peer sends back): as many over 6
    mini-batches as over 2, far fewer than it posted."""
    result = torchrun(2, "sends", tmp_path / "sends", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        held = torch.load(tmp_path / f"sends.{rank}")
        assert 0 < held["peaks"][0] == held["peaks"][1] < held["sent"] / 3, held


def test_a_failing_rank_stops_every_rank_with_its_error(tmp_path):
    """Rank 0 waits for the failed stage until Plan(timeout=2) passes, not for the process
    group's 300 s or the failed rank's exit (subprocess.TimeoutExpired fails the test)."""
    result = torchrun(2, "fail", tmp_path / "unused", timeout=120)
    assert result.returncode != 0
    lines = [line for line in result.stdout.splitlines() if "stopped:" in line]
    assert any(line.startswith("rank 1 stopped: RuntimeError: stage 1 failed: ValueError: "
                               "injected failure on stage 1") for line in lines), result.stdout
    assert any(line.startswith("rank 0 stopped:") and "rank 1 failed: ValueError: injected "
               "failure on stage 1" in line for line in lines), result.stdout


def test_a_rank_that_stops_making_progress_stops_every_rank(tmp_path):
    """Rank 1 of 3 stands still mid-step: ranks 0 and 2 give up at their deadline
    (Plan(timeout=2)), rank 1 when it goes on, all well before the process group's 300 s,
    each saying which stage and micro-batch was waited for and on which rank."""
    result = torchrun(3, "stall", tmp_path / "unused", timeout=170)
    assert result.returncode != 0
    stopped = {int(line.split()[1]): line for line in result.stdout.splitlines()
               if line.startswith("rank ") and " stopped: " in line}
    assert sorted(stopped) == [0, 1, 2], result.stdout + result.stderr[-3000:]
    for line in stopped.values():  # its own deadline, or the first one reported
        assert "micro-batch 0 from stage 1 (rank 1)" in line, line
        assert "Plan(timeout=...)" in line, line
    waited = {0: "rank 0 (stage 0) waited", 2: "rank 2 (stage 2) waited"}
    assert any(text in line for line in stopped.values() for text in waited.values())
    assert "PipelineAborted: the pipeline stopped because rank" in stopped[1], stopped[1]


def test_a_rank_that_stops_making_progress_stops_the_other_pipeline_groups_too(tmp_path):
    """2 groups x 2 stages; rank 3 (group 1's last stage) stands still mid-step. Group 0's
    last stage waits for it in the all-reduce of the groups' losses, a collective: it gives
    up at its deadline too, not at the process group's 300 s (the run's timeout would fail
    the test)."""
    result = torchrun(4, "stall-groups", tmp_path / "unused", timeout=170)
    assert result.returncode != 0
    stopped = {int(line.split()[1]): line for line in result.stdout.splitlines()
               if line.startswith("rank ") and " stopped: " in line}
    assert sorted(stopped) == [0, 1, 2, 3], result.stdout + result.stderr[-3000:]
    assert "(an all-reduce)" in stopped[1] or "PipelineAborted" in stopped[1], stopped[1]


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory):
    """One torchrun of the `names` scenario (2 ranks), for the tests below."""
    out = tmp_path_factory.mktemp("names") / "result"
    result = torchrun(2, "names", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return {tracer: torch.load(f"{out}.{tracer}") for tracer in ("export", "fx")}


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_gather_state_dict_holds_every_name_of_a_tied_weight(tied_run, tracer):
    """A weight two stages share has two names in the model's state dict; an exported stage
    knows it under one; a weight no stage uses, none. The gathered state dict is still the
    plain model's, key for key."""
    gathered = tied_run[tracer]["state"]
    torch.manual_seed(0)
    plain = dist_worker.Tied().double()
    expected = plain.state_dict()
    assert list(gathered) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(gathered[key], value, rtol=0, atol=0, msg=key)
    plain.load_state_dict(gathered, strict=True)
    for share in tied_run[tracer]["shares"]:  # each rank's own share holds both names
        assert {"emb.weight", "head.weight"} <= set(share["own"]), share["own"]


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_names_under_a_prefix_are_this_ranks_share(tied_run, tracer):
    """named_parameters(prefix="m") names what named_parameters() does, prefixed; a parent
    module's state dict keeps its own entries and this rank's share of the pipeline's."""
    for share in tied_run[tracer]["shares"]:
        assert share["names"] and share["prefixed"] == [f"m.{n}" for n in share["names"]]
        assert share["prefixed_buffers"] == [f"m.{n}" for n in share["buffers"]]
        assert share["parent"] == (["first.weight", "first.bias"]
                                   + [f"m.{k}" for k in share["own"]]
                                   + ["last.weight", "last.bias"])


def test_the_transport_holds_the_sizes_of_one_run_only(tied_run):
    for share in tied_run["export"]["shares"]:
        assert share["sizes"] == [1, 1, 1]


def test_shutdown_leaves_no_gloo_thread_behind(tmp_path):
    """A gloo thread alive when the interpreter shuts down can abort the process as it frees a
    collective's tensors; fxpipe.shutdown() ends every one a dropped pipeline held."""
    out = tmp_path / "threads"
    result = torchrun(2, "leave", out, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        threads = torch.load(f"{out}.{rank}")
        assert threads["during"] > 0 and threads["after"] == 0, threads


def test_world_size_must_fit_the_plan(tmp_path):
    result = torchrun(2, "mismatch", tmp_path / "unused", timeout=120)
    assert result.returncode != 0
    assert ("the job has 2 ranks but Plan(stages=3, groups=1) needs 3; launch with torchrun "
            "--nproc-per-node 3") in result.stderr


@pytest.mark.parametrize("mode, model", [("delayed", "skipnet"), ("naive", "skipnet"),
                                         ("delayed", "gpt"),  # the GPT ties weights
                                         ("naive", "gpt-padded")])  # a token mean
def test_pipeline_groups_train_like_one_process_on_the_global_batch(mode, model, tmp_path):
    """2 groups x 2 stages (4 ranks): every group ends with the same parameters, equal to one
    process training on the whole global batch, weights tied across stages included, and a
    token mean over groups whose targets count different numbers of tokens;
    GroPipe's delayed all-reduce is a schedule action on every stage, after the stage's last
    backward and gradient sent back (then waited for after the run), the naive one starts
    after the first stage has finished its backward."""
    out = tmp_path / "hybrid.pt"
    result = torchrun(4, f"hybrid:{mode}:{model}", out)
    assert result.returncode == 0, result.stderr[-3000:]
    shares = torch.load(out)
    state, losses = dist_worker.hybrid_reference(model)
    for share in shares:
        assert share["losses"] == pytest.approx(losses, rel=1e-12)
        for key, value in share["state"].items():
            torch.testing.assert_close(value, state[key], rtol=1e-10, atol=1e-12, msg=key)
    first_stage, last_stage = shares[0], shares[1]  # ranks 0 and 1: group 0's pipeline
    for share in (first_stage, last_stage):
        starts = sorted(e[2] for e in share["events"] if e[1] == "ALLREDUCE")
        if mode == "delayed":  # the action (its launch), then the wait
            assert len(starts) == 2, share["events"]
            assert starts[0] >= max(e[3] for e in share["events"] if e[1] in ("B", "SEND_B"))
        else:
            assert len(starts) == 1, share["events"]
    backward_end = max(e[3] for e in first_stage["events"] if e[1] == "B")
    if mode == "naive":
        assert min(e[2] for e in last_stage["events"] if e[1] == "ALLREDUCE") > backward_end
    trace = json.loads(out.with_suffix(".json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["measured, group 0", "measured, group 1", "predicted"]
    for pid, name in processes.items():  # every rank's all-reduce, on its stage's track
        if name.startswith("measured"):
            reduced = {e["tid"] for e in trace if e["ph"] == "X" and e["pid"] == pid
                       and e["cat"] == "ALLREDUCE"}
            assert reduced == {0, 1}, name


def test_bench_under_torchrun_calibrates_and_times_every_configuration():
    from fxpipe.bench import bench_under_torchrun

    rows = bench_under_torchrun(2, ["mlp", "--stages", "2", "--batch", "8", "--micro-batches",
                                    "2", "--partitioners", "even", "--schedules", "gpipe,1f1b",
                                    "--rounds", "1", "--steps", "2"])
    assert [(r.partitioner, r.schedule) for r in rows] == [("even", "gpipe"), ("even", "1f1b")]
    for row in rows:
        assert len(row.memory) == 2 and all(m > 0 for m in row.memory)
        # one stage per rank: each stage's peak measured, above its weights, gradients and
        # Adam's two slots (4 copies of the weights)
        weights = [sum(p.numel() * 4 for p in stage.parameters()) for stage in
                   _mlp_stages(row.sizes)]
        assert len(row.measured_memory) == 2
        assert all(m > 4 * w for m, w in zip(row.measured_memory, weights))
        assert row.measured_ms > 0 and row.predicted_ms > 0
        assert (row.rounds, row.timed_steps) == (1, 2)


def _mlp_stages(sizes):
    """The bundled MLP's layers (its units) in stages of `sizes` units."""
    from fxpipe.models import MLP

    layers, stages, start = list(MLP()), [], 0
    for size in sizes:
        stages.append(torch.nn.Sequential(*layers[start:start + size]))
        start += size
    return stages
