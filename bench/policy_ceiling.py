"""How far can an online policy go on the synthetic traces? An oracle that knows the
generator's hidden state (both AR(1) processes behind every expert's logit, see
bench/traces.py) computes, by Monte Carlo, each expert's chance of being in its layer's
top-k at the next token (p1) and in the long run (p_inf, the fast process forgotten),
and evicts the expert with the largest expected time to next use, d + L(1 - p1)/p_inf
layer steps ("expected-time"), or d + L(1/p1 - 1) (next-visit only, the rule
`activation` uses with its own estimates). Printed beside LRU, `activation` and Belady.

With --traces (recorded mlxmoe.trace/1 files, e.g. the demo model's in bench/out), there
is no hidden state to know; the oracle there knows exactly which experts each layer uses
at its next visit (p1 = 1 or 0), or at its next m visits (--visits), and keeps
`activation`'s own long-run rates for the rest: no online policy predicts the next
token's routing that well, let alone the routing of the tokens after it.

    python bench/policy_ceiling.py [--seed 0] [--tokens 800] [--layers 16]
    python bench/policy_ceiling.py --traces bench/out/demo-*.trace.jsonl [--visits 1,2,4]
    python bench/policy_ceiling.py --traces bench/out/demo-*.trace.jsonl --search 400

--ahead D,D: the cross-layer ceiling. The default told, at each layer call, which experts
the next D layer calls use (at this token; past the last layer, the next token's first),
as the next layers' routers applied to the current hidden state or a co-activation table
might guess them at best, with and without its layer floor, beside the next-visit oracle.

    python bench/policy_ceiling.py --traces TRACES/*.trace.jsonl --ahead 1,4

--choices: how much a layer's own history tells of its next token: how often the default's
victims (at 50 %) are the candidates used farthest ahead, beside simple rules in the same states.

--split: how much of Belady's lead comes from lending slots between layers over time:
Belady confined to each layer's even share of the slots, and to the best fixed split
found in hindsight (per-layer Belady curves, slots given greedily by marginal hits),
beside global Belady, LRU, per-layer LFU and the default; and what the odds of a layer's
next call are worth, each on the even split: per-layer LFU told the trace's final counts,
and a per-layer transition table (P(expert at the next call | experts at this one)) fitted
on the scored trace itself (in sample) and on the other traces of the same model (out of
sample).

    python bench/policy_ceiling.py --traces TRACES/*.trace.jsonl --split
"""

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from traces import load_heat  # noqa: E402

from mlxmoe.caching.cache import Residency  # noqa: E402
from mlxmoe.caching.policies import (DEFAULT_POLICY, FLOOR_SLACK, HALF_LIFE_FLOOR, POLICIES, Activation,  # noqa: E402
                             Policy, make_policy)
from mlxmoe.workload.trace import read_trace, replay, steps  # noqa: E402


def records_with_state(heat, k, tokens, layers, slow=0.998, fast=0.4, ss=0.8, sf=1.0, temperature=2.5, seed=0,
                       draws=256):
    """The synthetic generator of bench/traces.py (same defaults and random stream), plus,
    per token, the oracle's p1 and p_inf for every (layer, expert)."""
    rng, mc = np.random.default_rng(seed), np.random.default_rng(seed + 1000)
    heat = heat[:layers]
    L, E = heat.shape
    logp = np.log((heat + 1.0) / (heat + 1.0).sum(axis=1, keepdims=True)) / temperature
    zs, zf = rng.normal(size=(L, E)) * ss, rng.normal(size=(L, E)) * sf
    noise = np.sqrt((1 - slow ** 2) * ss ** 2 + (1 - fast ** 2) * sf ** 2)

    def in_top_k(mean, sd):
        d = mean[None] + sd * mc.normal(size=(draws, L, E))
        return (d >= -np.partition(-d, k - 1, axis=2)[:, :, k - 1:k]).mean(axis=0)

    records, chances = [], []
    for t in range(tokens):
        zs = slow * zs + np.sqrt(1 - slow ** 2) * ss * rng.normal(size=(L, E))
        zf = fast * zf + np.sqrt(1 - fast ** 2) * sf * rng.normal(size=(L, E))
        top = np.argpartition(-(logp + zs + zf), k, axis=1)[:, :k]
        chances.append((in_top_k(logp + slow * zs + fast * zf, noise), in_top_k(logp + zs, sf)))
        records += [(t, l, sorted(top[l].tolist())) for l in range(L)]
    return records, chances


class Oracle(Policy):
    name = "oracle"

    def __init__(self, capacity, num_layers, num_experts, chances=None, expected_time=True):
        super().__init__(capacity, num_layers, num_experts)
        self.chances, self.expected_time = chances, expected_time
        self.t, self.current, self.resident = -1, 0, set()

    def tick(self, tokens=1):
        self.t += 1

    def visit(self, layer, experts, scores=None, probs=None):
        self.current = layer

    def insert(self, key):
        self.resident.add(key)

    def remove(self, key):
        self.resident.discard(key)

    def victim(self, protected):
        L, best, found = self.num_layers, -1.0, None
        for key in self.resident - set(protected):
            # layers up to the current one next run at t+1 (known from the state at t);
            # the others later in this token (known from the state at t-1)
            t = self.t if key[0] <= self.current else self.t - 1
            p1, p_inf = (c[key] for c in self.chances[t]) if t >= 0 else (0.06, 0.06)
            d = (key[0] - self.current) % L or L
            steps = d + L * ((1 - p1) / max(p_inf, 1e-4) if self.expected_time else 1 / max(p1, 1e-9) - 1)
            if steps > best:
                best, found = steps, key
        return found


class NextVisit(Activation):
    """`activation` told the experts each layer uses at its next `visits` visits: an expert
    used at the j-th of them is j - 1 visits from its next use, one used at none of them
    `visits` + 1/g (its own long-run rate g, as `activation` estimates it). With one visit
    this is p1 = 1 or 0 in activation's d + L (1 - p1) / g."""

    def __init__(self, capacity, num_layers, num_experts, next_uses=None, visits=1, **kw):
        super().__init__(capacity, num_layers, num_experts, **kw)
        self.next_uses, self.seen = next_uses, [0] * num_layers  # next_uses[layer][i]: experts at its i-th call
        self.known = visits
        estimate = self.estimate
        estimate.tail = lambda key, p1=None, rate=None: estimate.num_layers * estimate.cost[key]  # visits told

    def visit(self, layer, experts, scores=None, probs=None):
        super().visit(layer, experts, scores, probs)
        i = self.seen[layer] = self.seen[layer] + 1
        uses = self.next_uses[layer]
        ahead = self.known + 1.0 / self.estimate.long_rate[layer]
        for j in range(min(self.known, len(uses) - i) - 1, -1, -1):  # the nearest use wins
            ahead[uses[i + j]] = j
        self.estimate.next_chance[layer] = ahead == 0
        self.estimate.cost[layer] = ahead
        self.index.sort(layer)


class NextLayers(Activation):
    """The default told, at each layer call, the experts the next `ahead` layer calls use
    (the following layers at this token; past the last layer, the next token's first):
    their p1 is 1 or 0 until their own visit. The most cross-layer prediction (the next
    layers' routers on the current hidden state, co-activation) could tell the eviction
    estimate; a layer's own next visit stays unknown, as online."""

    def __init__(self, capacity, num_layers, num_experts, next_uses=None, ahead=1, half_life=HALF_LIFE_FLOOR,
                 floor_slack=FLOOR_SLACK, **kw):
        super().__init__(capacity, num_layers, num_experts, half_life=half_life, floor_slack=floor_slack, **kw)
        self.next_uses, self.seen = next_uses, [0] * num_layers  # next_uses[layer][i]: experts at its i-th call
        self.ahead = min(ahead, num_layers - 1)

    def visit(self, layer, experts, scores=None, probs=None):
        super().visit(layer, experts, scores, probs)
        self.seen[layer] += 1
        for target in range(layer + 1, layer + 1 + self.ahead):
            target %= self.num_layers
            if self.seen[target] < len(self.next_uses[target]):
                used = np.zeros(self.num_experts)
                used[self.next_uses[target][self.seen[target]]] = 1.0
                self.estimate.next_chance[target] = used
                np.divide(1.0 - used, self.estimate.long_rate[target], out=self.estimate.cost[target])
                self.index.sort(target)


def next_uses(header, records, n):
    """[layer][i]: the experts of each layer's i-th fetch with `n` slots."""
    uses = [[] for _ in range(header["num_layers"])]
    for _, layer, experts, *_ in steps(records, header["num_layers"], n):
        uses[layer].append(experts)
    return uses


def next_use(times, t):
    """The first of the sorted `times` after t (math.inf: none)."""
    return next((u for u in times if u > t), math.inf)


def next_visit_hit_rate(header, records, n, visits=1, **kw):
    """The hit rate with `n` slots of the oracle told each layer's experts at its next
    `visits` visits (`kw`: activation's options)."""
    POLICIES.setdefault("next-visit", NextVisit)
    return replay(header, records, "next-visit", n, next_uses=next_uses(header, records, n), visits=visits,
                  **kw)["hit_rate"]


def next_layers(paths, depths):
    """Gap closed by the default against the default told the next d layer calls'
    experts (NextLayers; with its layer floor, and without), beside the next-visit oracle
    (activation's, and the default's: with the floor)."""
    POLICIES.setdefault("next-layers", NextLayers)
    print(f"{'trace':>40} {'cache':>6} {'lru':>7} {DEFAULT_POLICY:>17} {'belady':>7}   gap closed: {DEFAULT_POLICY} / "
          + " / ".join(f"told next {d}{'' if floor else ', no floor'}" for floor in (True, False) for d in depths)
          + " / next-visit oracle / the same with the default's floor")
    for path in paths:
        header, records = read_trace(path)
        L, E = header["num_layers"], header["num_experts"]
        for share in (0.25, 0.5, 0.75) if E <= 32 else (0.05, 0.1, 0.25):
            n = max(int(L * E * share), header["top_k"])
            lru, default, best = (replay(header, records, p, n)["hit_rate"] for p in ("lru", DEFAULT_POLICY, "belady"))
            uses = next_uses(header, records, n)
            as_default = {"half_life": HALF_LIFE_FLOOR, "floor_slack": FLOOR_SLACK}
            told = [replay(header, records, "next-layers", n, next_uses=uses, ahead=d,
                           floor_slack=FLOOR_SLACK if floor else None)["hit_rate"]
                    for floor in (True, False) for d in depths]
            gap = best - lru
            print(f"{Path(path).name[:40]:>40} {share:>6.0%} {100 * lru:>7.2f} {100 * default:>17.2f} {100 * best:>7.2f}   "
                  + " / ".join(f"{(r - lru) / gap:.2f}" for r in [default, *told, next_visit_hit_rate(header, records, n),
                                                                next_visit_hit_rate(header, records, n, **as_default)]),
                  flush=True)


def recorded(paths, visits=(1,)):
    """Gap closed at 25/50/75 % on recorded traces: activation against oracles that know
    each layer's experts at its next 1, 2, ... visits."""
    oracles = [f"next {m} visit{'s' if m > 1 else ''}" for m in visits]
    print(f"{'trace':>22} {'cache':>6} {'lru':>8} {'activation':>11} {'belady':>8}   gap closed: activation / "
          + " / ".join(oracles))
    for path in paths:
        header, records = read_trace(path)
        L, E = header["num_layers"], header["num_experts"]
        for share in (0.25, 0.5, 0.75):
            n = int(L * E * share)
            lru, act, best = (replay(header, records, p, n)["hit_rate"] for p in ("lru", "activation", "belady"))
            known = [next_visit_hit_rate(header, records, n, m) for m in visits]
            gap = best - lru
            print(f"{Path(path).name:>22} {share:>6.0%} {100 * lru:>8.2f} {100 * act:>11.2f} {100 * best:>8.2f}   "
                  + " / ".join(f"{(r - lru) / gap:.2f}" for r in [act] + known), flush=True)


def choices(paths, share=0.5):
    """How much a layer's own history tells of its next token: at each victim the default
    takes from the layer being served (its floor keeps it there on most models), whether
    it is the candidate used farthest ahead, beside what other rules would take in the same
    states: a random pick (expected), the least recently used, the lowest long-run rate
    (the default's own), decayed counts of a few half-lives."""
    print(f"{'trace':>40} {'victims':>8}   share of victims used farthest ahead of the candidates: ", end="")
    for path in paths:
        header, records = read_trace(path)
        L, E = header["num_layers"], header["num_experts"]
        n = max(int(L * E * share), header["top_k"])
        fetches = list(steps(records, L, n))
        uses, token = {}, -1  # key -> tokens it is used at
        for tokens, layer, experts, *_ in fetches:
            token += bool(tokens)
            for e in experts:
                uses.setdefault((layer, e), []).append(token)
        policy = make_policy(DEFAULT_POLICY, n, L, E)
        residency, now, right = Residency(n, policy), {}, {}
        choose = policy.victim

        def victim(protected):
            key = choose(protected)
            t, layer = now["token"], key[0]
            candidates = [(layer, e) for e in policy.index.resident[layer] if (layer, e) not in protected]
            if layer == now["layer"] and len(candidates) > 1:
                ahead = {c: next_use(uses[c], t) for c in candidates}
                far = max(ahead.values())
                counts = lambda c, h: sum(0.5 ** ((t - u) / h) for u in uses[c] if u <= t)
                picks = {DEFAULT_POLICY: key, "least recent": max(candidates, key=lambda c: t - policy.estimate.last_use[c]),
                         "lowest long-run rate": min(candidates, key=policy.estimate.long_rate.__getitem__),
                         **{f"counts, half-life {h}": min(candidates, key=lambda c: counts(c, h)) for h in (4, 16, 64)}}
                right.setdefault("random", []).append(sum(a == far for a in ahead.values()) / len(candidates))
                for name, c in picks.items():
                    right.setdefault(name, []).append(ahead[c] == far)
            return key

        policy.victim = victim
        for tokens, layer, experts, scores, dist in fetches:
            if tokens:
                residency.tick(tokens)
            now.update(token=now.get("token", -1) + bool(tokens), layer=layer)
            residency.access(layer, experts, scores, dist)
        print(f"\n{Path(path).name[:40]:>40} {len(right.get('random', [])):>8}   "
              + ", ".join(f"{name} {np.mean(v):.2f}" for name, v in right.items()), end="", flush=True)
    print()


def layer_hits(calls, slots, victim):
    """Hits on one layer's calls (sets of experts, in order) with `slots` slots, evicting
    victim(i, candidates) at call i."""
    resident, hits = set(), 0
    for i, experts in enumerate(calls):
        hits += len(experts & resident)
        for e in experts - resident:
            if len(resident) >= slots:
                if not resident - experts:
                    break  # a prefill call wider than the layer's slots: the rest pass through
                resident.remove(victim(i, resident - experts))
            resident.add(e)
    return hits


def belady_victim(calls):
    uses = {}
    for i, experts in enumerate(calls):
        for e in experts:
            uses.setdefault(e, []).append(i)
    return lambda i, candidates: max(candidates, key=lambda x: next_use(uses[x], i))


def transitions(calls, E):
    """P(expert used at a layer's next call | an expert used at this one), from one trace."""
    used = np.zeros((len(calls), E))
    for i, experts in enumerate(calls):
        used[i, list(experts)] = 1
    pairs = used[:-1].T @ used[1:]
    return (pairs + used.mean(axis=0)) / (used[:-1].sum(axis=0)[:, None] + 1)


def transition_victim(calls, table):
    """The candidate least likely at the next call given this call's experts (ties: fewest uses so far)."""
    def victim(i, candidates):
        chance = table[list(calls[i])].mean(axis=0)
        return min(candidates, key=lambda x: (chance[x], sum(x in c for c in calls[:i])))
    return victim


def counts_victim(calls):
    """The candidate the whole trace uses least (per-layer LFU told the final counts)."""
    counts = {}
    for experts in calls:
        for e in experts:
            counts[e] = counts.get(e, 0) + 1
    return lambda i, candidates: min(candidates, key=counts.get)


def layer_calls_of(path):
    header, records = read_trace(path)
    fetches = next_uses(header, records, header["num_layers"] * header["num_experts"])  # whole calls, unsplit
    return header, records, [[set(experts) for experts in layer] for layer in fetches]


def split(paths):
    """Belady on each layer's even share of the slots and on the best fixed split in
    hindsight, beside global Belady: the part of its lead no per-layer choice can reach.
    And what knowing the odds is worth, on the even split: per-layer LFU told the trace's
    final counts, and a per-layer transition table fitted on the scored trace itself (in
    sample) and on the other traces of its model (out of sample)."""
    print(f"{'trace':>40} {'cache':>6} {'lru':>7} {'layer-lfu':>10} {'default':>8} {'own counts; transitions: own / other':>37} "
          f"{'Belady, even split / best fixed split':>38} {'belady':>7}   gap closed, same order")
    traces = {path: layer_calls_of(path) for path in paths}
    for path, (header, records, calls) in traces.items():
        L, E, k = header["num_layers"], header["num_experts"], header["top_k"]
        others = [c for p, (h, _, c) in traces.items() if p != path and h["model"] == header["model"]]
        tables = [[transitions(c, E) for c in calls]]  # own; then the other traces' pooled
        if others:
            tables.append([np.mean([transitions(o[layer], E) for o in others], axis=0) for layer in range(L)])
        total = sum(len(c) for layer in calls for c in layer)
        victims = [belady_victim(c) for c in calls]
        curves = [[layer_hits(c, s, v) for s in range(k, E + 1)] for c, v in zip(calls, victims)]  # Belady's, slots k..E
        for share in (0.25, 0.5, 0.75) if E <= 32 else (0.05, 0.1, 0.25):
            n = max(int(L * E * share), k)
            even = max(n // L, k)
            lru, lfu, default, best = (replay(header, records, p, n)["hit_rate"]
                                       for p in ("lru", "layer-lfu", DEFAULT_POLICY, "belady"))
            told = [sum(layer_hits(c, even, counts_victim(c)) for c in calls) / total]
            told += [sum(layer_hits(c, even, transition_victim(c, t)) for c, t in zip(calls, fitted)) / total
                     for fitted in tables]
            slots = [k] * L  # greedy by marginal hits; a prefill can bend a curve, hence the even split beside it
            for _ in range(n - k * L):
                gain = [curve[s - k + 1] - curve[s - k] if s < E else -1 for curve, s in zip(curves, slots)]
                slots[int(np.argmax(gain))] += 1
            ceilings = [sum(curve[even - k] for curve in curves) / total]
            ceilings.append(max(ceilings[0], sum(curve[s - k] for curve, s in zip(curves, slots)) / total))
            gap = best - lru
            rates = [default, *told, *ceilings]
            print(f"{Path(path).name[:40]:>40} {share:>6.0%} {100 * lru:>7.2f} {100 * lfu:>10.2f} {100 * default:>8.2f} "
                  f"{' / '.join(f'{100 * r:.2f}' for r in told):>37} {' / '.join(f'{100 * r:.2f}' for r in ceilings):>38} "
                  f"{100 * best:>7.2f}   " + " / ".join(f"{(r - lru) / gap:.2f}" for r in rates), flush=True)


SEARCH_SPACE = dict(half_life=[8, 12, 24, 48, 96], recency_half_life=[1, 2, 4, 8], recency_weight=[0, 0.1, 0.2, 0.4, 0.6],
                    router_weight=[0, 0.5, 1, 2], now_weight=[0.3, 0.45, 0.6, 0.75, 0.9], now_scale=[2, 4, 8, 16, 32],
                    horizon=[1, 2, 4], long_min=[4, 8, 16, 32], long_prior=[1, 4, 16])


def search(paths, tries, seed=0, share=0.5):
    """Random search over `activation`'s parameters (SEARCH_SPACE), scored in sample on the
    traces themselves by the gap closed at `share`: how far its rule can go at best."""
    import random
    data = []
    for path in paths:
        header, records = read_trace(path)
        n = int(header["num_layers"] * header["num_experts"] * share)
        lru, best = (replay(header, records, p, n)["hit_rate"] for p in ("lru", "belady"))
        data.append((header, records, n, lru, best))

    def closed(kw):
        return [(replay(h, r, "activation", n, **kw)["hit_rate"] - lru) / (best - lru) for h, r, n, lru, best in data]

    rng = random.Random(seed)
    shipped = closed({})
    top = list(shipped)
    print("shipped settings: " + " / ".join(f"{c:.3f}" for c in shipped))
    for i in range(tries):
        kw = {k: rng.choice(v) for k, v in SEARCH_SPACE.items()}
        scores = closed(kw)
        if any(c > t for c, t in zip(scores, top)):
            top = [max(c, t) for c, t in zip(scores, top)]
            print(f"try {i}: " + " / ".join(f"{c:.3f}" for c in scores) + f"  {kw}", flush=True)
    print(f"best of {tries} per trace: " + " / ".join(f"{t:.3f}" for t in top))


def hit_rate(records, policy, capacity):
    r, last = Residency(capacity, policy), None
    for t, l, experts in records:
        if t != last:
            r.tick(1)
            last = t
        r.access(l, experts)
    return r.counters.hits / (r.counters.hits + r.counters.misses)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=800)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--traces", nargs="*", default=[], help="Recorded traces: the next-visit oracles on each.")
    ap.add_argument("--visits", default="1,2,4", help="With --traces: how many next visits each oracle knows.")
    ap.add_argument("--ahead", default="", metavar="D,D",
                    help="With --traces: the default told the next D layer calls' experts (cross-layer ceiling) instead.")
    ap.add_argument("--choices", action="store_true",
                    help="With --traces: how often the default's victims are the candidates used farthest ahead, "
                         "beside simple rules in the same states (at 50 %%).")
    ap.add_argument("--search", type=int, default=0, metavar="N",
                    help="With --traces: random search of N settings of activation's parameters instead.")
    ap.add_argument("--split", action="store_true",
                    help="With --traces: Belady on each layer's even share of the slots and on the best fixed split "
                         "in hindsight, beside global Belady.")
    args = ap.parse_args()
    if args.traces and args.split:
        return split(args.traces)
    if args.traces and args.choices:
        return choices(args.traces)
    if args.traces and args.ahead:
        return next_layers(args.traces, [int(d) for d in args.ahead.split(",")])
    if args.traces and args.search:
        return search(args.traces, args.search, args.seed)
    if args.traces:
        return recorded(args.traces, [int(m) for m in args.visits.split(",")])
    heat, k = load_heat()
    records, chances = records_with_state(heat, k, args.tokens, args.layers, seed=args.seed)
    L, E = args.layers, heat.shape[1]
    future = [(l, x) for _, l, experts in records for x in experts]
    print(f"{'cache':>6} {'lru':>8} {'activation':>11} {'oracle next-visit':>18} {'oracle expected-time':>21} {'belady':>8}"
          "   gap closed (activation / next-visit / expected-time)")
    for share in (0.25, 0.5, 0.75):
        n = int(L * E * share)
        rates = [hit_rate(records, make_policy("lru", n, L, E), n), hit_rate(records, make_policy("activation", n, L, E), n),
                 hit_rate(records, Oracle(n, L, E, chances, expected_time=False), n),
                 hit_rate(records, Oracle(n, L, E, chances), n),
                 hit_rate(records, make_policy("belady", n, L, E, future=future), n)]
        gap = rates[4] - rates[0]
        print(f"{share:>6.0%} " + " ".join(f"{100 * r:>{w}.2f}" for r, w in zip(rates, (8, 11, 18, 21, 8)))
              + "   " + " / ".join(f"{(r - rates[0]) / gap:.2f}" for r in rates[1:4]))


if __name__ == "__main__":
    main()
