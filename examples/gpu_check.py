"""GPU self-check: the bundled models compiled over the visible GPUs, checked against the plain
model, with step time, bubble and per-stage peak memory, predicted beside measured.

    python examples/gpu_check.py                       # one process over every visible GPU
    torchrun --nproc-per-node 2 examples/gpu_check.py  # one stage per rank, NCCL on GPUs
    python examples/gpu_check.py --quick               # small and fast (what the tests run)

Outputs, the loss and every parameter's gradient must equal the plain model's within float32
tolerances; under torchrun the same stages also run under torch.distributed.pipelining with the
same schedule, and must give the same loss. Exits 1 on any mismatch. Without a GPU it says so,
runs the CPU half (the same checks on CPU stages) and lists what it skipped.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fxpipe
from fxpipe.devices import cuda_count, job_backend, plan_rank_device
from fxpipe.models import MLP, bundled
from fxpipe.report import step_time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # HF models are built from a config: no download
RTOL, ATOL = 1e-4, 1e-5  # float32, summed in another order across micro-batches
MICRO_BATCHES = 4


def placements(gpus: int, quick: bool) -> dict[str, list[str]]:
    """The device lists to check: every GPU (two stages on one GPU when there is one), a CPU
    stage followed by GPU stages, or two CPU stages without a GPU."""
    if gpus == 0:
        return {"cpu": ["cpu", "cpu"]}
    on_gpus = [f"cuda:{i}" for i in range(gpus)] if gpus > 1 else ["cuda:0", "cuda:0"]
    found = {"gpus": on_gpus}
    if not quick:
        found["cpu+gpus"] = ["cpu", *on_gpus[: max(1, len(on_gpus) - 1)]]
    return found


def skipped(gpus: int, torchrun: bool, hf: bool) -> list[str]:
    """What this run cannot check, and why."""
    missing = []
    if gpus == 0:
        missing += ["stages on CUDA devices (no GPU: torch.cuda.is_available() is False)",
                    "a CPU stage followed by GPU stages (no GPU)",
                    "measured peak memory per GPU (torch.cuda.max_memory_allocated; no GPU)",
                    "pinned host buffers, copy streams and CUDA-event timing (no GPU)"]
    if not torchrun:
        missing += ["NCCL / gloo between ranks and the comparison with "
                    "torch.distributed.pipelining (one stage per process): run under torchrun"]
    if not hf:
        missing += ["HF GPT-2 (transformers is not installed: pip install 'fxpipe[hf]')"]
    return missing


def _tensor(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def _synchronize(devices: Sequence[str]) -> None:
    for device in {torch.device(d) for d in devices}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _peaks(devices: Sequence[str]) -> dict[str, float]:
    """The peak memory allocated on each GPU since the last reset (CPU: not measured here)."""
    return {d: torch.cuda.max_memory_allocated(d) for d in dict.fromkeys(devices)
            if torch.device(d).type == "cuda"}


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


class Check:
    """The mismatches found so far, and the lines to print: at once in one process; under
    torchrun each rank's, gathered to rank 0 at the end (`gather`)."""

    def __init__(self, torchrun: bool) -> None:
        self.failures: list[str] = []
        self.torchrun = torchrun
        self.quiet = False
        self.lines: list[str] = []

    def say(self, text: str) -> None:
        if self.torchrun:
            self.lines.append(text)
        elif not self.quiet:
            print(text, flush=True)

    def gather(self) -> None:
        """Under torchrun: every rank's lines and failures, printed by rank 0."""
        if not self.torchrun:
            return
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.lines, self.failures))
        self.failures = [f"rank {r}: {f}" for r, (_, fs) in enumerate(everyone) for f in fs]
        self.torchrun, self.quiet = False, dist.get_rank() != 0  # rank 0 prints the rest
        for r, (lines, _) in enumerate(everyone):
            self.say(f"\n=== rank {r} ===")
            for line in lines:
                self.say(line)

    def close(self, what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        # values, not dtypes: under torchrun pipe.step returns the loss in float64
        got = got.detach().to(expected.device, expected.dtype)
        try:
            torch.testing.assert_close(got, expected.detach(), rtol=RTOL, atol=ATOL)
        except AssertionError as error:
            first = str(error).splitlines()
            self.failures.append(f"{what}: {' '.join(first[:3])}")


def check_model(name: str, devices: Sequence[str] | None, schedule: str, size: int, steps: int,
                check: Check, stages: int) -> None:
    """One model on `devices` (None: this rank's, under torchrun) against the plain model."""
    model_def = bundled(name)
    torch.manual_seed(0)
    model = _without_dropout(model_def.build())
    here = (devices or [_rank_device()])[-1]
    reference = copy.deepcopy(model).to(here)
    x, y = model_def.batch(size, torch.Generator().manual_seed(0))
    plan = fxpipe.Plan(stages=stages, micro_batches=MICRO_BATCHES, schedule=schedule,
                       devices=devices,
                       loss_fn=model_def.loss_fn)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), example_target=y)
    label = f"{name} / {schedule} on {', '.join(devices) if devices else 'one rank each'}"
    before = len(check.failures)
    last = pipe.rank is None or pipe.rank == dist.get_world_size() - 1

    # the plain model run micro-batch by micro-batch, as the pipeline runs it: the same
    # result as the whole batch at once, except where batch norm sees each micro-batch alone
    xs, ys = torch.tensor_split(x.to(here), MICRO_BATCHES), torch.tensor_split(y.to(here),
                                                                              MICRO_BATCHES)
    with torch.no_grad():  # the outputs
        out = pipe(x)  # under torchrun: on the last rank, None on the others
        reference_out = torch.cat([_tensor(reference(chunk)) for chunk in xs])
    if out is not None:
        check.close(f"{label}: output", _tensor(out), reference_out)
    expected = sum(model_def.loss_fn(reference(a), b) * (len(a) / len(x)) for a, b in zip(xs, ys))
    expected.backward()
    loss = pipe.step(x, y)  # the loss and the gradients
    check.close(f"{label}: loss", loss, expected)
    wanted = dict(reference.named_parameters())
    for param_name, param in pipe.named_parameters():
        if param.grad is not None or pipe.rank is None:
            if param.grad is None:
                check.failures.append(f"{label}: {param_name} has no gradient")
                continue
            check.close(f"{label}: gradient of {param_name}", param.grad,
                        wanted[param_name].grad)

    # time: the cost model's prediction beside steps timed to the end of their GPU work
    placed = list(devices) if devices else [_rank_device()]
    for device in dict.fromkeys(placed):
        if torch.device(device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    walls = []
    for _ in range(steps):
        pipe.zero_grad()
        _synchronize(placed)
        start = time.perf_counter()
        pipe.step(x, y)
        _synchronize(placed)
        walls.append(time.perf_counter() - start)
    peaks = _peaks(placed)
    measured = step_time(pipe.full_trace(), stages)
    predicted = pipe.predicted_timeline()
    if len(check.failures) > before + 5:  # the first few say enough
        more = len(check.failures) - before - 5
        check.failures[before + 5:] = [f"{label}: ... and {more} more mismatches"]
    what = "outputs, loss and gradients" if last else "loss and this rank's gradients"
    verdict = ("equal the plain model's" if len(check.failures) == before
               else "DIFFER from the plain model's (below)")
    check.say(f"\n{label}: {what} {verdict}")
    check.say(f"  step     measured {statistics.median(walls) * 1e3:8.2f} ms (median of "
              f"{steps}, {min(walls) * 1e3:.2f}-{max(walls) * 1e3:.2f})   predicted "
              f"{predicted.makespan * 1e3:8.2f} ms")
    check.say(f"  bubble   measured {measured.bubble * 100:7.1f} %    predicted "
              f"{predicted.bubble * 100:7.1f} %")
    for s, cost in enumerate(pipe.partition.stages):
        device = placed[s] if devices else (placed[0] if s == pipe.rank else None)
        if device is None:
            continue  # another rank's stage: that rank measures it
        if device not in peaks:
            measured_text = "not measured on the CPU"
        else:
            shared = list(placed).count(device) > 1
            measured_text = (f"{_mib(peaks[device])} MiB"
                             f"{f' on {device}, shared with another stage' if shared else ''}")
        check.say(f"  stage {s} peak memory: predicted {_mib(cost.memory)} MiB, measured "
                  f"{measured_text}")


def _without_dropout(model: nn.Module) -> nn.Module:
    """The model with its dropout off: the pipeline and the plain model draw other random
    numbers, so their outputs would differ by design."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
    return model


def _rank_device() -> str:
    """This rank's device, as fxpipe chooses it for Plan(devices=None)."""
    count = cuda_count()
    return str(plan_rank_device(None, int(os.environ.get("LOCAL_RANK", "0")), count))


def compare_with_torch_pipelining(schedule: str, check: Check) -> None:
    """Under torchrun: the same stages of an MLP under torch.distributed.pipelining's schedule
    of the same name give fxpipe's loss."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(_rank_device())
    torch.manual_seed(0)
    model = MLP()
    theirs_model = copy.deepcopy(model)  # an MLP: no dropout
    x, y = bundled("mlp").batch(16, torch.Generator().manual_seed(0))
    loss_fn = bundled("mlp").loss_fn
    plan = fxpipe.Plan(stages=world, micro_batches=4, schedule=schedule, loss_fn=loss_fn,
                       unit_depth=1)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), example_target=y)
    ours = pipe.step(x, y)
    sizes = list(pipe.partition.sizes)
    children = list(theirs_model.children())
    start = sum(sizes[:rank])
    stage = PipelineStage(nn.Sequential(*children[start:start + sizes[rank]]).to(device),
                          rank, world, device)
    runner = kinds[schedule](stage, n_microbatches=4, loss_fn=loss_fn)
    losses: list[torch.Tensor] = []

    def their_step() -> None:
        losses.clear()
        if rank == 0:
            runner.step(x.to(device))
        elif rank == world - 1:
            runner.step(target=y.to(device), losses=losses)
        else:
            runner.step()

    their_step()
    before = len(check.failures)
    ours_by_name = dict(pipe.named_parameters())
    for name, param in stage.submod.named_parameters():  # its children renumbered from 0
        index, rest = name.split(".", 1)
        original = f"{int(index) + start}.{rest}"
        check.close(f"mlp / {schedule}: gradient of {original} against "
                    "torch.distributed.pipelining", ours_by_name[original].grad, param.grad)
    if rank == world - 1:
        theirs = torch.stack(losses).mean().detach()
        check.close(f"mlp / {schedule}: loss against torch.distributed.pipelining", ours, theirs)
    times = {}
    for label, step in (("fxpipe", lambda: pipe.step(x, y)), ("torch", their_step)) * 2:
        walls = []
        for _ in range(5):
            dist.barrier()
            _synchronize([str(device)])
            started = time.perf_counter()
            step()
            _synchronize([str(device)])
            walls.append(time.perf_counter() - started)
        times[label] = statistics.median(walls)  # the second round's: both warmed up
    same = "same" if len(check.failures) == before else "NOT the same"
    check.say(f"\nmlp / {schedule}, stages {sizes}: {same} loss and gradients as "
              f"torch.distributed.pipelining; step {times['fxpipe'] * 1e3:.2f} ms, theirs "
              f"{times['torch'] * 1e3:.2f} ms (median of 5)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, two models")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per model")
    parser.add_argument("--models", default=None,
                        help="comma-separated bundled models (default: mlp,resnet,vgg,gpt and "
                             "hf-gpt2 when transformers is installed; --quick: mlp,gpt,hf-gpt2)")
    args = parser.parse_args(argv)
    torchrun = fxpipe.distributed.launched()
    if torchrun:
        dist.init_process_group(job_backend(None, cuda_count()))
    check = Check(torchrun)
    gpus = cuda_count()
    hf = importlib.util.find_spec("transformers") is not None
    names = ["mlp", "gpt"] if args.quick else ["mlp", "resnet", "vgg", "gpt"]
    if hf:
        names.append("hf-gpt2")
    if args.models:
        names = args.models.split(",")
        unknown = [n for n in names if n not in fxpipe.models.MODELS]
        if unknown:
            parser.error(f"unknown models {unknown}; take {', '.join(fxpipe.models.MODELS)}")
    schedules = ["1f1b"] if args.quick else ["gpipe", "1f1b"]
    size, steps = (8, args.steps or 2) if args.quick else (32, args.steps or 10)
    if gpus == 0:
        check.say("gpu_check: no GPU found (torch.cuda.is_available() is False): running the "
                  "CPU half")
    else:
        check.say(f"gpu_check: {gpus} GPU(s): "
                  f"{', '.join(torch.cuda.get_device_name(i) for i in range(gpus))}")
    runs: list[tuple[Callable[[], None], str]] = []
    if torchrun:
        world = dist.get_world_size()
        for name in names:
            for schedule in schedules:
                runs.append((lambda n=name, s=schedule: check_model(
                    n, None, s, size, steps, check, world), f"{name} / {schedule}"))
        for schedule in schedules:
            runs.append((lambda s=schedule: compare_with_torch_pipelining(s, check),
                         f"torch.distributed.pipelining / {schedule}"))
    else:
        for devices in placements(gpus, args.quick).values():
            for name in names:
                for schedule in schedules:
                    runs.append((lambda n=name, s=schedule, d=devices: check_model(
                        n, d, s, size, steps, check, len(d)), f"{name} / {schedule}"))
    for run, what in runs:
        try:
            run()
        except Exception as error:  # a failure to compile or run is a failed check too
            check.failures.append(f"{what}: {type(error).__name__}: {error}")
    check.gather()
    missing = skipped(gpus, torchrun, hf)
    if missing:
        check.say("\nskipped:\n" + "\n".join(f"  - {m}" for m in missing))
    if check.failures:
        check.say("\nMISMATCH:\n" + "\n".join(f"  - {f}" for f in check.failures))
    else:
        check.say(f"\nall {len(runs)} checks passed")
    if torchrun:
        fxpipe.shutdown()
    return 1 if check.failures else 0


if __name__ == "__main__":
    # float32 convolutions and matmuls on GPUs, for float32 tolerances: set for this script's
    # own process only (main() run from another program leaves them as they are)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    sys.exit(main())
