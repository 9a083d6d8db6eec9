"""One process on the CPU: the plain model, fxpipe and torchgpipe, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/vs_torchgpipe.py

For each model and micro-batch count, times a training step (forward and backward, no
optimizer) of the plain model, of fxpipe's 2-stage GPipe pipeline and of torchgpipe's with
the same balance and chunks, alternated round by round; prints, as the median (min-max) over
rounds of each round's median: fxpipe's step, its ratio to the plain model's and to
torchgpipe's, and to fxpipe's calibrated prediction (`fxpipe.calibrate` at the start of every
round, then `pipe.predicted_timeline(cal).makespan + cal.step`). Every model is an
nn.Sequential (torchgpipe needs one) and fxpipe cuts it at the same children
(Plan(unit_depth=1)), so both pipelines run the same stages.

torchgpipe (last release 0.0.7, 2020) is optional: `pip install torchgpipe --no-deps` (its
own requirements could replace torch); where it cannot be imported, its column is skipped and
the script says so. On the CPU, torchgpipe runs every stage on "cpu" on one worker thread, so
its stages do not overlap. The script sets one intra-op thread (torch.set_num_threads(1));
OMP_NUM_THREADS=1 gives every other thread one too; the two stages then run on two cores.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from common import median_ms, sequential_resnet, spread
from torch import nn

import fxpipe
from fxpipe.models import MLP, VGG


def sequential(name: str) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        model = MLP((256, 512, 512, 512, 512, 512, 512, 10))
        return model, torch.randn(256, 256), torch.randint(0, 10, (256,))
    if name == "resnet":
        model = sequential_resnet()
    else:
        net = VGG()
        model = nn.Sequential(*net.features, *net.classifier)
    return model, torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet,vgg")
    parser.add_argument("--micro-batches", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the variants alternated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        from torchgpipe import GPipe
    except ImportError as error:
        GPipe = None
        print(f"torchgpipe cannot be imported ({error}): skipping it, comparing the plain model "
              "and fxpipe only (pip install torchgpipe --no-deps to add it)")

    rows = []
    for name in args.models.split(","):
        for p in map(int, args.micro_batches.split(",")):
            model, x, y = sequential(name)
            plan = fxpipe.Plan(stages=2, micro_batches=p, unit_depth=1, devices=["cpu", "cpu"],
                               loss_fn=F.cross_entropy)
            pipe = fxpipe.compile(model, plan, example_inputs=(x,), example_target=y)
            balance = list(pipe.partition.sizes)
            candidates = {
                "plain": lambda m=model, x=x, y=y: F.cross_entropy(m(x), y).backward(),
                "fxpipe": lambda pipe=pipe, x=x, y=y: pipe.step(x, y),
            }
            if GPipe is not None:
                gpipe = GPipe(model, balance=balance, devices=["cpu", "cpu"], chunks=p)
                candidates["torchgpipe"] = (lambda g=gpipe, x=x, y=y:
                                            F.cross_entropy(g(x), y).backward())
            for fn in candidates.values():  # warm-up
                fn()
            times: dict[str, list[float]] = {k: [] for k in candidates}
            times["predicted"] = []
            for r in range(args.rounds):
                cal = fxpipe.calibrate(pipe, x, target=y, steps=5, warmup=1)
                times["predicted"].append(
                    (pipe.predicted_timeline(cal).makespan + cal.step) * 1e3)
                keys = list(candidates)
                for key in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotate the order
                    times[key].append(median_ms(candidates[key], args.repeats))
            rows.append((name, p, balance, times))
            print(f"  {name} p={p}: " + ", ".join(f"{k} {statistics.median(v):.1f} ms"
                                                  for k, v in times.items()), flush=True)

    print(f"\ntraining step (forward + backward), 2 stages on 2 cores, 1 intra-op thread; "
          f"median (min-max) over {args.rounds} rounds of each round's median of "
          f"{args.repeats} steps; predicted: calibrated (fxpipe.calibrate, 5 steps per round)")
    header = (f"{'model':<7}{'p':>3} {'balance':<9}{'fxpipe ms':>10}  {'fxpipe / plain':<19}"
              f"{'fxpipe / torchgpipe':<21}fxpipe / predicted")
    print(header)
    for name, p, balance, times in rows:
        ours = times["fxpipe"]
        ratios = [spread([a / b for a, b in zip(ours, times[key])]) if key in times
                  else "skipped" for key in ("plain", "torchgpipe", "predicted")]
        print(f"{name:<7}{p:>3} {balance!s:<9}{statistics.median(ours):>10.1f}  "
              f"{ratios[0]:<19}{ratios[1]:<21}{ratios[2]}")


if __name__ == "__main__":
    main()
