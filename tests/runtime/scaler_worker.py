"""One rank of the fp16 loss-scaling scenario, run by tests/runtime/test_loss_scaling.py under
torchrun: an inf gradient on stage 0's rank only must skip the optimizer step on both ranks."""

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


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    pipe, x, y = pipeline()
    record = {"rank": torch.distributed.get_rank(), **train(pipe, x, y)}
    state = gather_state_dict(pipe)
    if record["rank"] == 0:
        torch.save(state, f"{out}.state")
    with open(f"{out}.{record['rank']}", "w") as file:
        json.dump(record, file)
    shutdown()


if __name__ == "__main__":
    main()
