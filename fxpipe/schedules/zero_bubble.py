"""Zero-bubble schedules: the backward split into B (input gradient) and W (weight gradient)."""

from __future__ import annotations

from fxpipe.schedules.actions import Action, B, F, Schedule, W, _positive

__all__ = ["zb_h1"]


def zb_h1(stages: int, micro_batches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each
    backward split into B, which computes the input gradient the previous stage waits for, and
    W, the weight gradient, which nothing waits for and so may run later.

    Stage s of N runs 1F1B's min(N-s-1, p) warm-up forwards, then F and B in turn, adding the
    oldest pending W after each pair from the (s+1)-th pair on; in the cool-down each B is
    followed by one W, and the W still pending close the list. Deferring W by s pairs lets the
    later stages send gradients back early (their B no longer waits behind a W), and the
    deferred W fill the cool-down's idle time. Every stage holds at most min(N, p)
    micro-batches from F to W, 1F1B's peak (its first stage's). With F, B and W each taking
    one unit and p >= N, the step takes 3p + N - 1 units against 1F1B's 3(p + N - 1): a third
    of 1F1B's bubble.
    """
    n, p = _positive("stages", stages), _positive("micro_batches", micro_batches)
    lists = []
    for s in range(n):
        warmup = min(n - s - 1, p)
        actions = [Action(s, F, m) for m in range(warmup)]
        weights = 0  # W done so far, oldest micro-batch first
        for m in range(p - warmup):  # steady state: F of a new micro-batch, B of the oldest
            actions += [Action(s, F, m + warmup), Action(s, B, m)]
            if m >= s:
                actions.append(Action(s, W, weights))
                weights += 1
        for m in range(p - warmup, p):  # cool-down: the remaining B, each followed by a W
            actions += [Action(s, B, m), Action(s, W, weights)]
            weights += 1
        actions += [Action(s, W, m) for m in range(weights, p)]
        lists.append(actions)
    return Schedule("zb-h1", n, p, lists)
