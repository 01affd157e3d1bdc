"""The default policy, `activation` (and `activation-floor`, the same with a layer floor):
Belady's rule on an estimate of each expert's next use (NextUse), over a victim index
(VictimIndex), with two rules: a prefill pass takes slots from the layers it has left
(PrefillPass), and each layer is kept at a floor (LayerFloor, activation-floor only).
"""

import bisect
import itertools
import math

import numpy as np

from .baselines import Policy, none_left

# Default half-lives of the default's decayed estimates, in tokens (each an option of the policy)
HALF_LIFE_ACTIVATION = 24  # activation's frequency estimate
HALF_LIFE_RECENCY = 4  # activation's recency estimate
HALF_LIFE_FLOOR = 0.5  # activation-floor's frequency estimate (chosen by bench_policies.py --lofo)
FLOOR_SLACK = 1.0  # activation-floor's layer floor: the even share less up to this many tokens' experts (the same)


class NextUse:
    """Each expert's expected layer steps to its next use, the estimate `activation`
    evicts by (Belady's rule on estimates) and the prefetcher weighs its guesses with.

    An expert of a layer d layer steps ahead (of L) is used at its layer's next visit with
    chance p1, and otherwise after about L / rate more steps: its next use is expected in
    d + L (1 - p1) / rate steps, over its layer's `miss_cost` (1 in a replay; lower where
    prefetch hides the layer's misses, see count_loads). p1 mixes decayed
    estimates: frequency of use (`half_life` tokens), recent use (`recency_half_life`),
    router mass and, where the router's whole distribution is known, its favour of the expert now (`now_weight`, `now_scale`). rate is the decayed
    share of the layer's visits that used the expert, its half-life `horizon` x the mean
    age of the experts evicted (at least `long_min` tokens), regularised by
    `long_prior` visits at the prior's rate. A call of n tokens (a prefill) counts as one visit, p1
    moving towards the share of its tokens that used each expert where the router is known.

    The hooks the cache and the prefetcher use: `miss_cost`, per layer what a miss costs
    relative to others (an array the cache lowers where prefetch hides a layer's misses);
    `chance(key)`, the chance that `key`'s layer uses it at its next visit; `steps(key, p1,
    rate)`, the expected layer steps until `key` is used (prefetch.outranks)."""

    def __init__(self, num_layers, num_experts, prior=None, half_life=HALF_LIFE_ACTIVATION,
                 recency_half_life=HALF_LIFE_RECENCY, recency_weight=0.2, router_weight=1.0,
                 now_weight=0.6, now_scale=8.0, horizon=2.0, long_min=16.0, long_prior=4.0):
        L, E = self.num_layers, self.num_experts = num_layers, num_experts
        self.slow = 2.0 ** (-1.0 / half_life)
        self.fast = 2.0 ** (-1.0 / recency_half_life)
        self.recency_weight, self.router_weight = recency_weight, router_weight
        self.now_weight, self.now_scale = now_weight, now_scale
        self.prior = np.zeros((L, E)) if prior is None else np.asarray(prior, dtype=np.float64)
        # A layer's rows side by side ([layer, 4, E]: freq, recent, router_mass, used_visits; views
        # below), so that one numpy call decays all, adds a use to all, or sums p1's terms (few calls at
        # E = 32-128). The profile's rates seed the frequencies.
        self.rows = np.zeros((L, 4, E))
        self.freq, self.recent, self.router_mass, self.used_visits = self.rows.transpose(1, 0, 2)
        self.freq[:] = self.prior
        self.mix_weights = np.array([[1 - recency_weight], [recency_weight], [router_weight]])
        self.next_chance = self.mix(slice(None))  # p1: chance of use at the layer's next visit
        self.horizon, self.long_min, self.long_prior = horizon, long_min, long_prior
        self.layer_visits = [0.0] * L  # decayed visits of each layer
        self.long_rate = np.ones((L, E))  # rate: long-run share of the layer's visits that use it
        self.cost = np.zeros((L, E))  # (1 - p1) / rate: expected visits to next use after the next
        self.rate_terms = {}  # top_k -> long_prior x each expert's prior rate per visit, [L, E]
        self.tokens = 0
        self.last_use = np.zeros((L, E))  # token count at each expert's last use
        self.evicted_age = 8.0  # mean tokens since last use of the experts evicted (decayed mean)
        self.current = 0  # the layer last visited
        self.call_tokens = 1  # tokens of every layer call until the next tick
        self.top_k = 1  # the most experts one token has used (seen at single-token calls)
        self.visits = 0  # layer calls so far
        self.visited_at = [0] * L  # the call count at each layer's last visit
        self.used_rows = np.array([[0], [1], [3]])  # freq, recent, used_visits: what a use adds to
        self.decays = np.array([[self.slow], [self.fast], [self.slow], [1.0]])  # of each row per visit
        self.gains = np.array([[1 - self.slow], [1 - self.fast], [1.0]])  # what a use adds to freq, recent, used_visits
        # the victim is the expert with the largest expected time to next use / its layer's miss cost
        self.miss_cost = np.ones(L)
        self.layer_loads = np.zeros((L, 2))  # per layer, decayed [loads a prefetch hid, demand loads] (count_loads)

    def count_loads(self, layer, hidden, demand, keep=0.98, hidden_cost=0.25):
        """A decode step's loads of `layer`: `hidden` found resident or on their way thanks
        to a prefetch, `demand` read on the decode path. The layer's miss cost is then
        1 - (1 - hidden_cost) x the share prefetch hides (a hidden load still takes the disk's
        time): a layer whose experts the lookahead predicts well gives up slots to one whose
        misses the decode thread would wait for (on the demo model, the next token's first
        layers, which no predictor sees coming)."""
        counts = self.layer_loads[layer]  # (in Python floats: the same doubles as in numpy, at a layer call's cost)
        counts[0] = hidden = float(counts[0]) * keep + hidden
        counts[1] = demand = float(counts[1]) * keep + demand
        self.miss_cost[layer] = 1.0 - (1.0 - hidden_cost) * (hidden / (hidden + demand + 1.0))

    def set_prior(self, prior):
        """The long-run rates' regulariser follows the new prior; what the live estimates
        learnt stays."""
        self.prior = np.zeros_like(self.prior) if prior is None else np.asarray(prior, dtype=np.float64)
        self.rate_terms.clear()

    def tick(self, tokens):
        self.call_tokens = tokens
        self.tokens += tokens

    def visit(self, layer, experts, scores=None, probs=None):
        # A call of n tokens (a prefill) counts as one visit: its estimates decay once and
        # move towards the share of its tokens that used each expert. Only the union of the
        # experts is known; the router's mean distribution times top-k estimates the share,
        # where the router is known (else each expert of the union counts as used). The
        # long-run counts take a call as one visit of the experts it used.
        # (At E = 32-128 each numpy call costs about its overhead: few calls, in place.)
        experts = np.asarray(experts, dtype=np.intp)
        probs = None if probs is None else np.asarray(probs)
        half_life = max(self.horizon * self.evicted_age, self.long_min)
        keep = 2.0 ** (-1.0 / half_life)  # used_visits' decay per visit (a call is one visit)
        self._count_use(layer, experts, scores, probs, keep)
        p1 = self.mix(layer, out=self.next_chance[layer])
        if probs is not None and self.now_weight:
            now = np.minimum(1.0, probs * (self.now_scale * self.top_k))
            now *= self.now_weight
            p1 *= 1 - self.now_weight
            p1 += now
        self.layer_visits[layer] = self.layer_visits[layer] * keep + 1.0
        rate = np.add(self.used_visits[layer], self.rate_term()[layer], out=self.long_rate[layer])
        rate /= self.layer_visits[layer] + self.long_prior
        np.maximum(rate, 1e-4, out=rate)
        cost = np.minimum(p1, 1.0, out=self.cost[layer])
        np.subtract(1.0, cost, out=cost)
        cost /= rate
        self.last_use[layer, experts] = self.tokens
        self.current = layer
        self.visits += 1
        self.visited_at[layer] = self.visits

    def _count_use(self, layer, experts, scores, probs, keep):
        """Decay `layer`'s rows by a visit and add its use of `experts`."""
        slow, fast, decays = self.slow, self.fast, self.decays
        rows = self.rows[layer]  # a view: updated in place; router_mass only decays where the router is known
        decays[2, 0] = slow if probs is not None or scores is not None else 1.0
        decays[3, 0] = keep
        rows *= decays
        freq, recent, router_mass, used_visits = rows
        # one token, or the router unknown: the experts used: freq, recent x decay + (1 - decay) x 1, used_visits + 1
        if self.call_tokens == 1 or probs is None:
            rows[self.used_rows, experts] += self.gains
        else:
            used = np.minimum(1.0, probs * self.top_k)
            freq += (1 - slow) * used
            recent += (1 - fast) * used
            used_visits[experts] += 1.0
        if probs is not None:
            router_mass += (1 - slow) * probs
        elif scores is not None:
            router_mass[experts] += (1 - slow) * np.asarray(scores)

    def visit_calls(self, calls):
        """visit() of each of `calls` [(layer, experts, scores, probs)] in order, in one numpy
        call per step: single-token calls of distinct layers (each layer's rows change alone)
        whose routing is known alike (probs of one dtype, else scores of one dtype, else
        neither). Every element goes through the same operations in the same order as in
        visit(), so the arrays are equal, not just close. False (nothing changed) where the
        calls are not alike."""
        if not calls or self.call_tokens != 1:
            return not calls  # (none: nothing to do)
        probs = [None if c[3] is None else np.asarray(c[3]) for c in calls]
        scores = [None if c[2] is None or p is not None else np.asarray(c[2]) for c, p in zip(calls, probs)]
        known = {(None if p is None else p.dtype, None if s is None else s.dtype) for p, s in zip(probs, scores)}
        if len(known) > 1 or len({c[0] for c in calls}) < len(calls):
            return False
        n, slow, rows = len(calls), self.slow, self.rows
        layers = np.array([c[0] for c in calls], dtype=np.intp)
        sizes = [len(c[1]) for c in calls]
        experts = np.fromiter(itertools.chain.from_iterable(c[1] for c in calls), dtype=np.intp, count=sum(sizes))
        at = np.repeat(layers, sizes)  # each expert's layer
        # _count_use: decay, a use, the router's mass
        keep = 2.0 ** (-1.0 / max(self.horizon * self.evicted_age, self.long_min))  # (changes only when a key leaves)
        self.decays[2, 0] = slow if probs[0] is not None or scores[0] is not None else 1.0
        self.decays[3, 0] = keep
        rows[layers] *= self.decays
        rows[at, self.used_rows, experts] += self.gains
        probs = None if probs[0] is None else np.stack(probs)
        if probs is not None:
            rows[layers, 2] += (1 - slow) * probs
        elif scores[0] is not None:
            rows[at, 2, experts] += (1 - slow) * np.concatenate(scores)
        # p1, the layer's visits, rate and cost as in visit()
        p1 = self.mix(layers)
        if probs is not None and self.now_weight:
            now = np.minimum(1.0, probs * (self.now_scale * self.top_k))
            now *= self.now_weight
            p1 *= 1 - self.now_weight
            p1 += now
        self.next_chance[layers] = p1
        layer_visits = np.array([self.layer_visits[layer] for layer in layers.tolist()]) * keep + 1.0
        for layer, v in zip(layers.tolist(), layer_visits.tolist()):
            self.layer_visits[layer] = v
        rate = self.used_visits[layers] + self.rate_term()[layers]
        rate /= (layer_visits + self.long_prior)[:, None]
        np.maximum(rate, 1e-4, out=rate)
        self.long_rate[layers] = rate
        cost = np.minimum(p1, 1.0)
        np.subtract(1.0, cost, out=cost)
        cost /= rate
        self.cost[layers] = cost
        self.last_use[at, experts] = self.tokens
        self.current = calls[-1][0]
        for i, layer in enumerate(layers.tolist(), start=self.visits + 1):
            self.visited_at[layer] = i
        self.visits += n
        return True

    def left(self, key):
        """`key` was evicted: the mean age of the evicted follows it."""
        self.evicted_age += 0.01 * (self.tokens - self.last_use[key] - self.evicted_age)

    def mix(self, layer, out=None):
        """p1 from the decayed estimates: ((1 - rw) freq + rw recent) + router_weight router_mass,
        summed in that order (a reduction over 3 rows adds them one after the other)."""
        return np.add.reduce(self.rows[layer, ..., :3, :] * self.mix_weights, axis=-2, out=out)

    def rate_term(self):
        """long_prior x each expert's long-run rate per visit before any is seen: the
        prior's rates scaled to top_k uses per visit (top_k / E without a prior)."""
        k = self.top_k
        if k not in self.rate_terms:
            sums = self.prior.sum(axis=1, keepdims=True)
            rate = np.where(sums > 0, self.prior * (k / np.where(sums > 0, sums, 1.0)), k / self.num_experts)
            self.rate_terms[k] = self.long_prior * rate
        return self.rate_terms[k]

    def steps(self, key, p1=None, rate=None):
        """Expected layer steps until `key` is used: d + L (1 - p1) / rate, with p1 its chance
        of use at its layer's next visit (by default its own) and rate its share of its
        layer's visits in the long run (by default its own)."""
        return ((key[0] - self.current) % self.num_layers or self.num_layers) + self.tail(key, p1, rate)

    def tail(self, key, p1=None, rate=None):
        """The second term of steps(): L (1 - p1) / rate."""
        if p1 is None:
            p1 = self.next_chance[key]
        return self.num_layers * (1.0 - min(p1, 1.0)) / (self.long_rate[key] if rate is None else rate)

    def chance(self, key):
        """The chance that `key`'s layer uses it at its next visit by the decayed estimates
        alone (without the router's favour at the layer's last call): the prefetcher weighs
        its guesses against it."""
        return ((1 - self.recency_weight) * self.freq[key] + self.recency_weight * self.recent[key]
                + self.router_weight * self.router_mass[key])


class LayerFloor:
    """A layer at or under its floor gives no slot to another layer (it still pays for its
    own misses): its even share of the slots less `slack` x top_k x the share of the expert
    accesses so far that came from single-token calls (rounded down), never under one
    token's experts (top_k) nor over the even share. A prefill uses most of every layer's
    experts, so the more of the accesses prefills make, the closer each layer is kept to
    its even share."""

    def __init__(self, capacity, num_layers, slack=FLOOR_SLACK):
        self.even = capacity // num_layers
        self.floor = self.even  # until top_k is known
        self.slack = slack
        self.multi_calls = self.multi_accesses = 0  # layer calls of several tokens (prefills), their expert accesses
        self.due = 0  # the layer call count from which the floor may move (a tick recomputes it then)
        self.at_floor = np.zeros(num_layers)  # -inf where a layer is at or under its floor: out of reach

    def count(self, call_tokens, experts):
        """A layer call of `call_tokens` tokens used `experts` experts."""
        if call_tokens > 1:
            self.multi_calls += 1
            self.multi_accesses += experts
            self.due = 0

    def update(self, visits, top_k, resident):
        """The floor for the top_k and the accesses seen so far (`resident`: each layer's resident experts)."""
        multi = self.multi_accesses
        single = (visits - self.multi_calls) * top_k  # a single-token call uses top_k experts
        slack = self.slack * single / (single + multi) if multi else self.slack
        give, most = int(slack * top_k), self.slack * top_k
        floor = min(self.even, max(top_k, self.even - give))
        # single-token calls until `give` grows by one: single / (single + multi) >= (give + 1) / most
        # (rounded down: at worst one recomputation early); none without a prefill until the next
        self.due = (self.multi_calls + int((give + 1) * multi / (most - give - 1) / top_k)
                    if multi and give + 1 < most else math.inf)
        if floor != self.floor:
            self.floor = floor
            for layer, experts in enumerate(resident):
                self.hold(layer, len(experts))

    def hold(self, layer, resident):
        self.at_floor[layer] = -np.inf if resident <= self.floor else 0.0

    def out_of_reach(self, steps, current):
        """`steps` with the layers at their floor at -inf, but the current layer."""
        floored = steps + self.at_floor
        floored[current] = steps[current]
        return floored


class PrefillPass:
    """In a pass of several tokens (a prefill), the layers the pass has still to visit give
    a slot only when neither the current layer nor one the pass has left can (their call of
    as many tokens comes before the next token's and uses most of their experts), and their
    experts' chance of use at that call is that of one of its tokens using them at their
    long-run rate."""

    def __init__(self, estimate, order):
        self.estimate, self.order = estimate, order  # order: VictimIndex.order
        # the layer call from which only the layers ahead can pay, their steps then, and
        # the one of them a key left since
        self.blocked, self.ahead_steps, self.emptied = -1, [], None

    def inserted(self, layer):
        if layer > self.estimate.current:  # a layer the pass may have still to visit (prefetched): all are redone
            self.blocked = -1

    def removed(self, layer):
        if layer > self.estimate.current:  # a layer the pass may have still to visit: its steps are redone
            self.emptied = layer

    def victim(self, protected, steps, floored_victim):
        """The victim while the layers ahead are out of reach (by `floored_victim`); else
        None, and the layers ahead's steps by the pass's chance in `steps`."""
        est = self.estimate
        ahead = est.current + 1
        if self.blocked != est.visits:  # (else none could at this layer call's last victim)
            masked = steps.copy()
            masked[ahead:] = -np.inf
            found = floored_victim(protected, masked)
            if found:
                return found
            self.blocked, self.emptied = est.visits, None
            self.ahead_steps = self._farthest(range(ahead, est.num_layers))
        elif self.emptied is not None:  # a key left that layer (the last victim): its farthest changed
            self.ahead_steps[self.emptied - ahead] = self._farthest([self.emptied])[0]
            self.emptied = None
        steps[ahead:] = self.ahead_steps
        return None

    def _farthest(self, layers):
        """steps() of the farthest expert of each of `layers` (-inf where one has none), over its miss cost."""
        return [self.steps((layer, self.order[layer][0])) / self.estimate.miss_cost[layer] if self.order[layer]
                else -np.inf for layer in layers]

    def steps(self, key):
        """The estimate's steps(), with, for a layer the pass has still to visit, the chance
        that one of the call's tokens uses `key` at its long-run rate."""
        est = self.estimate
        if key[0] > est.current:  # its call in this pass
            return est.steps(key, 1.0 - (1.0 - min(est.long_rate[key], 1.0)) ** est.call_tokens)
        return est.steps(key)


class VictimIndex:
    """Each layer's resident experts, farthest next use first, and the farthest of each
    layer's as one array, so that a victim needs no loop over layers; a layer visited since its
    last sort is sorted before the next victim, an expert given to a sorted layer put in place."""

    def __init__(self, estimate):
        L = estimate.num_layers
        self.estimate = estimate
        self.resident = [set() for _ in range(L)]
        self.order = [[] for _ in range(L)]  # resident experts of each layer, farthest next use first
        self.unsorted = set()  # layers visited (or given a first expert) since their order was sorted
        # the second term of steps() of each layer's farthest expert (order[layer][0]; -inf if
        # none), and the first term, layer steps from the current layer ([current, layer])
        self.head = np.full(L, -np.inf)
        self.distance = np.array([[(l - c) % L or L for l in range(L)] for c in range(L)], dtype=np.float64)

    def visited(self, layer):
        """`layer`'s estimates changed: its order is sorted again before the next victim (in
        the order its resident experts have now: ties keep it), not now (a token whose layer
        calls all hit needs no victim)."""
        self.order[layer] = list(self.resident[layer])
        self.unsorted.add(layer)

    def insert(self, key):
        layer, e = key
        self.resident[layer].add(e)
        order = self.order[layer]
        if layer in self.unsorted or not order:
            order.append(e)
            self.unsorted.add(layer)  # sorted before the next victim: a rare expert just used can be the farthest
            return
        # a sorted layer: put it where the sort would (after its equals), not sort it all again
        cost = self.estimate.cost[layer].tolist()
        bisect.insort_right(order, e, key=lambda x: -cost[x])
        if order[0] == e:
            self.set_head(layer)

    def remove(self, key):
        layer, e = key
        self.resident[layer].discard(e)
        order = self.order[layer]
        if e in order:
            head = order[0] == e
            order.remove(e)
            if head:
                self.set_head(layer)

    def visited_calls(self, layers):
        """visited() of each of `layers`."""
        for layer in layers:
            self.visited(layer)

    def sort(self, layer):
        """Sort `layer`'s resident experts, farthest next use first (ties keep their order)."""
        order = self.order[layer]
        order.sort(key=self.estimate.cost[layer].tolist().__getitem__, reverse=True)
        self.set_head(layer)

    def sort_inserted(self):
        for layer in self.unsorted:
            self.sort(layer)
        self.unsorted.clear()

    def set_head(self, layer):
        order = self.order[layer]
        key = (layer, order[0]) if order else None
        self.head[layer] = -np.inf if key is None else self.estimate.tail(key, self.estimate.next_chance[key])

    def steps(self):
        """steps() of every layer's farthest expert, over its layer's miss cost."""
        est = self.estimate
        return (self.distance[est.current] + self.head) / est.miss_cost

    def victim(self, protected, steps, steps_of):
        """The expert of largest steps over the layers whose `steps` are not -inf, or None;
        the layers whose candidate is another one (their farthest is protected) or that have
        not run for a round of all layers (a prefill split into runs) are redone with
        `steps_of(key)`."""
        est, order = self.estimate, self.order
        redo = {l for l, e in protected if order[l] and order[l][0] == e}
        oldest = est.visits - est.num_layers
        if min(est.visited_at) < oldest:  # (a decode step visits every layer in a round: none)
            redo.update(l for l, visited in enumerate(est.visited_at) if visited < oldest)
        candidates, s = {}, steps
        if redo:
            s = steps.copy()
            for layer in redo:
                if steps[layer] == -np.inf:  # held at its floor (or empty)
                    continue
                s[layer] = -np.inf
                for e in order[layer]:
                    if (layer, e) not in protected:
                        candidates[layer] = e
                        s[layer] = steps_of((layer, e)) / est.miss_cost[layer]
                        break  # the farthest of this layer is its only candidate
        layer = int(np.argmax(s))  # the first of equals, as a loop over layers would
        if s[layer] == -np.inf:
            return None
        return layer, candidates.get(layer, order[layer][0] if order[layer] else None)


class Activation(Policy):
    """Evict the expert whose next use is expected farthest (Belady's rule on the NextUse
    estimate, a profile's rates its prior), a prefill pass taking slots from the layers it
    has left (PrefillPass) and, with `floor_slack` (not None), each layer kept
    at a floor (LayerFloor). `activation` is these rules without the floor, at the
    estimate's own half-life; the default, `activation-floor`, with the floor (slack 1) and
    a frequency half-life of half a token, chosen on real routing (bench_policies.py
    --lofo)."""

    name = "activation"
    wants_router = True

    def __init__(self, capacity, num_layers, num_experts, prior=None, half_life=HALF_LIFE_ACTIVATION,
                 recency_half_life=HALF_LIFE_RECENCY, recency_weight=0.2, router_weight=1.0,
                 now_weight=0.6, now_scale=8.0, horizon=2.0, long_min=16.0, long_prior=4.0,
                 floor_slack=None, **kw):
        super().__init__(capacity, num_layers, num_experts, **kw)
        self.estimate = NextUse(num_layers, num_experts, prior, half_life, recency_half_life, recency_weight,
                                router_weight, now_weight, now_scale, horizon, long_min, long_prior)
        self.index = VictimIndex(self.estimate)
        self.prefill_pass = PrefillPass(self.estimate, self.index.order)
        self.floor = None if floor_slack is None else LayerFloor(capacity, num_layers, floor_slack)

    def set_prior(self, prior):
        self.estimate.set_prior(prior)
        return True

    def resized(self, capacity):
        super().resized(capacity)
        if self.floor is not None:  # the floor moves to the new even share at the next tick
            self.floor.even, self.floor.due = capacity // self.num_layers, 0

    def tick(self, tokens=1):
        self.estimate.tick(tokens)  # every layer call until the next tick has this many tokens
        if self.floor is not None and self.estimate.visits >= self.floor.due:
            self.floor.update(self.estimate.visits, self.estimate.top_k, self.index.resident)

    def visit(self, layer, experts, scores=None, probs=None):
        est = self.estimate
        if self.floor is not None:
            self.floor.count(est.call_tokens, len(experts))
        if est.call_tokens == 1 and len(experts) > est.top_k:
            est.top_k = len(experts)
            if self.floor is not None:
                self.floor.update(est.visits, est.top_k, self.index.resident)
        est.visit(layer, experts, scores, probs)
        self.index.visited(layer)

    def hits(self, calls):
        """As Policy.hits (access() is nothing here) in a few numpy calls (NextUse.visit_calls,
        VictimIndex.visited_calls); one visit after the other where a call raises top_k (the
        floor moves then), the calls are not alike (see visit_calls) or they are too few for
        the batch's fixed cost to pay (one or two: half the time of visit_calls for one)."""
        est = self.estimate
        if len(calls) <= 2 or any(len(c[1]) > est.top_k for c in calls) or not est.visit_calls(calls):
            return super().hits(calls)
        self.index.visited_calls([c[0] for c in calls])

    def insert(self, key):
        self.prefill_pass.inserted(key[0])
        self.index.insert(key)
        if self.floor is not None:
            self.floor.hold(key[0], len(self.index.resident[key[0]]))

    def remove(self, key):
        self.prefill_pass.removed(key[0])
        self.index.remove(key)
        if self.floor is not None:
            self.floor.hold(key[0], len(self.index.resident[key[0]]))
        self.estimate.left(key)

    def victim(self, protected):
        est = self.estimate
        self.index.sort_inserted()
        steps = self.index.steps()
        in_pass = est.call_tokens > 1 and est.current + 1 < est.num_layers
        if in_pass:
            found = self.prefill_pass.victim(protected, steps, self._floored_victim)
            if found:
                return found
        found = self._floored_victim(protected, steps)
        if found:
            return found
        raise none_left()

    def _floored_victim(self, protected, steps):
        """The victim with the layers at or under their floor out of reach while another
        layer can pay (the current layer pays for itself), then with every layer; None if none."""
        steps_of = self.prefill_pass.steps if self.estimate.call_tokens > 1 else self.estimate.steps
        if self.floor is not None:
            found = self.index.victim(protected, self.floor.out_of_reach(steps, self.estimate.current), steps_of)
            if found:
                return found
        return self.index.victim(protected, steps, steps_of)

