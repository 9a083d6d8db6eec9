"""Recomputation: a stage's forward under torch.utils.checkpoint, run again in its backward."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["Recompute"]


class Recompute:
    """How one stage's training forward runs: as it is, or (`enabled`) checkpointed, keeping
    only its inputs, so its backward recomputes the activations (non-reentrant, with the RNG
    state of the forward: dropout draws the same masks).

    The recompute must not update the stage's buffers a second time: they are put back after
    it (BatchNorm's running statistics end as the plain model's), at the cost of a copy of
    the stage's buffers while it runs. Stages on several worker threads of one process share
    the CPU's random generator: a forward's draws and their replay are the stage's own only
    while no other stage draws, so those stages hold `lock` (one for them all) through every
    training forward and through a recomputing stage's backward.
    """

    def __init__(self, module: torch.nn.Module, enabled: bool,
                 lock: threading.Lock | None = None) -> None:
        self.enabled = enabled
        self.module = module
        self.lock = lock

    def forward(self, run: Callable[..., Any], inputs: Sequence[Any]) -> Any:
        """`run(*inputs)` with gradients enabled, checkpointed if enabled."""
        with self._held():
            if not self.enabled:
                return run(*inputs)
            return checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=True,
                              context_fn=self._contexts)

    def backward(self) -> contextlib.AbstractContextManager:
        """Around a backward, which recomputes the forward if enabled."""
        return self._held() if self.enabled else contextlib.nullcontext()

    def _held(self) -> contextlib.AbstractContextManager:
        return self.lock if self.lock is not None else contextlib.nullcontext()

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, ...]:
        """checkpoint's (forward, recompute) contexts: the recompute puts the stage's buffers
        back as they were before it. All of them: a kernel may update one in place without
        autograd seeing it (BatchNorm's running statistics keep their version counter)."""
        return contextlib.nullcontext(), self._buffers_kept()

    @contextlib.contextmanager
    def _buffers_kept(self) -> Iterator[None]:
        buffers = list(self.module.buffers())  # read now: moving a module replaces them
        kept = [b.clone() for b in buffers]
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in zip(buffers, kept):
                    buffer.copy_(value)
