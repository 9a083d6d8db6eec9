"""One rank of the precision scenario, run by tests/runtime/test_loss_scaling.py under
torchrun: an inf gradient on stage 0's rank only must skip the optimizer step on both ranks
(fp16); values crossing ranks travel in the dtypes autocast made them in (bf16)."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from poison import Poison, poisoned_net  # this script's folder is on the path

import fxpipe
from fxpipe.distributed import gather_state_dict, shutdown


def pipeline(devices=None) -> tuple[fxpipe.CompiledPipeline, torch.Tensor, torch.Tensor]:
    """The fp16 pipeline of the scenario (`devices`: one process) and its batch."""
    torch.manual_seed(0)
    model = poisoned_net()
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    plan = fxpipe.Plan(stages=2, micro_batches=2, partitioner=[3, 3], costs="none",
                       loss_fn=F.cross_entropy, precision="fp16", leaf_modules=[Poison],
                       timeout=60, devices=devices)
    return fxpipe.compile(model, plan, (x,)), x, y


def train(pipe, x, y) -> dict:
    """Three steps, the first with an inf gradient on stage 0: what each did, and the losses."""
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    record = {"steps": [], "losses": []}
    for armed in (True, False, False):
        Poison.armed = armed
        record["losses"].append(pipe.step(x, y).item())
        local_inf = any(not torch.isfinite(p.grad).all() for p in pipe.parameters())
        before = [p.detach().clone() for p in pipe.parameters()]
        scale = pipe.scaler.get_scale()
        pipe.scaler.step(optimizer)
        pipe.scaler.update()
        optimizer.zero_grad()
        changed = any(not torch.equal(b, p) for b, p in zip(before, pipe.parameters()))
        record["steps"].append({"armed": armed, "local_inf": local_inf, "stepped": changed,
                                "scale": scale, "next_scale": pipe.scaler.get_scale()})
    Poison.armed = False
    return record


class Residual(torch.nn.Module):
    """Under a [1, 2] partition stage 0 makes `h` and tanh(h), both bf16 under autocast; stage 1
    adds `h` to a Linear's bf16 output and squashes the sum: in bf16, as one process hands
    `h` over (in fp32, were `h` to cross in fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = (torch.nn.Linear(m, n) for m, n in ((8, 16), (16, 16),
                                                                       (16, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.out(torch.tanh(self.b(torch.tanh(h)) + h) * 1.7)


def bf16_pipeline(devices=None) -> tuple[fxpipe.CompiledPipeline, torch.Tensor, torch.Tensor]:
    """The bf16 pipeline of the scenario (`devices`: one process) and its batch."""
    torch.manual_seed(0)
    model = Residual()
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    plan = fxpipe.Plan(stages=2, micro_batches=2, partitioner=[1, 2], costs="none",
                       loss_fn=F.cross_entropy, precision="bf16", timeout=60, devices=devices)
    return fxpipe.compile(model, plan, (x,)), x, y


def bf16_step(pipe, x, y) -> dict:
    """One step's loss and gradients (by parameter name), and the dtypes of the values
    crossing between stages as torchrun's transport sends them."""
    loss = pipe.step(x, y).item()
    slots = getattr(pipe.executor.transport, "_forward", {})
    return {"loss": loss, "grads": {n: p.grad for n, p in pipe.named_parameters()},
            "wire": {slot.value: str(slot.dtype) for message in slots.values()
                     for slot in message}}


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    pipe, x, y = pipeline()
    record = {"rank": torch.distributed.get_rank(), **train(pipe, x, y)}
    state = gather_state_dict(pipe)
    if record["rank"] == 0:
        torch.save(state, f"{out}.state")
    torch.save(bf16_step(*bf16_pipeline()), f"{out}.bf16.{record['rank']}")
    with open(f"{out}.{record['rank']}", "w") as file:
        json.dump(record, file)
    shutdown()


if __name__ == "__main__":
    main()
