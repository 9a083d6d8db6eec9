"""Compile time of the README's ten-line example, as a multiple of one training step.

    python benchmarks/compile_time.py                        # 5 rounds, torch's own threads
    python benchmarks/compile_time.py --threads default,1    # and 1 intra-op thread, alternated

The example: the bundled ResNet, x = randn(32, 3, 32, 32), y = randint(0, 10, (32,)),
Plan(stages=2, micro_batches=4, schedule="1f1b", loss_fn=F.cross_entropy), compiled with
example_target=y and a fresh, empty profile cache (so the units are timed, as on a first run).
Each round is a fresh Python process (this script re-invoked with --child): it compiles
--compiles times, the first one cold (lazy imports, first kernel calls, allocator warm-up),
then times pipe.step(x, y) (median of --steps after --warmup steps) in the same process.
Reported per round and as the median (min-max) over rounds: compile seconds, step ms, and
compile / step, cold and warm. `--threads 1` calls torch.set_num_threads(1) before compiling
(one intra-op thread per stage thread on 2 cores); "default" leaves torch's setting. Several
values are run alternately, round by round. The passes table (pipe.passes) of the first
round's cold and last compile shows where compile's time goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

from common import spread

MARK = "COMPILE_TIME_RESULT "


def child(threads: str, compiles: int, steps: int, warmup: int) -> None:
    """One round, in this fresh process; prints one JSON line."""
    import torch
    import torch.nn.functional as F

    import fxpipe
    from fxpipe.models import ResNet

    if threads != "default":
        torch.set_num_threads(int(threads))
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    plan = fxpipe.Plan(stages=2, micro_batches=4, schedule="1f1b", loss_fn=F.cross_entropy)
    seconds, passes = [], []
    for _ in range(compiles):
        model = ResNet()
        with tempfile.TemporaryDirectory() as cache:
            start = time.perf_counter()
            pipe = fxpipe.compile(model, plan, example_inputs=(x,), example_target=y,
                                  cache=cache)
            seconds.append(time.perf_counter() - start)
        passes.append(str(getattr(pipe, "passes", "(this version keeps no pass record)")))
    step = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        pipe.step(x, y)
        if i >= warmup:
            step.append(time.perf_counter() - start)
    print(MARK + json.dumps({"threads": torch.get_num_threads(), "compile": seconds,
                             "step": statistics.median(step), "passes": passes}))


def run_round(args: argparse.Namespace, threads: str) -> dict:
    command = [sys.executable, __file__, "--child", "--threads", threads,
               "--compiles", str(args.compiles), "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith(MARK))
                      [len(MARK):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per variant")
    parser.add_argument("--threads", default="default",
                        help="intra-op threads, comma-separated: 'default' or a number")
    parser.add_argument("--compiles", type=int, default=3, help="per process, the first cold")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.threads, args.compiles, args.steps, args.warmup)
    if args.compiles < 2:
        parser.error("--compiles must be at least 2 (one cold, then warm ones)")

    variants = args.threads.split(",")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    print(f"{'round':>5} {'threads':>12} {'cold s':>7} {'warm s':>7} {'step ms':>8} "
          f"{'cold/step':>10} {'warm/step':>10}")
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:  # rotate
            res = run_round(args, v)
            res["cold"], res["warm"] = res["compile"][0], statistics.median(res["compile"][1:])
            results[v].append(res)
            print(f"{r + 1:>5} {v + ' (' + str(res['threads']) + ')':>12} {res['cold']:7.3f} "
                  f"{res['warm']:7.3f} {res['step'] * 1e3:8.1f} "
                  f"{res['cold'] / res['step']:10.1f} {res['warm'] / res['step']:10.1f}",
                  flush=True)

    print(f"\nmedian (min-max) over {args.rounds} rounds; warm = median of compiles 2.."
          f"{args.compiles} of each process; step = median of {args.steps} pipe.step(x, y)")
    for v, rounds in results.items():
        print(f"threads {v}: compile cold {spread([r['cold'] for r in rounds], '.3f')} s, "
              f"warm {spread([r['warm'] for r in rounds], '.3f')} s; "
              f"step {spread([r['step'] * 1e3 for r in rounds], '.1f')} ms")
        print(f"  compile / step: cold {spread([r['cold'] / r['step'] for r in rounds], '.1f')}"
              f", warm {spread([r['warm'] / r['step'] for r in rounds], '.1f')}")
    first = results[variants[0]][0]["passes"]
    print(f"\npipe.passes, round 1, threads {variants[0]}: the cold compile\n{first[0]}")
    print(f"\nand compile {args.compiles} of the same process\n{first[-1]}")


if __name__ == "__main__":
    main()
