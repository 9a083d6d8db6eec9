"""Recomputation: a stage's forward under torch.utils.checkpoint segment by segment, run again
in its backward."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

from fxpipe.ir import Stage, StageArgs
from fxpipe.unit_chain import Segment, UnitChain

__all__ = ["Recompute"]


class _Replay(NamedTuple):
    """What running a micro-batch's forward again needs: the weights its forward used (None:
    the parameters) and the random and autocast state the forward began with."""

    weights: Mapping[str, torch.Tensor] | None
    cpu_rng: torch.Tensor
    devices: list[int]
    device_rng: list[torch.Tensor]
    autocast: list[tuple[str, bool, torch.dtype]]


class Recompute:
    """How one stage's training forward runs: as it is, or (`enabled`) as a chain of segments
    of its units (UnitChain, cut where the compiler marked), each under its own checkpoint
    (non-reentrant, with the RNG state of the forward: dropout draws the same masks). A
    micro-batch in flight then keeps only the values entering each segment, and its backward
    recomputes one segment at a time, so at most one segment's activations exist again.

    A recompute must not update the stage's buffers a second time: those its unit can
    update are put back after it (BatchNorm's running statistics end as the plain model's),
    at the cost of a copy of them while it runs. Stages on several worker threads of one
    process share the CPU's random generator: a forward's draws and their replay are the
    stage's own only while no other stage draws, so those stages hold `lock` (one for them
    all) through every training forward and through a recomputing stage's backward.

    A split backward (zero-bubble: B, then W later) makes several autograd calls over the
    graph, and checkpoint would recompute in each; `replay` instead runs the whole forward
    again once, before B, and B and W share the graph it builds.
    """

    def __init__(self, stage: Stage, enabled: bool,
                 lock: threading.Lock | None = None, device: str | torch.device = "cpu") -> None:
        self.enabled = enabled
        self.stage = stage
        self.lock = lock
        self.device_type = torch.device(device).type
        self._replays: dict[Any, _Replay] = {}  # in-flight micro-batch -> its forward's state
        self._chain: UnitChain | None = None  # of stage.module, built at the first forward

    def forward(self, key: Any, inputs: Sequence[Any],
                weights: Mapping[str, torch.Tensor] | None = None, split: bool = False) -> Any:
        """The stage on `inputs` with gradients enabled (with `weights` instead of its
        parameters, if given), checkpointed segment by segment if enabled. `split`: its backward
        will be split, and `replay` run the whole forward again anyway, so it is
        checkpointed whole, keeping only the stage's inputs."""
        with self._held():
            if not self.enabled:
                return self._run(weights, *inputs)
            devices, states = get_device_states(*inputs)
            kinds = dict.fromkeys(("cpu", self.device_type))
            self._replays[key] = _Replay(weights, torch.get_rng_state(), devices, states, [
                (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                for kind in kinds])
            if split:
                return checkpoint(functools.partial(self._run, weights), *inputs,
                                  use_reentrant=False, preserve_rng_state=True,
                                  context_fn=lambda: (contextlib.nullcontext(),
                                                      self._buffers_kept()))
            chain = self._unit_chain()
            named = {f"stage.{name}": w for name, w in weights.items()} if weights else None
            return chain.run(inputs, functools.partial(self._checkpointed, chain, named))

    def _checkpointed(self, chain: UnitChain, weights: dict[str, torch.Tensor] | None,
                      segment: Segment, values: Sequence[Any]) -> Any:
        run = (segment.code if weights is None  # the same weights again when it recomputes
               else lambda *x: functional_call(segment.code, weights, x))
        # checkpoint's (forward, recompute) contexts: the recompute puts the buffers back
        contexts = lambda: (contextlib.nullcontext(),  # noqa: E731
                            _BuffersKept(lambda: chain.buffers(segment)))
        return checkpoint(run, *values, use_reentrant=False, preserve_rng_state=True,
                          context_fn=contexts)

    def _unit_chain(self) -> UnitChain:
        if self._chain is None or self._chain.module is not self.stage.module:
            self._chain = UnitChain(self.stage.module)
        return self._chain

    def _buffers_kept(self) -> _BuffersKept:
        return _BuffersKept(lambda: list(self.stage.module.buffers()))

    def _run(self, weights: Mapping[str, torch.Tensor] | None, *inputs: Any) -> Any:
        return self.stage(StageArgs(inputs, dict(weights or {})))

    def backward(self, key: Any) -> contextlib.AbstractContextManager:
        """Around a backward of `key`, which recomputes the forward if enabled."""
        self.forget(key)
        return self.locked()

    def locked(self) -> contextlib.AbstractContextManager:
        """Around an autograd call that may recompute (the lock, if enabled)."""
        return self._held() if self.enabled else contextlib.nullcontext()

    def forget(self, key: Any) -> None:
        self._replays.pop(key, None)

    def replay(self, key: Any, inputs: Sequence[Any], outputs: Sequence[Any], roots: int,
               tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
               ) -> tuple[list[torch.Tensor], list[Any], list[torch.Tensor]] | None:
        """For a split backward: the forward of `key` run again from `inputs` (its outputs
        were `outputs`), with what the backward was given — `tensors` (the first `roots` of
        them roots such as a loss, the others outputs) and their `grads` — moved onto the
        new graph. Returns the new outputs to backpropagate, their gradients and the new
        input leaves (those that need a gradient, in order). None where a root reaches an
        input leaf other than through the stage (a model output passed through): the old
        graph then serves, checkpoint recomputing in each of its autograd calls."""
        leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        wanted = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        from_roots: dict[int, Any] = {}
        if roots:  # a loss on this stage: its gradient at the stage's outputs
            if _reaches(tensors[:roots], {o.grad_fn for o in wanted},
                        {get_gradient_edge(leaf).node for leaf in leaves}):
                self.forget(key)
                return None
            found = torch.autograd.grad(tensors[:roots], wanted, grads[:roots],
                                        allow_unused=True) if wanted else ()
            from_roots = {id(t): g for t, g in zip(wanted, found)}
        given = {id(t): g for t, g in zip(tensors[roots:], grads[roots:])}
        fresh = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor)
                 else x for x in inputs]
        again = self._run_again(key, fresh)
        new_tensors, new_grads = [], []
        for old, new in zip(outputs, again):
            if not isinstance(old, torch.Tensor) or not old.requires_grad:
                continue
            parts = [g for g in (given.get(id(old)), from_roots.get(id(old))) if g is not None]
            if parts:
                new_tensors.append(new)
                new_grads.append(sum(parts[1:], parts[0]))
        return new_tensors, new_grads, [x for x in fresh if isinstance(x, torch.Tensor)
                                        and x.requires_grad]

    def _run_again(self, key: Any, inputs: Sequence[Any]) -> Any:
        state = self._replays.pop(key)
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._held())
            stack.enter_context(torch.random.fork_rng(devices=state.devices,
                                                      device_type=self.device_type))
            torch.set_rng_state(state.cpu_rng)
            set_device_states(state.devices, state.device_rng, device_type=self.device_type)
            for kind, enabled, dtype in state.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            stack.enter_context(self._buffers_kept())
            stack.enter_context(torch.enable_grad())
            return self._run(state.weights, *inputs)

    def _held(self) -> contextlib.AbstractContextManager:
        return self.lock if self.lock is not None else contextlib.nullcontext()


class _BuffersKept:
    """Puts buffers back after the block as they were before it. All that the block can
    reach: a kernel may update one in place without autograd seeing it (BatchNorm's running
    statistics keep their version counter). Enters again each time checkpoint recomputes
    (a split backward's autograd calls each do)."""

    def __init__(self, buffers: Callable[[], list[torch.Tensor]]) -> None:
        self.buffers = buffers
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        # read now: moving a module replaces its buffers
        self.kept = [(b, b.clone()) for b in self.buffers()]

    def __exit__(self, *exc: object) -> None:
        for buffer, value in self.kept:  # .data: no version bump, as the graph just
            buffer.data.copy_(value)  # built saved the buffer (BatchNorm's)
        self.kept = []

def _reaches(roots: Sequence[torch.Tensor], stops: set[Any], targets: set[Any]) -> bool:
    """Whether the autograd graph below `roots` reaches a node of `targets` on a path that
    passes no node of `stops`."""
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node in targets:
            return True
        if node in seen or node in stops:
            continue
        seen.add(node)
        stack += [child for child, _ in node.next_functions if child is not None]
    return False
