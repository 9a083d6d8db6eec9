"""Plan(intra_layer=...): the split-and-merge specification, checked and filled in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fxpipe.errors import PlanError

__all__ = ["intra_layer_spec"]


def intra_layer_spec(spec: Any, stages: int, costs: str) -> dict[str, Any]:
    """`intra_layer=n`: split each Conv/Linear layer above 30% of its stage's time into n
    channel shards on the stage's device; or a dict with "shards", "threshold" (share of
    the stage's time), "layers" (names, instead of a threshold) and "devices" (per stage,
    one device per shard)."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = {"shards": spec}
    if not isinstance(spec, Mapping):
        raise PlanError(f"Plan(intra_layer={spec!r}) must be a shard count such as 2, or a "
                        "dict like {'shards': 2, 'threshold': 0.3}.")
    unknown = set(spec) - {"shards", "threshold", "layers", "devices"}
    if unknown:
        raise PlanError(f"Plan(intra_layer=...) has unknown keys {sorted(unknown)}; use "
                        "shards, threshold, layers and devices.")
    devices = spec.get("devices")
    if devices is not None:
        devices = [list(d) for d in devices]
        if len(devices) != stages:
            raise PlanError(f"Plan(intra_layer={{'devices': ...}}) gives {len(devices)} "
                            f"device lists for stages={stages}; give one list (one "
                            "device per shard) per stage.")
    shards = spec.get("shards", len(devices[0]) if devices else 2)
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 2:
        raise PlanError(f"Plan(intra_layer=...) asks for {shards!r} shards; splitting a "
                        "layer needs at least 2.")
    if devices is not None and any(len(d) != shards for d in devices):
        raise PlanError(f"Plan(intra_layer=...): every stage's device list must name one "
                        f"device per shard ({shards}).")
    threshold = spec.get("threshold", 0.3)
    if not isinstance(threshold, (int, float)) or not 0 < threshold < 1:
        raise PlanError(f"Plan(intra_layer={{'threshold': {threshold!r}}}) must be a share "
                        "of the stage's time between 0 and 1, e.g. 0.3.")
    layers = spec.get("layers")
    if isinstance(layers, str):
        layers = [layers]
    if layers is not None and not all(isinstance(n, str) for n in layers):
        raise PlanError("Plan(intra_layer={'layers': [...]}) takes layer names such as "
                        "'features.3'.")
    if costs == "none" and layers is None:
        raise PlanError("Plan(intra_layer=...) picks layers by their measured share of the "
                        "stage's time, but costs='none'; name them with "
                        "{'layers': [...]} or measure costs.")
    return {"shards": shards, "threshold": float(threshold),
            "layers": list(layers) if layers is not None else None, "devices": devices}
