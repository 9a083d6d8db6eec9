"""Local pipeline benchmark: the plain model, fxpipe and torchgpipe, side by side in one run.

For each model and micro-batch count, times a training step (forward and backward, no
optimizer) of the plain model, of fxpipe's 2-stage GPipe pipeline and of torchgpipe's
(`pip install torchgpipe`) with the same balance and chunks, alternating them A B C A B C;
prints medians, the simulator's prediction and the ratios. Every model is written as an
nn.Sequential (torchgpipe needs one) and fxpipe cuts it at the same children
(Plan(unit_depth=1)), so both pipelines run exactly the same stages.

    OMP_NUM_THREADS=1 python examples/bench_local.py

All intra-op thread counts are 1 (set OMP_NUM_THREADS=1 before Python starts so that every
worker thread, ours and torchgpipe's, has one); the two stages then run on the two cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.models import MLP, VGG, ResNet


class PoolFlatten(nn.Module):
    def forward(self, x):
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


def sequential(name: str) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        model = MLP((256, 512, 512, 512, 512, 512, 512, 10))
        return model, torch.randn(256, 256), torch.randint(0, 10, (256,))
    if name == "resnet":
        net = ResNet()
        model = nn.Sequential(net.stem, *net.layers, PoolFlatten(), net.fc)
    else:
        net = VGG()
        model = nn.Sequential(*net.features, *net.classifier)
    return model, torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet,vgg")
    parser.add_argument("--micro-batches", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3, help="A B C rounds, alternated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        from torchgpipe import GPipe
    except ImportError:
        GPipe = None
        print("torchgpipe is not installed (pip install torchgpipe): its column stays empty")

    rows = []
    for name in args.models.split(","):
        for p in map(int, args.micro_batches.split(",")):
            model, x, y = sequential(name)
            plan = fxpipe.Plan(stages=2, micro_batches=p, unit_depth=1, devices=["cpu", "cpu"],
                               loss_fn=F.cross_entropy)
            pipe = fxpipe.compile(model, plan, example_inputs=(x,))
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
            for _ in range(args.rounds):
                for key, fn in candidates.items():
                    times[key].append(median_ms(fn, args.repeats))
            result = {k: statistics.median(v) for k, v in times.items()}
            predicted = pipe.predicted_timeline().makespan * 1e3
            rows.append((name, p, balance, result, predicted))
            print(f"  {name} p={p}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in result.items()),
                  flush=True)

    print("\nmedian training step (forward + backward), 2 stages on 2 cores, 1 thread each")
    header = (f"{'model':<8}{'p':>3}  {'balance':<10}{'plain ms':>10}{'fxpipe ms':>11}"
              f"{'torchgpipe':>12}{'predicted':>11}{'fx/tgp':>8}{'meas/pred':>11}")
    print(header)
    for name, p, balance, result, predicted in rows:
        ours, theirs = result["fxpipe"], result.get("torchgpipe")
        tgp = f"{theirs:.1f}" if theirs else "-"
        ratio = f"{ours / theirs:.2f}" if theirs else "-"
        print(f"{name:<8}{p:>3}  {balance!s:<10}{result['plain']:>10.1f}{ours:>11.1f}"
              f"{tgp:>12}{predicted:>11.1f}{ratio:>8}{ours / predicted:>11.2f}")


if __name__ == "__main__":
    main()
