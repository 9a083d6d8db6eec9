"""A stage's gradient all-reduce over its data-parallel group: GroPipe's delayed one, or naive."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fxpipe.ir import Event
from fxpipe.schedules import Action, ActionKind

__all__ = ["GradientSync"]

DEFAULT_BUCKET_BYTES = 25 * 2 ** 20


class GradientSync:
    """All-reduces one stage's gradients over its data-parallel group.

    Stage s of every pipeline replica forms a data-parallel group. `delayed` (GroPipe) starts
    `all_reduce(async_op=True)` of the stage's gradient buckets at the schedule's ALLREDUCE
    action (`launch`), which follows the stage's last action of the mini-batch, its last
    gradient sent back included, so the earlier stages' backward overlaps it and never waits
    for it; it is waited for only before the optimizer step. `naive` waits for the whole
    pipeline's backward, then reduces. Both run the same all-reduces, one per bucket; delayed
    starts them earlier and skips the barrier. Buckets hold at most `bucket_bytes` (DDP's 25
    MiB). Each group's loss is weighted by its share of the global mini-batch, so the
    all-reduce sums.
    """

    def __init__(self, stage: int, params: Sequence[torch.nn.Parameter], group: Any,
                 mode: str = "delayed", pipeline: Any = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 wait: Callable[[Any, str], None] | None = None) -> None:
        self.stage = stage
        self.params = [p for p in params if p.requires_grad]
        self.group, self.pipeline, self.mode = group, pipeline, mode
        # a wait on the other ranks, bounded by the watchdog's deadline when given
        self._wait = wait or (lambda work, what: work.wait())
        self.buckets = _buckets(self.params, bucket_bytes)
        self._pending: list[tuple[Any, torch.Tensor, list[torch.nn.Parameter]]] = []
        # wall-clock spans of the stage's time in all-reduces outside the schedule's actions
        # (the driver times the ALLREDUCE action, delayed's launch): naive's launch and wait,
        # delayed's wait, for the trace
        self.events: list[Event] = []

    def finish(self) -> None:
        """Before the optimizer step: make this stage's gradients the group's average."""
        if self.mode == "naive":
            self._wait(dist.barrier(self.pipeline, async_op=True),  # the whole pipeline's
                       "the pipeline's other stages to finish their backward")  # backward
        start = time.time()
        if not self._pending:  # naive, or delayed where no ALLREDUCE action ran (loss.backward())
            self.launch()
        for handle, flat, bucket in self._pending:
            self._wait(handle, f"stage {self.stage}'s gradients from the other pipeline groups "
                       "(an all-reduce)")
            for param, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                param.grad.copy_(reduced)
        if self._pending:
            self.events.append(Event(self.stage, Action(self.stage, ActionKind.ALLREDUCE),
                                     start, time.time()))
        self._pending = []

    def launch(self) -> None:
        """Start the all-reduce of every bucket of the stage's gradients (a parameter the
        step did not reach takes part as zeros, so every group sends the same buckets)."""
        for bucket in self.buckets:
            for param in bucket:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            flat = _flatten_dense_tensors([p.grad for p in bucket])
            handle = dist.all_reduce(flat, group=self.group, async_op=True)
            self._pending.append((handle, flat, bucket))


def _buckets(params: Sequence[torch.nn.Parameter], limit: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters, in reverse order (the order backward finishes them), grouped
    into buckets of at most `limit` bytes and one dtype/device each."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for param in reversed(list(params)):
        nbytes = param.numel() * param.element_size()
        last = buckets[-1] if buckets else None
        fits = (last is not None and size + nbytes <= limit
                and last[0].dtype == param.dtype and last[0].device == param.device)
        if fits:
            last.append(param)
            size += nbytes
        else:
            buckets.append([param])
            size = nbytes
    return buckets
