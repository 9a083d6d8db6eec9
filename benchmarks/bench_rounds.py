"""Benchmark: how a bench row's meas/pred depends on how many rounds measured it.

Reads the CSVs of `fxpipe bench --csv` runs made with many rounds (`--rounds 15 --repeats
15`) and, for each row, computes measured/predicted again from consecutive groups of
`--group` of its rounds (rounds 1 to 5, 6 to 10, ...: what a bench run of that many rounds
would have measured) and from the first N rounds for each N of `--first`. A group's
measured figure is the median of its rounds' median steps (the bench's own is the median of
all its timed steps, which comes out close to it). It prints one line per row and counts the
figures within the target (measured/predicted from 1/1.15 to 1/0.85).

    OMP_NUM_THREADS=1 fxpipe bench mlp --stages 2 --batch 32 --micro-batches 4 \\
        --partitioners even,balanced --schedules gpipe,1f1b --rounds 15 --repeats 15 --csv a.csv
    python benchmarks/bench_rounds.py a.csv b.csv --group 5 --first 5,10,15
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections.abc import Sequence

LOW, HIGH = 1 / 1.15, 1 / 0.85  # the target: the prediction within 15% of the measured step


def ratio(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Measured over predicted, from rounds' predictions and median steps."""
    return statistics.median(measured) / statistics.median(predicted)


def within(value: float) -> bool:
    return LOW <= value <= HIGH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="files `fxpipe bench --csv` wrote")
    parser.add_argument("--group", type=int, default=5, help="rounds per group")
    parser.add_argument("--first", default="5,10,15", help="the first N rounds, for each N")
    args = parser.parse_args()
    firsts = [int(n) for n in args.first.split(",")]
    counts = {"the bench's own": [0, 0], f"groups of {args.group}": [0, 0],
              **{f"first {n}": [0, 0] for n in firsts}}

    def count(kind: str, value: float) -> None:
        counts[kind][0] += within(value)
        counts[kind][1] += 1

    for path in args.csv:
        with open(path) as handle:
            rows = list(csv.DictReader(handle))
        for row in rows:
            predicted = [float(v) for v in row["round_predicted_ms"].split()]
            measured = [float(v) for v in row["round_measured_ms"].split()]
            groups = [ratio(predicted[i:i + args.group], measured[i:i + args.group])
                      for i in range(0, len(predicted) - args.group + 1, args.group)]
            first = {n: ratio(predicted[:n], measured[:n]) for n in firsts
                     if n <= len(predicted)}
            count("the bench's own", float(row["ratio"]))
            for value in groups:
                count(f"groups of {args.group}", value)
            for n, value in first.items():
                count(f"first {n}", value)
            print(f"{path} {row['partitioner']}/{row['schedule']}: bench {float(row['ratio']):.3f};"
                  f" groups {' '.join(f'{v:.3f}' for v in groups)};"
                  f" first {' '.join(f'{n}: {v:.3f}' for n, v in first.items())}"
                  + ("" if all(map(within, [*groups, *first.values()])) else "  (a miss)"))
    for kind, (good, total) in counts.items():
        print(f"{kind}: {good} of {total} within 15%")


if __name__ == "__main__":
    main()
