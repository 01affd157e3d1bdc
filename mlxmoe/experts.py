"""StreamingExperts: stands in for mlx-lm's SwitchGLU/SwitchMLP.

It keeps the original module (its activation, bias handling, sorting and
gather_qmm/gather_mm call) but points its weights at the cache's slot pools, and calls
it with expert ids remapped to slot ids. So the arithmetic is mlx-lm's own.
"""

import time
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import token_chunks
from .errors import MlxmoeError


class LayerCall(NamedTuple):
    """What the cache's observers learn of one fetch of a layer call (a call with more
    distinct experts than slots is fetched in runs of tokens, one record each)."""

    layer: int
    position: int  # the position of the first of its tokens in the sequence
    rows: np.ndarray  # each token's experts [tokens, k]
    probs: np.ndarray | None  # each token's router distribution [tokens, experts]
    tokens: int  # tokens in the whole layer call
    experts: list  # the distinct experts, sorted
    scores: list | None  # their router probabilities (of the one token at a decode step)
    mean: np.ndarray | None  # the router's mean distribution over the tokens
    ticked: int  # tokens that start with this call (its first layer's first run), else 0


def _tapped(cls):
    """A subclass of a router's Linear class whose call also keeps its output (an instance
    attribute, not a module entry: no parameter, and read with no lookup through the module)."""

    def __call__(self, x):
        logits = self.__dict__["last_logits"] = cls.__call__(self, x)
        return logits

    return type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})


def find_router(block):
    """The router of the MoE block that holds the experts (its `gate` or `router`), as
    two functions: probs(x), the router's probabilities over all experts for the input
    it just routed, and scores(x), its scores for any hidden state x (for lookahead).
    (None, None) if it has neither.

    A Linear router is tapped: its instance gets a subclass that keeps its logits, so
    probs come from the model's own routing with no second matmul (and the parameter
    tree stays as mlx-lm built it)."""
    gate = block.get("gate", block.get("router")) if isinstance(block, nn.Module) else None
    if isinstance(gate, (nn.Linear, nn.QuantizedLinear)):
        base = type(gate)
        gate.__class__ = _tapped(base)

        def probs(x):
            logits = gate.last_logits
            if logits.dtype != mx.float32:
                logits = logits.astype(mx.float32)
            return mx.softmax(logits, axis=-1, precise=True)

        probs.logits = lambda: gate.last_logits  # the model's own array: host_probs reads it with no op
        return probs, lambda x: base.__call__(gate, x)
    weight = getattr(gate, "weight", None)
    if isinstance(weight, mx.array) and weight.ndim == 2:  # e.g. deepseek's MoEGate: sigmoid scores
        def scores(x):
            return (x @ weight.T).astype(mx.float32)

        def probs(x):
            s = mx.sigmoid(scores(x))
            return s / s.sum(axis=-1, keepdims=True)

        return probs, scores
    return None, None


def host_flat(arrays: list) -> np.ndarray:
    """The elements of evaluated mx arrays, in order, as one flat numpy array (bfloat16 as
    float32: numpy has none), adding no op to the graph; arrays of one dtype, contiguous
    (router logits, a decode step's indices) are read with one copy for all."""
    views = [memoryview(a) for a in arrays]
    if len({v.format for v in views}) > 1:
        return np.concatenate([host_flat([a]) for a in arrays])
    if not all(v.c_contiguous for v in views):
        return np.concatenate([np.array(a).reshape(-1) for a in arrays])
    bf16 = views[0].format == "bfloat16"
    flat = np.frombuffer(b"".join(views), dtype=np.uint16 if bf16 else np.dtype(views[0].format))
    return (flat.astype(np.uint32) << 16).view(np.float32) if bf16 else flat


def host_probs(logits):
    """softmax over the last axis of evaluated router logits (a list of mx arrays with the
    same last axis), on the host in float32, all in one go: one numpy array [rows, experts],
    the arrays' rows in order."""
    z = host_flat(logits).astype(np.float32, copy=False).reshape(-1, logits[0].shape[-1])
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    z /= z.sum(axis=-1, keepdims=True)
    return z


def resident(cache) -> bool:
    """Whether every expert is resident and none is on its way (kept as cache.resident once
    true: with room for all, each lies in its home slot, ExpertCache.home, and nothing is
    evicted: they stay put). Never while the cache's `hold_resident` is set."""
    cache.check_open()
    if not cache.resident and not cache.hold_resident:
        cache.resident = all_resident(cache)
    return cache.resident


def all_resident(cache) -> bool:
    """Whether every expert is resident and none is on its way now."""
    L, E = cache.store.num_layers, cache.store.num_experts
    if cache.prefetcher is not None or len(cache.slot_of) < L * E:
        return False  # (asked again under the lock)
    # under the lock: a pre-warm claims a slot (slot_of) and marks it on its way
    # (in_flight) in one step, so the last expert's read is never missed here
    with cache.lock:
        if cache.prefetcher is not None or cache.in_flight or len(cache.slot_of) < L * E:
            return False
    if cache.loader.failed:  # background reads that failed: read now (a second failure raises)
        cache.loader.read_failed()
    return True


class ResidentCalls:
    """A run of tokens' layer calls on the resident path (at most `tokens_per_run`),
    [(StreamingExperts, indices, logits, probs)], accounted in one go once their routing is
    on the host: the tapped routers' probabilities from their logits in one softmax, then
    each call's hits and observers in order. `side`: the untapped routers' probabilities,
    which the model's output does not need. Host work done once per run rather than per
    token costs a fraction (its numpy calls run warm, and the softmax is one for the run).

    A run's first layer call queues it in the cache's `later` (defer). mlx-lm builds a
    token's graph while the previous one computes and has waited for the one before, so the
    runs queued before the previous run are done then with no sync; the previous run's side
    arrays are queued for evaluation then, all at once (read unqueued, they would wait for
    everything queued before them). Stats and flush() do what is queued at once."""

    tokens_per_run = 16

    def __init__(self, cache) -> None:
        self.cache = cache
        self.calls: list = []
        self.side: list = []
        self.tokens = 1  # tokens started in this run (a token starts at layer 0)

    @classmethod
    def defer(cls, cache, layer: int) -> "ResidentCalls":
        """The current run's work (queued last in `later` until done), a new one at the first
        layer call of a token once the current run has `tokens_per_run` tokens."""
        with cache.lock:
            last = cache.later[-1][0] if cache.later else None
            previous = last if isinstance(last, cls) else None
            if previous is not None and (layer != 0 or previous.tokens < cls.tokens_per_run):
                previous.tokens += layer == 0
                return previous
            work = cls(cache)
            if previous is not None and previous.side:
                mx.async_eval(*previous.side)
            cache.later.append((work, ()))
            tic = time.perf_counter()
            cache.catch_up(until=work if previous is None else previous)
            cache.counters.bookkeeping_seconds += time.perf_counter() - tic
            return work

    def __call__(self) -> None:
        cache = self.cache
        tapped = [c[2] for c in self.calls if c[2] is not None]
        from_logits = host_probs(tapped) if tapped else None
        steps = all(c[1].size == c[1].shape[-1] for c in self.calls)
        if steps and not cache.observers and (cache.profile is None or len(tapped) == len(self.calls)):
            self._steps(from_logits)
            return
        row = 0
        for module, indices, logits, probs in self.calls:
            if logits is not None:
                n = logits.size // logits.shape[-1]
                probs, row = from_logits[row:row + n], row + n
            _, flat, p = module._routing(indices, probs)
            call = module._record(flat, p, 0, len(flat))
            cache.counters.hits += len(call.experts)  # no policy: nothing will be evicted
            cache.observe(call)

    def _steps(self, probs: np.ndarray | None) -> None:
        """What __call__'s loop does, for decode steps that only the live profile observes
        (`probs`: each call's router distribution, a row each), each token's calls in one go."""
        cache, profile = self.cache, self.cache.profile
        experts = np.sort(host_flat([c[1] for c in self.calls]).reshape(len(self.calls), -1), axis=1)
        cache.counters.hits += len(experts) + int((experts[:, 1:] != experts[:, :-1]).sum())  # distinct per call
        layers = [c[0]._layer for c in self.calls]
        starts = [i for i, layer in enumerate(layers) if layer == 0]  # a token starts at layer 0
        layers = np.array(layers)
        for a, b in zip([0, *starts], [*starts, len(layers)]):
            if a == b:
                continue
            if layers[a] == 0:
                cache.tick(1)
            if profile is not None:
                if layers[a] == 0:
                    profile.tick(1)
                profile.observe_calls(layers[a:b], experts[a:b], probs[a:b])


class StepRouting:
    """A decode step's routing beyond its experts, read on the host when first asked (under
    the cache's lock): by the policy at once where the layer call misses, else by the host
    work left for later (off the decode thread where a prefetcher runs), which also makes the
    observers' LayerCall from it."""

    def __init__(self, layer: int, row: list, probs: mx.array | None, experts: list, position: int) -> None:
        self.layer, self.row, self.probs, self.experts, self.position = layer, row, probs, experts, position
        self.read = None

    def __call__(self) -> tuple:
        """(the experts' router probabilities, the router's distribution), None where unknown."""
        if self.read is None:
            p = None if self.probs is None else np.array(self.probs).reshape(-1)
            self.read = (None, None) if p is None else ([float(p[e]) for e in self.experts], p)
        return self.read

    def record(self) -> LayerCall:
        scores, probs = self()
        rows = np.array([self.row], dtype=np.uint32)  # as mlx-lm's indices are
        return LayerCall(self.layer, self.position, rows, None if probs is None else probs.reshape(1, -1), 1,
                         self.experts, scores, probs, 1 if self.layer == 0 else 0)


def point_weights(inner, pools, layer: int | None = None) -> None:
    """Point the expert weights of `inner` (mlx-lm's SwitchGLU/SwitchMLP) at the slot pools
    (SlotPools.compute), or at `layer`'s rows of them: its experts in their home slots, in
    order, which the model's own indices then pick as in stock mlx-lm (a view of the same
    memory, evaluated with the first graph that uses it)."""
    for name, pool in zip(pools.names, pools.compute):
        if layer is not None:
            experts = pools.store.num_experts
            pool = pool[layer * experts:(layer + 1) * experts]
        lin, p = name.split(".")
        inner[lin][p] = pool


class StreamingExperts(nn.Module):
    def __init__(self, inner, layer, router=None, cache=None):
        super().__init__()
        # Underscored attributes are not parameters: load_weights and set_dtype skip them.
        self._inner = inner
        self._layer = layer
        self._router = router
        self._cache = cache
        self._runtime = None  # api.Runtime, with the cache (loader.attach_cache)
        self._own_rows = False  # the weights are this layer's rows of the pools (point_weights)

    def __call__(self, x, indices):
        runtime = self._runtime
        if runtime is None or runtime.group is None:
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
        if resident(cache):
            return self._resident(x, indices)
        tic = time.perf_counter()
        decode = x.size == x.shape[-1]
        prefetcher = cache.prefetcher
        # the prefetcher's lookahead is evaluated with this layer's routing: one sync, not two
        looked = prefetcher.lookahead(self._layer, x, decode) if prefetcher is not None else {}
        probs = self._probs(x)
        sync = time.perf_counter()
        # evaluates the router (and with it every earlier layer): mlx-lm's own work
        mx.eval(indices, *([] if probs is None else [probs]), *looked.values())
        sync = time.perf_counter() - sync
        counters = cache.counters
        read_before = counters.read_seconds
        if decode:
            slots, rows = self._step(indices, probs)
        else:
            idx, rows, probs = self._routing(indices, probs)
            chunks = token_chunks(rows, cache.capacity)
            if len(chunks) > 1:
                return self._chunked(x, rows, probs, chunks)
            slots = self._slots(rows, idx, probs, 0, len(rows))
        inner = time.perf_counter()
        y = self._inner(x, slots)  # mlx-lm's own work: building the expert computation
        inner = time.perf_counter() - inner
        if prefetcher is not None:
            prefetcher.layer_done(self._layer, rows, looked, counters.tokens, decode)
        # what this layer added beyond mlx-lm's own work (building and evaluating the
        # model up to the router, building the expert computation) and the reads: the
        # lookahead and router probabilities, routing copies, the policy, remapping
        counters.bookkeeping_seconds += time.perf_counter() - tic - sync - inner - (counters.read_seconds - read_before)
        return y

    def _chunked(self, x, flat, probs, chunks):
        """More distinct experts than slots (long prefill at a small cache): compute each run
        of tokens (`chunks`) and evaluate it before the next run may reuse its slots."""
        xs = x.reshape(-1, x.shape[-1])
        outs = []
        for a, b in chunks:
            part = None if probs is None else probs[a:b]
            y = self._inner(xs[a:b], self._slots(flat[a:b], flat[a:b], part, a, len(flat)))
            mx.eval(y)
            outs.append(y)
        y = mx.concatenate(outs, axis=0)
        return y.reshape(*x.shape[:-1], *y.shape[1:])

    def _probs(self, x):
        """The router's distribution for x (unevaluated), where the cache uses it."""
        return self._router(x) if self._wants_probs() else None

    def _logits(self):
        """The tapped router's logits of this call (the model's own array), where the cache
        uses the router's distribution; else None."""
        logits = getattr(self._router, "logits", None)
        return logits() if logits is not None and self._wants_probs() else None

    def _wants_probs(self):
        return self._router is not None and self._cache.wants_probs()

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

    def _step(self, indices, probs):
        """A decode step (one token): its experts read as a list, the rest of its routing as
        the policy and the observers need it (StepRouting); returns (slots nested as
        `indices`, [the token's experts])."""
        cache = self._cache
        row, depth = indices.tolist(), 0
        while isinstance(row[0], list):
            row, depth = row[0], depth + 1
        if self._layer == 0:
            cache.tick(1)
        experts = sorted(set(row))
        routing = StepRouting(self._layer, row, probs, experts, cache.call_position)
        slots = cache.fetch(self._layer, experts, routing=routing)
        cache.observe(routing.record)
        slot_of = dict(zip(experts, slots))
        nested = [slot_of[e] for e in row]
        for _ in range(depth):  # nested as `indices` is: no reshape op
            nested = [nested]
        return mx.array(nested, dtype=mx.uint32), [row]

    def _resident(self, x, indices):
        """Every expert is resident, each in its home slot (they stay put then): the layer
        computes on its own rows of the pools, which the model's own indices pick as in
        stock mlx-lm, and its host work (hits, live profile, trace; no policy: nothing will
        be evicted) is done once this token's routing has been computed anyway (see
        ResidentCalls), so the layer forces no sync and decoding runs as stock mlx-lm does.
        A tapped router's probabilities come from its logits on the host (host_probs): no
        op beside the model's own; another router's are computed beside the model."""
        logits = self._logits()
        probs = self._probs(x) if logits is None else None
        work = ResidentCalls.defer(self._cache, self._layer)
        work.calls.append((self, indices, logits, probs))
        if probs is not None:
            work.side.append(probs)
        if not self._own_rows:
            self._own_rows = True
            point_weights(self._inner, self._cache.pools, self._layer)
        return self._inner(x, indices)

    def _summary(self, rows, probs):
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

    def _record(self, rows: np.ndarray, probs: np.ndarray | None, start: int, tokens: int) -> LayerCall:
        """The LayerCall of `rows`, the tokens from `start` of a layer call of `tokens`."""
        experts, scores, mean = self._summary(rows, probs)
        ticked = tokens if self._layer == 0 and start == 0 else 0
        return LayerCall(self._layer, self._cache.call_position + start, rows, probs, tokens, experts, scores, mean,
                         ticked)

    def _slots(self, rows: np.ndarray, idx: np.ndarray, probs: np.ndarray | None, start: int,
               tokens: int) -> mx.array:
        """Fetch the distinct experts of `rows` (the tokens from `start` of a layer call of
        `tokens`) and tell the cache's observers; return `idx` with expert ids replaced by slots."""
        call = self._record(rows, probs, start, tokens)
        experts = call.experts
        slots = self._cache.fetch(self._layer, experts, call.scores, call.mean)
        self._cache.observe(call)
        lut = np.zeros(max(experts) + 1, dtype=np.uint32)
        lut[experts] = slots
        return mx.array(lut[idx])
