"""Benchmark: a pipeline's step with the C allocator keeping freed memory, and as it comes.

`Plan(cpu_memory="keep")` (the default) has glibc's malloc keep the memory a process frees
for its next allocations; "system" leaves the allocator as it is, handing large blocks back
to the system at every free, so the next step's tensors fault their pages in afresh. An
allocator's settings last as long as its process, so this script runs each setting in a
process of its own, taking turns for `--pairs` pairs: each compiles a bundled model into 2
stage threads, runs a few untimed steps, times its units (`fxpipe.retime`) and predicts the
step, then runs `--steps` timed steps after a few more untimed ones. It prints each
process's median step and prediction, and the medians over the pairs with the ratio of the
two settings' steps.

    python benchmarks/cpu_memory.py --model vgg --batch 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from two_stages import add_model_arguments, at_least_one, two_stages

import fxpipe

SETTINGS = ("system", "keep")


def child(args: argparse.Namespace) -> None:
    setup = two_stages(args, schedule=args.schedule, cpu_memory=args.child)
    setup.warm_up(10)  # the units are timed as between a training loop's steps
    fresh = fxpipe.retime(setup.pipe, (setup.x,), target=setup.y, warmup=1, repeats=5)
    predicted = (setup.pipe.predicted_timeline(fresh).makespan
                 + setup.pipe.measure_step_overhead(setup.x))
    setup.warm_up(10)
    measured = statistics.median(setup.timed_step() for _ in range(args.steps))
    print(json.dumps({"measured": measured, "predicted": predicted}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, "vgg", schedule=True, steps=30)
    parser.add_argument("--pairs", type=at_least_one, default=3)
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    results: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    print(f"{args.model}, batch {args.batch}, {args.micro_batches} micro-batches, "
          f"{args.schedule}, 2 stage threads; ms, medians of {args.steps} steps")
    for pair in range(args.pairs):
        for setting in SETTINGS:
            command = [sys.executable, __file__, "--child", setting, "--model", args.model,
                       "--batch", str(args.batch), "--micro-batches", str(args.micro_batches),
                       "--schedule", args.schedule, "--steps", str(args.steps)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"the {setting!r} process failed:\n{done.stderr}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results[setting].append(result)
            print(f"pair {pair + 1} {setting:6s}: step {result['measured'] * 1e3:6.1f}  "
                  f"predicted {result['predicted'] * 1e3:6.1f}  "
                  f"meas/pred {result['measured'] / result['predicted']:.2f}", flush=True)
    steps = {s: statistics.median(r["measured"] for r in results[s]) for s in SETTINGS}
    for setting in SETTINGS:
        ratios = [r["measured"] / r["predicted"] for r in results[setting]]
        print(f"{setting:6s}: median step {steps[setting] * 1e3:.1f} ms, meas/pred "
              + " ".join(f"{r:.2f}" for r in ratios))
    print(f"steps with memory kept take {steps['keep'] / steps['system']:.2f}x the time "
          "of the allocator as it comes")


if __name__ == "__main__":
    main()
