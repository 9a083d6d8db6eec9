"""One rank of a distributed test scenario, run by tests/runtime/test_distributed.py under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node N dist_worker.py SCENARIO OUT
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import pathlib
import sys
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import fxpipe
from fxpipe.ir import tied_parameters
from fxpipe.models import GPT
from fxpipe.preserve import gradients_set_aside, preserved_state

STEPS = 2
# the CPUs this process could run on when it started: compile and steps must not narrow them
STARTED_ON = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


class SkipNet(nn.Module):
    """The input is used again by the last layer: a skip edge over every middle stage."""

    def __init__(self, width: int = 6, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.skip = nn.Linear(5, width)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h + self.skip(x))


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight (as GPT-2's wte and lm_head), on
    two stages; an exported stage knows the weight under one of its two names. No stage uses
    `spare`."""

    def __init__(self, vocab: int = 11, width: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.spare = nn.Linear(2, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x)) * self.scale))


def tokens_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class Repeated(nn.Module):
    """One Linear applied at three depths: with 4 stages, a weight three ranks hold."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.shared = nn.Linear(width, width)
        self.middle = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        for layer in self.middle:
            h = torch.tanh(self.shared(torch.tanh(layer(h))))
        return self.out(h)


def skipnet_data():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(7, 5, generator=gen, dtype=torch.float64),
             torch.randint(0, 3, (7,), generator=gen)) for _ in range(STEPS)]


def gpt_data():
    gen = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 128, (4, 12), generator=gen),
             torch.randint(0, 128, (4, 12), generator=gen)) for _ in range(STEPS)]


def build(name):
    torch.manual_seed(0)
    if name == "skipnet":
        return SkipNet().double(), skipnet_data(), F.cross_entropy
    if name == "repeated":
        return Repeated().double(), skipnet_data(), F.cross_entropy
    return GPT(layers=2).double(), gpt_data(), tokens_loss  # "gpt", "gpt-padded"


def reference(name):
    """The same training in one process, no pipeline: what every scenario must reproduce."""
    return train_plainly(*build(name))


def train_plainly(model, data, loss_fn):
    """SGD on `data` through the plain model: its final state dict and losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def train_pipelined(pipe, data):
    """SGD on `data` through the compiled pipeline, as train_plainly does: the losses."""
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        losses.append(pipe.step(x, y).item())
        optimizer.step()
    return losses


def async_pipeline(name, stages, policy, micro_batches, recompute=False):
    """An async-1f1b pipeline with per-stage optimizers (the same in one process or several)."""
    model, data, loss_fn = build(name)
    plan = fxpipe.Plan(stages=stages, schedule="async-1f1b", consistency=policy,
                       micro_batches=micro_batches, loss_fn=loss_fn, costs="none",
                       recompute=recompute)
    pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],))
    pipe.attach_optimizer(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    return pipe, data


def train(name, stages, schedule, micro_batches, out):
    schedule, _, flag = schedule.partition("@")  # SCHEDULE@rc: every stage recomputes
    recompute = flag == "rc"
    if schedule.startswith("async-"):
        pipe, data = async_pipeline(name, stages, schedule.removeprefix("async-"),
                                    micro_batches, recompute)
        losses = [loss.item() for loss in pipe.step_many(data)]
    elif name.endswith("-meta"):  # built on the meta device, timed, then its weights loaded
        with torch.device("meta"):
            model = build(name.removesuffix("-meta"))[0]
        initial, data, loss_fn = build(name.removesuffix("-meta"))
        timed = []  # the loss's calls: compile times it with the units, given a target

        def counted_loss(output, target):
            timed.append(target.shape[0])
            return loss_fn(output, target)

        plan = fxpipe.Plan(stages=stages, schedule=schedule, micro_batches=micro_batches,
                           loss_fn=counted_loss, partitioner="balanced")
        pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],),
                              example_target=data[0][1], cache=False)
        batch = data[0][0].shape[0]  # timed on the plan's micro-batches, as the steps run it
        assert set(timed) == {-(-batch // micro_batches)}, f"compile timed the loss on {timed}"
        pipe.load_state_dict(initial.state_dict())
        losses = train_pipelined(pipe, data)
        _check_measures(pipe, data, stages)
    else:  # SCHEDULE*V: V stages per rank
        schedule, _, per_rank = schedule.partition("*")
        model, data, loss_fn = build(name)
        plan = fxpipe.Plan(stages=stages, schedule=schedule, micro_batches=micro_batches,
                           loss_fn=loss_fn, costs="none", stages_per_device=int(per_rank or 1),
                           recompute=recompute)
        pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],))
        held = sorted(pipe.executor.runners)
        assert held == list(pipe.executor.schedule.stages_on(dist.get_rank())), held
        assert pipe.link.source.startswith("measured ping-pong")  # whatever the costs
        losses = train_pipelined(pipe, data)
    held = {id(p) for p in pipe.parameters()}  # each tied weight by its one name, if held
    names = {id(p): n for n, p in torch.nn.Module.named_parameters(pipe)}
    tied = {name: p.detach().clone() for name, p, _ in tied_parameters(pipe.stages, names)
            if id(p) in held}
    state = fxpipe.gather_state_dict(pipe)
    every_rank_tied: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank_tied, tied)
    every_rank_bytes: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank_bytes, _bytes_held(pipe))
    every_rank_links: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank_links, _links(pipe))
    every_rank_cpus: list = [None] * dist.get_world_size()  # where each rank's threads may run
    dist.all_gather_object(every_rank_cpus, (_thread_cpus(), sorted(STARTED_ON)))
    if dist.get_rank() == 0:
        torch.save({"state": state, "losses": losses, "tied": every_rank_tied,
                    "own_keys": sorted(pipe.state_dict()), "bytes": every_rank_bytes,
                    "links": every_rank_links, "cpus": every_rank_cpus}, out)


class DropNet(nn.Module):
    """Dropout and BatchNorm in every stage."""

    def __init__(self, width: int = 6, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(m for _ in range(depth) for m in (
            nn.Linear(width, width), nn.Dropout(0.3), nn.BatchNorm1d(width), nn.Tanh())))
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        return self.out(self.layers(x))


def recompute_pairs(out):
    """DropNet trained with and without recomputation (each rank draws its own dropout masks
    from its own generator, the same in both): rank 0 saves both runs, per schedule."""
    gen = torch.Generator().manual_seed(4)
    data = [(torch.randn(8, 6, generator=gen, dtype=torch.float64),
             torch.randint(0, 3, (8,), generator=gen)) for _ in range(STEPS)]
    results = {}
    for schedule, stages, per_rank in (("interleaved-1f1b", 4, 2), ("zbv", 4, 2)):
        for recompute in (False, True):
            torch.manual_seed(0)
            plan = fxpipe.Plan(stages=stages, stages_per_device=per_rank, schedule=schedule,
                               micro_batches=2, loss_fn=F.cross_entropy, costs="none",
                               recompute=recompute)
            pipe = fxpipe.compile(DropNet().double(), plan, example_inputs=(data[0][0],))
            runners = pipe.executor.runners.values()
            assert all(runner.recompute.enabled is recompute for runner in runners)
            torch.manual_seed(1)
            losses = train_pipelined(pipe, data)
            results[schedule, recompute] = (losses, fxpipe.gather_state_dict(pipe))
    if dist.get_rank() == 0:
        torch.save(results, out)


def _thread_cpus():
    """The CPU sets this rank's threads (gloo's, the stage's) may run on."""
    cpus = set()
    for thread in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(OSError):  # ended meanwhile
            cpus.add(tuple(sorted(os.sched_getaffinity(thread))))
    return sorted(cpus)


def _check_measures(pipe, data, stages):
    """The link's ping-pong, a calibration (every rank at once) and the report under
    torchrun: the same figures on every rank, gathered in one exchange, leaving no trace."""
    assert pipe.link.source.startswith("measured ping-pong") and pipe.link.per_message > 0
    links: list = [None] * dist.get_world_size()  # the same figures on every rank
    dist.all_gather_object(links, pipe.link)
    assert links == [pipe.link] * len(links)
    grads = [p.grad.clone() for p in pipe.parameters()]  # the last step's
    buffers = [b.clone() for b in pipe.buffers()]
    x, y = data[0]
    calibration = fxpipe.calibrate(pipe, x, target=y, steps=3, warmup=1)
    assert all(torch.equal(p.grad, g) for p, g in zip(pipe.parameters(), grads))
    assert all(torch.equal(b, c) for b, c in zip(pipe.buffers(), buffers))
    figures: list = [None] * dist.get_world_size()  # every stage's, from the gathered events
    dist.all_gather_object(figures, (calibration.forward, calibration.backward,
                                     calibration.send))
    assert figures == [figures[0]] * len(figures)
    assert len(calibration.forward) == stages and calibration.steps == 3
    traces = pipe.executor.full_traces([(pipe.last_trace(), pipe.executor.trace_origin)] * 2)
    assert all({e.stage for e in trace} == set(range(stages)) for trace in traces)
    assert all(min(e.start for e in trace) == 0 for trace in traces)
    exchanges = []
    gather = dist.all_gather_object
    dist.all_gather_object = lambda *a, **k: (exchanges.append(a), gather(*a, **k))[1]
    try:
        report = pipe.report(file=io.StringIO(), calibration=calibration)
    finally:
        dist.all_gather_object = gather
    assert len(exchanges) == 1 and report.startswith("step (")  # the last step's traces
    assert "calibrated" in report
    kept = [(pipe.last_trace(), pipe.executor.trace_origin)] * (1 + dist.get_rank())
    try:  # as many runs on no two ranks: every rank says so
        pipe.executor.full_traces(kept)
    except fxpipe.FxpipeError as error:
        assert "different numbers of runs (rank 0: 1, rank 1: 2" in str(error), error
    else:
        raise AssertionError("ranks gathering different numbers of runs went unnoticed")
    _check_measured_step(pipe, x, y)


def _check_measured_step(pipe, x, y):
    """measure_memory's peak needs a measured step that frees nothing its unprofiled warm-up
    left (the profiler reports freeing a block only if it saw it allocated): across ranks too
    (the transport's messages, the tied weight's gradients), profiled from the warm-up on, the
    step's memory events on this rank sum to zero and rise to measure_memory's peak."""
    measured = fxpipe.measure_memory(pipe, x, target=y).activations[dist.get_rank()]
    params = list(pipe.parameters())
    with preserved_state(pipe), gradients_set_aside(pipe), pipe.executor.runs_aside():
        made = [p.grad.data_ptr() for p in params]
        for _ in range(2):  # the warm-up, then the step
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as session:
                pipe.step(x, y)
        assert [p.grad.data_ptr() for p in params] == made  # accumulated in place
    events = sorted((e.start_ns(), e.nbytes()) for e in session.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    level, peak = 0, 0
    for _, change in events:
        level += change
        peak = max(peak, level)
    assert (level, peak) == (0, measured) and peak > 0, (level, peak, measured)


def _links(pipe):
    """This rank's one-way groups: (sending stage, receiving stage) -> the group's ranks, and
    the directions the comm table's edges need to and from this rank's stages (not between
    two of them: those messages stay in the process)."""
    transport = pipe.executor.transport
    held = set(pipe.executor.runners)
    needed = {pair for e in pipe.comm.edges for pair in ((e.src, e.dst), (e.dst, e.src))
              if len(held & set(pair)) == 1}
    groups = {pair: dist.get_process_group_ranks(handle)
              for pair, handle in transport.links.items()}
    distinct = len({id(handle) for handle in transport.links.values()}) == len(transport.links)
    return {"groups": groups, "needed": needed, "distinct": distinct,
            "ranks": list(transport.ranks)}


def _bytes_held(pipe):
    """Bytes of the model's tensors that have storage on this rank, of this rank's stage, and
    of the whole model (each tensor once)."""
    def size(tensors):
        unique = {id(t): t for t in tensors}.values()
        return sum(t.numel() * t.element_size() for t in unique)

    everything = [*pipe.graph.parameters(), *pipe.graph.buffers()]
    return {"real": size(t for t in everything if not t.is_meta),
            "stage": size([*pipe.parameters(), *pipe.buffers()]),
            "model": size(everything)}


def hybrid(mode, name, out):
    """2 pipeline groups x 2 stages: each group trains on its half of the global batch and
    GroPipe's all-reduce (delayed, or naive) averages the stages' gradients across groups
    (for the GPT, whose embedding is tied to its output layer, also across the two stages)."""
    model, data, loss_fn = build(name)
    data = global_batches(data, padded=name.endswith("-padded"))
    plan = fxpipe.Plan(stages=2, groups=2, micro_batches=2, loss_fn=loss_fn, costs="none",
                       dp_sync=mode)
    pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],))
    losses = train_pipelined(pipe, data)
    events = [(str(e.action), e.action.kind.name, pipe.executor.trace_origin + e.start,
               pipe.executor.trace_origin + e.end) for e in pipe.last_trace()]
    pipe.save_trace(str(out).removesuffix(".pt") + ".json")  # every rank of the job takes part
    share = {"rank": dist.get_rank(), "state": {k: v.clone() for k, v in
                                                 pipe.state_dict().items()},
             "events": events, "losses": losses}
    shares: list = [None] * dist.get_world_size()
    dist.all_gather_object(shares, share)
    if dist.get_rank() == 0:
        torch.save(shares, out)


def hybrid_reference(name):
    """One process, the whole global batch, no pipeline."""
    model, data, loss_fn = build(name)
    return train_plainly(model, global_batches(data, padded=name.endswith("-padded")), loss_fn)


def global_batches(data, padded=False):
    """Each batch doubled into a global batch for two pipeline groups, the second half's
    samples other than the first's; `padded`: most of the second half's target tokens are
    padding (-100), so the groups' token means average over different counts."""
    batches = []
    for x, y in data:
        second = y.flip(0).clone()
        if padded:
            second[:, 3:] = -100
            second[0, 1:] = -100
        batches.append((torch.cat([x, x.roll(1, -1)]), torch.cat([y, second])))
    return batches


def fail(out):
    """Stage 1 raises during the step: every rank must stop with that error, none may hang
    (rank 0 waits for stage 1 until its deadline, then reads the error rank 1 posted)."""
    model, data, loss_fn = build("skipnet")
    plan = fxpipe.Plan(stages=2, micro_batches=2, loss_fn=loss_fn, costs="none",
                       partitioner=[3, 4], timeout=2)
    pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],))
    if dist.get_rank() == 1:
        def explode(module, inputs):
            raise ValueError("injected failure on stage 1")
        model.layers[3].register_forward_pre_hook(explode)
    try:
        pipe.step(*data[0])
    except Exception as error:
        _stop(error)


def stall(out, groups=1):
    """Rank 1 (with groups, rank 3: group 1's last stage) stands still in the second step's
    first forward, as a stopped process would, until every other rank has given up; then it
    goes on (as after SIGCONT). Every rank must stop within a few deadlines, saying what it
    waited for: a message of the schedule, or (with groups) a collective over the groups."""
    model, data, loss_fn = build("skipnet")
    plan = fxpipe.Plan(stages=3 if groups == 1 else 2, micro_batches=2, schedule="1f1b",
                       loss_fn=loss_fn, costs="none", timeout=2, groups=groups)
    if groups > 1:
        data = global_batches(data)
    pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],))
    pipe.step(*data[0])  # a step that completes: the deadline is now max(2 s, 10 x its time)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == (1 if groups == 1 else 3):
        store = dist.distributed_c10d._get_default_store()
        others = [f"stopped/{r}" for r in range(world) if r != rank]

        def stand_still(module, inputs):
            store.wait(others, datetime.timedelta(seconds=150))
        for module in model.modules():  # this rank runs only its stage's
            module.register_forward_pre_hook(stand_still)
    try:
        pipe.step(*data[1])
    except Exception as error:
        _stop(error)


def _stop(error: Exception) -> None:
    """Report the error, then exit: every rank but the last to report at once and cleanly, the
    last with the error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # one write, the newline in it: print() writes it apart, and ranks share the pipe
    sys.stdout.flush()
    os.write(1, f"rank {rank} stopped: {type(error).__name__}: {error}\n".encode())
    # a waiting peer wakes when this process's connections close, that is when it exits;
    # torchrun kills the other ranks as soon as one exits with an error, which could cut a
    # peer short before it reports. So no rank waits on a timeout (no teardown: the operating
    # system closes its sockets), and none is killed before it prints.
    store = dist.distributed_c10d._get_default_store()
    store.set(f"stopped/{rank}", "1")  # what a standing-still rank waits for
    os._exit(3 if store.add("stopped", 1) == world else 0)


def names(out):
    """A model whose embedding and output layer share a weight, traced by export and by fx:
    the state dict gathered from both ranks, the names under a prefix, a parent module's
    state dict, and how many runs' micro-batch sizes the transport holds after 1 and 3 steps."""
    for tracer in ("export", "fx"):
        torch.manual_seed(0)
        model = Tied().double()
        data = [(torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))) for _ in range(3)]
        plan = fxpipe.Plan(stages=2, micro_batches=2, loss_fn=tokens_loss, costs="none",
                           tracer=tracer)
        pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],))
        state = fxpipe.gather_state_dict(pipe)
        parent = nn.Module()
        parent.first, parent.m, parent.last = nn.Linear(2, 2), pipe, nn.Linear(2, 2)
        share = {"names": [n for n, _ in pipe.named_parameters()],
                 "buffers": [n for n, _ in pipe.named_buffers()],
                 "prefixed": [n for n, _ in pipe.named_parameters(prefix="m")],
                 "prefixed_buffers": [n for n, _ in pipe.named_buffers(prefix="m")],
                 "parent": list(parent.state_dict()), "own": list(pipe.state_dict())}
        sizes = []
        for x, y in data:
            pipe.step(x, y)
            sizes.append(len(pipe.executor.transport._dims))
        share["sizes"] = sizes
        shares: list = [None] * dist.get_world_size()
        dist.all_gather_object(shares, share)
        if dist.get_rank() == 0:
            torch.save({"state": state, "shares": shares}, f"{out}.{tracer}")


def _gloo_threads() -> int:
    """Threads of gloo's process groups running in this process, by the names gloo gives them."""
    names = [pathlib.Path(f"/proc/self/task/{task}/comm").read_text().strip()
             for task in os.listdir("/proc/self/task")]
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)


def leave(out):
    """Steps of a pipeline, then its trace gathered (a collective on Python objects, whose
    tensors gloo's threads free after it returns), then fxpipe.shutdown(): no gloo thread is
    left to outlive the interpreter. (Without an optimizer: building one imports
    torch._dynamo, after which torch itself keeps the default group alive.)"""
    model, data, loss_fn = build("gpt")
    plan = fxpipe.Plan(stages=2, micro_batches=2, loss_fn=loss_fn, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],))
    for x, y in data:
        pipe.step(x, y)
    pipe.full_trace()
    rank, during = dist.get_rank(), _gloo_threads()
    del pipe
    fxpipe.shutdown()
    torch.save({"during": during, "after": _gloo_threads()}, f"{out}.{rank}")


def sends(out):
    """async-1f1b over 2, then 6 mini-batches: the most sends (isend works) alive at once in
    each run, as this rank posts them, and how many it posted in the longer one."""
    pipe, data = async_pipeline("skipnet", 2, "none", 2)
    posted: list[weakref.ref] = []
    peaks = []
    isend = dist.isend

    def recording(*args, **kwargs):
        work = isend(*args, **kwargs)
        posted.append(weakref.ref(work))
        peaks[-1] = max(peaks[-1], sum(ref() is not None for ref in posted))
        return work

    dist.isend = recording
    try:
        for count in (2, 6):
            posted.clear()
            peaks.append(0)
            pipe.step_many((data * 3)[:count])
    finally:
        dist.isend = isend
    torch.save({"peaks": peaks, "sent": len(posted)}, f"{out}.{dist.get_rank()}")


def main() -> None:
    torch.set_num_threads(1)
    scenario, out = sys.argv[1], sys.argv[2]
    if scenario in ("fail", "stall", "names", "sends"):
        {"fail": fail, "stall": stall, "names": names, "sends": sends}[scenario](out)
    elif scenario == "stall-groups":
        stall(out, groups=2)
    elif scenario.startswith("hybrid:"):  # hybrid:MODE:MODEL
        hybrid(*scenario.split(":")[1:], out)
    elif scenario == "leave":
        leave(out)
    elif scenario == "recompute":
        recompute_pairs(out)
    elif scenario == "mismatch":
        fxpipe.compile(SkipNet(), fxpipe.Plan(stages=3, costs="none"),
                       example_inputs=(torch.randn(4, 5),))
    else:  # training scenarios NAME:STAGES:SCHEDULE:MICRO_BATCHES, several joined by '+'
        for index, case in enumerate(scenario.split("+")):
            name, stages, schedule, micro_batches = case.split(":")
            train(name, int(stages), schedule, int(micro_batches), f"{out}.{index}")
    fxpipe.shutdown()  # every rank is done communicating before any tears gloo down


if __name__ == "__main__":
    main()
