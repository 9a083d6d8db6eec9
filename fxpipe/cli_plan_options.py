"""The `fxpipe` options that set Plan's training fields: --recompute, --optimizer, --precision,
--consistency."""

from __future__ import annotations

import argparse
from typing import Any

from fxpipe.memory_spec import OPTIMIZER_SLOTS
from fxpipe.plan import CONSISTENCY_POLICIES
from fxpipe.precision import PRECISIONS

__all__ = ["add_training_options", "optimizer_option", "recompute_option", "training_fields",
           "uncapped_recompute_option"]

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_OPTIMIZERS = ("adam", "sgd", "sgd-momentum")  # the common ones; Plan knows a few more


def recompute_option(text: str) -> bool | str | tuple[bool, ...]:
    """An argparse type for Plan(recompute=...): true, false, auto, or one boolean per stage
    separated by commas, such as 1,0,0,1."""
    word = text.strip().lower()
    if word == "auto":
        return word
    if "," not in word and word in _TRUE + _FALSE:
        return word in _TRUE
    flags = [part.strip() for part in word.split(",")]
    if "," in word and all(flag in _TRUE + _FALSE for flag in flags):
        return tuple(flag in _TRUE for flag in flags)
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a recompute choice; give true (every stage), false (none), auto "
        "(the stages a memory cap needs), or one true/false per stage such as 1,0,0,1")


def uncapped_recompute_option(text: str) -> bool | tuple[bool, ...]:
    """recompute_option for a command without a memory cap, where auto would recompute
    nothing."""
    value = recompute_option(text)
    if value == "auto":
        raise argparse.ArgumentTypeError(
            "auto recomputes only the stages a memory cap needs, and this command takes no "
            "memory cap, so it would recompute nothing; give true, false, or one per stage "
            "such as 1,0")
    return value


def optimizer_option(text: str) -> str | int:
    """An argparse type for Plan(optimizer=...): an optimizer's name, or the number of
    weight-sized state tensors it keeps per parameter."""
    word = text.strip().lower()
    if word in OPTIMIZER_SLOTS:
        return word
    if word.isdigit():  # digits only: a whole number of slots, 0 or more
        return int(word)
    raise argparse.ArgumentTypeError(
        f"{text!r} is not an optimizer fxpipe knows; give {', '.join(_OPTIMIZERS)} (or "
        f"{', '.join(k for k in OPTIMIZER_SLOTS if k not in _OPTIMIZERS)}), or the number of "
        "weight-sized state tensors it keeps per parameter, e.g. 2 for Adam")


def add_training_options(command: argparse.ArgumentParser, optimizer: bool = True,
                         capped: bool = True) -> None:
    """Add --recompute, --precision and, for a command that only plans (`optimizer`: it does
    not pick its own optimizer or schedule), --optimizer and --consistency, each defaulting
    to Plan's own default; `capped`: the command takes a memory cap (else --recompute
    refuses auto)."""
    command.add_argument("--recompute", default=False,
                         type=recompute_option if capped else uncapped_recompute_option,
                         help="recompute each stage's forward in its backward to save memory: "
                              "true, false, " + ("auto (only the stages a memory cap needs), "
                                                 if capped else "") + "or one per stage such "
                              "as 1,0")
    command.add_argument("--precision", choices=PRECISIONS,
                         help="run the stages under torch.autocast in this dtype (default: "
                              "full precision)")
    if optimizer:
        command.add_argument("--optimizer", type=optimizer_option,
                             help=f"the optimizer whose state the memory model counts: "
                                  f"{', '.join(_OPTIMIZERS)}, or its state tensors per "
                                  "parameter (default: adam, as Plan's)")
        command.add_argument("--consistency", choices=CONSISTENCY_POLICIES, default="none",
                             help="with --schedule async-1f1b, the weight versions each stage "
                                  "keeps, whose copies the memory model counts (default: none, "
                                  "as Plan's)")


def training_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The Plan fields the options of add_training_options set."""
    fields = {"recompute": args.recompute, "precision": args.precision}
    if "optimizer" in args:
        fields["optimizer"] = args.optimizer
        fields["consistency"] = args.consistency
    return fields
