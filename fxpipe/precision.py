"""Mixed precision: which autocast a stage runs under, from the plan's precision and its device."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Collection, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.errors import PlanError

__all__ = ["DTYPES", "PRECISIONS", "autocast", "autocast_args", "check_autocast_runs",
           "check_precision", "is_weight_cast", "weight_casts", "weight_casts_kept"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = tuple(DTYPES)
_FIX = "choose 'bf16', 'fp16' or None (full precision)"


def check_precision(precision: object, devices: Sequence[str] | None, schedule: str) -> None:
    """Plan(precision=...): a known name, on devices of a type torch.autocast runs on (whether
    this machine has them is compile's to check); fp16's loss scaling skips a step on every
    stage at once, which a schedule stepping each stage inside the run cannot."""
    if precision is None:
        return
    if isinstance(precision, torch.dtype):
        name = next((n for n, d in DTYPES.items() if d == precision), None)
        fix = f"give precision={name!r}" if name else _FIX
        raise PlanError(f"Plan(precision={precision}) takes a name, not a dtype; {fix}.")
    if precision not in PRECISIONS:
        raise PlanError(f"Plan(precision={precision!r}) is not known; {_FIX}.")
    if precision == "fp16" and schedule == "async-1f1b":
        raise PlanError("Plan(precision='fp16') scales the loss and skips the optimizer step on "
                        "every stage when any gradient overflows, but schedule='async-1f1b' "
                        "steps each stage inside the run, before the others' gradients exist; "
                        "use precision='bf16' (no loss scaling), or a synchronous schedule "
                        "such as '1f1b'.")
    for device in devices or ():
        kind = torch.device(device).type
        if not torch.amp.is_autocast_available(kind):
            raise PlanError(f"Plan(precision={precision!r}) runs each stage under "
                            f"torch.autocast, which does not run on {kind!r} devices "
                            f"({device!r}); use precision=None there, or devices such as "
                            "'cpu' or 'cuda:0'.")


def autocast_args(device: str | torch.device, precision: str | None
                  ) -> tuple[str, torch.dtype] | None:
    """(device_type, dtype) of the autocast a stage on `device` runs under, None for full
    precision: autocast is per device type, so 'cuda:1' runs under autocast('cuda')."""
    if precision is None:
        return None
    return torch.device(device).type, DTYPES[precision]


def autocast(device: str | torch.device, precision: str | None
             ) -> contextlib.AbstractContextManager:
    """The autocast context of a stage on `device` (a no-op for full precision); a loss you
    compute on the pipeline's output belongs under it too, as torch.amp recommends."""
    args = autocast_args(device, precision)
    return contextlib.nullcontext() if args is None else torch.autocast(args[0], dtype=args[1])


@contextlib.contextmanager
def weight_casts_kept() -> Iterator[None]:
    """Keep autocast's cast of each weight (a leaf that requires grad) meanwhile, on this
    thread: a stage's micro-batches then share one bf16/fp16 copy of its weights, as one
    forward over the whole batch would, instead of each holding its own until its backward.
    torch keeps its cast cache while an autocast region is open (its nesting count above 0)
    and clears it when the outermost one closes; this counts as one such region, enabling
    nothing. Clear the cache (`torch.clear_autocast_cache()`) when the weights change. The
    cache is the process's, not the thread's: another thread's clear empties it too (which
    costs a second cast, never a stale one)."""
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


class _CastRecorder(TorchDispatchMode):
    """Records the bytes of each cast of one of `weights` to a lower precision."""

    def __init__(self, weights: Collection[torch.Tensor]) -> None:
        super().__init__()
        self.weights = {id(w) for w in weights}
        self.found: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and args and id(args[0]) in self.weights
                and isinstance(out, torch.Tensor) and out.dtype in DTYPES.values()):
            self.found[id(args[0])] = out.nbytes
        return out


@contextlib.contextmanager
def weight_casts(weights: Collection[torch.Tensor]) -> Iterator[dict[int, int]]:
    """Meanwhile, the bytes of autocast's bf16/fp16 copy of each of `weights` it casts, by
    the weight's id: what its cast cache holds while a stage's step runs (`weight_casts_kept`),
    whether or not autograd saves the copy (a layer whose input needs no gradient saves it
    not)."""
    recorder = _CastRecorder(weights)
    with recorder:
        yield recorder.found


def is_weight_cast(tensor: torch.Tensor, weights: Collection[torch.Tensor]) -> bool:
    """Whether `tensor` is autocast's copy of one of `weights` (or a view of it, such as the
    transpose a linear layer saves): its autograd history is views of a cast of that leaf."""
    fn = tensor.grad_fn
    for _ in range(4):  # the views a layer takes of its weight: a transpose, a reshape
        if fn is None or len(fn.next_functions) != 1:
            return False
        source = fn.next_functions[0][0]
        if type(fn).__name__ == "ToCopyBackward0":
            leaf = getattr(source, "variable", None)  # AccumulateGrad: a leaf's
            return any(leaf is weight for weight in weights)
        fn = source
    return False


def check_autocast_runs(precision: str | None, devices: Sequence[str]) -> None:
    """Before any work: torch.autocast runs `precision` on each of the stages' `devices` on
    this machine (torch would otherwise warn and run in full precision, or fail at the first
    forward, e.g. bf16 on a GPU without it)."""
    if precision is None:
        return
    for device in dict.fromkeys(map(str, devices)):
        kind, dtype = autocast_args(device, precision)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:  # torch warns when it turns an autocast off, and raises for some devices
                torch.autocast(kind, dtype=dtype)
                problem = " ".join(str(w.message).replace("\n", " ") for w in caught)
            except RuntimeError as error:
                problem = str(error)
        if problem:
            other = "'fp16'" if precision == "bf16" else "'bf16'"
            raise PlanError(f"Plan(precision={precision!r}) cannot run on {device}: {problem} "
                            f"Use precision={other} or None, or another device.")
