"""The profile cache: unit timings on disk, keyed on everything that changes a timing."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import platform
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

__all__ = ["STALE", "ProfileCache", "UnitProfile", "cache_key", "default_cache_dir",
           "describe_key"]

_FORMAT = 17  # bump when the cached record changes (or how it is measured)
# a cached profile is measured afresh when a short re-time of its units is off its times by
# more than this factor either way: a second CPU-bound job on a 2-core machine doubles a
# timing, which must not discard a good entry; a profile taken under other conditions the key
# cannot see (a loaded machine, another power mode) is off by far more
STALE = 3.0


@dataclasses.dataclass(frozen=True, eq=False)
class UnitProfile:
    """Measurements per (micro-batch size, unit); times in seconds, sizes in bytes."""

    sizes: tuple[int, ...]  # micro-batch sizes measured, ascending
    forward: np.ndarray  # (M, K)
    backward: np.ndarray  # (M, K)
    boundary_bytes: np.ndarray  # (M, K): values crossing the cut after unit i
    boundary_grad_bytes: np.ndarray  # (M, K): their gradients (floating values only)
    # (M, K): what autograd saves for backward, each storage counted once, in the unit that
    # made it (a value saved by the unit after the one that made it counts in its maker)
    activation_bytes: np.ndarray
    boundary_saved_bytes: np.ndarray  # (M, K): the part of boundary_bytes autograd saves
    output_bytes: np.ndarray  # (M,): the model's outputs (what the loss takes)
    device: str
    cached: pathlib.Path | None = None  # the cache file it was read from, if it was
    origin: str = ""  # where the times come from, in words: measured now, or which cache entry
    # (M, K): autocast's bf16/fp16 copies of the unit's weights (0 in full precision)
    weight_cast_bytes: np.ndarray | None = None
    # (M, K): the gradients of the values crossing the cut after unit i in their own dtypes,
    # as a backward within a stage holds them (boundary_grad_bytes: as they travel)
    inner_grad_bytes: np.ndarray | None = None
    # (M, K, K): bytes of the values unit m makes and unit r reads last (r > m)
    lifetime_bytes: np.ndarray | None = None

    def to_json(self) -> dict[str, Any]:
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in arrays.items()
                if k not in ("cached", "origin")}

    @classmethod
    def from_json(cls, data: dict[str, Any], path: pathlib.Path) -> UnitProfile:
        fields = {f.name for f in dataclasses.fields(cls)} - {"cached", "origin", "sizes",
                                                               "device"}
        arrays = {k: None if data.get(k) is None else np.asarray(data[k], dtype=np.float64)
                  for k in fields}
        return cls(tuple(data["sizes"]), device=data["device"], cached=path, **arrays)


def default_cache_dir() -> pathlib.Path:
    """~/.cache/fxpipe/profiles (or under $XDG_CACHE_HOME)."""
    root = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(root) / "fxpipe" / "profiles"


@dataclasses.dataclass(frozen=True)
class ProfileCache:
    """Profiles on disk, one JSON file per key."""

    directory: pathlib.Path

    def get(self, key: str) -> UnitProfile | None:
        path = self.directory / f"{key}.json"
        try:
            return UnitProfile.from_json(json.loads(path.read_text()), path)
        except (OSError, ValueError, KeyError):
            return None

    def put(self, key: str, profile: UnitProfile) -> str:
        """Where the profile went, in words (an unwritable cache only costs a re-measurement
        next time, so it is said, not raised)."""
        path = self.directory / f"{key}.json"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(profile.to_json()))
            tmp.replace(path)
        except OSError as error:
            return f"not cached: {error}"
        return f"cached at {path}"


def cache_key(graph, flat_inputs, sizes, device, warmup, repeats, min_time, whole,
              runs, precision=None) -> tuple[str, dict[str, Any]]:
    """What the timings depend on, hashed, and unhashed: the stages' code, the tensors' shapes
    and dtypes, train or eval mode, the micro-batch sizes, the device, this machine and the
    CPUs this process may use, torch and its settings, how the units were timed, and the
    precision they ran in (Plan(precision): an autocast dtype, or None)."""
    stages = [m for name, m in graph.named_children() if name.startswith("stage")]
    cuda = torch.device(device).type == "cuda"
    signature = {
        "format": _FORMAT, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": [platform.node(), platform.machine(), platform.processor(), os.cpu_count()],
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "flags": [torch.backends.mkldnn.enabled, torch.get_float32_matmul_precision(),
                  torch.are_deterministic_algorithms_enabled()],
        "device": device, "sizes": sizes, "warmup": warmup, "repeats": repeats,
        "min_time": min_time, "whole": list(whole), "precision": precision,
        "runs": [(r.start, r.stop) for r in runs] if runs is not None else None,
        "code": [stage.module.code for stage in stages],
        "training": [m.training for m in graph.modules()],
        "state": [(n, list(t.shape), str(t.dtype), t.requires_grad)
                  for n, t in [*graph.named_parameters(), *graph.named_buffers()]],
        "inputs": [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x)
                   for x in pytree.tree_leaves(list(flat_inputs))],
    }
    key = hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:32]
    return key, signature


def describe_key(signature: Mapping[str, Any]) -> str:
    """The key's main parts in words: device, host, threads, dtypes, sizes, torch."""
    dtypes = {s[2] for s in signature["state"]} | {
        i[1] for i in signature["inputs"] if isinstance(i, list)}
    threads = signature["threads"]
    autocast = f" under {signature['precision']} autocast" if signature.get("precision") else ""
    return (f"{signature['device']} on {signature['machine'][0]}, {threads} thread"
            f"{'s' * (threads != 1)}, "
            f"{'/'.join(d.removeprefix('torch.') for d in sorted(dtypes))}{autocast}, "
            f"micro-batch sizes {list(signature['sizes'])}, torch {signature['torch']}")
