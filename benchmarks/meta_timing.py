"""How a model built on the meta device times against the same model built real.

    OMP_NUM_THREADS=1 python benchmarks/meta_timing.py --model mlp --shares 1,0.5,0
    OMP_NUM_THREADS=1 python benchmarks/meta_timing.py --model gpt --shares 1 --concurrency 2

A meta model's units are timed on real copies, a run of consecutive units at a time whose
weights make up at most a share of the model's (compile: what the timing device holds of them,
all of them below ALL_REAL_BELOW bytes); a real model's are timed all in one run. For each
share (0: one unit per run), the rounds alternate between the real model and the meta one,
and the script prints the medians over the rounds of the units' summed forward and backward
times at the largest micro-batch size, and of the fixed cost of a backward call, each meta one
over the real one's.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from two_stages import add_model_arguments

import fxpipe
from fxpipe.allocator import keep_for
from fxpipe.compile.front import profile_sizes, split_into_units, trace_and_cut
from fxpipe.models import bundled
from fxpipe.passes.analysis.profile import _runs, _tensor_bytes, profile_units, real_bytes


def _timed(spec, device: str, plan: fxpipe.Plan, x, share: float, concurrency: int
           ) -> tuple[float, ...]:
    """(forward, backward, call) in seconds of the model built on `device`."""
    with torch.device(device):
        model = spec.build()
    traced, units, flat = trace_and_cut(model, plan, (x,), {})
    graph, table = split_into_units(traced.gm, units, "cpu")
    window = share * real_bytes(graph)
    profile = profile_units(graph, table, flat, profile_sizes(len(x), plan), "cpu",
                            min_time=0.05, window=window, concurrency=concurrency)
    return (profile.forward[-1].sum(), profile.backward[-1].sum(),
            float(profile.backward_call[-1]))


def _unit_tensors(graph, units: int) -> list[dict[int, int]]:
    return _tensor_bytes([graph.get_submodule(f"stage{i}").module for i in range(units)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[-1])
    add_model_arguments(parser, "mlp")
    parser.add_argument("--shares", default="1,0.5,0",
                        help="shares of the weights a run of units may hold, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="stages busy at once: the others' work runs beside the timing, "
                             "as compile has it on one process's stage threads")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = bundled(args.model)
    x, _ = spec.batch(args.batch, torch.Generator().manual_seed(0))
    plan = fxpipe.Plan(stages=2, micro_batches=args.micro_batches)
    keep_for(plan.cpu_memory, ["cpu"])
    with torch.device("meta"):
        traced, units, _ = trace_and_cut(spec.build(), plan, (x,), {})
    graph, _ = split_into_units(traced.gm, units, "cpu")
    tensors = _unit_tensors(graph, len(units))
    print(f"{args.model}: {len(units)} units, batch {args.batch}, {args.micro_batches} "
          f"micro-batches, {args.concurrency} busy at once; meta over real, medians of "
          f"{args.rounds} rounds")
    print("share  runs  forward  backward  call")
    for share in (float(s) for s in args.shares.split(",")):
        ratios = []
        for _ in range(args.rounds):
            real = _timed(spec, "cpu", plan, x, share, args.concurrency)
            meta = _timed(spec, "meta", plan, x, share, args.concurrency)
            ratios.append([m / r if r > 0 else float("nan") for m, r in zip(meta, real)])
        runs = len(_runs(tensors, share * real_bytes(graph)))
        cells = [f"{statistics.median(column):.2f}" for column in np.array(ratios).T]
        print(f"{share:<5g}  {runs:<4}  {cells[0]:<7}  {cells[1]:<8}  {cells[2]}")


if __name__ == "__main__":
    main()
