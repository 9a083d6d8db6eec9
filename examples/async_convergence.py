"""Does weight prediction keep asynchronous 1F1B on GPipe's loss curve? Measure it.

A 4-stage MLP learns a synthetic task (labels from a fixed random teacher network) with the
same seed and data order under GPipe (synchronous) and async-1f1b with each consistency policy
(none, stash, 2bw, predict), with SGD-momentum and with AdamW. Prints the training loss every
`--every` mini-batches, the final held-out loss and accuracy, and throughput; `--png` also draws
the curves (needs matplotlib: pip install fxpipe[plot]).

    python examples/async_convergence.py --steps 300 --png async_convergence.png
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe

POLICIES = [("gpipe", "none"), ("async-1f1b", "none"), ("async-1f1b", "stash"),
            ("async-1f1b", "2bw"), ("async-1f1b", "predict")]


def task(seed: int, samples: int, dim: int = 32, classes: int = 10):
    """Inputs and the labels a fixed random teacher gives them: learnable, not trivial."""
    gen = torch.Generator().manual_seed(seed)
    teacher = [torch.randn(dim, 64, generator=gen), torch.randn(64, classes, generator=gen)]
    x = torch.randn(samples, dim, generator=gen)
    y = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(1)
    return x, y


def student(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def optimizer_factory(name: str, lr: float):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def run(schedule: str, consistency: str, optimizer: str, lr: float, args) -> dict:
    x, y = task(0, args.steps * args.batch + 2048)  # the last 2048 samples are held out
    (x, test_x), (y, test_y) = x.split([len(x) - 2048, 2048]), y.split([len(y) - 2048, 2048])
    batches = list(zip(x.split(args.batch), y.split(args.batch)))
    model = student(args.seed)
    plan = fxpipe.Plan(stages=4, partitioner=[2, 2, 2, 1], schedule=schedule,
                       consistency=consistency, micro_batches=args.micro_batches,
                       loss_fn=F.cross_entropy, costs="none")
    pipe = fxpipe.compile(model, plan, example_inputs=(batches[0][0],))
    pipe.attach_optimizer(optimizer_factory(optimizer, lr))
    losses, start = [], time.perf_counter()
    for window in range(0, len(batches), args.window):
        losses += [loss.item() for loss in pipe.step_many(batches[window:window + args.window])]
    seconds = time.perf_counter() - start
    with torch.no_grad():
        logits = model(test_x)
    return {
        "losses": losses,
        "test_loss": F.cross_entropy(logits, test_y).item(),
        "test_accuracy": (logits.argmax(1) == test_y).float().mean().item(),
        "samples_per_second": len(batches) * args.batch / seconds,
        "copies": pipe.weight_copies(),
    }


def smooth(values: list[float], width: int) -> list[float]:
    return [sum(values[max(0, i - width + 1):i + 1]) / len(values[max(0, i - width + 1):i + 1])
            for i in range(len(values))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="mini-batches per run")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="per mini-batch (PipeDream: 1)")
    parser.add_argument("--window", type=int, default=50,
                        help="mini-batches streamed per step_many call")
    parser.add_argument("--every", type=int, default=50, help="print the loss every N steps")
    parser.add_argument("--sgd-lr", type=float, default=0.05)
    parser.add_argument("--adamw-lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", help="write the loss curves to this PNG")
    args = parser.parse_args()
    torch.set_num_threads(1)

    results = {}
    for optimizer, lr in (("sgd", args.sgd_lr), ("adamw", args.adamw_lr)):
        for schedule, consistency in POLICIES:
            label = "gpipe" if schedule == "gpipe" else f"async+{consistency}"
            results[optimizer, label] = run(schedule, consistency, optimizer, lr, args)

    for optimizer in ("sgd", "adamw"):
        labels = [label for (opt, label) in results if opt == optimizer]
        print(f"\n{optimizer}: training loss (mean of the last {args.every} mini-batches)")
        print("step    " + "".join(f"{label:>15}" for label in labels))
        for step in range(args.every, args.steps + 1, args.every):
            row = [sum(results[optimizer, label]["losses"][step - args.every:step]) / args.every
                   for label in labels]
            print(f"{step:<8}" + "".join(f"{v:>15.4f}" for v in row))
        gap = {label: sum(abs(a - b) for a, b in zip(
            smooth(results[optimizer, label]["losses"], args.every),
            smooth(results[optimizer, "gpipe"]["losses"], args.every))) / args.steps
            for label in labels}
        print("mean |loss - gpipe loss| (smoothed): "
              + ", ".join(f"{label} {gap[label]:.4f}" for label in labels))
        for label in labels:
            r = results[optimizer, label]
            print(f"  {label:<15} test loss {r['test_loss']:.4f}  accuracy "
                  f"{r['test_accuracy']:.3f}  {r['samples_per_second']:.0f} samples/s  "
                  f"weight copies per stage {r['copies']}")

    if args.png:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise SystemExit("--png needs matplotlib: pip install fxpipe[plot]") from e
        figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for axis, optimizer in zip(axes, ("sgd", "adamw")):
            for (opt, label), r in results.items():
                if opt == optimizer:
                    axis.plot(smooth(r["losses"], 10), label=label,
                              linewidth=2.5 if label == "gpipe" else 1.2)
            axis.set_title(f"{optimizer}: training loss (moving mean of 10)")
            axis.set_xlabel("mini-batch")
            axis.legend()
        figure.tight_layout()
        figure.savefig(args.png, dpi=120)
        print(f"\ncurves written to {args.png}")


if __name__ == "__main__":
    main()
