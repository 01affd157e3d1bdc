"""Policy.hits, a token's all-hit layer calls at once (Residency.hit_calls, and the deferred
hits that Residency.catch_up finds one after the other), leaves every policy exactly as the
calls' updates one at a time do: the same arrays (equal, not close), the same counters,
hence the same victims and evictions."""

import copy

import numpy as np
import pytest

from mlxmoe.caching.cache import Residency
from mlxmoe.caching.baselines import Policy
from mlxmoe.caching.default import Activation, VictimIndex
from mlxmoe.caching.policies import ONLINE, make_policy
from mlxmoe.errors import MlxmoeError


def same(a, b, path, seen):
    """a and b hold equal state: arrays of one dtype and equal elements, containers in the same order."""
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            same(a[key], b[key], f"{path}[{key!r}]", seen)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]", seen)
    elif hasattr(a, "__dict__") and not callable(a):  # a policy's parts (NextUse, VictimIndex, ...)
        assert type(a) is type(b), path
        if id(a) not in seen:
            seen.add(id(a))
            same(vars(a), vars(b), path, seen)
    else:
        assert a == b, path


def victim(policy):
    try:
        return copy.deepcopy(policy).victim(set())
    except MlxmoeError:
        return None


def workload(seed, L, E, tokens, mode, k_at=lambda t: 2):
    """Events for both runs: ticks, layer calls (skewed routing: many all-hit tokens), now
    and then a prefill-like call of 3 tokens, claims, a key leaving, each token's end."""
    rng = np.random.default_rng(seed)
    heat = 1.0 / np.arange(1, E + 1) ** 1.5
    orders = [rng.permutation(E) for _ in range(L)]  # each layer its own hot experts
    events = []
    for t in range(tokens):
        n = 3 if t % 25 == 10 else 1
        events.append(("tick", n))
        for layer, order in enumerate(orders):
            picked = {int(order[e]) for _ in range(n)
                      for e in rng.choice(E, size=k_at(t), replace=False, p=heat / heat.sum())}
            experts = sorted(picked)
            probs = rng.dirichlet(np.ones(E) * 0.3)
            call_mode = rng.choice(["probs", "none"]) if mode == "mixed" else mode
            scores = None if call_mode == "none" else probs[experts].tolist()
            p = {"probs": probs, "probs32": probs.astype(np.float32)}.get(call_mode)
            events.append(("call", layer, experts, scores, p))
            if t % 4 == 1 and layer == 1:
                claim = [(L - 1, int(e)) for e in rng.choice(E, size=3, replace=False)]
                events.append(("claim", claim, {(layer, e) for e in experts}))
        if t % 30 == 17:
            events.append(("release",))
        events.append(("end",))
    return events


def run(name, events, L, E, capacity, mode):
    """Apply `events`; yield at each token's end. `mode` "hit_calls": the all-hit calls of a
    token go to hit_calls in runs (up to the next miss, claim, key leaving or tick);
    "deferred": each call to access(), its hits left for catch_up; "one": each call's
    updates at once (nothing deferred)."""
    batched = mode == "hit_calls"
    r = Residency(capacity, make_policy(name, capacity, L, E), defer_hits=mode != "one")
    log, pending = [], []
    r.evicted = lambda key: log.append(("evicted", key))

    def flush():
        if pending:
            r.hit_calls(list(pending))
            pending.clear()

    for event in events:
        kind = event[0]
        if kind == "call":
            _, layer, experts, scores, probs = event
            if batched and all((layer, e) in r.slot_of for e in experts):
                pending.append((layer, experts, scores, probs))
                r.counters.hits += len(experts)
                log.append(("access", tuple(r.slot_of[(layer, e)] for e in experts), ()))
                continue
            flush()
            slots, missed = r.access(layer, experts, scores, probs)
            log.append(("access", tuple(slots), tuple(missed)))
            continue
        flush()
        if kind == "tick":
            r.tick(event[1])
        elif kind == "claim":
            log.append(("claim", tuple(r.claim(event[1], event[2], evict=True))))
        elif kind == "release" and r.slot_of:
            r.free.append(r._release(sorted(r.slot_of)[0]))
        elif kind == "end":
            r.catch_up()
            yield r, log


def compare(name, events, L, E, capacity, modes=("deferred", "hit_calls")):
    """The runs of `modes` against the run of one update at a time, token by token."""
    tokens = 0
    runs = [run(name, events, L, E, capacity, mode) for mode in ("one", *modes)]
    for (a, log_a), *others in zip(*runs):
        for b, log_b in others:
            assert log_a == log_b, name
            assert (a.slot_of, a.free, a.counters.hits, a.counters.misses, a.counters.evictions) == \
                   (b.slot_of, b.free, b.counters.hits, b.counters.misses, b.counters.evictions)
            same(a.policy, b.policy, name, set())
            assert victim(a.policy) == victim(b.policy)
        tokens += 1
    return tokens


@pytest.fixture
def vectorised(monkeypatch):
    """How many batches the default did in numpy (True), how many by the loop (False)."""
    taken = {True: 0, False: 0}
    for cls, how, done in ((VictimIndex, "visited_calls", True), (Policy, "hits", False)):
        def counted(self, *args, _f=getattr(cls, how), _done=done):
            taken[_done] += isinstance(self, (VictimIndex, Activation))
            return _f(self, *args)
        monkeypatch.setattr(cls, how, counted)
    return taken


@pytest.mark.parametrize("mode", ["probs", "probs32", "scores", "none", "mixed"])
@pytest.mark.parametrize("name", ONLINE)
def test_batched_hits_leave_the_same_state(name, mode, vectorised):
    L, E = 4, 16
    events = workload(1, L, E, 120, mode, k_at=lambda t: 2 if t < 60 else 3)  # top_k changes mid-run
    assert compare(name, events, L, E, capacity=24) == 120
    if name.startswith("activation") and mode != "mixed":
        assert vectorised[True] > 20  # many batches in numpy (the first ones raise top_k; prefills and runs of 1-2 loop)
    elif name.startswith("activation"):
        assert vectorised[False] > 0  # calls known unalike: the loop


@pytest.mark.parametrize("name", ["activation", "activation-floor"])
def test_a_top_k_change_and_a_floor_update_inside_a_batch(name, vectorised):
    """Everything resident: every token one batch; top_k rises from 1 to 2 in the first and
    from 2 to 4 at token 5 (activation-floor's floor moves then), those batches by the loop."""
    L, E = 4, 8
    events = [("claim", [(l, e) for l in range(L) for e in range(E)], set())]
    events += workload(2, L, E, 10, "probs", k_at=lambda t: 2 if t < 5 else 4)
    runs = run(name, events, L, E, L * E, "hit_calls")
    floors = []
    for t, (r, _) in enumerate(runs):
        assert r.counters.misses == 0
        assert r.policy.estimate.top_k == (2 if t < 5 else 4)
        floors.append(r.policy.floor.floor if r.policy.floor else None)
    if name == "activation-floor":
        assert floors[4] != floors[5]
    assert compare(name, events, L, E, L * E) == 10
    assert vectorised[False] >= 4 and vectorised[True] >= 10  # (both runs: the 2 changes loop)


def test_a_layer_twice_in_a_batch_is_done_in_turn(vectorised):
    """Calls of one layer twice (not a token's, yet allowed) go by the loop."""
    L, E = 2, 8
    events = [("claim", [(l, e) for l in range(L) for e in range(E)], set()),
              ("tick", 1), ("call", 0, [0, 1], [0.5, 0.5], None), ("end",),  # top_k 2
              ("tick", 1), ("call", 0, [1, 2], [0.5, 0.5], None), ("call", 1, [3, 4], [0.6, 0.4], None),
              ("call", 0, [1, 5], [0.7, 0.3], None), ("end",)]
    assert compare("activation-floor", events, L, E, L * E) == 2
    assert vectorised == {True: 0, False: 4}  # (two in each batching run: the first raises top_k)


def test_without_deferring_the_hits_are_told_at_once():
    r = Residency(4, make_policy("activation-floor", 4, 2, 4))
    r.claim([(0, 0), (1, 1)])
    r.tick(1)
    r.hit_calls([(0, [0], [1.0], None), (1, [1], [1.0], None)])
    assert not r.deferred and r.policy.estimate.visits == 2
