"""The `Policy` interface every eviction policy implements (its hooks are listed in
policies.py, the registry) and the simple baselines the default is measured against: lru,
lfu (decayed), slru, s3fifo, the per-layer splits (layer-lru, layer-lfu, lfuda) and belady
(offline, the ceiling of a replay). The default policy and its rules are in default.py.
"""

import heapq
import inspect
import math
from collections import OrderedDict

import numpy as np

from ..errors import MlxmoeError

HALF_LIFE_LFU = 256  # lfu's and slru's counts, in tokens (an option of each)


class Policy:
    """`prior`, where a policy takes one, is a profile's per-token use rate of each
    expert, an array [layers, experts] (see profile.py). Every policy takes it; any other
    keyword option a policy does not declare is refused.

    Besides the hooks in policies.py's docstring (and set_prior), the cache and the
    prefetcher use `estimate`, where a policy keeps estimates of next use (None otherwise):
    a NextUse, with `miss_cost` (per layer, an array the cache lowers where prefetch hides
    a layer's misses, NextUse.count_loads), `chance(key)` and `steps(key, p1, rate)`
    (prefetch.outranks weighs guesses with them)."""

    name = ""
    wants_router = False  # visit() wants the router's whole distribution (the runtime computes it only then)
    offline = False  # needs the future accesses: trace replay only
    estimate = None  # a NextUse where the policy evicts by expected next use

    def __init__(self, capacity, num_layers, num_experts, prior=None, **options):
        if options:
            known = ", ".join(policy_options(type(self))) or "none"
            raise MlxmoeError(f"policy {self.name or type(self).__name__!r} has no option "
                              f"{', '.join(map(repr, options))} (its options: {known})")
        self.capacity, self.num_layers, self.num_experts = capacity, num_layers, num_experts

    def tick(self, tokens=1):
        pass

    def visit(self, layer, experts, scores=None, probs=None):
        pass

    def access(self, key, hit, score=None):
        pass

    def hits(self, calls):
        """A token's layer calls that hit, [(layer, experts, scores, probs)] in order: each
        one's visit, then its accesses (as Residency._hit). A policy may do it in fewer steps
        where that leaves exactly the same state."""
        for layer, experts, scores, probs in calls:
            self.visit(layer, experts, scores, probs)
            for i, e in enumerate(experts):
                self.access((layer, int(e)), True, None if scores is None else scores[i])

    def insert(self, key):
        raise NotImplementedError

    def remove(self, key):
        raise NotImplementedError

    def victim(self, protected):
        raise NotImplementedError

    def set_prior(self, prior):
        """Take another profile's rates as the prior mid-run (a server's per-request
        profile); False where the policy keeps the one it was built with."""
        return False

    def resized(self, capacity):
        """The cache now has `capacity` slots (the memory governor; its victims already left)."""
        self.capacity = capacity


def policy_options(cls):
    """The keyword options a policy class takes: those of its __init__ and its bases'."""
    names = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty and p.name not in names:
                names.append(p.name)
    return names


def pop_victim(heap, current, key_of, protected):
    """Pop the heap's smallest entry that is `current` (entries go stale when their key
    is accessed again or leaves) and whose key is not protected; protected entries are
    pushed back."""
    skipped = []
    try:
        while heap:
            entry = heapq.heappop(heap)
            if not current(entry):
                continue
            if key_of(entry) in protected:
                skipped.append(entry)
                continue
            return key_of(entry)
        raise none_left()
    finally:
        for entry in skipped:
            heapq.heappush(heap, entry)


def hottest(rates, n, layer=None):
    """The n keys (layer, expert) of highest rate in `rates` [layers, experts], hottest
    first (equal rates: the lower index first); of one layer if given. The one ranking of
    experts by heat: a policy's pins, the prefetcher's profile guesses, a profile's top."""
    rates = np.asarray(rates)
    if layer is not None:
        return [(layer, int(e)) for e in np.argsort(-rates[layer], kind="stable")[:n]]
    E = rates.shape[1]
    return [(int(i // E), int(i % E)) for i in np.argsort(-rates, axis=None, kind="stable")[:n]]


def pins(prior, n):
    """The n keys with the highest prior rate among those above 0, hottest first: the keys
    a policy pins when it has a profile."""
    if prior is None or n <= 0:
        return []
    prior = np.asarray(prior)
    return [key for key in hottest(prior, n) if prior[key] > 0]


def none_left():
    return MlxmoeError("every resident expert is needed by the current layer; the cache is below its minimum")


class LRU(Policy):
    """Least recently used, over all resident experts of all layers."""

    name = "lru"

    def __init__(self, capacity, num_layers, num_experts, **kw):
        super().__init__(capacity, num_layers, num_experts, **kw)
        self.order = OrderedDict()  # least recent first

    def access(self, key, hit, score=None):
        if hit:
            self.order.move_to_end(key)

    def insert(self, key):
        self.order[key] = None

    def remove(self, key):
        del self.order[key]

    def victim(self, protected):
        for key in self.order:
            if key not in protected:
                return key
        raise none_left()


class DecayedCounts:
    """Access counts that halve every `half_life` tokens, kept for every key ever seen.

    Instead of decaying every count each token, the increment grows by 2**(1/half_life)
    per token: order between keys is the same and nothing needs touching but the key
    accessed. `value(key)` gives the decayed count.
    """

    def __init__(self, half_life=HALF_LIFE_LFU, initial=None):
        self.growth = 2.0 ** (1.0 / half_life)
        self.inc = 1.0
        self.count = dict(initial or {})

    def tick(self, tokens=1):
        self.inc *= self.growth ** tokens
        if self.inc > 1e150:  # renormalise long before float overflow
            self.count = {k: v / self.inc for k, v in self.count.items()}
            self.inc = 1.0
            return True
        return False

    def add(self, key, amount=1.0):
        self.count[key] = self.count.get(key, 0.0) + amount * self.inc
        return self.count[key]

    def value(self, key):
        return self.count.get(key, 0.0) / self.inc


def prior_counts(prior, half_life):
    """Decayed counts as if the profile's per-token rates `prior` [L, E] had been seen
    for a long time: rate / (1 - decay per token)."""
    if prior is None:
        return {}
    prior = np.asarray(prior, dtype=np.float64) / (1 - 2.0 ** (-1.0 / half_life))
    return {(int(l), int(e)): prior[l, e] for l, e in zip(*np.nonzero(prior))}


class LFU(Policy):
    """Least frequently used by decayed counts (history kept for evicted keys too);
    ties go to the least recently inserted."""

    name = "lfu"

    def __init__(self, capacity, num_layers, num_experts, half_life=HALF_LIFE_LFU, prior=None, **kw):
        super().__init__(capacity, num_layers, num_experts, **kw)
        self.counts = DecayedCounts(half_life, prior_counts(prior, half_life))
        self.heap = []  # (inflated count, seq, key), stale entries skipped lazily
        self.resident = set()
        self.seq = 0

    def _push(self, key):
        self.seq += 1
        heapq.heappush(self.heap, (self.counts.count.get(key, 0.0), self.seq, key))

    def tick(self, tokens=1):
        if self.counts.tick(tokens):
            self.heap = []
            for key in self.resident:
                self._push(key)

    def access(self, key, hit, score=None):
        self.counts.add(key)
        if hit:
            self._push(key)

    def insert(self, key):
        self.resident.add(key)
        self._push(key)

    def remove(self, key):
        self.resident.discard(key)

    def victim(self, protected):
        return pop_victim(self.heap, lambda e: e[2] in self.resident and e[0] == self.counts.count.get(e[2], 0.0),
                          lambda e: e[2], protected)


class SLRU(Policy):
    """Segmented LRU: new keys enter a probationary segment, a hit promotes to the
    protected segment (80 % of the cache), whose overflow is demoted back. The victim is
    the least frequently used (decayed counts) of the `window` least recent probationary
    keys. Pinned keys (by default a profile's hottest, up to `pin_share` of the protected
    segment) enter the protected segment and stay there."""

    name = "slru"

    def __init__(self, capacity, num_layers, num_experts, protected_share=0.8, window=4,
                 half_life=HALF_LIFE_LFU, prior=None, pinned=None, pin_share=0.25, **kw):
        super().__init__(capacity, num_layers, num_experts, **kw)
        self.probation, self.protected = OrderedDict(), OrderedDict()
        self.protected_share = protected_share
        self.protected_capacity = max(1, int(capacity * protected_share))
        self.window = window
        self.counts = DecayedCounts(half_life, prior_counts(prior, half_life))
        # by default a profile's hottest, at most pin_share of the protected segment
        self.pinned = set(pins(prior, int(self.protected_capacity * pin_share)) if pinned is None else pinned)

    def resized(self, capacity):
        super().resized(capacity)
        self.protected_capacity = max(1, int(capacity * self.protected_share))

    def tick(self, tokens=1):
        self.counts.tick(tokens)

    def access(self, key, hit, score=None):
        self.counts.add(key)
        if not hit:
            return
        if key in self.protected:
            self.protected.move_to_end(key)
            return
        del self.probation[key]
        self.protected[key] = None
        if len(self.protected) > self.protected_capacity:
            for old in self.protected:
                if old not in self.pinned:
                    del self.protected[old]
                    self.probation[old] = None
                    break

    def insert(self, key):
        (self.protected if key in self.pinned else self.probation)[key] = None

    def remove(self, key):
        self.probation.pop(key, None) or self.protected.pop(key, None)

    def victim(self, protected):
        candidates = []
        for key in self.probation:
            if key not in protected:
                candidates.append(key)
                if len(candidates) == self.window:
                    break
        if candidates:
            return min(candidates, key=self.counts.value)  # min keeps the least recent on ties
        for segment_keys in ([k for k in self.protected if k not in self.pinned], list(self.protected)):
            for key in segment_keys:
                if key not in protected:
                    return key
        raise none_left()


class S3FIFO(Policy):
    """S3-FIFO (Yang et al., SOSP 2023), the general-purpose yardstick: a small FIFO (10 %)
    filters one-hit keys, a main FIFO with reinsertion keeps the rest, and a ghost FIFO
    of recently evicted keys sends returning keys straight to main."""

    name = "s3fifo"

    def __init__(self, capacity, num_layers, num_experts, small_share=0.1, **kw):
        super().__init__(capacity, num_layers, num_experts, **kw)
        self.small, self.main, self.ghost = OrderedDict(), OrderedDict(), OrderedDict()
        self.small_share = small_share
        self.resized(capacity)
        self.freq = {}

    def resized(self, capacity):
        super().resized(capacity)
        self.small_capacity = max(1, int(capacity * self.small_share))
        self.ghost_capacity = capacity

    def access(self, key, hit, score=None):
        if hit:
            self.freq[key] = min(self.freq.get(key, 0) + 1, 3)

    def insert(self, key):
        self.freq[key] = 0
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None

    def remove(self, key):
        if self.small.pop(key, 1) is None:  # leaving the small queue: remember it
            self.ghost[key] = None
            if len(self.ghost) > self.ghost_capacity:
                self.ghost.popitem(last=False)
        else:
            self.main.pop(key, None)
        self.freq.pop(key, None)

    def victim(self, protected):
        # Each key is moved at most a few times, so this loop ends.
        for _ in range(4 * (len(self.small) + len(self.main)) + 4):
            from_small = len(self.small) >= self.small_capacity or not self.main
            queue = self.small if from_small else self.main
            key = next((k for k in queue if k not in protected), None)
            if key is None:  # all of that queue is protected (a call using most slots): the other one
                from_small = not from_small
                key = next((k for k in (self.small if from_small else self.main) if k not in protected), None)
                if key is None:
                    raise none_left()
            if from_small:
                del self.small[key]
                if self.freq.get(key, 0) > 0:
                    self.main[key] = None  # accessed while in small: promote
                    self.freq[key] = 0
                    continue
                self.small[key] = None  # back where remove() expects it
                return key
            if self.freq.get(key, 0) > 0:
                self.freq[key] -= 1
                self.main.move_to_end(key)
                continue
            return key
        raise none_left()


class Belady(Policy):
    """Belady's MIN: evict the key whose next use is farthest. Offline: it needs the
    whole future access sequence (`future`, keys in the order the cache sees them), so
    it exists for trace replay only, as the ceiling."""

    name = "belady"
    offline = True

    def __init__(self, capacity, num_layers, num_experts, future=None, **kw):
        super().__init__(capacity, num_layers, num_experts, **kw)
        if future is None:
            raise MlxmoeError("belady needs the future accesses: it is for `mlxmoe trace replay` only")
        self.next_use = [math.inf] * len(future)
        last = {}
        for i in range(len(future) - 1, -1, -1):
            self.next_use[i] = last.get(future[i], math.inf)
            last[future[i]] = i
        self.future = future
        self.pos = 0
        self.next_of = {}
        self.resident = set()
        self.heap = []  # (-next use, key)

    def access(self, key, hit, score=None):
        if self.future[self.pos] != key:
            raise MlxmoeError(f"belady was given a different access sequence (at {self.pos}: {key})")
        self.next_of[key] = self.next_use[self.pos]
        self.pos += 1
        if hit:
            heapq.heappush(self.heap, (-self.next_of[key], key))

    def insert(self, key):
        self.resident.add(key)
        heapq.heappush(self.heap, (-self.next_of[key], key))

    def remove(self, key):
        self.resident.discard(key)

    def victim(self, protected):
        return pop_victim(self.heap, lambda e: e[1] in self.resident and -e[0] == self.next_of[e[1]],
                          lambda e: e[1], protected)


class LayerSplit(Policy):
    """The peers' per-layer cache (llama.cpp forks, SharpInference): the slots split evenly
    across layers, each layer evicting its own keys by `rank` (the lowest goes first). A
    layer under its share takes a slot from the layer furthest over its own. Subclasses
    define rank(key); recency is kept per key as a tiebreak."""

    def __init__(self, capacity, num_layers, num_experts, **kw):
        super().__init__(capacity, num_layers, num_experts, **kw)
        self.resized(capacity)
        self.resident = [set() for _ in range(num_layers)]
        self.current = 0  # the layer whose call is being served
        self.clock = 0
        self.last_use = {}

    def resized(self, capacity):
        super().resized(capacity)
        base, extra = divmod(capacity, self.num_layers)
        self.share = [base + (layer < extra) for layer in range(self.num_layers)]

    def visit(self, layer, experts, scores=None, probs=None):
        self.current = layer

    def access(self, key, hit, score=None):
        self.clock += 1
        self.last_use[key] = self.clock

    def insert(self, key):
        self.resident[key[0]].add(key)
        self.last_use.setdefault(key, self.clock)

    def remove(self, key):
        self.resident[key[0]].discard(key)

    def victim(self, protected):
        over = sorted(range(self.num_layers), key=lambda l: self.share[l] - len(self.resident[l]))  # most over first
        cur = self.current
        if len(self.resident[cur]) >= self.share[cur]:  # at its share: the layer pays for itself
            over.remove(cur)
            over.insert(0, cur)
        for layer in over:
            keys = [k for k in self.resident[layer] if k not in protected]
            if keys:
                return min(keys, key=lambda k: (self.rank(k), self.last_use[k]))
        raise none_left()


class LayerLRU(LayerSplit):
    """Per-layer LRU on an even split of the slots."""

    name = "layer-lru"

    def rank(self, key):
        return self.last_use[key]


class LayerLFU(LayerSplit):
    """Per-layer LFU on an even split of the slots: counts of every use so far (no decay),
    ties to the least recent."""

    name = "layer-lfu"

    def __init__(self, capacity, num_layers, num_experts, **kw):
        super().__init__(capacity, num_layers, num_experts, **kw)
        self.count = {}

    def access(self, key, hit, score=None):
        super().access(key, hit, score)
        self.count[key] = self.count.get(key, 0) + 1

    def rank(self, key):
        return self.count.get(key, 0)


class LFUDA(LayerSplit):
    """LFU with dynamic aging (bigrig's default), per layer on an even split of the slots,
    as bigrig measures it: a key's priority is its uses while resident plus its layer's age
    at its last use, the age being the priority of the layer's last victim, so keys that
    were popular long ago age out. (Over one global cache the age rises with every miss of
    every layer, and a layer's keys age out before it runs again: 5 % hits on Mixtral.)"""

    name = "lfuda"

    def __init__(self, capacity, num_layers, num_experts, **kw):
        super().__init__(capacity, num_layers, num_experts, **kw)
        self.count = {}
        self.priority = {}
        self.age = [0.0] * num_layers

    def access(self, key, hit, score=None):
        super().access(key, hit, score)
        self.count[key] = self.count.get(key, 0) + 1
        if hit:
            self.priority[key] = self.count[key] + self.age[key[0]]

    def insert(self, key):  # after its victim set the age
        super().insert(key)
        self.count.setdefault(key, 0)  # (a pre-warmed or prefetched key, not yet used)
        self.priority[key] = self.count[key] + self.age[key[0]]

    def remove(self, key):
        super().remove(key)
        self.age[key[0]] = self.priority.pop(key)
        del self.count[key]

    def rank(self, key):
        return self.priority[key]
