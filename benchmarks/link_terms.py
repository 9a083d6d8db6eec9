"""Benchmark: how a term of the measured link changes the prediction's error, in one run.

Compiles a bundled model into 2 stages (one per rank under torchrun), and in each of
`--rounds` rounds times the units afresh, times the runtime's own work per step, runs
`--steps` steps and predicts the step twice from the same timings: with the link as measured,
and with `--term` (a Link field, e.g. after_receive or after_send) set to 0; for `resume`,
which compile measures on each stage's own compute under torchrun, also with the figure the
link's ping-pong measures on its small probe. It prints measured/predicted per round for
each, so the predictions meet the same steps.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/link_terms.py --model gpt --schedule 1f1b --term after_receive
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        benchmarks/link_terms.py --model gpt --term resume --rounds 6
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import numpy as np
import torch.distributed as dist
from two_stages import add_model_arguments, at_least_one, two_stages

import fxpipe
from fxpipe.cost import Link
from fxpipe.passes.analysis.comm import measure_rank_link


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "gpt", schedule=True, steps=30)
    parser.add_argument("--partitioner", default="even")
    parser.add_argument("--term", default="after_receive",
                        choices=[f.name for f in dataclasses.fields(Link)
                                 if str(f.type).startswith("float")
                                 and f.name not in ("latency", "bandwidth")])
    parser.add_argument("--rounds", type=at_least_one, default=3)
    args = parser.parse_args()
    setup = two_stages(args, partitioner=args.partitioner, schedule=args.schedule)
    pipe, x, y = setup.pipe, setup.x, setup.y
    measured_link = pipe.link
    links = {"with it": measured_link,
             "without": dataclasses.replace(measured_link, **{args.term: 0.0})}
    if args.term == "resume" and setup.distributed:
        probe = probe_resume()
        links[f"probe's {probe * 1e6:.0f} us"] = dataclasses.replace(measured_link, resume=probe)
    ratios: list[list[float]] = []
    for _ in range(args.rounds):
        fresh = fxpipe.retime(pipe, (x,), target=y, warmup=1, repeats=5)
        pipe.measure_runtime_overhead(x)  # per step, and per action (in the timeline)
        overhead = pipe.step_overhead
        setup.warm_up(20)  # the cores settle after the timing (benchmarks/after_pause.py)
        walls = [setup.timed_step() for _ in range(args.steps)]
        predicted = []
        for link in links.values():
            vars(pipe)["link"] = link
            predicted.append(pipe.predicted_timeline(fresh).makespan + overhead)
        vars(pipe)["link"] = measured_link
        measured = statistics.median(walls)
        ratios.append([measured / p for p in predicted])
    if not setup.reporting():
        return
    value = getattr(measured_link, args.term)
    shown = "None" if value is None else "/".join(f"{v * 1e6:.0f}" for v in np.atleast_1d(value))
    print(f"{args.model}, {setup.where}, {args.partitioner}, {args.schedule}, "
          f"{args.micro_batches} micro-batches; {args.term} = {shown} us; medians of "
          f"{args.steps} steps per round")
    for i, name in enumerate(links):
        print(f"meas/pred {name + ':':18s} " + "  ".join(f"{r[i]:.3f}" for r in ratios))


def probe_resume() -> float:
    """The slowdown after a wait as the ping-pong between ranks 0 and 1 measures it on its
    small probe, on every rank."""
    link = measure_rank_link(0, 1)
    shared = [link.resume if link is not None else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


if __name__ == "__main__":
    main()
