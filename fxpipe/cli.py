"""The `fxpipe` command: `fxpipe demo` compiles and trains a bundled model on the CPU."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from fxpipe.compile import compile
from fxpipe.errors import FxpipeError
from fxpipe.models import MODELS, bundled
from fxpipe.plan import Plan

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    spec = bundled(args.model)
    model = spec.build()
    data = torch.Generator().manual_seed(args.seed)
    x, y = spec.batch(args.batch, data)
    plan = Plan(stages=args.stages, partitioner=args.partitioner, loss_fn=spec.loss_fn)
    pipe = compile(model, plan, example_inputs=(x,))
    print(pipe)
    print()
    pipe.print_graph()
    print()
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    print(f"training {args.steps} steps on one fixed batch of {args.batch} "
          f"(SGD, lr={args.lr}, momentum 0.9) through the compiled pipeline:")
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = spec.loss_fn(pipe(x), y)
        loss.backward()
        optimizer.step()
        print(f"  step {step}: loss {loss.item():.4f}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxpipe", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="compile a bundled model and train a few steps")
    demo.add_argument("--model", choices=sorted(MODELS), default="resnet")
    demo.add_argument("--stages", type=int, default=2)
    demo.add_argument("--partitioner", default="even")
    demo.add_argument("--batch", type=int, default=16)
    demo.add_argument("--steps", type=int, default=5)
    demo.add_argument("--lr", type=float, default=0.05)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except FxpipeError as e:
        print(f"fxpipe: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
