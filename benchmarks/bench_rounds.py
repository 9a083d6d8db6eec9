"""Benchmark: how a bench row's meas/pred depends on how many rounds measured it.

Reads the CSVs of `fxpipe bench --csv` runs made with many rounds (15, the bench's default
since b97be3a) and, for each row, computes measured/predicted again from consecutive groups of
`--group` of its rounds (rounds 1 to 5, 6 to 10, ...: what a bench run of that many rounds
would have measured) and from the first N rounds for each N of `--first`. A group's prediction
is its rounds' median (the lower middle one of an even count), as the bench takes it; its
measured step is the median of its rounds' median steps (the bench's own is the median of all
its timed steps, which comes out close to it). "rounds paired" is the median over the rounds of
each round's median step over that round's own prediction: a row's rounds set side by side with
the prediction made right before them, rather than the two medians taken apart (what a slow
stretch of the machine falling on a round moves less, where it moves the round's prediction and
steps alike). It prints one line per row and counts the figures within the target
(measured/predicted from 1/1.15 to 1/0.85), then the bench's own meas/pred over all rows and
per partitioner and schedule (lowest, median, highest), and the median over the rows of each
spread column the CSVs have.

    OMP_NUM_THREADS=1 fxpipe bench mlp --stages 2 --batch 32 --micro-batches 4 \\
        --partitioners even,balanced --schedules gpipe,1f1b --csv a.csv
    python benchmarks/bench_rounds.py a.csv b.csv --group 5 --first 5,10,15
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence

LOW, HIGH = 1 / 1.15, 1 / 0.85  # the target: the prediction within 15% of the measured step


def ratio(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Measured over predicted, from rounds' predictions and median steps."""
    return statistics.median(measured) / statistics.median_low(predicted)


def within(value: float) -> bool:
    return LOW <= value <= HIGH


def row_ratios(row: Mapping[str, str], group: int, firsts: Sequence[int]
               ) -> dict[str, list[float]]:
    """The row's meas/pred: the bench's own, its rounds paired, each group's, and each of the
    first N rounds'."""
    predicted = [float(v) for v in row["round_predicted_ms"].split()]
    measured = [float(v) for v in row["round_measured_ms"].split()]
    ratios = {"the bench's own": [float(row["ratio"])],
              "rounds paired": [statistics.median(m / p for p, m in zip(predicted, measured))
                                if predicted else float("nan")],
              f"groups of {group}": [ratio(predicted[i:i + group], measured[i:i + group])
                                     for i in range(0, len(predicted) - group + 1, group)]}
    for n in firsts:
        if n <= len(predicted):
            ratios[f"first {n}"] = [ratio(predicted[:n], measured[:n])]
    return ratios


SPREADS = ("predicted_spread", "measured_spread", "compute_spread", "runtime_spread",
           "core_spread")


def summary(rows: Sequence[Mapping[str, str]]) -> list[str]:
    """The bench's own meas/pred over `rows` and per (partitioner, schedule), and the median
    of each spread column (those the rows have: older CSVs lack compute and runtime)."""
    def spread(values: Sequence[float]) -> str:
        return (f"lowest {min(values):.3f}, median {statistics.median(values):.3f}, highest "
                f"{max(values):.3f} over {len(values)} rows")

    ratios: dict[str, list[float]] = {}
    for row in rows:
        ratios.setdefault(f"{row['partitioner']}/{row['schedule']}", []).append(
            float(row["ratio"]))
    every = [v for values in ratios.values() for v in values]
    lines = [f"meas/pred: {spread(every)}"]
    lines += [f"  {name}: {spread(values)}" for name, values in ratios.items()]
    medians = [f"{name} {statistics.median(float(row[name]) for row in rows):.1%}"
               for name in SPREADS if all(row.get(name) for row in rows)]
    if medians:
        lines.append("median over the rows: " + ", ".join(medians))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="files `fxpipe bench --csv` wrote")
    parser.add_argument("--group", type=int, default=5, help="rounds per group")
    parser.add_argument("--first", default="5,10,15", help="the first N rounds, for each N")
    args = parser.parse_args()
    firsts = [int(n) for n in args.first.split(",")]
    good, total = Counter(), Counter()
    every: list[dict[str, str]] = []
    for path in args.csv:
        with open(path) as handle:
            rows = list(csv.DictReader(handle))
        every += rows
        for row in rows:
            ratios = row_ratios(row, args.group, firsts)
            for kind, values in ratios.items():
                good[kind] += sum(map(within, values))
                total[kind] += len(values)
            missed = not all(within(v) for values in ratios.values() for v in values)
            shown = "; ".join(f"{kind} {' '.join(f'{v:.3f}' for v in values)}"
                              for kind, values in ratios.items())
            print(f"{path} {row['partitioner']}/{row['schedule']}: {shown}"
                  + ("  (a miss)" if missed else ""))
    for kind in total:
        print(f"{kind}: {good[kind]} of {total[kind]} within 15%")
    for line in summary(every):
        print(line)


if __name__ == "__main__":
    main()
