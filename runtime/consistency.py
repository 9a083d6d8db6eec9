"""Weight consistency in asynchronous pipelines: which weights a forward and backward see."""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from fxpipe.errors import FxpipeError
from fxpipe.schedules import Action, B, F, Schedule

__all__ = ["POLICIES", "Predictor", "WeightPolicy", "make_policy", "predicted_update"]

# (optimizer, parameter, its last gradient or None) -> ΔW, the direction of the next update
Predictor = Callable[[torch.optim.Optimizer, torch.nn.Parameter, torch.Tensor | None],
                     torch.Tensor]


class WeightPolicy:
    """`none`: forward and backward read the stage's parameters as they are at that moment."""

    keeps_last_grads = False  # whether step() keeps a copy of the gradients it applies

    def __init__(self, weights: Mapping[str, torch.nn.Parameter], stage: int, stages: int) -> None:
        self.weights = dict(weights)
        self.stage, self.stages = stage, stages
        self.version = 0  # optimizer steps taken by this stage
        self.optimizer: torch.optim.Optimizer | None = None
        self.forward_versions: dict[Any, int] = {}  # in-flight micro-batch -> its forward's version
        # (micro-batch, forward's version, backward's version) of the latest backwards
        self.history: collections.deque[tuple[Any, int, int]] = collections.deque(maxlen=4096)
        # gradients of the latest step, kept only by a policy that reads them (predict)
        self.last_grads: dict[str, torch.Tensor] = {}
        self.peak_copies = 0  # most weight copies held at once
        self.schedule: Schedule | None = None  # what the current run executes (follow)

    def follow(self, schedule: Schedule) -> None:
        """The schedule the next run executes (the one whose micro-batches `key.mb` numbers)."""
        self.schedule = schedule

    def forward_weights(self, key: Any) -> dict[str, torch.Tensor] | None:
        """The weights the forward of `key` runs with (None: the parameters themselves)."""
        self.forward_versions[key] = self.version
        return None

    @contextlib.contextmanager
    def forward_context(self, key: Any, hooked: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Around the forward: decide what its backward will read for each weight. `hooked`
        maps names to the tensors the stage actually runs with."""
        with _reading_current(hooked, self.weights):
            yield

    def before_backward(self, key: Any) -> None:
        """Right before the backward of `key` (its gradients then accumulate as the policy
        says)."""
        return None

    def after_backward(self, key: Any) -> None:
        self.history.append((key, self.forward_versions[key], self._backward_version(key)))
        self.forward_versions.pop(key)

    def _backward_version(self, key: Any) -> int:
        return self.version

    def forget(self, key: Any) -> None:
        """A micro-batch whose backward will never run (a failed or abandoned run)."""
        self.forward_versions.pop(key, None)

    def step(self) -> None:
        """The stage's optimizer step (the schedule's STEP action)."""
        if self.optimizer is None:
            raise FxpipeError("an asynchronous schedule steps each stage's optimizer itself: "
                              "call pipe.attach_optimizer(lambda params: torch.optim.SGD(params, "
                              "lr=0.1)) before training.")
        self.before_step()
        if self.keeps_last_grads:
            self.last_grads = {}  # the previous step's go before this step's are copied
            self.last_grads = {n: w.grad.detach().clone() for n, w in self.weights.items()
                               if w.grad is not None}
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.version += 1

    def before_step(self) -> None:
        return None


class StashPolicy(WeightPolicy):
    """`stash`: a copy of the weights per version still needed by an in-flight micro-batch."""

    def __init__(self, weights, stage, stages) -> None:
        super().__init__(weights, stage, stages)
        self._copies: dict[int, dict[str, torch.Tensor]] = {}
        self._users: dict[int, set[Any]] = {}

    def forward_weights(self, key: Any) -> dict[str, torch.Tensor]:
        version = self._version_for_forward()
        self.forward_versions[key] = version
        if version not in self._copies:
            self._copies[version] = self._snapshot()
        self.peak_copies = max(self.peak_copies, self._held())
        self._users.setdefault(version, set()).add(key)
        return self._copies[version]

    def forward_context(self, key, hooked):
        return contextlib.nullcontext()  # the backward reads the copy the forward used

    def _version_for_forward(self) -> int:
        return self.version

    def _held(self) -> int:
        """The weight copies the policy holds now."""
        return len(self._copies)

    def _backward_version(self, key: Any) -> int:
        return self.forward_versions[key]

    def before_backward(self, key: Any) -> None:
        """The copy's gradients are the parameters': autograd adds this micro-batch's into
        .grad in place, as it does without a policy, instead of making a second set of
        gradients to add afterwards."""
        for name, tensor in self._copies[self.forward_versions[key]].items():
            if tensor.requires_grad:
                tensor.grad = self.weights[name].grad

    def after_backward(self, key: Any) -> None:
        version = self.forward_versions[key]
        super().after_backward(key)
        for name, tensor in self._copies[version].items():  # this micro-batch's gradients
            if tensor.grad is not None:  # .grad itself, or new where .grad was None
                self.weights[name].grad = tensor.grad
                tensor.grad = None
        users = self._users[version]
        users.discard(key)
        if not users:  # the last micro-batch of this version is done: free the copy
            del self._copies[version], self._users[version]

    def forget(self, key: Any) -> None:
        version = self.forward_versions.pop(key, None)
        users = self._users.get(version)
        if users is not None:
            users.discard(key)
            if not users:
                del self._copies[version], self._users[version]

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {name: w.detach().clone().requires_grad_(w.requires_grad)
                for name, w in self.weights.items()}


class TwoBufferPolicy(StashPolicy):
    """`2bw`: new micro-batches use the version before the latest step (kept as a shadow copy),
    forward and backward alike, so at most two versions exist besides in-flight stragglers."""

    def __init__(self, weights, stage, stages) -> None:
        super().__init__(weights, stage, stages)
        self._shadow: dict[str, torch.Tensor] | None = None

    def before_step(self) -> None:
        self._shadow = None  # the last step's shadow goes (unless a version in use) first
        self._shadow = self._snapshot()  # the version this step is about to replace
        self.peak_copies = max(self.peak_copies, self._held())

    def _held(self) -> int:
        """The versions' copies and the shadow, which may be one of them (counted once)."""
        held = {id(copies) for copies in self._copies.values()}
        return len(held | ({id(self._shadow)} if self._shadow is not None else set()))

    def _version_for_forward(self) -> int:
        version = max(self.version - 1, 0)
        if version not in self._copies and self._shadow is not None and self.version > 0:
            self._copies[version] = self._shadow
        return version


class PredictPolicy(WeightPolicy):
    """`predict` (PipeOptim): forward with Ŵ = W − lr·s·ΔW, the weights expected after the s
    steps that land before this micro-batch's backward; the backward reads the current W."""

    keeps_last_grads = True  # the predictors of SGD without momentum, and the fallback, read them

    def __init__(self, weights, stage, stages, predictor: Predictor | None = None) -> None:
        super().__init__(weights, stage, stages)
        self.predictor = predictor

    def updates_ahead(self, mb: int) -> int:
        """s for micro-batch `mb`: the STEPs the stage takes between its forward and its
        backward in the schedule being run, weight_version(B) - weight_version(F). PipeOptim's
        N - stage - 1 holds for one micro-batch per update only; with p micro-batches per
        update it is at most ceil((N - stage - 1) / p)."""
        if self.schedule is None:
            return 0  # no schedule followed yet: nothing known to land in between
        version = self.schedule.weight_version
        return version(Action(self.stage, B, mb)) - version(Action(self.stage, F, mb))

    def forward_weights(self, key: Any) -> dict[str, torch.Tensor] | None:
        self.forward_versions[key] = self.version
        ahead = self.updates_ahead(key.mb)
        if ahead == 0 or self.optimizer is None or self.version == 0:
            return None  # no step lands before the backward, or nothing to predict from yet
        self.peak_copies = 1  # Ŵ exists while the forward runs; the backward reads W
        predicted = {}
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                name = self._name_of(param)
                if name is None:
                    continue
                with torch.no_grad():
                    predictor = self.predictor or predicted_update
                    update = predictor(self.optimizer, param, self.last_grads.get(name))
                    shift = group["lr"] * ahead * update
                predicted[name] = param - shift  # valued Ŵ, differentiable in W
        return predicted

    def _name_of(self, param: torch.nn.Parameter) -> str | None:
        return next((n for n, w in self.weights.items() if w is param), None)


def predicted_update(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter,
                     last_grad: torch.Tensor | None = None) -> torch.Tensor:
    """ΔW of PipeOptim's Table I from the optimizer's own state, as PyTorch computes it (the
    step is W -= lr·ΔW).

    SGD: the momentum buffer, which already holds weight decay, dampening and `maximize`; with
    `nesterov`, the gradient (weight decay added) plus momentum·buffer; without momentum, that
    gradient. Adam: m̂ / (√v̂ + eps), with v̂ from the running maximum under `amsgrad` (coupled
    weight decay and `maximize` are already in the moments). AdamW: the same, plus weight
    decay·W (decoupled). Others: the last gradient, warned once.
    """
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    state = optimizer.state.get(param, {})
    if isinstance(optimizer, torch.optim.AdamW | torch.optim.Adam) and "exp_avg" in state:
        beta1, beta2 = group["betas"]
        steps = float(state["step"])
        second = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
        m_hat = state["exp_avg"] / (1 - beta1 ** steps)
        v_hat = second / (1 - beta2 ** steps)
        update = m_hat / (v_hat.sqrt() + group["eps"])
        if isinstance(optimizer, torch.optim.AdamW) and group["weight_decay"]:
            update = update + group["weight_decay"] * param
        return update
    if isinstance(optimizer, torch.optim.SGD):
        buffer = state.get("momentum_buffer")
        if buffer is not None and not group.get("nesterov"):
            return buffer
        grad = last_grad if last_grad is not None else torch.zeros_like(param)
        grad = -grad if group.get("maximize") else grad
        if group["weight_decay"]:
            grad = grad + group["weight_decay"] * param
        return grad if buffer is None else grad + group["momentum"] * buffer
    _warn_fallback(type(optimizer).__name__)
    return last_grad if last_grad is not None else torch.zeros_like(param)


_WARNED: set[str] = set()


def _warn_fallback(name: str) -> None:
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"consistency='predict' has no rule for {name}; it predicts with the last "
                      "gradient (ΔW = g). Pass attach_optimizer(..., predictor=fn) for a better "
                      "one.", stacklevel=3)


@contextlib.contextmanager
def _reading_current(hooked: Mapping[str, torch.Tensor],
                     params: Mapping[str, torch.nn.Parameter]) -> Iterator[None]:
    """Saved weights are read back at backward time from the parameters as they are then
    (the weights may have been stepped meanwhile; autograd's version check is not wanted).
    A weight saved as a view (a Linear's weight is saved transposed) is read as the same view
    of its parameter: keeping the substitute's view would keep the substitute (predict's Ŵ)
    alive until the backward, and the backward would read it instead of the weights."""
    originals = {id(t): params[name] for name, t in hooked.items() if name in params}
    # a substitute laid out as its parameter, by its storage: views of it are read from W
    storages = {t.untyped_storage().data_ptr(): params[name] for name, t in hooked.items()
                if name in params and t is not params[name] and t.shape == params[name].shape
                and t.stride() == params[name].stride()
                and t.storage_offset() == params[name].storage_offset()}

    def pack(tensor: torch.Tensor) -> Any:
        param = originals.get(id(tensor))
        if param is not None:
            return ("weight", param)
        param = storages.get(tensor.untyped_storage().data_ptr()) if storages else None
        if param is not None:
            return ("view", param, tensor.size(), tensor.stride(), tensor.storage_offset())
        return tensor

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple) and packed[0] == "weight":
            return packed[1]
        if isinstance(packed, tuple) and packed[0] == "view":
            return packed[1].as_strided(*packed[2:])
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


POLICIES = {"none": WeightPolicy, "stash": StashPolicy, "2bw": TwoBufferPolicy,
            "predict": PredictPolicy}


def make_policy(name: str, weights: Mapping[str, torch.nn.Parameter], stage: int, stages: int,
                predictor: Predictor | None = None) -> WeightPolicy:
    """The policy `name` for one stage: the weights a micro-batch's forward and backward see
    when the stage's optimizer steps in between (ALGORITHMS §6-§7):

        none     forward with the current weights; backward with whatever is current then
        stash    backward with exactly the weights its forward used (PipeDream weight stashing)
        2bw      forward and backward with the version before the latest step (PipeDream-2BW)
        predict  forward with the weights predicted s steps ahead, s the steps the schedule
                 lands between the micro-batch's forward and backward on the stage (N - stage - 1
                 with one micro-batch per update), from the optimizer's own state; backward with
                 the current weights (PipeOptim)

    Weights never change in place for a forward: a policy hands the stage substitute tensors
    and `saved_tensors_hooks` choose what the backward reads; copies live per weight version
    until their last micro-batch's backward is done."""
    if name == "predict":
        return PredictPolicy(weights, stage, stages, predictor)
    return POLICIES[name](weights, stage, stages)

