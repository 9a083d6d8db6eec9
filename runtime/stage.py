"""StageRunner: the forward and backward of one micro-batch on one stage."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

import torch

from fxpipe.ir import Stage, StageHook, StageIO
from fxpipe.precision import autocast
from fxpipe.runtime.consistency import WeightPolicy
from fxpipe.runtime.recompute import Recompute
from fxpipe.runtime.split_backward import WeightWork, input_backward, weight_backward
from fxpipe.runtime.transport import MicroBatchKey

__all__ = ["StageRunner"]


class StageRunner:
    """Runs one stage's graph module on micro-batches, and its hook after each backward.

    A forward keeps what its backward needs (the stage's input leaves and outputs) under its
    micro-batch key; the backward releases them, so only in-flight micro-batches hold
    activations. Received values are cut from the sender's autograd graph: each stage's backward
    is its own, and hands input gradients back explicitly. Because the runner runs each stage's
    backward itself, it fires the stage's hook callbacks when that backward has returned (the
    gradients are accumulated then), instead of routing every weight through the hook's
    autograd function as the sequential PipelineGraph does: the stage runs on its own
    parameters, with no per-call re-binding, unless a consistency policy substitutes weights.
    """

    def __init__(self, stage: Stage, hook: StageHook, io: StageIO, device: str,
                 needs_grad: Mapping[str, bool], recompute: bool = False,
                 rng_lock: threading.Lock | None = None) -> None:
        self.stage, self.hook, self.io = stage, hook, io
        # a training forward checkpointed (recompute) or not; rng_lock: see Recompute
        self.recompute = Recompute(stage, recompute, rng_lock, device)
        self.index = io.stage
        self.device = torch.device(device)
        self.needs_grad = dict(needs_grad)  # value -> carries a gradient in training
        self._in_flight: dict[Any, tuple[list[Any], tuple[Any, ...], list[torch.Tensor]]] = {}
        # split backwards (zero-bubble): micro-batch -> what its weight gradient still computes,
        # whose graph (and so activations) is kept until then
        self._awaiting_weights: dict[Any, WeightWork] = {}
        self.peak_in_flight = 0  # most micro-batches held at once so far
        self.policy: WeightPolicy | None = None  # asynchronous schedules: which weights to use
        self.precision: str | None = None  # Plan(precision): the forward runs under autocast

    @property
    def in_flight(self) -> int:
        """Micro-batches whose forward ran and whose backward (its weight gradient, where
        split off) has not."""
        return len(self._in_flight) + len(self._awaiting_weights)

    def forward(self, key: MicroBatchKey, values: Mapping[str, Any],
                split: bool = False) -> dict[str, Any]:
        """Run the stage on `values` (its inputs by name). Returns its outputs by name, and its
        inputs as the stage saw them (cut from the sender's graph), so a later use of an input,
        such as a loss on a model output that passed through, backpropagates into this stage.
        `split`: the micro-batch's backward will be split (see Recompute.forward)."""
        training = torch.is_grad_enabled()
        inputs = [self._leaf(values[name], name, training) for name in self.io.inputs]
        policy = self.policy if training else None
        weights = policy.forward_weights(key) if policy else None
        context = (policy.forward_context(key, weights or policy.weights) if policy
                   else contextlib.nullcontext())
        with context, self.autocast():  # weights: a version chosen by the policy, if any
            outputs = (self.recompute.forward(key, inputs, weights, split) if training
                       else self.stage.module(*inputs))
        if training:
            self._in_flight[key] = (inputs, outputs, [])
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return {**dict(zip(self.io.inputs, inputs)), **dict(zip(self.io.outputs, outputs))}

    def autocast(self) -> contextlib.AbstractContextManager:
        """The stage's autocast on its device (none in full precision): its forward runs under
        it, and so does the loss on the last stage, as in a plain torch.amp loop."""
        return autocast(self.device, self.precision)

    def add_root(self, key: MicroBatchKey, tensor: torch.Tensor) -> None:
        """Make `tensor` (the micro-batch's loss, on the last stage) a root of its backward."""
        self._in_flight[key][2].append(tensor)

    def backward(self, key: MicroBatchKey, grads: Mapping[str, torch.Tensor | None],
                 last: bool = False, split: bool = False) -> dict[str, Any]:
        """Backpropagate the gradients of the stage's outputs (and of any roots added);
        accumulate parameter gradients; return the gradients of the stage's inputs by name.
        A gradient given for an input name (an input that is also a model output) is added.
        `last`: this is the stage's last backward of the mini-batch (its hook callbacks read
        `hook.finishing`, e.g. to start the gradient all-reduce).

        `split` (zero-bubble schedules): compute the inputs' gradients only, keeping the graph
        and the micro-batch's activations for `weight_backward`, which accumulates the
        parameters' gradients later and fires the hook then."""
        inputs, outputs, roots = self._in_flight.pop(key)
        if self.policy is not None:
            self.policy.before_backward(key)
        tensors = list(roots)
        grad_tensors: list[torch.Tensor | None] = [None] * len(roots)
        for name, output in zip(self.io.outputs, outputs):
            grad = grads.get(name)
            if grad is not None and isinstance(output, torch.Tensor) and output.requires_grad:
                tensors.append(output)
                grad_tensors.append(grad)
        leaves = [(name, leaf) for name, leaf in zip(self.io.inputs, inputs)
                  if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if split:  # the weights' part of the graph stays for weight_backward
            found, self._awaiting_weights[key] = self._input_backward(
                key, inputs, outputs, len(roots), tensors, grad_tensors,
                [leaf for _, leaf in leaves])
        else:
            with self.recompute.backward(key):
                if tensors:
                    torch.autograd.backward(tensors, grad_tensors)
            found = [leaf.grad for _, leaf in leaves]
            self._finished(key, last)
        result = {name: grad for name, grad in grads.items()  # values it only forwarded
                  if grad is not None and name not in self.io.inputs
                  and name not in self.io.outputs}
        for (name, _), grad in zip(leaves, found):
            direct = grads.get(name)
            if direct is not None:
                grad = direct if grad is None else grad + direct
            result[name] = grad
        return result

    def _input_backward(self, key, inputs, outputs, roots, tensors, grads, leaves):
        """B of a split backward. A recomputing stage runs its forward again first, once,
        and B and W share the graph that builds (Recompute.replay); where it cannot, the
        checkpointed graph serves, recomputing in each autograd call."""
        replayed = (self.recompute.replay(key, inputs, outputs, roots, tensors, grads)
                    if self.recompute.enabled else None)
        if replayed is None:
            with self.recompute.backward(key):
                return input_backward(tensors, grads, leaves)
        return input_backward(*replayed)

    def weight_backward(self, key: MicroBatchKey, last: bool = False) -> None:
        """The parameters' gradients of a micro-batch whose `backward(split=True)` ran,
        accumulated into `.grad` as the unsplit backward does; then its activations and graph
        are released and the hook fires (`last` as backward's)."""
        with self.recompute.locked():  # checkpoint may recompute here (Recompute.replay)
            weight_backward(self._awaiting_weights.pop(key))
        self._finished(key, last)

    def _finished(self, key: MicroBatchKey, last: bool) -> None:
        """A micro-batch's gradients are all accumulated: tell the policy, fire the hook."""
        if self.policy is not None:
            self.policy.after_backward(key)
        self.hook.finishing = last
        self.hook.fire()

    def step(self) -> None:
        """The stage's optimizer step, by its policy (step_many checks every stage has one)."""
        self.policy.step()

    def discard(self, run: Any) -> None:
        """Drop the in-flight micro-batches of `run` (failed, or never to be backwarded)."""
        for held in (self._in_flight, self._awaiting_weights):
            for key in [key for key in held if key.run == run]:
                del held[key]
                self.recompute.forget(key)
                if self.policy is not None:
                    self.policy.forget(key)

    def _leaf(self, value: Any, name: str, training: bool) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        leaf = value.detach()
        wanted = value.requires_grad or self.needs_grad.get(name, False)
        if training and wanted and leaf.is_floating_point():
            leaf.requires_grad_(True)
        return leaf
