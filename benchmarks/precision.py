"""Mixed precision on the bundled GPT: bf16 and fp16 loss curves against fp32, and memory.

    python benchmarks/precision.py --seeds 3

For each seed, the bundled GPT (fxpipe.models.GPT, default size) is compiled three times from
the same initial weights, Plan(stages=2, schedule="1f1b", micro_batches=4) with precision
None (fp32), "bf16" and "fp16", and trained for --steps Adam steps on the same batches (a
fixed set of --batches batches of --batch token sequences, cycled, so the loss falls). fp16
steps through pipe.scaler. It prints, per precision: the loss after the last step, its
difference from fp32's relative to fp32's (median and range over seeds), the steps the scaler
skipped, the median step time relative to fp32's in the same run, and the predicted saved
activation bytes per micro-batch (the cost table's, measured by the profile pass under the
same autocast) relative to fp32's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import spread

import fxpipe
from fxpipe.models import bundled

PRECISIONS = (None, "bf16", "fp16")


def train(seed: int, precision: str | None, steps: int, batches: int, batch: int
          ) -> tuple[list[float], int, float, float]:
    """Losses of each step, steps skipped, the median step time (s) and the predicted saved
    bytes per micro-batch of the whole model."""
    gpt = bundled("gpt")
    torch.manual_seed(seed)
    model = gpt.build()
    gen = torch.Generator().manual_seed(seed)
    data = [gpt.batch(batch, gen) for _ in range(batches)]
    plan = fxpipe.Plan(stages=2, schedule="1f1b", micro_batches=4, devices=["cpu", "cpu"],
                       loss_fn=gpt.loss_fn, precision=precision)
    pipe = fxpipe.compile(model, plan, example_inputs=(data[0][0],), cache=False)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    losses, skipped, times = [], 0, []
    for step in range(steps):
        x, y = data[step % batches]
        start = time.perf_counter()
        losses.append(pipe.step(x, y).item())
        scale = pipe.scaler.get_scale()
        pipe.scaler.step(optimizer)
        pipe.scaler.update()
        skipped += pipe.scaler.get_scale() < scale  # the scaler backs off where it skipped
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    saved = float(pipe.cost.saved_bytes(pipe.partition.micro_batches).sum())
    return losses, skipped, statistics.median(times), saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    results = {p: [] for p in PRECISIONS}
    for seed in range(args.seeds):
        for precision in PRECISIONS:
            results[precision].append(train(seed, precision, args.steps, args.batches,
                                            args.batch))
    base = results[None]
    print(f"bundled GPT, 2 stages, 1f1b, 4 micro-batches, batch {args.batch}, "
          f"{args.steps} Adam steps, {args.seeds} seeds: median (range)\n")
    print("| precision | loss after last step | vs fp32 | skipped steps | step time / fp32 | "
          "saved bytes / fp32 |\n| --- | --- | --- | --- | --- | --- |")
    for precision in PRECISIONS:
        runs = results[precision]
        last = [r[0][-1] for r in runs]
        diff = [100 * (r[0][-1] - b[0][-1]) / b[0][-1] for r, b in zip(runs, base)]
        print(f"| {precision or 'fp32'} | {spread(last, '.4f')} | {spread(diff, '+.2f')} % | "
              f"{spread([float(r[1]) for r in runs], '.0f')} | "
              f"{spread([r[2] / b[2] for r, b in zip(runs, base)])} | "
              f"{spread([r[3] / b[3] for r, b in zip(runs, base)])} |")
    print("\nfp32 loss, first and last step: " + ", ".join(
        f"{r[0][0]:.4f} -> {r[0][-1]:.4f}" for r in base))


if __name__ == "__main__":
    main()
