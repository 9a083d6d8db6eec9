"""What a stage's forward costs against its units' forwards timed one by one.

    OMP_NUM_THREADS=1 python benchmarks/fused_forward.py --model gpt --bounds 9,18

The profile times every unit as a module of its own, and each repetition also runs the units
as one graph, as a stage's module runs them; the units' forward times are then scaled to add
up to that. For a partition (`--bounds`, the stages' end units), in each of `--rounds` rounds
this script times each stage's units as the profile does, with and without that scaling, and
each stage as one unit (the reference: its module called once, as in a pipeline), all in one
thread, and prints per stage the medians over the rounds in microseconds.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from two_stages import add_model_arguments

import fxpipe
from fxpipe.allocator import keep_for
from fxpipe.compile.front import trace_and_cut
from fxpipe.cost import check_bounds
from fxpipe.models import bundled
from fxpipe.passes.analysis import profile as profile_module
from fxpipe.passes.rewrite.stages import split_stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[-1])
    add_model_arguments(parser, "mlp")
    parser.add_argument("--bounds", default="4,9", help="the stages' end units, e.g. 4,9")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = bundled(args.model)
    x, _ = spec.batch(args.batch, torch.Generator().manual_seed(0))
    plan = fxpipe.Plan(stages=2, micro_batches=args.micro_batches)  # tracing options only
    keep_for(plan.cpu_memory, ["cpu"])
    traced, units, flat = trace_and_cut(spec.build(), plan, (x,), {})
    k = len(units)
    try:
        bounds = check_bounds(args.bounds.split(","), k)
    except ValueError as error:
        parser.error(f"--bounds: {error}")
    per_unit = split_stages(traced.gm, units, range(1, k + 1), ["cpu"] * k)
    per_stage = split_stages(traced.gm, units, bounds, ["cpu"] * len(bounds))
    size = [args.batch // args.micro_batches]
    starts = (0, *bounds[:-1])
    scaled = profile_module._as_fused
    rows: dict[str, list[list[float]]] = {"units one by one": [], "units scaled": [],
                                          "stage as one unit": []}
    for _ in range(args.rounds):
        profile_module._as_fused = lambda forward, fused: forward  # the raw timings
        try:
            raw = profile_module.profile_units(*per_unit, flat, size, min_time=0.05).forward[0]
        finally:
            profile_module._as_fused = scaled
        units_scaled = profile_module.profile_units(*per_unit, flat, size,
                                                    min_time=0.05).forward[0]
        stages = profile_module.profile_units(*per_stage, flat, size, min_time=0.05).forward[0]
        rows["units one by one"].append([raw[a:b].sum() for a, b in zip(starts, bounds)])
        rows["units scaled"].append([units_scaled[a:b].sum() for a, b in zip(starts, bounds)])
        rows["stage as one unit"].append(list(stages))
    print(f"{args.model}: {k} units, stages end at {bounds}, micro-batch {size[0]}; forward "
          f"per stage in us, medians of {args.rounds} rounds")
    for name, values in rows.items():
        cells = "  ".join(f"{statistics.median(column) * 1e6:8.1f}" for column in zip(*values))
        print(f"{name:<18} {cells}")


if __name__ == "__main__":
    main()
