"""Running under torchrun: each rank's stage and group, gathering state dicts, leaving the job."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.devices import cuda_count, job_backend, plan_rank_device
from fxpipe.errors import FxpipeError, PlanError
from fxpipe.plan import Plan

__all__ = ["RankLayout", "gather_state_dict", "launched", "rank_device", "rank_layout",
           "shutdown"]


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """Rank r is device r % D of pipeline group r // D (D devices, G groups, G * D ranks), and
    runs the stages `placement` puts on that device (None: stage s on device s, D = stages)."""

    rank: int
    world: int
    stages: int
    groups: int
    placement: tuple[int, ...] | None = None  # the device of each stage

    @property
    def devices(self) -> int:
        """Ranks in one pipeline."""
        return self.stages if self.placement is None else max(self.placement) + 1

    @property
    def device(self) -> int:
        return self.rank % self.devices

    @property
    def held(self) -> tuple[int, ...]:
        """The stages this rank runs, in increasing order."""
        return tuple(s for s in range(self.stages) if self.device_of(s) == self.device)

    @property
    def stage(self) -> int:
        """This rank's (first) stage."""
        return self.held[0]

    @property
    def group(self) -> int:
        return self.rank // self.devices

    def device_of(self, stage: int) -> int:
        return stage if self.placement is None else self.placement[stage]

    def rank_of(self, stage: int, group: int | None = None) -> int:
        return (self.group if group is None else group) * self.devices + self.device_of(stage)

    @property
    def pipeline_ranks(self) -> list[int]:
        """The ranks of this rank's pipeline, stage by stage (a rank once per stage it runs)."""
        return [self.rank_of(s) for s in range(self.stages)]

    def data_parallel_ranks(self, stage: int) -> list[int]:
        """The ranks that run `stage`, one per pipeline group."""
        return [self.rank_of(stage, g) for g in range(self.groups)]


def launched() -> bool:
    """Whether this process is one rank of a torch.distributed job (initialised or by torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return True
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank_layout(plan: Plan, timeout: float = 300.0) -> RankLayout:
    """This rank's place in the plan; joins the process group torchrun describes if the script
    has not, and refuses a world size that does not fit the plan before communicating."""
    if not dist.is_available():
        raise FxpipeError("this torch build has no torch.distributed; run one process with "
                          "Plan(devices=[...]) instead.")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    need = plan.device_count * plan.groups
    if world != need:
        each = (f", stages_per_device={plan.stages_per_device}"
                if plan.device_count != plan.stages else "")
        raise PlanError(
            f"the job has {world} ranks but Plan(stages={plan.stages}{each}, groups="
            f"{plan.groups}) needs {need}; launch with torchrun --nproc-per-node {need} or "
            "change the plan."
        )
    if not dist.is_initialized():
        backend = job_backend(plan.devices, torch.cuda.device_count()
                              if torch.cuda.is_available() else 0)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return RankLayout(rank, world, plan.stages, plan.groups, plan.placement)


def rank_device(plan: Plan, layout: RankLayout) -> str:
    """The device of this rank's stage: the plan's (a bare "cuda": this node's GPU numbered
    LOCAL_RANK), else this rank's GPU by LOCAL_RANK, else the CPU (fxpipe.devices)."""
    given = None if plan.devices is None else plan.devices[layout.device]
    count = cuda_count()
    local_rank = int(os.environ.get("LOCAL_RANK", layout.rank))
    return str(plan_rank_device(given, local_rank, count, layout.rank, layout.stage))


def gather_state_dict(pipe: Any, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict, on rank `dst`, from every rank's share (None elsewhere).
    Every rank of the job must call it. Loads into the plain model with load_state_dict."""
    if not (dist.is_available() and dist.is_initialized()):
        return pipe.state_dict()
    own = {k: v.detach().cpu() for k, v in pipe.state_dict().items()}
    shares: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(own, shares, dst=dst)
    if shares is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for share in shares:
        merged.update(share)
    order = getattr(pipe, "state_dict_keys", None) or list(merged)
    # what no stage holds, the model never uses: every rank keeps it as it was built
    unheld = [k for k in order if k not in merged]
    everything = torch.nn.Module.state_dict(pipe) if unheld else {}
    if any(everything[k].is_meta for k in unheld):
        raise FxpipeError(f"no stage uses {unheld}, so the model built on the meta device has "
                          "no values for them: load them from your checkpoint, or remove them "
                          "from the model.")
    merged.update({k: everything[k].detach().cpu() for k in unheld})
    return {k: merged[k] for k in order}


def shutdown() -> None:
    """Leave the torchrun job: every rank calls it last, in place of destroy_process_group.

    It waits for the other ranks, destroys the process groups and frees them while the
    interpreter still runs. A gloo group's worker threads free each collective's tensors
    after the call that waited for it has returned, which takes the interpreter lock; a
    thread that does so once the interpreter has begun to shut down aborts the process
    ("terminate called without an active exception", pytorch/pytorch#190489). So the groups
    that pipelines no longer in use still hold are freed here, which joins their threads,
    and any group still held elsewhere gets a moment for its threads to finish."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()  # pipelines in reference cycles hold groups, whose threads their end joins
    time.sleep(0.05)  # blocking here hands the interpreter lock to any thread still freeing
