"""Communication model: the default link between two stages' devices, by device pair kind."""

from __future__ import annotations

import math

import torch

from fxpipe.cost import Link

__all__ = ["default_link"]


# Defaults by device pair kind. They are rough figures for the common case, to be replaced by a
# measured ping-pong or the plan's own numbers; each says where it comes from when printed.
_DEFAULTS = {
    ("local", "same"): (0.0, math.inf),  # one process, one device: stages pass references
    ("local", "cpu-cpu"): (0.0, math.inf),  # one process, host memory: no copy either
    ("local", "cuda-cuda"): (10e-6, 10e9),  # peer copy over PCIe/NVLink, conservative
    ("local", "cpu-cuda"): (10e-6, 12e9),  # host <-> device over PCIe
    ("distributed", "cpu-cpu"): (50e-6, 2e9),  # gloo over loopback TCP
    ("distributed", "cuda-cuda"): (20e-6, 10e9),  # NCCL
    ("distributed", "cpu-cuda"): (50e-6, 2e9),
}


def default_link(src: str, dst: str, distributed: bool = False) -> Link:
    """The default link between devices `src` and `dst` (strings like 'cpu', 'cuda:1')."""
    a, b = torch.device(src), torch.device(dst)
    scope = "distributed" if distributed else "local"
    kind = "same" if not distributed and a == b else "-".join(sorted((a.type, b.type)))
    latency, bandwidth = _DEFAULTS.get((scope, kind), _DEFAULTS[(scope, "cpu-cpu")])
    return Link(latency, bandwidth, "default")
