"""Benchmark: split-and-merge overhead and step time on the bundled VGG (ALGORITHMS §9).

Measures, side by side in one run (variants interleaved round by round, one step each): the
time of the rewrite pass itself, and the training-step time (forward, cross-entropy,
backward, SGD step) of the unsplit graph and of split-and-merge graphs with n = 1, 2, ...
devices: the median step, and the median (min-max) over rounds of its ratio to the unsplit
step of the same round, with the paper's eqs. 11-13 prediction beside each.

    python benchmarks/split_merge.py --batch 32 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from common import median_ms
from torch import fx

from fxpipe.meta import SHAPE
from fxpipe.models import VGG, bundled
from fxpipe.passes.analysis.shape import annotate_shapes
from fxpipe.passes.rewrite.split_merge import GATHER, outline_shards, overlap_cost, split_merge


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-devices", type=int, default=2, help="n = 1 .. this")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = VGG()
    x, y = bundled("vgg").batch(args.batch, torch.Generator().manual_seed(0))
    gm = fx.symbolic_trace(model)
    annotate_shapes(gm, (x,))

    # the rewrite itself (shapes already annotated, as in compile())
    rewrite_ms = {n: median_ms(lambda n=n: split_merge(gm, None, ["cpu"] * n), args.repeats)
                  for n in range(1, args.max_devices + 1)}
    results = {n: split_merge(gm, None, ["cpu"] * n) for n in range(1, args.max_devices + 1)}
    outline_ms = median_ms(lambda: outline_shards(results[args.max_devices].gm), args.repeats)

    variants: dict[str, torch.nn.Module] = {"unsplit": gm}
    for n, result in results.items():
        variants[f"n={n}"] = result.gm
        if n > 1:
            variants[f"n={n} threads"] = outline_shards(result.gm, concurrent=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # every variant shares them

    def step(net: torch.nn.Module) -> None:
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()

    def forward(net: torch.nn.Module) -> None:
        with torch.no_grad():
            net(x)

    times: dict[str, list[float]] = {name: [] for name in variants}
    forward_times: list[float] = []
    names = list(variants)
    for round_ in range(args.warmup + args.repeats):
        order = names[round_ % len(names):] + names[: round_ % len(names)]  # rotate: fair noise
        for name in order:
            start = time.perf_counter()
            step(variants[name])
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        forward(gm)
        if round_ >= args.warmup:
            forward_times.append(time.perf_counter() - start)
    median = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    t_fwd = 1e3 * statistics.median(forward_times)
    t_bwd = max(median["unsplit"] - t_fwd, 0.0)

    # T_C: one transfer of a micro-batch's largest gathered activation (a cat on this machine)
    widest = max((node for node in gm.graph.nodes if node.op == "call_module"),
                 key=lambda node: node.meta[SHAPE].nbytes)
    shape = widest.meta[SHAPE].tensors[0].shape

    print(f"VGG, batch {args.batch}, {torch.get_num_threads()} intra-op thread(s), "
          f"{args.repeats} timed steps per variant (after {args.warmup} warm-up), medians")
    print()
    print("rewrite pass (graph -> graph, shapes annotated):")
    for n, ms in rewrite_ms.items():
        print(f"  split_merge n={n}: {ms:7.2f} ms  ({len(results[n].layers)} layers split, "
              f"{len(results[n].chains)} chains, {len(results[n].gathers)} gathers)")
    print(f"  outline_shards n={args.max_devices}: {outline_ms:7.2f} ms")
    print()
    header = (f"{'variant':<12} {'step ms':>9} {'x unsplit (min-max)':>21} {'extra ms':>9} "
              f"{'eq.12 T_O':>10} {'eq.13 S':>8}")
    print(header)
    print("-" * len(header))
    for name in names:
        n = 1 if name == "unsplit" else int(name.split()[0].removeprefix("n="))
        micro = [args.batch // n, *shape[1:]]
        pieces = torch.randn(micro).chunk(max(n, 1), dim=1)
        t_c = 0.0 if n == 1 else median_ms(lambda p=pieces: torch.cat(p, 1), 50)
        cost = overlap_cost(n, t_fwd / n**2, t_bwd / n**2, t_c)
        ratio = [t / u for t, u in zip(times[name], times["unsplit"])]
        ratio_text = f"{statistics.median(ratio):.3f} ({min(ratio):.2f}-{max(ratio):.2f})"
        print(f"{name:<12} {median[name]:9.2f} {ratio_text:>21} "
              f"{median[name] - median['unsplit']:+9.2f} {cost.t_o:10.2f} {cost.speedup:8.2f}")
    print()
    # how much of the extra time is the gathers themselves (cat of the pieces, per forward)
    widest_n = results[args.max_devices]
    gather_ms = 0.0
    for node in widest_n.gm.graph.nodes:
        if GATHER in node.meta:
            sizes = [p.meta[SHAPE].tensors[0].shape for p in node.args[0]]
            pieces = [torch.randn(size) for size in sizes]
            gather_ms += median_ms(lambda p=pieces, d=node.args[1]: torch.cat(p, d), 20)
    print(f"the {len(widest_n.gathers)} gathers of n={args.max_devices} take {gather_ms:.2f} ms "
          "per forward in total; the rest of the extra time is the split layers themselves, "
          "run as n narrower kernels on the same cores (each shard re-reads the whole input, "
          "and backward adds the n input gradients).")
    print(f"T_F = {t_fwd:.2f} ms and T_B = {t_bwd:.2f} ms measured unsplit on the whole batch; "
          "eqs. 11-13 use T_F/n², T_B/n² (one of n sub-modules on one of n micro-batches) and "
          "T_C = one gather of the widest activation at micro-batch size.")
    print("What 2 CPU cores can show: the per-step cost of splitting and gathering (the "
          "'extra ms' column; the paper's Table 6 reports ~0.25 ms per split-and-merge on GPUs) "
          "and the pass's own time. What they cannot: a speedup from more devices. Every "
          "shard runs on the same cores ('cpu' x n), which intra-op threads already keep busy, "
          "so n > 1 can only cost time here; the eq. 12 column is what n real devices "
          "would take under the paper's model.")


if __name__ == "__main__":
    main()
