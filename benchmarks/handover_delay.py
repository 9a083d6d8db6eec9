"""Benchmark: how long a message between two stage threads takes to reach its receiver, with
more threads busy than cores.

Two threads play a 2-stage pipeline through the runtime's own transport (LocalTransport):
each computes, sends the other a message and waits for the next, as stage threads do between
their forwards and backwards. `--busy` more threads compute without a pause meanwhile, as the
other stages of a pipeline with more stage threads than cores do. For each number of busy
threads it prints the one-way delay, from a send's start to its receiver's return from the
receive: median, mean and 90th percentile. `fxpipe.compile` measures the hand-over between two
otherwise idle threads (`pipe.link`), and the prediction uses that figure for every message.
`--spin` says what the busy threads run: "torch", small operators in a loop as the stages do;
"long-op", one matrix product after another of about 10 ms each, which let Python's interpreter
lock go for all that time (so a wait left is one for a core); or "python", a loop of Python
code, which holds the lock but for the interpreter's switch interval.

    python benchmarks/handover_delay.py --busy 0,1,2,3 --compute-us 150,700
    python benchmarks/handover_delay.py --busy 0,2,3 --compute-us 700 --spin long-op
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from fxpipe.runtime.transport import LocalTransport

SPINS = ("torch", "long-op", "python")


def _counts(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give counts of 0 or more")
    return values


def _compute(width: int, rounds: int) -> None:
    x = torch.ones(32, width)
    weight = torch.full((width, width), 1.0 / width)
    for _ in range(rounds):
        x = torch.tanh(x @ weight)


def _rounds_for(seconds: float, width: int) -> int:
    """Rounds of _compute that take about `seconds` on this thread alone."""
    _compute(width, 20)  # warm-up
    start = time.perf_counter()
    _compute(width, 200)
    per_round = (time.perf_counter() - start) / 200
    return max(1, round(seconds / per_round))


def _python_loop() -> None:
    """About 0.6 ms of Python code alone here, which holds the interpreter lock."""
    total = 0
    for i in range(20_000):
        total += i


def delays(busy: int, work: int, width: int, messages: int, kind: str = "torch") -> list[float]:
    """Seconds from each send's start to its receiver's return from the receive, both ways,
    while `busy` threads run `kind` of work (SPINS) without a pause (the first tenth left out,
    as warm-up)."""
    transport = LocalTransport(["cpu", "cpu"], 60.0)
    stop = threading.Event()
    sent: dict[tuple[str, int], float] = {}
    found: list[float] = []
    square = torch.randn(700, 700)  # a product of two takes about 10 ms here

    def spin() -> None:
        while not stop.is_set():
            if kind == "torch":
                _compute(width, work)
            elif kind == "long-op":
                torch.mm(square, square)
            else:
                _python_loop()

    failed: list[BaseException] = []

    def second_stage() -> None:
        try:
            for i in range(messages):
                transport.recv(0, 1, "F", ("handover", i))
                found.append(time.perf_counter() - sent["F", i])
                _compute(width, work)
                sent["B", i] = time.perf_counter()
                transport.send(1, 0, "B", ("handover", i), {"value": torch.zeros(1)})
        except BaseException as error:  # re-raised below; wakes the first stage
            failed.append(error)
            transport.abort(error)

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
    peer = threading.Thread(target=second_stage, daemon=True)
    for thread in [*spinners, peer]:
        thread.start()
    try:
        for i in range(messages):
            _compute(width, work)
            sent["F", i] = time.perf_counter()
            transport.send(0, 1, "F", ("handover", i), {"value": torch.zeros(1)})
            transport.recv(1, 0, "B", ("handover", i))
            found.append(time.perf_counter() - sent["B", i])
    except BaseException as error:  # wakes the second stage, which may wait for a message
        transport.abort(error)
        if not failed:  # else the second stage's error, which stopped this one, is raised
            raise
    finally:
        stop.set()
        peer.join()
        for thread in spinners:
            thread.join()
    if failed:
        raise failed[0]
    return found[len(found) // 10:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=_counts, default=[0, 1, 2, 3],
                        help="threads computing meanwhile, comma-separated")
    parser.add_argument("--compute-us", type=_counts, default=[150, 700],
                        help="microseconds each stage thread computes between messages")
    parser.add_argument("--width", type=int, default=256, help="the computes' matrix width")
    parser.add_argument("--messages", type=int, default=300, help="round trips per setting")
    parser.add_argument("--spin", choices=SPINS, default="torch",
                        help="what the busy threads run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"one-way hand-over delay between two stage threads, us; {args.messages} round trips "
          f"per setting; {torch.get_num_threads()} intra-op thread per thread; busy threads "
          f"run {args.spin}")
    for micro in args.compute_us:
        work = _rounds_for(micro * 1e-6, args.width)
        for busy in args.busy:
            found = sorted(delays(busy, work, args.width, args.messages, args.spin))
            print(f"compute {micro} us, {busy} busy: median "
                  f"{statistics.median(found) * 1e6:.0f}, mean {statistics.fmean(found) * 1e6:.0f},"
                  f" 90th percentile {found[int(0.9 * len(found))] * 1e6:.0f}")


if __name__ == "__main__":
    main()
