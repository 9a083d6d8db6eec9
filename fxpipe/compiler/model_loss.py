"""How a loss the model computes itself (labels=) joins over micro-batches, found by probing."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.batching import IGNORE_INDEX, ScalarJoin, split, split_sizes
from fxpipe.errors import PlanError
from fxpipe.materialize import has_meta_tensors
from fxpipe.preserve import modes_kept, preserved_state

__all__ = ["LABEL_NAMES", "PREFERENCE", "decide", "scalar_joins"]

# the order in which rules no probe could tell apart are taken: each agrees with the later
# ones on every batch without ignored labels
PREFERENCE = ("shifted", "tokens", "samples", "sum")
LABEL_NAMES = ("labels", "label", "targets", "target")  # arguments a loss's labels come as
PROBE_ROWS = 4  # of the example, which the probes run on: enough for every probe


def scalar_joins(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any],
                 positions: Sequence[int], batch: int, given_whole: set[str],
                 labels_input: tuple[str, str] | None, distributed: bool
                 ) -> dict[int, ScalarJoin]:
    """How each one-number output at `positions` of the flat model output joins over
    micro-batches: the model is run (in eval mode, without side effects) on the example and on
    its two halves, with some of the `labels` argument's entries set to IGNORE_INDEX, and the
    rule whose join of the halves gives the whole's value is kept. `given_whole`: arguments
    every micro-batch gets whole; `labels_input`: the graph input the labels argument becomes."""
    if not positions:
        return {}
    if distributed:
        raise PlanError(
            f"model output #{positions[0]} is one number (a loss the model computes, e.g. from "
            "labels=); under torchrun train with Plan(loss_fn=...) and pipe.step(x, target), "
            "passing no labels, or use micro_batches=1 and groups=1.")
    if has_meta_tensors(model):
        raise PlanError(
            f"model output #{positions[0]} is one number (a loss the model computes, e.g. from "
            "labels=); fxpipe finds how it joins over micro-batches by running the model, "
            "which a meta model cannot: use Plan(loss_fn=...) and pipe.step(x, target), or "
            "micro_batches=1.")
    rows = min(batch, PROBE_ROWS)
    bound = _first_rows(inspect.signature(model.forward).bind(*args, **kwargs), rows, batch,
                        given_whole)
    batch = rows
    name = labels_input[1] if labels_input is not None else None
    labels = _labels(bound, batch, name) if name is not None else None
    counted = () if labels is None else ("shifted", "tokens") if labels.dim() >= 2 else ("tokens",)
    rules = {p: [r for r in PREFERENCE if r in ("samples", "sum", *counted)] for p in positions}
    sizes = split_sizes(batch, 2)
    for probe in _probes(labels, sizes):
        try:
            runs = [_outputs(model, bound, probe, half, given_whole, positions, batch, name)
                    for half in (None, 0, 1)]
        except PlanError:
            raise
        except Exception:  # the model cannot take -100 labels: its loss counts no tokens
            if probe is labels:
                raise
            rules = {p: [r for r in r_ if r not in ("shifted", "tokens")]
                     for p, r_ in rules.items()}
            continue
        values = [[float(v) for v in run] for run in runs]
        pieces = None if probe is None else split([probe], 2, batch=batch)
        for i, position in enumerate(positions):
            weights = {rule: [_weight(rule, size, None if pieces is None else pieces[h][0])
                              for h, size in enumerate(sizes)] for rule in rules[position]}
            tolerance = 3e-2 if runs[0][i].dtype in (torch.float16, torch.bfloat16) else 1e-4
            rules[position] = decide(rules[position], weights, *(v[i] for v in values),
                                     tolerance)
            if not rules[position]:
                raise PlanError(
                    f"model output #{position} is one number (a loss the model computes, e.g. "
                    f"from labels=), but neither the sum nor a mean over samples or over labels "
                    "not -100 of its value on two halves of the example gives its value on the "
                    "whole, so its micro-batches' values cannot make the batch's: train with "
                    "Plan(loss_fn=...) and pipe.step(x, target) (compile(example_target=...) "
                    "times the loss), passing no labels, or use micro_batches=1.")
    return {p: ScalarJoin(r[0], labels_input[0] if r[0] in ("tokens", "shifted") else None)
            for p, r in rules.items()}


def decide(rules: Sequence[str], weights: Mapping[str, Sequence[Any]], whole: float,
           first: float, second: float, tolerance: float) -> list[str]:
    """The `rules` whose join of the halves' values (`first`, `second`, counted by `weights`)
    gives `whole` within `tolerance` of the largest (relative: a half-batch rounds otherwise,
    and rules differ by far more); all of them when `whole` is not finite, which tells
    nothing."""
    if not math.isfinite(whole):
        return list(rules)
    kept = []
    for rule in rules:
        if rule == "sum":
            joined = first + second
        else:
            a, b = (float(w) for w in weights[rule])
            joined = ((a * first if a else 0.0) + (b * second if b else 0.0)) / (a + b) \
                if a + b else math.nan
        if math.isfinite(joined) and abs(joined - whole) <= tolerance * max(
                1.0, abs(whole), abs(first) if math.isfinite(first) else 0.0,
                abs(second) if math.isfinite(second) else 0.0):
            kept.append(rule)
    return kept


def _weight(rule: str, size: int, labels: torch.Tensor | None) -> Any:
    if rule in ("samples", "sum"):
        return size
    return ScalarJoin(rule, "labels").weight({"labels": labels}, size)


def _first_rows(bound: inspect.BoundArguments, rows: int, batch: int, given_whole: set[str]
                ) -> inspect.BoundArguments:
    def cut(value: Any) -> Any:
        return value[:rows] if isinstance(value, torch.Tensor) and value.dim() and \
            value.shape[0] == batch else value
    return inspect.BoundArguments(bound.signature, {
        name: value if name in given_whole else pytree.tree_map(cut, value)
        for name, value in bound.arguments.items()})


def _labels(bound: inspect.BoundArguments, batch: int, name: str) -> torch.Tensor | None:
    """The labels argument `name`, when it is an integer tensor with a row per sample."""
    labels = bound.arguments.get(name)
    for kind, parameter in bound.signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and labels is None:
            labels = bound.arguments.get(kind, {}).get(name)
    if (isinstance(labels, torch.Tensor) and labels.dim() > 0 and labels.shape[0] == batch
            and not labels.is_floating_point() and not labels.is_complex()):
        return labels
    return None


def _probes(labels: torch.Tensor | None, sizes: Sequence[int]) -> Iterator[torch.Tensor | None]:
    """Labels that tell the rules apart: the first half's rows keep only one column (only one
    row), so a token mean counts that half by very little, a shifted one (column 0) not at all;
    then the labels as given."""
    if labels is not None:
        first = sizes[0]
        counted = labels[labels != IGNORE_INDEX]  # a kept entry is counted: a valid label
        valid = counted[0] if counted.numel() else torch.zeros((), dtype=labels.dtype)
        if labels.dim() >= 2:
            for column in range(min(labels.shape[1], 2)):
                probe = labels.clone()
                keep = probe[:first, column].clone()
                probe[:first] = IGNORE_INDEX
                probe[:first, column] = torch.where(keep == IGNORE_INDEX, valid, keep)
                yield probe
        if first >= 2:
            probe = labels.clone()
            probe[1:first] = IGNORE_INDEX
            probe[0] = torch.where(probe[0] == IGNORE_INDEX, valid, probe[0])
            yield probe
    yield labels


def _outputs(model: torch.nn.Module, bound: inspect.BoundArguments,
             labels: torch.Tensor | None, half: int | None, given_whole: set[str],
             positions: Sequence[int], batch: int, name: str | None) -> list[torch.Tensor]:
    """The model's one-number outputs at `positions`, run on the example (its first or second
    half) with `labels` in place of its labels."""
    arguments = dict(bound.arguments)
    if labels is not None:
        _replace_labels(bound.signature, arguments, labels, name)
    if half is not None:
        names = list(arguments)
        pieces = split([arguments[n] for n in names], 2,
                       whole=[i for i, n in enumerate(names) if n in given_whole], batch=batch)
        arguments = dict(zip(names, pieces[half]))
    call = inspect.BoundArguments(bound.signature, arguments)
    # in eval mode: dropout off, as the values of runs are compared
    with modes_kept(model), preserved_state(model), torch.no_grad():
        leaves = pytree.tree_leaves(model.eval()(*call.args, **call.kwargs))
    values = [leaves[p] if p < len(leaves) else None for p in positions]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in values):
        raise PlanError(
            f"model output #{positions[0]} is one number in the traced graph, but not where "
            "the model's own output has it, so fxpipe cannot find how it joins over "
            "micro-batches: use Plan(loss_fn=...) and pipe.step(x, target), or micro_batches=1.")
    return values


def _replace_labels(signature: inspect.Signature, arguments: dict[str, Any],
                    labels: torch.Tensor, name: str) -> None:
    if name in arguments:
        arguments[name] = labels
        return
    for kind, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in arguments.get(kind, {}):
            arguments[kind] = {**arguments[kind], name: labels}


