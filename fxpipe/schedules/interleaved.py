"""Schedules with several stages per device: interleaved 1F1B, looped BFS, ZB-V, DualPipeV."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from fxpipe.schedules.actions import Action, ActionKind, B, F, Schedule, W, _positive

__all__ = ["VIRTUAL_SCHEDULES", "dualpipev", "interleaved_one_f_one_b", "looped_bfs", "round_robin",
           "v_shape", "zbv"]


def round_robin(stages: int, devices: int) -> tuple[int, ...]:
    """Stage s on device s % N: each device holds every N-th stage (Megatron's model chunks)."""
    return tuple(s % devices for s in range(stages))


def interleaved_one_f_one_b(stages: int, micro_batches: int, *, devices: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, §2.2): S = N*v stages round-robin on
    N devices (v model chunks each). Device r counts its forwards k = 0..v*p-1 through the
    chunks in groups of N micro-batches (chunk (k // N) % v, micro-batch (k // (N*v))*N + k % N),
    its backwards the same way with the chunks reversed; it warms up with (N-r-1)*2 + (v-1)*N
    forwards (N-r-1 for v = 1, which is 1F1B), then alternates a forward and a backward, then
    drains the backwards. Needs p a multiple of N for v >= 2, like Megatron."""
    n, v, p = _shape(stages, micro_batches, devices)
    if v > 1 and p % n:
        near = " or ".join(str(c) for c in sorted({p - p % n, p - p % n + n}) if c)
        raise ValueError(f"interleaved-1f1b runs micro-batches through the model chunks in groups "
                         f"of one per device, so micro_batches={p} must be a multiple of "
                         f"devices={n}; use {near}")
    total = v * p

    def action(rank: int, k: int, kind: ActionKind) -> Action:
        chunk = (k // n) % v
        if kind is B:
            chunk = v - 1 - chunk
        return Action(chunk * n + rank, kind, (k // (n * v)) * n + k % n)

    programs = []
    for r in range(n):
        warmup = min((n - r - 1) * (2 if v > 1 else 1) + (v - 1) * n, total)
        order = [action(r, k, F) for k in range(warmup)]
        for k in range(total - warmup):
            order += [action(r, k + warmup, F), action(r, k, B)]
        programs.append(order + [action(r, k, B) for k in range(total - warmup, total)])
    return _from_programs("interleaved-1f1b", n * v, p, round_robin(n * v, n), programs)


def looped_bfs(stages: int, micro_batches: int, *, devices: int) -> Schedule:
    """Looped breadth-first (Lamy-Poirier 2022): S = N*v stages round-robin on N devices; each
    device runs every micro-batch's forward through its stages in increasing order, then every
    backward through them in decreasing order, each stage's backwards in reverse micro-batch
    order (GPipe on each stage; v = 1 is GPipe)."""
    n, v, p = _shape(stages, micro_batches, devices)
    programs = []
    for r in range(n):
        local = range(r, n * v, n)
        programs.append([Action(s, F, m) for s in local for m in range(p)]
                        + [Action(s, B, m) for s in reversed(local) for m in reversed(range(p))])
    return _from_programs("looped-bfs", n * v, p, round_robin(n * v, n), programs)


def v_shape(stages: int) -> tuple[int, ...]:
    """Stage s on device s for s < N, on device 2N-1-s after: the model runs down the devices
    and back up, so device N-1 holds stages N-1 and N and device 0 the first and the last."""
    half = stages // 2
    return tuple(s if s < half else stages - 1 - s for s in range(stages))


def zbv(stages: int, micro_batches: int, *, devices: int | None = None) -> Schedule:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §6): 2N stages placed in a
    V (`v_shape`) on N devices, each backward split into B (input gradient) and W (weight
    gradient), W filling what would be bubbles. Device r holds the descending stage r and the
    ascending stage 2N-1-r; it warms up with 2(N-r)-1 forwards down, then r pairs (F up, F
    down), then N-r triples (F, B, W up); in the steady state it runs (F, B, W) down then up;
    it cools down with r pairs (B down, B up), N-r pairs (B, W down) and the remaining Ws, up
    first. The phases are laid out for max(p, 2N-1) micro-batches and the ones past p dropped,
    as PyTorch's ScheduleZBVZeroBubble does. With equal F, B and W times t, free links and
    p >= 2N-1, a device idles only until micro-batch 0 reaches it: the step takes (6p + N-1)t."""
    s, p, n = _v_shape("zbv", stages, micro_batches, devices)
    programs = [_zbv_program(r, n, p) for r in range(n)]
    return _from_programs("zbv", s, p, v_shape(s), programs)


def _zbv_program(r: int, n: int, p: int) -> list[Action]:
    """Device r's ZB-V program, laid out for max(p, 2N-1) micro-batches (enough to fill the
    pipeline) and kept to the first p."""
    down, up, q = r, 2 * n - 1 - r, max(p, 2 * n - 1)
    count: dict[tuple[int, ActionKind], int] = defaultdict(int)  # next micro-batch per stage, kind
    order: list[Action] = []

    def run(stage: int, *kinds: ActionKind) -> None:
        for kind in kinds:
            m = count[stage, kind]
            count[stage, kind] += 1
            if m < p:
                order.append(Action(stage, kind, m))

    run(down, *[F] * (2 * (n - r) - 1))
    for _ in range(r):
        run(up, F), run(down, F)
    for _ in range(n - r):
        run(up, F, B, W)
    while count[up, F] < count[down, F] or count[down, F] < q:
        if count[down, F] < q:
            run(down, F)
        run(down, B, W), run(up, F, B, W)
    for _ in range(r):
        run(down, B), run(up, B)
    for _ in range(n - r):
        run(down, B, W)
    run(up, *[W] * (count[up, B] - count[up, W]))
    run(down, *[W] * (count[down, B] - count[down, W]))
    return order


def dualpipev(stages: int, micro_batches: int, *, devices: int | None = None) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe "cut in half", DeepSeek-V3 report and its DualPipe
    repository; PyTorch's ScheduleDualPipeV): 2N stages in a V (`v_shape`) on N devices,
    device r holding the descending stage r and the ascending stage 2N-1-r. Device r warms up
    with 2(N-r-1) forwards down, r+1 pairs (F down, F up) and N-r-1 triples (B, W, F up);
    in the steady state it runs a forward of one stage with a whole backward of the other,
    (F down, B up) then (F up, B down); it cools down with N-r-1 triples (B up, F up, B down),
    r+1 pairs (B up, B down) and N-r-1 pairs (W, B down), then its remaining Ws. From the
    middle of the (B up, B down) pairs on (from the down stage's B for even r), backwards are
    split into B and W, every W taken oldest first; the steady state's are whole.

    DualPipe overlaps each (F, B) pair of different stages; one worker per device runs the
    pair as F then B, as PyTorch's runtime unrolls its OVERLAP_F_B. Needs micro_batches >=
    stages (2N), like PyTorch. Stage s holds at most 2N - s micro-batches from F to B or W,
    1F1B's on 2N stages, so a device holds 2N + 1: DualPipeV's PP + 1 for PP = 2N stages."""
    s, p, n = _v_shape("dualpipev", stages, micro_batches, devices)
    if p < s:
        raise ValueError(f"dualpipev fills both arms of the V before its steady state, so it "
                         f"needs micro_batches >= stages: give micro_batches >= {s}, not {p}")
    return _from_programs("dualpipev", s, p, v_shape(s),
                          [_dualpipev_program(r, n, p) for r in range(n)])


def _dualpipev_program(r: int, n: int, p: int) -> list[Action]:
    """Device r's DualPipeV program, phase by phase."""
    down, up = r, 2 * n - 1 - r
    count: dict[tuple[int, ActionKind], int] = defaultdict(int)  # next micro-batch per stage, kind
    pending: list[Action] = []  # Ws of split backwards, oldest first
    order: list[Action] = []

    def run(stage: int, kind: ActionKind, split: bool = False) -> None:
        m = count[stage, kind]
        count[stage, kind] += 1
        order.append(Action(stage, kind, m))
        if split:
            pending.append(Action(stage, W, m))

    def weight() -> None:
        if pending:
            order.append(pending.pop(0))

    for _ in range(2 * (n - r - 1)):
        run(down, F)
    for _ in range(r + 1):
        run(down, F), run(up, F)
    for _ in range(n - r - 1):
        run(up, B, split=True), weight(), run(up, F)
    for _ in range(p - 2 * n + r + 1):
        run(down, F), run(up, B), run(up, F), run(down, B)
    for _ in range(n - r - 1):
        run(up, B), run(up, F), run(down, B)
    half = (r + 1) // 2  # the pair where splitting starts: at its up B for odd r, down B for even
    for i in range(r + 1):
        run(up, B, split=i > half or (i == half and r % 2 == 1))
        run(down, B, split=i >= half)
    for _ in range(n - r - 1):
        weight(), run(down, B, split=True)
    while pending:
        weight()
    return order


def _v_shape(name: str, stages: int, micro_batches: int,
             devices: int | None) -> tuple[int, int, int]:
    """(stages, p micro-batches, N devices) of a V schedule, checked: two stages per device."""
    s, p = _positive("stages", stages), _positive("micro_batches", micro_batches)
    if s % 2:
        raise ValueError(f"{name} places two stages on each device, so stages={s} must be even")
    n = s // 2
    if devices is not None and devices != n:
        raise ValueError(f"{name} places two stages on each device: {s} stages need devices={n}, "
                         f"not {devices}; use {2 * devices} stages for {devices} devices")
    return s, p, n


def _shape(stages: int, micro_batches: int, devices: int) -> tuple[int, int, int]:
    """(N devices, v stages per device, p micro-batches), checked."""
    s, p = _positive("stages", stages), _positive("micro_batches", micro_batches)
    n = _positive("devices", devices)
    if s % n:
        raise ValueError(f"stages={s} do not split evenly over devices={n}: give a multiple of "
                         f"{n} stages ({n} x v for v stages per device)")
    return n, s // n, p


def _from_programs(name: str, stages: int, micro_batches: int, placement: tuple[int, ...],
                   programs: list[list[Action]]) -> Schedule:
    """The schedule whose stage lists are the programs' actions of each stage, in order."""
    lists: list[list[Action]] = [[] for _ in range(stages)]
    for program in programs:
        for a in program:
            lists[a.stage].append(a)
    return Schedule(name, stages, micro_batches, lists, placement=placement, programs=programs)


VIRTUAL_SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "interleaved-1f1b": interleaved_one_f_one_b,
    "looped-bfs": looped_bfs,
    "zbv": zbv,
    "dualpipev": dualpipev,
}
