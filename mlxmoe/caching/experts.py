"""StreamingExperts: stands in for mlx-lm's SwitchGLU/SwitchMLP.

It keeps the original module (its activation, bias handling, sorting and
gather_qmm/gather_mm call) but points its weights at the cache's slot pools, and calls
it with expert ids remapped to slot ids. So the arithmetic is mlx-lm's own.
"""

import copy
import threading
import time
from collections import deque
from itertools import chain, repeat
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..backend import GATHER_GEMM_ROWS, host_dists, host_floats, host_probs
from .cache import expert_groups, low_bit
from ..errors import MlxmoeError
from .lossy import host_logits
from .prefetch import decayed

# tokens of router mass a live profile's DeviceMass sums on the device between two reads
FLUSH_TOKENS = 64
# a sequence's resident decode steps whose routing is joined on the device and read in one
# host copy (JoinedSteps): a host read and an extra queue of the device's work per this many
# tokens, not per token (on CUDA a host read of a GPU array is a managed allocation and a copy)
JOIN_TOKENS = 8

FEW_CALLS = 16  # a decode step's layer calls (rows as lists) up to which plain Python summarises them faster than numpy (even warm)


def nest(slots: list, depth: int) -> mx.array:
    """`slots` as a uint32 array nested `depth` deep, as a decode step's indices are: no reshape op."""
    for _ in range(depth):
        slots = [slots]
    return mx.array(slots, dtype=mx.uint32)


class LayerCall(NamedTuple):
    """What the cache's observers learn of one layer call (one record, also where a call
    with more distinct experts than slots is fetched in groups of experts)."""

    layer: int
    position: int  # the position of the first of its tokens in the sequence
    rows: np.ndarray  # each token's experts [tokens, k]
    probs: np.ndarray | None  # each token's router distribution [tokens, experts]
    tokens: int  # tokens in the layer call
    experts: list  # the distinct experts, sorted
    scores: list | None  # their router probabilities (of the one token at a decode step)
    mean: np.ndarray | None  # the router's mean distribution over the tokens
    ticked: int  # tokens that start with this call (the first layer's), else 0


def step_call(layer, row, probs, tokens=1):
    """(layer, its distinct experts, their router scores, the router's distribution) of a
    decode step's layer call of `tokens` tokens whose experts are `row` (flat, token after
    token; `probs` likewise): summary() of it, as observe_calls and the policy's hits take it."""
    if tokens == 1 and isinstance(row, list):  # (a handful of experts: cheaper without numpy)
        experts, probs = sorted(set(row)), None if probs is None else probs.reshape(-1)
        return layer, experts, None if probs is None else [float(probs[e]) for e in experts], probs
    experts, scores, probs = summary(np.asarray(row).reshape(tokens, -1),
                                     None if probs is None else probs.reshape(tokens, -1))
    return layer, experts, scores, probs


def step_calls(layers, rows, probs, tokens=1) -> list:
    """step_call() of each of these layer calls; where each is one token's distinct experts
    with its router's distribution, in a few numpy calls for them all (the same values), but
    for a few calls whose rows are lists (step_call's plain Python)."""
    few = len(rows) <= FEW_CALLS and isinstance(rows[0], list)
    if tokens == 1 and not few and len({len(r) for r in rows}) == 1 and all(p is not None for p in probs):
        experts = np.sort(np.asarray(rows).reshape(len(rows), -1), axis=1)
        if not (experts[:, 1:] == experts[:, :-1]).any():
            dists = [p.reshape(-1) for p in probs]
            scores = np.stack(dists)[np.arange(len(rows))[:, None], experts]
            return list(zip(layers, experts.tolist(), scores.tolist(), dists))
    return [step_call(m, r, p, tokens) for m, r, p in zip(layers, rows, probs)]


def as_rows(row, tokens: int) -> np.ndarray:
    """A layer call's experts (flat) as mlx-lm's indices hold them: [tokens, k]."""
    return np.asarray(row, dtype=np.uint32).reshape(tokens, -1)


def observe_calls(cache, calls, rows, tokens=1, dists=None) -> None:
    """Tell the cache's observers of a decode step's layer calls of `tokens` tokens [(layer,
    experts, scores, probs)] (their experts in `rows`, flat; each token's router distribution
    in `dists`, flat, where given), in order; where the live profile is the only observer,
    it learns them at once (as ActivationProfile.observe would one by one); within a batched
    model call (a batch of one: `cache.rows`), its row's request learns them."""
    profile = cache.profile
    if cache.observers or profile is None or cache.rows is not None or any(c[3] is None for c in calls):
        for i, ((layer, experts, scores, probs), row) in enumerate(zip(calls, rows)):
            rows_ = as_rows(row, tokens)
            each = probs if dists is None else dists[i]
            each = None if each is None or (tokens > 1 and dists is None) else each.reshape(tokens, -1)
            cache.observe(LayerCall(layer, cache.call_position, rows_, each, tokens, experts, scores, probs,
                                    tokens if layer == 0 else 0))
    elif calls:
        layers = [c[0] for c in calls]
        at_layers = list(chain.from_iterable(repeat(c[0], len(c[1])) for c in calls))
        learn_step(cache, layers, at_layers, list(chain.from_iterable(c[1] for c in calls)),
                   np.stack([c[3] for c in calls]), tokens)


def learn_step(cache, layers, at_layers, experts, mass, tokens=1) -> None:
    """The live profile (the cache's only observer) learns a decode step's layer calls at
    once: each distinct expert `experts[i]` of layer `at_layers[i]` counted, the router's
    distribution of each of `layers` added to its mass, the step's tokens at the first layer."""
    with cache.lock:
        if cache.observed:  # (older calls first)
            cache.catch_up()
        cache.profile.observe_step(layers, at_layers, experts, mass, tokens if layers[0] == 0 else 0)


def row_counts(rows, sequences, missed=(), nbytes=0, real=None) -> np.ndarray:
    """Per sequence of a batched layer call whose tokens' experts are `rows` [tokens, k]
    (sequence after sequence, alike in length; `real`: each one's first tokens that are not
    padding, where some are): [hits, misses, bytes read], int64 [sequences, 3]. Each
    sequence's distinct experts count once, as its own call's would: a miss where in `missed`
    (the experts the call read), else a hit. The `nbytes` read, in equal parts per expert read,
    are shared by the sequences that routed to it (the remainder to the first)."""
    seq = np.repeat(np.arange(sequences), len(rows) // sequences)  # each token's
    if real is not None:  # (an expert only padding routed to: read, given to no sequence)
        keep = np.arange(len(rows)) % (len(rows) // sequences) < np.asarray(real)[seq]
        rows, seq = rows[keep], seq[keep]
    pairs = np.unique(rows.astype(np.int64) * sequences + seq[:, None])  # (expert, sequence), by expert
    expert, row = np.divmod(pairs, sequences)
    miss = np.isin(expert, missed)
    out = np.zeros((sequences, 3), dtype=np.int64)
    out[:, 0] = np.bincount(row[~miss], minlength=sequences)
    out[:, 1] = np.bincount(row[miss], minlength=sequences)
    if nbytes and miss.any():
        _, first, readers = np.unique(expert[miss], return_index=True, return_counts=True)
        part = nbytes // len(readers) + (np.arange(len(readers)) < nbytes % len(readers))  # each expert's bytes
        part, n = np.repeat(part, readers), np.repeat(readers, readers)  # of each (expert, sequence) pair read
        rank = np.arange(len(n)) - np.repeat(first, readers)  # the pair's place among its expert's readers
        np.add.at(out[:, 2], row[miss], part // n + (rank < part % n))
    return out


def count_rows(cache, batch, rows, experts, missed=(), nbytes=0) -> None:
    """A batched layer call's counts per row (row_counts), given to its rows' requests (`batch`,
    batching.CallRows); the cache's hits and misses count them too, in place of the call's
    distinct `experts` (of which `missed` missed), so that the requests' add up to the cache's."""
    per_row = row_counts(rows, batch.size, missed, nbytes, batch.real)
    with cache.lock:
        cache.counters.hits += int(per_row[:, 0].sum()) - len(experts) + len(missed)
        cache.counters.misses += int(per_row[:, 1].sum()) - len(missed)
        batch.count(per_row)


def distinct_counts(rows: np.ndarray) -> np.ndarray:
    """The distinct experts of each row of `rows` (along its last axis)."""
    return (np.diff(np.sort(rows, axis=-1), axis=-1) != 0).sum(axis=-1) + 1


def count_hit_rows(cache, batch, rows, union=0) -> None:
    """count_rows of a batched step's layer calls that all hit, in one go: `rows` [calls,
    sequences, k]; the cache's hits count each row's distinct experts in place of the calls'
    `union` (counted already)."""
    per_row = np.zeros((batch.size, 3), dtype=np.int64)
    per_row[:, 0] = distinct_counts(rows).sum(axis=0)
    with cache.lock:
        cache.counters.hits += int(per_row[:, 0].sum()) - union
        batch.count(per_row)


def told(cache, call, fetch):
    """`fetch(missed)` (the cache's fetches of layer call `call`, given a list to put their
    misses in), then the call counted per row (a batched model call's: count_rows) and told
    to the observers. Returns what fetch returned."""
    batch, missed, read = cache.rows, [], cache.counters.demand_bytes
    out = fetch(missed)
    if batch is not None:
        count_rows(cache, batch, call.rows, call.experts, missed, cache.counters.demand_bytes - read)
    cache.observe(call)
    return out


def _tapped(cls):
    """A subclass of a router's Linear class whose call also keeps its output."""

    def __call__(self, x):
        logits = cls.__call__(self, x)
        object.__setattr__(self, "last_logits", logits)  # (an attribute, not a parameter of the module's tree)
        return logits

    return type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})


def find_router(block, num_experts=None):
    """The router of the MoE block that holds the experts (its `gate` or `router`), as
    two functions: probs(x), the router's probabilities over all experts for the input
    it just routed, and scores(x), its scores for any hidden state x (for lookahead).
    (None, None) if it has neither, or if its scores are not one per expert (of
    `num_experts`, where given: e.g. a router that also scores zero-compute experts).

    A Linear router is tapped: its instance gets a subclass that keeps its logits, so
    probs come from the model's own routing with no second matmul (and the parameter
    tree stays as mlx-lm built it)."""
    gate = block.get("gate", block.get("router")) if isinstance(block, nn.Module) else None
    weight = getattr(gate, "weight", None)
    if num_experts is not None and isinstance(weight, mx.array) and weight.ndim == 2 \
            and weight.shape[0] != num_experts:
        return None, None
    if isinstance(gate, (nn.Linear, nn.QuantizedLinear)):
        base = type(gate)
        gate.__class__ = _tapped(base)

        def probs(x):
            return mx.softmax(gate.last_logits.astype(mx.float32), axis=-1, precise=True)

        probs.logits = lambda: gate.last_logits  # the model's own array: host_probs reads it with no op
        probs.gate = gate  # (lossy.attach_lossy biases it)
        return probs, lambda x: base.__call__(gate, x)
    if isinstance(weight, mx.array) and weight.ndim == 2:  # e.g. deepseek's MoEGate: sigmoid scores
        def scores(x):
            return (x @ weight.T).astype(mx.float32)

        def probs(x):
            s = mx.sigmoid(scores(x))
            return s / s.sum(axis=-1, keepdims=True)

        return probs, scores
    return None, None


def wait_for(cache, arrays, decode: bool) -> float:
    """mx.eval(arrays): a layer call's routing, and with it every earlier layer (mlx-lm's own
    work). At a decode step the earlier layers' deferred policy updates are done while the device
    computes (host_work_meanwhile). Returns the seconds waited, those updates left out (they are
    bookkeeping)."""
    tic, spent = time.perf_counter(), 0.0
    if decode and cache.deferred:
        mx.async_eval(*arrays)
        spent = host_work_meanwhile(cache, layer_call=True)
    mx.eval(*arrays)
    return time.perf_counter() - tic - spent


def host_work_meanwhile(cache, layer_call: bool = False) -> float:
    """Before a wait on the device: the host work left for later (`deferred`) done while the
    device computes, by the prefetcher's host thread where it runs (off the decode thread: a
    GPU's host has a core for it), else here; at a per-layer `layer_call`'s wait, the policy's
    updates alone (the observers' calls wait for the token's end). Returns the seconds this
    thread spent (bookkeeping)."""
    tic = time.perf_counter()
    prefetcher = cache.prefetcher
    if prefetcher is not None and prefetcher.off_thread:
        prefetcher.hand_off()
    elif cache.deferred:
        with cache.lock:
            cache.catch_up(policy_only=layer_call)
    return time.perf_counter() - tic


def resident_table(cache) -> list | None:
    """Every expert's slot, per layer an mx array [experts] (kept as cache.slot_table), once
    all are resident and none is on its way (with room for all, nothing is evicted: they
    stay put), else None: the layers' slots on the resident path. None while the cache's
    `hold_resident` is set."""
    cache.check_open()
    if cache.slot_table is None and not cache.hold_resident:
        cache.slot_table = all_resident(cache)
    return cache.slot_table


def all_resident(cache) -> list | None:
    """resident_table's table, if every expert is resident and none is on its way now, else None."""
    L, E = cache.store.num_layers, cache.store.num_experts
    if cache.prefetcher is not None or len(cache.slot_of) < L * E:
        return None  # (asked again under the lock before the table is made)
    # under the lock: a pre-warm claims a slot (slot_of) and marks it on its way
    # (in_flight) in one step, so the last expert's read is never missed here
    with cache.lock:
        if cache.prefetcher is not None or cache.in_flight or len(cache.slot_of) < L * E:
            return None
        table = np.zeros((L, E), dtype=np.uint32)
        for (layer, e), slot in cache.slot_of.items():
            table[layer, e] = slot
        at_home = cache.home is not None and all(slot == cache.home(key) for key, slot in cache.slot_of.items())
    if cache.loader.failed:  # background reads that failed: read now (a second failure raises)
        cache.loader.read_failed()
    return SlotTable([mx.array(row) for row in table], cache.pools, at_home)  # one per layer: no slicing op per call


class SlotTable(list):
    """resident_table's table: per layer an mx array [experts] of each expert's slot. `at_home`:
    every expert at its home (ExpertCache.home), a layer's experts its pools' rows in expert
    order, so that a layer computes from views of those rows with mlx-lm's own indices
    (experts_at_home), as stock does: no lookup op a layer call."""

    def __init__(self, rows: list, pools, at_home: bool) -> None:
        super().__init__(rows)
        self.pools, self.at_home, self.modules = pools, at_home, {}
        self.batch, self.joined = [], None  # JoinedSteps: the decode steps not joined yet, (first, last) of the last joined

    def experts(self, streaming, x, indices):
        """`streaming`'s experts' output for `x` routed to `indices`: from the views where every
        expert is at home, else through a lookup of their slots."""
        if self.at_home:
            return self.experts_at_home(streaming)(x, indices)
        return streaming._inner(x, self[streaming._layer][indices])

    def experts_at_home(self, streaming):
        """`streaming`'s mlx-lm experts module with each weight a view (no copy) of its layer's
        rows of the pool, made at the layer's first call."""
        module = self.modules.get(streaming._layer)
        if module is None:
            inner, E = streaming._inner, len(self[streaming._layer])
            module = copy.copy(inner)
            for name, pool in zip(self.pools.names, self.pools.compute):
                lin, p = name.split(".")
                if module[lin] is inner[lin]:
                    module[lin] = copy.copy(inner[lin])
                module[lin][p] = pool[streaming._layer * E:(streaming._layer + 1) * E]
            mx.eval(module.parameters())
            self.modules[streaming._layer] = module
        return module


class DeviceMass:
    """A live profile's router mass from the resident path's decode steps, summed on the device
    and read by the host when the profile's mass is read (`take`) or every FLUSH_TOKENS tokens:
    a step's [layers, experts] router arrays, just computed, cost the host more to read (fresh
    device memory), softmax and add than they cost the device. A step's arrays wait (`waiting`)
    until the decode thread queues the next token (`queue`: ops of its graph, no wait of their
    own). Each step is weighed against the profile's tick count at the sum's start (`start`); the
    decay since is applied at the read."""

    def __init__(self, profile) -> None:
        self.profile, self.sum, self.start, self.waiting = profile, None, None, []
        self.lock = threading.Lock()  # (a profile is read from other threads: a server's)
        profile.unread = self

    @classmethod
    def of(cls, profile) -> "DeviceMass":
        return profile.unread if isinstance(profile.unread, cls) else cls(profile)

    def add(self, routers: mx.array, tapped: bool, rows=slice(None)) -> None:
        """A decode step's routers [layers, experts], `routers[rows]` (a tapped router's
        logits, else its probabilities; computed), after its tick."""
        p = self.profile
        if self.start is not None and p.tokens_total - self.start >= FLUSH_TOKENS:
            p.mass  # (its read takes what is summed)
        with self.lock:
            self.start = p.tokens_total if self.start is None else self.start
            self.waiting.append((routers, rows, tapped, 1.0 / p.decay(p.tokens_total - self.start)))

    def queue(self) -> list:
        """The new sum, with the steps waiting, to be queued by the decode thread ([] if none wait)."""
        with self.lock:
            if not self.waiting:
                return []
            for routers, rows, tapped, weight in self.waiting:
                dists = routers[rows].astype(mx.float32)
                dists = mx.softmax(dists, axis=-1, precise=True) * weight if tapped else dists * weight
                self.sum = dists if self.sum is None else self.sum + dists
            self.waiting = []
            return [self.sum]

    def take(self) -> np.ndarray | None:
        """What is summed, decayed to now (float64 [layers, experts]), or None; the sum starts over."""
        with self.lock:
            total, waiting, start = self.sum, self.waiting, self.start
            self.sum, self.waiting, self.start = None, [], None
        if start is None:
            return None
        host = np.zeros((self.profile.num_layers, self.profile.num_experts)) if total is None \
            else host_floats(total).astype(np.float64)
        for routers, rows, tapped, weight in waiting:  # (steps not queued yet: their arrays are computed)
            host += weight * host_dists(routers, tapped)[rows]
        return host * self.profile.decay(self.profile.tokens_total - start)


class ResidentCalls:
    """One token's layer calls on the resident path, [(StreamingExperts, indices, logits,
    probs)], accounted in one go once their routing is on the host: the tapped routers'
    probabilities from their logits in one softmax, then each call's hits and observers in
    layer order. `side`: the untapped routers' probabilities, which the model's output does
    not need.

    The token's first layer call queues it in the cache's `deferred` (defer). mlx-lm builds a
    token's graph while the previous one computes and has waited for the one before, so the
    work queued before the previous token's is done then with no sync; the previous token's
    side arrays are queued for evaluation then, all at once (read unqueued, they would wait
    for everything queued before them). A decode step's routing is packed into two arrays
    (`packed`) queued with its last layer call: read in two host copies, not two a layer call
    (on CUDA each host read of a GPU array is a managed allocation and a synchronous copy)."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.calls: list = []
        self.side: list = []
        self.packed = None  # the JoinedSteps holding this decode step's routing, and where: pack()
        self.routers = None  # its calls' router arrays, alike (_step_routers)
        # a batched model call's rows: its calls counted and learnt per row (batching.CallRows)
        self.rows, self.profile = cache.rows, cache.profile if cache.rows is None else cache.rows

    @classmethod
    def defer(cls, cache, layer: int) -> "ResidentCalls":
        """The current token's work (queued last in `deferred` until done), a new one at the
        token's first layer call."""
        if layer != 0:  # (the token's work, last in `deferred`: one read of it needs no lock)
            try:
                last = cache.deferred[-1][0]
            except IndexError:
                last = None
            if isinstance(last, cls):
                return last
        with cache.lock:
            last = cache.deferred[-1][0] if cache.deferred else None
            previous = last if isinstance(last, cls) else None
            if layer != 0 and previous is not None:
                return previous
            work = cls(cache)
            if previous is not None and previous.side:
                mx.async_eval(*previous.side)
            cache.deferred.append((work, ()))
            tic = time.perf_counter()
            cache.catch_up(until=JoinedSteps.unfinished(cache.slot_table, previous, work))
            cache.counters.bookkeeping_seconds += time.perf_counter() - tic
            return work

    def __call__(self) -> None:
        table = self.cache.slot_table
        if self.packed is None and table is not None and self in table.batch:  # (read before its batch was joined)
            mx.eval(JoinedSteps.join(table))  # (in this thread: its arrays are of this thread's stream)
        if self.packed is not None and (self.rows is None or not self.cache.observers):  # (pack() checked the rest)
            return self._decode_step(None)
        routers = self._step_routers()
        if routers is not None:
            return self._decode_step(routers)
        self._call_by_call()

    def _step_routers(self) -> list | None:
        """The routers' arrays of a decode step whose calls (one token a sequence) are alike,
        else None. A batch's (its rows all its requests' own, one token each) where no observer
        takes its calls one by one."""
        calls = self.calls
        routers = [c[2] if c[2] is not None else c[3] for c in calls]
        if not calls or self.rows is not None and (self.rows.real is not None or self.cache.observers):
            return None
        one_token = calls[0][1].size == calls[0][1].shape[-1] * (1 if self.rows is None else self.rows.size)
        if one_token and all(r is not None for r in routers) \
                and len({(c[1].shape, r.shape, r.dtype, c[2] is None) for c, r in zip(calls, routers)}) == 1:
            return routers
        return None

    def pack(self, table) -> list:
        """Once a decode step's calls are all built (at its last layer call): the step joins
        the slot table's batch of steps whose routing is joined on the device (JoinedSteps), one
        sequence's JOIN_TOKENS steps, a batch's each alone. Returns the arrays to be queued with
        this step ([] until its batch is full, and where it is no decode step)."""
        self.routers = self._step_routers()
        if self.routers is None:
            return []
        batch = table.batch
        first = batch[0] if batch else self
        queued = JoinedSteps.join(table) if batch and not batch[0].alike(self) else []
        batch.append(self)
        if len(batch) >= (JOIN_TOKENS if self.rows is None else 1):
            queued += JoinedSteps.join(table)
        if queued:  # (the steps joined now: a batch, or two where this step's is unlike the last)
            table.joined = (first, self)
        return queued

    def alike(self, other) -> bool:
        """Whether `other`'s routing joins this step's along their first axis."""
        return self.rows is None and other.rows is None and len(self.calls) == len(other.calls) \
            and all(a[1].shape == b[1].shape for a, b in zip(self.calls, other.calls)) \
            and self.routers[0].shape == other.routers[0].shape and self.routers[0].dtype == other.routers[0].dtype

    def _call_by_call(self) -> None:
        logits = [c[2] for c in self.calls if c[2] is not None]
        from_logits = iter(host_probs(logits) if logits else ())
        steps, rows = [], []  # a decode step's calls: told at once (observe_calls)
        for module, indices, tapped, probs in self.calls:
            _, flat, p = module._routing(indices, probs if tapped is None else next(from_logits))
            if len(flat) == 1 and self.rows is None:
                steps.append(step_call(module._layer, flat[0], p))
                rows.append(flat[0])
                self.cache.counters.hits += len(steps[-1][1])  # no policy: nothing will be evicted
                continue
            call = module._record(flat, p)
            self.cache.counters.hits += len(call.experts)
            if self.rows is not None:
                count_rows(self.cache, self.rows, flat, call.experts)
            self.cache.observe(call, self.profile)
        if steps:
            observe_calls(self.cache, steps, rows)

    def _decode_step(self, routers) -> None:
        """A decode step's accounting (its calls one token each, alike): what __call__ does
        call by call, in one go from its routing read into two host arrays (the live profile
        learns the step at once where it is the only observer)."""
        cache = self.cache
        tapped = self.calls[0][2] is not None  # (routers: a tapped router's logits, else its probabilities)
        layers = [c[0]._layer for c in self.calls]
        # the live profile, the only observer, of one sequence's step over every layer: its mass on the device
        on_device = self.packed is not None and self.rows is None and not cache.observers \
            and cache.profile is not None and layers == list(range(cache.store.num_layers))
        if self.packed is not None:
            joined, at = self.packed
            rows = joined.rows()[at]
            probs = None if on_device else joined.dists(tapped)[at]
        else:  # (under several ranks nothing was packed: the calls' own arrays, no new op to wait for)
            rows = np.concatenate([np.asarray(c[1]).reshape(-1, c[1].shape[-1]) for c in self.calls])
            probs = np.concatenate(host_probs(routers) if tapped else [host_floats(r) for r in routers])
        size = len(rows) // len(layers)  # (sequences: a batch's rows)
        if layers[0] == 0:
            cache.tick(size)
        if self.rows is not None:  # each row's hits and routing its request's (as count_rows and CallRows.learn)
            each = rows.reshape(len(layers), size, -1)
            count_hit_rows(cache, self.rows, each)
            self.rows.learn_step(layers, each, probs.reshape(len(layers), size, -1))
            return
        cache.counters.hits += int(distinct_counts(rows).sum())
        if cache.observers or cache.profile is None:
            observe_calls(cache, step_calls(layers, rows, probs), list(rows))
        else:  # (a row's repeated expert, if any, counted once: as its distinct experts)
            learn_step(cache, layers, np.array(layers)[:, None], rows, probs)
            if on_device:
                DeviceMass.of(cache.profile).add(self.packed[0].routers, tapped, self.packed[1])


class JoinedSteps:
    """Resident decode steps' routing joined on the device into two arrays, `indices` [rows,
    1, k] and `routers` [rows, 1, experts] (a step's rows: its calls' in layer order), queued
    with the last step's graph and read on the host in one copy each when the first step is
    accounted; each step's `packed` is (this, its rows' slice). The steps of a batch are done
    in `deferred` only once the graph that joined them is done (unfinished): no wait."""

    def __init__(self, steps: list) -> None:
        calls = [c for step in steps for c in step.calls]
        self.indices = mx.concatenate([c[1] for c in calls])
        self.routers = mx.concatenate([r for step in steps for r in step.routers])
        self.host_rows, self.host_routers = None, None
        start = 0
        for step in steps:
            n = sum(c[1].size // c[1].shape[-1] for c in step.calls)  # (its rows of experts, as rows() reads them)
            step.packed, start = (self, slice(start, start + n)), start + n

    @classmethod
    def join(cls, table) -> list:
        """Join the slot table's batch (emptied); the arrays to queue."""
        steps = list(table.batch)
        table.batch.clear()
        joined = cls(steps)
        summed = getattr(steps[0].profile, "unread", None) if steps[0].rows is None else None
        return [joined.indices, joined.routers] + (summed.queue() if isinstance(summed, DeviceMass) else [])

    @staticmethod
    def unfinished(table, previous, work):
        """The first step of `deferred` whose routing may not be computed yet when `work`, a
        new token's, starts: mlx-lm has waited for the token before `previous` (the previous
        token's step) only, so that of a batch joined by `previous`, else of the batch not joined."""
        if previous is None or table is None:
            return work if previous is None else previous
        if table.joined is not None and table.joined[1] is previous:
            return table.joined[0]
        return table.batch[0] if table.batch else previous

    def rows(self) -> np.ndarray:
        """The steps' experts on the host, [rows, k]."""
        if self.host_rows is None:
            self.host_rows = np.asarray(self.indices).reshape(-1, self.indices.shape[-1])
        return self.host_rows

    def dists(self, tapped: bool) -> np.ndarray:
        """The steps' router distributions on the host (backend.host_dists)."""
        if self.host_routers is None:
            self.host_routers = host_dists(self.routers, tapped)
        return self.host_routers


def drained(queue: deque):
    """The items of `queue`, taken out one by one."""
    while True:
        try:
            yield queue.popleft()
        except IndexError:
            return


class StepRouting:
    """A decode step's routing beyond its experts, read on the host when first asked (under
    the cache's lock): by the policy at once where the layer call misses, else by the host
    work left for later (off the decode thread where a prefetcher runs), which also makes the
    observers' LayerCall from it. Those not yet read wait in `unread` (the cache's), and the
    first asked reads them all in one go: host work done right after a wait on the device runs
    cold (a softmax of one router's logits ~100 us here, against ~15 us warm)."""

    def __init__(self, layer: int, row: list, probs: mx.array | None, logits: mx.array | None, experts: list,
                 position: int, unread: deque) -> None:
        self.layer, self.row, self.experts, self.position = layer, row, experts, position
        self.probs, self.logits = probs, logits  # evaluated: the router's distribution, or a tapped router's logits
        self.read = None
        if logits is not None:
            unread.append(self)
        self.unread = unread

    def __call__(self) -> tuple:
        """(the experts' router probabilities, the router's distribution), None where unknown."""
        if self.read is None and self.logits is not None:
            batch = [self] + [r for r in drained(self.unread) if r.read is None and r is not self]
            for r, p in zip(batch, host_probs([r.logits for r in batch])):
                r.known(p.reshape(-1))
        elif self.read is None:
            self.known(None if self.probs is None else np.array(self.probs).reshape(-1))
        return self.read

    def known(self, p: np.ndarray | None) -> None:
        self.read = (None, None) if p is None else ([float(p[e]) for e in self.experts], p)

    def record(self) -> LayerCall:
        scores, probs = self()
        rows = np.array([self.row], dtype=np.uint32)  # as mlx-lm's indices are
        return LayerCall(self.layer, self.position, rows, None if probs is None else probs.reshape(1, -1), 1,
                         self.experts, scores, probs, 1 if self.layer == 0 else 0)


def summary(rows, probs):
    """The distinct experts of `rows` (sorted), their router scores and the router's
    mean distribution over the rows (None where unknown)."""
    if len(rows) == 1:  # decode: a handful of experts, cheaper without numpy
        experts = sorted(set(rows[0].tolist()))
        if probs is None:
            return experts, None, None
        probs = probs[0]
        return experts, [float(probs[e]) for e in experts], probs
    experts = np.unique(rows).tolist()
    probs = None if probs is None else probs.mean(axis=0)
    return experts, None if probs is None else probs[experts].tolist(), probs


def split_exact(runtime) -> bool:
    """Whether a layer call's experts may be computed in several calls (Backend.split_exact)."""
    return runtime is None or runtime.backend.split_exact


def whole_call_rows(t, j, total, exact):
    """A group's (token, expert) pairs `t`, `j` of a layer call of `total` pairs, with copies
    of the last up to GATHER_GEMM_ROWS where the backend's kernel follows the row count (not
    `exact`) and the whole call reaches that many: the group computes with its kernel."""
    n = len(t)
    if exact or not n < GATHER_GEMM_ROWS <= total:
        return t, j
    pad = (0, GATHER_GEMM_ROWS - n)
    return np.pad(t, pad, mode="edge"), np.pad(j, pad, mode="edge")


class StreamingExperts(nn.Module):
    def __init__(self, inner, layer, router=None, cache=None):
        super().__init__()
        # Underscored attributes are not parameters: load_weights and set_dtype skip them.
        self._inner = inner
        self._layer = layer
        self._router = router
        self._cache = cache
        self._runtime = None  # api.Runtime, with the cache (loader.attach_cache)
        self._lossy = None  # lossy.Lossy where a lossy mode is on (lossy.attach_lossy)
        self._fallback = None  # the experts' low-bit copies, a module like _inner (fallback.attach_fallback)

    def __call__(self, x, indices):
        runtime, cache = self._runtime, self._cache
        if runtime is None or runtime.group is None:
            if cache.slot_table is not None:  # (every expert resident: no verified step, no running ahead)
                return self._resident(x, indices, resident_table(cache))
            return self._call(x, indices)
        try:
            return self._call(x, indices)
        except MlxmoeError as e:
            # A rank of a group keeps its peers' pipeline going with zeros for this layer;
            # after this token every rank stops with the error (api.stream_generate).
            runtime.error = runtime.error or e
            return mx.zeros((*indices.shape, x.shape[-1]), x.dtype)

    def _call(self, x, indices):
        cache = self._cache
        if cache.verifier is not None and cache.verifier.forward:
            return cache.verifier.experts(self, x, indices)  # a verified decode step (verify.py)
        if cache.speculator is not None and cache.speculator.running is not None:
            return cache.speculator.experts(self, x, indices)  # running ahead (speculate.py)
        table = resident_table(cache)
        if table is not None:
            return self._resident(x, indices, table)
        tic = time.perf_counter()
        decode = x.size == x.shape[-1]
        prefetcher = cache.prefetcher
        # the prefetcher's lookahead is evaluated with this layer's routing: one sync, not two
        ahead_scores = prefetcher.lookahead(self._layer, x, decode) if prefetcher is not None else {}
        # a decode step reads a tapped router's own logits (no op; the softmax on the host,
        # when first needed: see StepRouting)
        logits = self._logits() if decode else None
        probs = self._probs(x) if logits is None else None
        router = probs if logits is None else logits
        sync = wait_for(cache, (indices, *([] if router is None else [router]), *ahead_scores.values()), decode)
        if decode:  # what a wait per layer costs (the device's work the host could not build beside)
            cache.layer_wait = decayed(cache.layer_wait, sync)
        counters = cache.counters
        read_before = counters.read_seconds
        scales = None
        if decode:
            slots, rows, ready, scales = self._step(x, indices, probs, logits)
        else:
            ready = None
            idx, rows, probs = self._routing(indices, probs)
            groups = expert_groups(rows, cache.capacity)
            if len(groups) > 1:
                return self._grouped(x, idx, rows, probs, groups)
            slots = self._slots(rows, idx, probs)
        inner = time.perf_counter()
        # mlx-lm's own work: building the expert computation (none left where low-bit copies took all)
        y = self._inner(x, slots) if slots is not None else None
        if ready is not None:  # the experts resident before the reads (or low-bit copies), computed meanwhile
            order, y_ready = ready
            y = y_ready if y is None else mx.concatenate([y_ready, y], axis=-2)
            y = mx.take(y, mx.array(np.argsort(order)), axis=-2)
        if scales is not None:  # a lossy mode reweighted or dropped some experts (lossy.Lossy.step)
            y = y * mx.array(scales, dtype=y.dtype)[:, None]
        inner = time.perf_counter() - inner
        if prefetcher is not None:
            prefetcher.layer_done(self._layer, rows, ahead_scores, counters.tokens, decode)
        # what this layer added beyond mlx-lm's own work (building and evaluating the
        # model up to the router, building the expert computation) and the reads: the
        # lookahead and router probabilities, routing copies, the policy, remapping
        counters.bookkeeping_seconds += time.perf_counter() - tic - sync - inner - (counters.read_seconds - read_before)
        return y

    def _grouped(self, x, idx, rows, probs, groups):
        """More distinct experts than slots (a long prefill at a small cache): fetch the
        experts in `groups` that fit, each read once, and compute each group's (token,
        expert) pairs, evaluated before the next group may reuse its slots; the pairs'
        outputs are then put back in the order of `idx`. The observers see one layer call."""
        cache, call = self._cache, self._record(rows, probs)
        score = None if call.scores is None else dict(zip(call.experts, call.scores))
        xs = x.reshape(-1, x.shape[-1])
        outs, places = [], []

        def compute(missed):
            for group in groups:
                slots = cache.fetch(self._layer, group, None if score is None else [score[e] for e in group],
                                    call.mean, misses=missed)
                lut = np.zeros(group[-1] + 1, dtype=np.uint32)
                lut[group] = slots
                t, j = np.nonzero(np.isin(rows, group))
                n = len(t)
                t, j = whole_call_rows(t, j, rows.size, split_exact(self._runtime))
                y = self._inner(xs[mx.array(t)], mx.array(lut[rows[t, j]].reshape(-1, 1)))
                mx.eval(y)
                outs.append(y[:n].reshape(n, *y.shape[2:]))
                places.append(t[:n] * rows.shape[1] + j[:n])
        told(cache, call, compute)
        y = mx.concatenate(outs, axis=0)[mx.array(np.argsort(np.concatenate(places)))]
        return y.reshape(*idx.shape, *y.shape[1:])

    def _probs(self, x):
        """The router's distribution for x (unevaluated), where the cache uses it."""
        return self._router(x) if self._router is not None and self._cache.wants_probs() else None

    def _logits(self):
        """The tapped router's logits of this call (the model's own array), where the cache
        uses the router's distribution; else None."""
        logits = getattr(self._router, "logits", None)
        return logits() if logits is not None and (self._lossy is not None or self._cache.wants_probs()) else None

    def _routing(self, indices, probs):
        """The evaluated routing on the host: (indices, indices [tokens, k], probs [tokens,
        experts] or None); ticks the cache at the first layer."""
        idx = np.array(indices)
        if probs is not None:
            probs = np.array(probs).reshape(-1, probs.shape[-1])
        flat = idx.reshape(-1, idx.shape[-1])
        if self._layer == 0:
            self._cache.tick(flat.shape[0])
        return idx, flat, probs

    def _step(self, x, indices, probs, logits):
        """A decode step (one token): its experts read as a list, the rest of its routing
        (the router's `probs`, or a tapped router's `logits`) as the policy and the observers
        need it (StepRouting). Where some experts are read on the decode thread, those
        already resident are computed while they are read (where Backend.split_exact). Returns
        (slots nested as `indices` of the experts left to compute, [the token's experts], None
        or (the order of the rows of [computed early, left], the early rows' output), None or the
        scale of each routed expert's output where a lossy mode reweighted or skipped some: see lossy.py)."""
        cache = self._cache
        row, depth = indices.tolist(), 0
        while isinstance(row[0], list):
            row, depth = row[0], depth + 1
        if self._layer == 0:
            cache.tick(1)
        keep, scales = None, None
        if self._lossy is not None:
            keep, scales = self._lossy_step(row, logits)
        experts = sorted(set(row if keep is None else [e for e, k in zip(row, keep) if k]))
        if self._fallback is not None:
            with cache.lock:  # (background loads neither evict nor add a key meanwhile)
                return self._substitute(x, row, depth, keep, scales, low_bit(cache, self._layer, experts), probs, logits)
        routing = StepRouting(self._layer, row, probs, logits, experts, cache.call_position, cache.unread)
        started = []

        def early(ready):
            cols = [i for i, e in enumerate(row) if e in ready]
            y = self._inner(x, nest([ready[row[i]] for i in cols], depth))
            mx.async_eval(y)
            started.append((cols, y))
            if cache.speculator is not None:  # the layer's output with these, while running ahead
                cache.speculator.early = (self._layer, cols, y)

        try:  # (where the backend's kernel follows the row count: one call of all the experts)
            slots = cache.fetch(self._layer, experts, routing=routing,
                                early=early if split_exact(self._runtime) else None)
        except BaseException:
            if started:  # nothing may still compute from slots that leave the cache
                mx.eval(started[0][1])
            raise
        cache.observe(routing.record, later=True)
        slot_of = dict(zip(experts, slots))
        if keep is not None:  # a skipped expert computes with a kept one's slot, scaled by 0
            for e in row:
                slot_of.setdefault(e, slots[0])
        if not started:
            return nest([slot_of[e] for e in row], depth), [row], None, scales
        cols, y_ready = started[0]
        rest = [i for i in range(len(row)) if i not in cols]
        return nest([slot_of[row[i]] for i in rest], depth), [row], (cols + rest, y_ready), scales

    def _substitute(self, x, row, depth, keep, scales, low, probs, logits):
        """_step where some experts (`low`) compute with their low-bit copies at once and are
        read in the background; the others are resident: a fetch of them never reads (under
        the cache's lock, held by the caller)."""
        cache, layer = self._cache, self._layer
        kept = keep or [True] * len(row)
        cols = [i for i, e in enumerate(row) if kept[i] and e in low]
        y_low = self._fallback(x, nest([row[i] for i in cols], depth)) if cols else None
        rest = [i for i in range(len(row)) if i not in cols]
        experts = sorted({row[i] for i in rest if kept[i]})
        routing = StepRouting(layer, row, probs, logits, experts, cache.call_position, cache.unread)
        slots = cache.fetch(layer, experts, routing=routing) if experts else []
        cache.observe(routing.record, later=True)
        cache.counters.substituted += len(cols)
        cache.fallback.request([(layer, row[i]) for i in cols])
        slot_of = dict(zip(experts, slots))
        fill = slots[0] if slots else None
        rest_slots = [slot_of.get(row[i], fill) for i in rest]
        if fill is None and rest:  # only skipped experts left: they compute with a low-bit copy, scaled by 0
            cols, rest = cols + rest, []
            y_low = self._fallback(x, nest([row[i] for i in cols], depth))
        if not cols:
            return nest(rest_slots, depth), [row], None, scales
        return (nest(rest_slots, depth) if rest else None), [row], (cols + rest, y_low), scales

    def _lossy_step(self, row, logits):
        """The lossy modes' decision for one token (lossy.Lossy.step), counted in the cache's
        counters: (which routed experts to keep, or None: all; scales or None)."""
        cache, gate = self._cache, self._router.gate
        slot_of, layer = cache.slot_of, self._layer
        resident = [(layer, e) in slot_of for e in row]
        mask = getattr(gate, "last_mask", None)
        if mask is None and all(resident):  # (the common case: nothing to do)
            return None, None
        keep, scales, biased = self._lossy.step(host_logits(logits), row, resident, mask)
        skipped = len(row) - sum(keep)
        counters = cache.counters
        counters.skipped += skipped
        counters.biased += biased
        return (keep if skipped else None), scales

    def _resident(self, x, indices, table):
        """Every expert resident (they stay put): slots from the table on the device, the host
        work (hits, live profile, trace; no policy) done once the token's routing is computed
        anyway (ResidentCalls): no sync, the token queued whole as stock queues it."""
        logits = self._logits()
        probs = self._probs(x) if logits is None else None
        work = ResidentCalls.defer(self._cache, self._layer)
        work.calls.append((self, indices, logits, probs))
        if probs is not None:
            work.side.append(probs)
        out = table.experts(self, x, indices)
        last = self._layer == len(table) - 1
        packed = work.pack(table) if last and self._runtime is not None and self._runtime.group is None else []
        if packed:
            mx.async_eval(out, *packed)
        return out

    def _record(self, rows: np.ndarray, probs: np.ndarray | None) -> LayerCall:
        """The LayerCall of a layer call's `rows`."""
        experts, scores, mean = summary(rows, probs)
        ticked = len(rows) if self._layer == 0 else 0
        return LayerCall(self._layer, self._cache.call_position, rows, probs, len(rows), experts, scores, mean, ticked)

    def _slots(self, rows: np.ndarray, idx: np.ndarray, probs: np.ndarray | None) -> mx.array:
        """Fetch the distinct experts of a layer call's `rows` and tell the cache's observers;
        return `idx` with expert ids replaced by slots."""
        cache, call = self._cache, self._record(rows, probs)
        experts = call.experts
        slots = told(cache, call, lambda missed: cache.fetch(self._layer, experts, call.scores, call.mean, misses=missed))
        lut = np.zeros(max(experts) + 1, dtype=np.uint32)
        lut[experts] = slots
        return mx.array(lut[idx])
