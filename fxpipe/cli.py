"""The `fxpipe` command: its `demo`, `plan` and `bench` subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from fxpipe.bench import (
    against_even,
    bench,
    bench_plans,
    bench_under_torchrun,
    check_stage_count_of,
    format_rows,
    rows_to_json,
    write_csv,
)
from fxpipe.calibrate import calibrate
from fxpipe.cli_compare import (
    comma_separated,
    compared_schedules,
    partitioner_comparison,
    schedule_comparison,
)
from fxpipe.cli_plan_options import add_training_options, training_fields
from fxpipe.compiler import compile
from fxpipe.distributed import launched, shutdown
from fxpipe.errors import FxpipeError
from fxpipe.loading import bench_build, bundled_model, factory, load_model
from fxpipe.models import MODELS
from fxpipe.plan import PARTITIONERS, SCHEDULES, VIRTUAL, Plan

__all__ = ["at_least_one", "main"]

DESCRIPTION = ("`demo` trains a bundled model through a compiled pipeline on the CPU; `plan` "
               "prints the stage table of any importable model; `bench` compares partitioners "
               "and schedules on one, predicted against measured.")


_TIMED_STEPS = 10  # steps the demo times after calibrating
_ONE_PER_STAGE = "default: one per stage (up to the batch), as Plan's"


def _demo(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    _threads_per_stage(args.threads, args.stages // args.stages_per_device)
    spec = bundled_model(args.model)
    model = spec.build()
    data = torch.Generator().manual_seed(args.seed)
    x, y = spec.batch(args.batch, data)
    plan = Plan(stages=args.stages, partitioner=_partitioner(args.partitioner),
                micro_batches=args.micro_batches, schedule=args.schedule, loss_fn=spec.loss_fn,
                stages_per_device=args.stages_per_device, optimizer="sgd-momentum",
                **training_fields(args))  # the optimizer it trains with, below
    pipe = compile(model, plan, example_inputs=(x,), example_target=y)
    print(pipe)
    print()
    pipe.print_graph()
    print()
    print("predicted timeline of one step (event simulator; times in seconds):")
    print(pipe.predicted_timeline().ascii())
    print()
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    print(f"training {args.steps} steps on one fixed batch of {args.batch} "
          f"(SGD, lr={args.lr}, momentum 0.9) through the compiled pipeline, "
          f"{args.schedule} over {plan.device_count} worker threads:")
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = pipe.step(x, y)
        pipe.scaler.step(optimizer)  # fp16's loss scaling; otherwise optimizer.step()
        pipe.scaler.update()
        print(f"  step {step}: loss {loss.item():.4f}")
    print()
    print("the last step, measured against predicted from the units' times:")
    pipe.report()
    calibration = calibrate(pipe, x, target=y)
    times = []
    for _ in range(_TIMED_STEPS):  # the weights stay as they are: no optimizer step
        start = time.perf_counter()
        pipe.step(x, y)
        times.append(time.perf_counter() - start)
    optimizer.zero_grad()
    predicted = pipe.predicted_timeline(calibration).makespan + calibration.step
    print()
    print(f"{calibration}")
    print(f"{_TIMED_STEPS} more steps: median {statistics.median(times) * 1e3:.2f} ms (from "
          f"{min(times) * 1e3:.2f} to {max(times) * 1e3:.2f}), calibrated prediction "
          f"{predicted * 1e3:.2f} ms; the last of them, measured against it:")
    pipe.report(calibration=calibration)


def _threads_per_stage(threads: str, stages: int) -> None:
    """--threads: intra-op threads for each stage thread (torch.set_num_threads, which the
    stage threads take on); 'auto' shares this process's threads among the stages, 'torch'
    leaves torch's setting as it is."""
    if threads == "torch":
        return
    count = max(1, torch.get_num_threads() // stages) if threads == "auto" else int(threads)
    torch.set_num_threads(count)


def dist_rank() -> int:
    """This process's rank: from the process group, or from torchrun before it is joined."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _plan(args: argparse.Namespace) -> None:
    if args.json:
        check_output_path("--json", args.json)
    plan = Plan(stages=args.stages, partitioner=_partitioner(args.partitioner),
                micro_batches=args.micro_batches, schedule=args.schedule, tracer=args.tracer,
                stages_per_device=args.stages_per_device,
                memory_limit=args.memory_limit, **training_fields(args))
    schedules = compared_schedules(args, plan)
    model, inputs = load_model(args.model, args.batch, args.input_shape, args.input_dtype,
                                args.input_high)
    pipe = compile(model, plan, example_inputs=inputs)
    print(pipe)
    if args.compare:
        print()
        print(partitioner_comparison(pipe))
    if schedules:
        print()
        print(schedule_comparison(pipe, schedules))
    if args.json:
        chosen = dataclasses.replace(plan, partitioner=list(pipe.partition.sizes),
                                     micro_batches=pipe.partition.micro_batches)
        chosen.save(args.json, partitioner_used=pipe.partition.partitioner,
                    predicted_step_seconds=pipe.partition.predicted_time,
                    units=[u.name for u in pipe.units])
        print(f"\nplan written to {args.json}")


def _bench(args: argparse.Namespace) -> None:
    micro_batches = args.micro_batches
    partitioners = comma_separated("--partitioners", args.partitioners)
    schedules = comma_separated("--schedules", args.schedules)
    if args.nproc == 1:
        raise FxpipeError("--nproc 1 runs one process, as the run without --nproc does: drop "
                          "--nproc, or give at least 2 stages and as many processes.")
    if args.nproc is not None and args.nproc != args.stages:
        raise FxpipeError(f"--nproc {args.nproc} runs one stage per process: give --stages "
                          f"{args.nproc}, or --nproc {args.stages}.")
    if isinstance(micro_batches, int) and args.batch < micro_batches:
        raise FxpipeError(f"--batch {args.batch} cannot fill --micro-batches {micro_batches} "
                          f"(each needs a sample at least): give --batch {micro_batches} or "
                          f"more, or fewer micro-batches.")
    if args.csv:
        check_output_path("--csv", args.csv)
    factory(args.model)  # an unknown model fails here, before any progress is shown
    bench_plans(args.stages, micro_batches, partitioners, schedules)  # and so does a plan
    build = bench_build(args.model, args.batch, args.input_shape, args.input_dtype,
                        args.input_high)
    if args.nproc:  # and a model with too few units, before the job starts (bench checks too)
        check_stage_count_of(build, args.stages)
    rows = _bench_rows(args, build, micro_batches, partitioners, schedules)
    if rows is None:  # a rank under torchrun: rank 0 of the job reports
        return
    title = (f"{args.model}: {args.stages} stages, batch {args.batch}, micro-batches "
             f"{args.micro_batches or 'one per stage'}, {rows[0].rounds} rounds of "
             f"{args.steps} steps"
             + (f", {args.nproc} processes under torchrun" if args.nproc else ""))
    print(title)
    print(format_rows(rows))
    for line in against_even(rows):
        print(line)
    print("predicted: the simulated step with the calibration's per-action times "
          "(fxpipe.calibrate); measured: the median of the timed steps, the rounds' range "
          "being the lowest and highest round median (the machine's drift and the steps' "
          "own noise)")
    if args.csv:
        write_csv(args.csv, rows)
        print(f"rows written to {args.csv}")


def _bench_rows(args: argparse.Namespace, build: Callable[[], tuple],
                micro_batches: int | str, partitioners: Sequence[str],
                schedules: Sequence[str]) -> list | None:
    """The benchmark's rows: run here, or under torchrun with --nproc (None on the ranks
    of that job, whose rank 0 hands its rows back as JSON)."""
    if args.nproc:
        forwarded = _without_option(args.argv[1:], "--nproc")  # the words after "bench"
        forwarded = _without_option(forwarded, "--csv")
        return bench_under_torchrun(args.nproc, forwarded)
    if not launched():
        _threads_per_stage(args.threads, args.stages)
    rows = bench(build, args.stages, micro_batches, partitioners, schedules, args.rounds,
                 args.steps, progress=not launched() or dist_rank() == 0)
    if not launched():
        return rows
    if args.rows_json and dist_rank() == 0:
        rows_to_json(args.rows_json, rows)
    shutdown()  # every rank is done communicating before teardown
    return None


def _without_option(argv: Sequence[str], option: str) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == option:
            skip = True
            continue
        if item.startswith(option + "="):
            continue
        out.append(item)
    return out


def _partitioner(text: str | None) -> str | list[int] | None:
    if text is None:  # Plan's default
        return None
    if "," in text or text.isdigit():
        try:
            return [int(part) for part in text.split(",")]
        except ValueError as e:
            raise FxpipeError(f"--partitioner {text!r}: give a name or units per stage "
                              "such as 4,6") from e
    return text


def at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"give a whole number of at least 1, not {text!r}")
    return value


def check_output_path(option: str, path: str) -> None:
    """Raise FxpipeError unless a file can be written at `path` (given with `option`), so a
    mistake shows before the work, not after it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise FxpipeError(f"{option} {path}: that is a folder; give a file name in it.")
    if not os.path.isdir(folder):
        raise FxpipeError(f"{option} {path}: there is no folder {folder}; create it first.")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise FxpipeError(f"{option} {path}: not writable here; give a path you can write.")


def _threads(text: str) -> str:
    """An argparse type: auto, torch, or a whole number of at least 1."""
    if text in ("auto", "torch"):
        return text
    try:
        return str(at_least_one(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"give auto, torch or a whole number of at least 1, "
                                         f"not {text!r}") from None


def _micro_batches(text: str) -> int | str:
    """An argparse type: a micro-batch count of at least 1, or auto."""
    if text == "auto":
        return text
    try:
        return at_least_one(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"give a whole number of at least 1, or auto, not "
                                         f"{text!r}") from None


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends with the option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _model_inputs(command: argparse.ArgumentParser) -> None:
    """The options describing a MODULE:FACTORY model's example inputs."""
    command.add_argument("--input-shape", action="append",
                         help="per-sample shape of a MODULE:FACTORY model's input, e.g. "
                              "3x32x32 (once per input)")
    command.add_argument("--input-dtype", default="float32", help="dtype of the inputs")
    command.add_argument("--input-high", type=int, default=2, help="integer inputs: upper bound")


def _stages_per_device_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("--stages-per-device", type=at_least_one, default=1,
                         help=f"stages each device runs ({', '.join(VIRTUAL)}: 2 or more)")


def _threads_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("--threads", type=_threads, default="auto",
                         help="intra-op threads per stage thread (torch.set_num_threads): auto "
                              "shares this process's threads among the stages, torch leaves "
                              "torch's setting as it is")


def _parser() -> argparse.ArgumentParser:
    # no abbreviated options: bench hands its own words on to torchrun's processes
    parser = argparse.ArgumentParser(prog="fxpipe", description=DESCRIPTION, allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    shown = {"formatter_class": _DefaultsShown, "allow_abbrev": False}
    demo = commands.add_parser("demo", help="compile a bundled model and train a few steps",
                               **shown)
    demo.add_argument("--model", choices=sorted(MODELS), default="resnet",
                      help="the bundled model to train")
    demo.add_argument("--stages", type=at_least_one, default=2, help="pipeline stages")
    demo.add_argument("--partitioner", default="balanced",
                      help="how to split the model into stages")
    demo.add_argument("--micro-batches", type=_micro_batches,
                      help=f"micro-batches per step, or auto; {_ONE_PER_STAGE}")
    demo.add_argument("--schedule", default="1f1b",
                      choices=[s for s in SCHEDULES if s != "async-1f1b"],
                      help="the pipeline schedule")
    demo.add_argument("--batch", type=at_least_one, default=32, help="mini-batch size")
    demo.add_argument("--steps", type=at_least_one, default=5, help="training steps")
    demo.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    demo.add_argument("--seed", type=int, default=0, help="seed of the weights and data")
    _stages_per_device_option(demo)
    add_training_options(demo, optimizer=False, capped=False)  # SGD with momentum, no cap
    _threads_option(demo)
    demo.set_defaults(run=_demo)

    plan = commands.add_parser("plan", help="print the stage table of a model's pipeline",
                               **shown)
    plan.add_argument("model", help=f"MODULE:FACTORY, or a bundled model: {', '.join(MODELS)}")
    plan.add_argument("--stages", type=at_least_one, required=True, help="pipeline stages")
    plan.add_argument("--partitioner",
                      help=f"one of {', '.join(PARTITIONERS)}, or units per stage: 4,6 "
                           "(default: balanced, as Plan's)")
    plan.add_argument("--batch", type=at_least_one, default=16, help="example mini-batch size")
    plan.add_argument("--micro-batches", type=_micro_batches,
                      help=f"a number, or auto; {_ONE_PER_STAGE}")
    plan.add_argument("--schedule", default="gpipe", help="the pipeline schedule")
    _stages_per_device_option(plan)
    plan.add_argument("--tracer", default="auto", help="fx, export, or auto (fx, else export)")
    _model_inputs(plan)
    plan.add_argument("--compare", action="store_true", help="every partitioner side by side")
    plan.add_argument("--memory-limit", help="memory cap per device, e.g. 8GiB: planners fit it")
    add_training_options(plan)
    plan.add_argument("--schedules", help="with --compare, also these schedules side by side "
                                          "for the chosen partitioner, e.g. gpipe,1f1b,zb-h1")
    plan.add_argument("--json", help="write the chosen plan to this file")
    plan.set_defaults(run=_plan)

    bench_cmd = commands.add_parser("bench", help="compare partitioners and schedules: "
                                                  "predicted and measured step times", **shown)
    bench_cmd.add_argument("model", help=f"MODULE:FACTORY, or a bundled model: "
                                         f"{', '.join(MODELS)}")
    bench_cmd.add_argument("--stages", type=at_least_one, default=2, help="pipeline stages")
    bench_cmd.add_argument("--batch", type=at_least_one, default=32, help="mini-batch size")
    bench_cmd.add_argument("--micro-batches", type=_micro_batches,
                           help=f"a number, or auto; {_ONE_PER_STAGE}")
    bench_cmd.add_argument("--partitioners", default="even,params,balanced,ampa,imd,csimd",
                           help="the partitioners to compare, comma-separated")
    bench_cmd.add_argument("--schedules", default="gpipe,1f1b",
                           help="the schedules to compare, comma-separated")
    bench_cmd.add_argument("--rounds", type=at_least_one, default=5,
                           help="rounds of timed steps per configuration, the configurations "
                                "taking turns")
    bench_cmd.add_argument("--steps", type=at_least_one, default=5,
                           help="timed steps per round")
    bench_cmd.add_argument("--nproc", type=at_least_one,
                           help="run every configuration under torchrun with this many "
                                "processes (one stage each)")
    _threads_option(bench_cmd)
    _model_inputs(bench_cmd)
    bench_cmd.add_argument("--csv", help="write the table as CSV (benchmarks/plot_bench.py "
                                         "draws it)")
    bench_cmd.add_argument("--rows-json", help=argparse.SUPPRESS)
    bench_cmd.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    threads = torch.get_num_threads()  # --threads sets them for the command's run only
    try:
        args.run(args)
    except FxpipeError as e:
        print(f"fxpipe: error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
