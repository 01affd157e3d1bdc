"""Predicted hit rate vs cache size: an LRU stack-distance simulator, replays of the
other policies on a recorded trace, reading a curve at a cache size, and what a memory
budget buys read off a profile."""

import numpy as np

from ..budget import parse_size
from ..caching.policies import ONLINE
from .trace import replay, steps


def lru_curve(steps_keys, sizes):
    """Hit rate of the runtime's LRU cache of each size in `sizes` on an access sequence
    given as steps (the distinct keys of one layer call each), from one pass of stack
    distances (a Fenwick tree over last-access positions). A step's keys count as
    accessed together, as the cache protects them from each other."""
    n = sum(len(step) for step in steps_keys)
    tree = [0] * (n + 1)

    def add(i, v):
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i):  # sum over positions [0, i)
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    last = {}
    distances = []
    pos = 0
    for step in steps_keys:
        start = prefix(pos)
        for key in step:
            if key in last:  # distinct keys touched since, before this step
                distances.append(start - prefix(last[key] + 1))
        for key in step:
            if key in last:
                add(last[key], -1)
            add(pos, 1)
            last[key] = pos
            pos += 1
    distances = np.sort(np.asarray(distances, dtype=np.int64))
    return [(int(c), float(np.searchsorted(distances, c, side="left")) / n if n else 0.0) for c in sizes]


CURVE_SHARES = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0)


def curve_at(points, experts):
    """A policy's predicted hit rate at a cache of `experts` experts, read off its curve
    ([[experts, hit rate], ...] by size) by linear interpolation; None outside it."""
    for c, r in points:
        if c == experts:
            return r
    for (c0, r0), (c1, r1) in zip(points, points[1:]):
        if c0 < experts < c1:
            return r0 + (r1 - r0) * (experts - c0) / (c1 - c0)
    return None


def predicted_curve(header, records, policies=None, shares=CURVE_SHARES):
    """Hit rate vs cache size (experts) on a recorded access sequence for each online
    policy (default: all): LRU from one pass of stack distances, the others by replay."""
    policies = ONLINE if policies is None else policies

    total = header["num_layers"] * header["num_experts"]
    k = max((len(set(r[3])) for r in records), default=1)
    sizes = sorted({max(k, int(round(total * s))) for s in shares})
    keys = [[(l, x) for x in experts] for _, l, experts, *_ in steps(records, header["num_layers"])]
    widest = max((len(step) for step in keys), default=0)
    curve = {}
    for name in policies:
        if name == "lru":
            # a cache smaller than a layer call's experts (a prefill) splits the call into runs
            # that fit it, which the stack distances of whole calls do not see: replay those sizes
            curve[name] = lru_curve(keys, [c for c in sizes if c >= widest]) + [
                (c, replay(header, records, name, c)["hit_rate"]) for c in sizes if c < widest]
            curve[name].sort()
        else:
            curve[name] = [(c, replay(header, records, name, c)["hit_rate"]) for c in sizes]
    return {name: [[c, round(r, 4)] for c, r in points] for name, points in curve.items()}


def profile_budget(profile, memory_budget):
    """What `memory_budget` buys on the model a profile was recorded on, by the sizes the
    profile holds (api.profile_sizes): {"budget", "cache_experts", "predicted_hit_rate" (each
    policy's, read off the profile's curve)}; None where the profile does not hold the
    expert size (one built from routing alone)."""
    if not profile.expert_bytes:
        return None
    free = parse_size(memory_budget, "budget") - (profile.resident_bytes or 0)
    c = min(max(0, free // profile.expert_bytes), profile.num_layers * profile.num_experts)
    predicted = {name: curve_at(points, c) for name, points in profile.curve.items()}
    return {"budget": memory_budget, "cache_experts": c,
            "predicted_hit_rate": {n: round(r, 4) for n, r in predicted.items() if r is not None}}
