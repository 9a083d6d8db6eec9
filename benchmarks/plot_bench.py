"""A chart of `fxpipe bench --csv` rows: predicted and measured step per configuration.

    fxpipe bench resnet --stages 2 --csv rows.csv
    python benchmarks/plot_bench.py rows.csv rows.png

Each configuration (partitioner / schedule) gets two bars, the calibrated prediction and the
measured median, the whisker spanning the lowest and highest round median. Needs matplotlib
(pip install 'fxpipe[plot]'); any extension matplotlib writes works (.png, .svg, .pdf).
"""

from __future__ import annotations

import argparse
import csv

from matplotlib.figure import Figure  # a Figure of its own: pyplot's state stays as it is


def draw(rows: list[dict[str, str]], path: str, title: str) -> None:
    predicted = [float(r["predicted_ms"]) for r in rows]
    measured = [float(r["measured_ms"]) for r in rows]
    whiskers = [[max(m - float(r["measured_low_ms"]), 0) for m, r in zip(measured, rows)],
                [max(float(r["measured_high_ms"]) - m, 0) for m, r in zip(measured, rows)]]
    positions = range(len(rows))
    figure = Figure(figsize=(max(6, 0.9 * len(rows) + 2), 4))
    axis = figure.subplots()
    axis.bar([i - 0.2 for i in positions], predicted, 0.4, label="predicted (calibrated)",
             color="#9ecae1")
    axis.bar([i + 0.2 for i in positions], measured, 0.4, yerr=whiskers, capsize=3,
             ecolor="#636363", label="measured (median; whisker: the rounds')", color="#3182bd")
    axis.set_xticks(list(positions), [f"{r['partitioner']}\n{r['schedule']}" for r in rows],
                    fontsize=8)
    axis.set_ylabel("step time (ms)")
    axis.set_title(title, fontsize=10)
    axis.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="the file `fxpipe bench --csv` wrote")
    parser.add_argument("chart", help="the picture to write, e.g. rows.png")
    parser.add_argument("--title", default="", help="the chart's title")
    args = parser.parse_args()
    with open(args.csv, newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        raise SystemExit(f"{args.csv} holds no rows: write it with fxpipe bench --csv")
    draw(rows, args.chart, args.title or args.csv)
    print(f"chart written to {args.chart}")


if __name__ == "__main__":
    main()
