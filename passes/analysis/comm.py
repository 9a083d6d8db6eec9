"""Communication model: the link between stages, by device kind, configured, or measured."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fxpipe.cost import Link

__all__ = ["default_link", "fit_link", "measure_local_link", "measure_rank_link"]


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
    return Link(latency, bandwidth, source="default")


_PROBE_BYTES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)


def fit_link(sizes: Sequence[float], seconds: Sequence[float], source: str) -> Link:
    """latency + bytes / bandwidth fitted to one-way transfer times, least squares on relative
    error (so the small messages that set the latency count as much as the big ones)."""
    seconds = np.asarray(seconds, float)
    slope, intercept = np.polyfit(np.asarray(sizes, float), seconds, 1, w=1.0 / seconds)
    bandwidth = 1.0 / slope if slope > 0 else math.inf
    return Link(max(float(intercept), 0.0), float(bandwidth), source=source)


def measure_local_link(src: str, dst: str, repeats: int = 10) -> Link:
    """Time copies from device `src` to `dst` in this process (median per size)."""
    a, b = torch.device(src), torch.device(dst)
    if a == b or {a.type, b.type} == {"cpu"}:
        return Link(0.0, math.inf, source="measured: same memory, no copy")
    seconds = []
    for size in _PROBE_BYTES:
        tensor = torch.empty(size // 4, dtype=torch.float32, device=a)
        times = []
        for _ in range(repeats):
            _synchronize(a, b)
            start = time.perf_counter()
            tensor.to(b)
            _synchronize(a, b)
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
    return fit_link(_PROBE_BYTES, seconds, f"measured {src} -> {dst}")


def measure_rank_link(peer_a: int, peer_b: int, group: Any = None, device: str = "cpu",
                      repeats: int = 10, reply_group: Any = None) -> Link | None:
    """Ping-pong between ranks `peer_a` and `peer_b` over torch.distributed (every rank of the
    group calls this; only the two peers exchange). Returns the fitted link on the two peers,
    None elsewhere. One-way time = half the round trip, median of `repeats` per size;
    `per_message`: the median time peer_a's isend call takes to hand over a small tensor.
    Messages from peer_a travel in `group`, replies in `reply_group` (default: `group`), as
    the pipeline's one-way groups carry them."""
    rank = dist.get_rank()
    if rank not in (peer_a, peer_b):
        return None
    other = peer_b if rank == peer_a else peer_a
    reply = group if reply_group is None else reply_group
    seconds, posts = [], []
    for size in _PROBE_BYTES:
        tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)
        times = []
        for _ in range(repeats + 1):  # the first exchange warms the connection up
            start = time.perf_counter()
            if rank == peer_a:
                dist.send(tensor, other, group)
                dist.recv(tensor, other, reply)
            else:
                dist.recv(tensor, other, group)
                dist.send(tensor, other, reply)
            # NCCL's recv returns once queued on the stream: wait for it to have arrived
            _synchronize(tensor.device)
            times.append((time.perf_counter() - start) / 2)
        seconds.append(statistics.median(times[1:]))
    for index in range(repeats + 1):  # the sender's own time to post a small tensor
        tensor = torch.zeros(_PROBE_BYTES[0] // 4, dtype=torch.float32, device=device)
        if rank == peer_a:
            start = time.perf_counter()
            work = dist.isend(tensor.detach().contiguous(), other, group, tag=index)
            posts.append(time.perf_counter() - start)
            work.wait()
        else:
            dist.recv(tensor, other, group, tag=index)
    shared = torch.tensor([statistics.median(posts[1:]) if posts else 0.0], dtype=torch.float64,
                          device=device)  # NCCL sends device tensors only
    if rank == peer_a:  # both peers return the same link
        dist.send(shared, other, group)
    else:
        dist.recv(shared, other, group)
    link = fit_link(_PROBE_BYTES, seconds, f"measured ping-pong rank {peer_a} <-> {peer_b}")
    return dataclasses.replace(link, per_message=float(shared))


def _synchronize(*devices: torch.device) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
