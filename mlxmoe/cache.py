"""The expert cache: slot pools, residency map, hits/misses, reads on a miss.

`Residency` is the bookkeeping alone (which key holds which slot, asking the policy for
victims); the trace replay simulator uses it as is, so a policy behaves the same in a
replay as in a run. `ExpertCache` adds the slot pools (`SlotPools`), the reads, the
counters (`CacheStats`) and the observers of each layer call (experts.LayerCall).
"""

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

import mlx.core as mx
import numpy as np

from .budget import peak_rss
from .counters import CacheStats
from .errors import MlxmoeError
from .prefetch import BackgroundLoader, Prefetcher


def token_chunks(rows, capacity: int) -> list[tuple[int, int]]:
    """Split `rows` (each token's expert ids, a list of lists or an array [tokens, k]) into
    runs of tokens whose distinct experts fit the cache: one fetch each."""
    chunks, start, seen = [], 0, set()
    for t, row in enumerate(rows.tolist() if hasattr(rows, "tolist") else rows):
        new = seen.union(row)
        if len(new) > capacity:
            chunks.append((start, t))
            start, new = t, set(row)
        seen = new
    chunks.append((start, len(rows)))
    return chunks


class Busy(Exception):
    """Not enough slots outside those being filled in the background: wait for them."""


class Residency:
    """Which key holds which slot; victims from the policy. `defer_hits`: a layer call
    whose experts are all resident needs nothing from the policy now, so its policy updates
    wait in `later` (see catch_up): the same decisions as without deferring (the replay
    does not defer), made off the decode thread where a prefetcher runs."""

    def __init__(self, capacity: int, policy, defer_hits: bool = False) -> None:
        if capacity < 1:
            raise MlxmoeError(f"the expert cache needs at least one slot, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.slot_of = {}  # (layer, expert) -> slot
        self.free = list(range(capacity - 1, -1, -1))
        self.in_flight = {}  # key -> Event set once the background read filling its slot ended: never victims
        self.held = set()  # prefetched for a coming layer call: victims only when nothing else is
        self.counters = CacheStats()
        self.defer_hits = defer_hits
        self.later = deque()  # host work left for later, (function, args), in order: see catch_up
        self.catching_up = False

    def catch_up(self, until: Callable | None = None) -> None:
        """Do the host work left in `later`, in order (up to the entry of function `until`).

        The one rule for host work a layer call leaves for later: what changes no decision
        now waits in `later` (the policy updates of a call that hit, the observers' calls,
        on the resident path each token's accounting) and is done in order, under the cache's
        lock, before anything reads the policy's state (a victim, a claim, a key leaving, a
        tick), else by whoever gets to it first: the prefetcher's host thread after each
        layer call's predictions, the resident path two tokens on, flush(). Work done here
        that calls for it again finds it under way."""
        if self.catching_up:
            return
        self.catching_up = True
        try:
            while self.later and self.later[0][0] is not until:
                work, args = self.later.popleft()
                work(*args)
        finally:
            self.catching_up = False

    def _hit(self, layer: int, experts: list, scores: list | None, probs: np.ndarray | None,
             routing: Callable | None = None) -> None:
        """The policy updates of a layer call that hit."""
        if routing is not None:
            scores, probs = routing()
        self.policy.visit(layer, experts, scores, probs)
        for i, e in enumerate(experts):
            self.policy.access((layer, int(e)), True, None if scores is None else scores[i])

    def tick(self, tokens: int) -> None:
        """New tokens start: the policy's clock moves (after the calls deferred before)."""
        self.catch_up()
        self.policy.tick(tokens)

    def access(self, layer: int, experts: list, scores: list | None = None, probs: np.ndarray | None = None,
               routing: Callable | None = None) -> tuple[list, list]:
        """Make `experts` (distinct ids) of `layer` resident; `scores` are their router
        probabilities and `probs` the router's distribution over all experts, when known, or
        `routing()` gives both when first needed (at once on a miss, else in `later`).

        Returns (slots, missed) where slots[i] holds experts[i] and missed lists the
        (expert, slot) pairs that must be filled now.
        """
        if len(experts) > self.capacity:
            raise MlxmoeError(f"layer {layer} needs {len(experts)} experts at once; the cache holds {self.capacity}")
        if self.defer_hits:
            slots = [self.slot_of.get((layer, int(e))) for e in experts]
            if None not in slots:
                self.later.append((self._hit, (layer, experts, scores, probs, routing)))
                self.counters.hits += len(experts)
                return slots, []
            self.catch_up()
        protected = {(layer, int(e)) for e in experts} | self.in_flight.keys()
        if self.in_flight:  # background reads hold slots: wait for them rather than run out of victims
            missing = sum((layer, int(e)) not in self.slot_of for e in experts)
            evictable = len(self.slot_of) - len(protected & self.slot_of.keys())
            if missing > len(self.free) + evictable:
                raise Busy()
        if routing is not None:
            scores, probs = routing()
        self.policy.visit(layer, experts, scores, probs)
        slots, missed = [], []
        for i, e in enumerate(experts):
            key = (layer, int(e))
            hit = key in self.slot_of
            self.policy.access(key, hit, None if scores is None else scores[i])
            if hit:
                self.counters.hits += 1
            else:
                self.counters.misses += 1
                slot = self.free.pop() if self.free else self._evict(protected)
                self.slot_of[key] = slot
                self.policy.insert(key)
                missed.append((key[1], slot))
            slots.append(self.slot_of[key])
        return slots, missed

    def _evict(self, protected: set | None, victim: tuple | None = None) -> int:
        """Evict `victim`, or the policy's victim outside `protected`; return its slot."""
        victim = self.victim(protected) if victim is None else victim
        self.counters.evictions += 1
        return self._release(victim)

    def _release(self, key: tuple) -> int:
        """Take resident `key` out of the policy and the residency map; return its slot."""
        self.catch_up()
        self.policy.remove(key)
        self.evicted(key)
        return self.slot_of.pop(key)

    def victim(self, protected: set) -> tuple:
        self.catch_up()
        if self.held:
            try:
                return self.policy.victim(protected | self.held)
            except MlxmoeError:
                pass
        return self.policy.victim(protected)

    def claim(self, keys: list, protected=(), evict: bool = False, worth: Callable | None = None) -> list:
        """Give slots to the non-resident `keys` (most important first) ahead of their use:
        free slots, and victims outside `protected` when `evict`, as far as they go. A key
        with `worth(key, victim)` false stops the claim there rather than evict that victim.
        The policy sees the most important inserted last. Returns [(key, slot)]."""
        self.catch_up()
        taken = []
        for key in keys:
            if key in self.slot_of:
                continue
            if self.free:
                slot = self.free.pop()
            elif evict:
                try:
                    victim = self.victim(set(protected) | self.in_flight.keys())
                except MlxmoeError:
                    break
                if worth is not None and not worth(key, victim):
                    break
                slot = self._evict(None, victim)
            else:
                break
            self.slot_of[key] = slot
            taken.append((key, slot))
        for key, _ in reversed(taken):
            self.policy.insert(key)
        return taken

    def evicted(self, key: tuple) -> None:
        pass


class SlotPools:
    """The slots' memory, shared by all MoE layers (every layer's experts have the same
    shapes), and the reads into it: per expert tensor an mx array [capacity, *shape]
    (`pools`), a writable numpy view of its memory (`views`) and what the experts compute
    with (`compute`, a dtype view where numpy lacks the type)."""

    def __init__(self, store, capacity: int, pool_dtypes: list, io_threads: int = 4) -> None:
        self.store = store
        self.pools, self.views, self.compute = [], [], []
        for shape, dtype in zip(store.tensor_shapes, pool_dtypes):
            storage = mx.uint16 if dtype == mx.bfloat16 else dtype
            # made on the CPU stream: on CUDA that is managed memory, host-writable with no
            # copy (a GPU-made array is moved to managed memory when numpy first views it)
            pool = mx.zeros((capacity, *shape), dtype=storage, stream=mx.cpu)
            mx.eval(pool)
            view = np.array(pool, copy=False)
            if not view.flags.writeable:
                raise MlxmoeError("this MLX build does not expose writable array memory; cannot stream experts")
            self.pools.append(pool)
            self.views.append(view)
            self.compute.append(pool.view(mx.bfloat16) if dtype == mx.bfloat16 else pool)
        mx.eval(self.compute)
        self.names = list(store.tensors)
        self.slot_bytes = sum(v[0].nbytes for v in self.views)
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="mlxmoe-io") if io_threads > 1 else None

    def read_into(self, key: tuple, slot: int) -> int:
        """Read expert `key` into `slot`; return the bytes read."""
        return self.store.read_expert(key[0], key[1], [v[slot] for v in self.views])

    def read(self, layer: int, missed: list) -> int:
        """Read `missed` [(expert, slot)] of `layer` (on the IO threads when several); return
        the bytes read. On an error, once no thread writes into those slots any more."""
        futures = []
        try:
            if self.io is not None and len(missed) > 1:
                futures = [self.io.submit(self.read_into, (layer, e), slot) for e, slot in missed]
                return sum(f.result() for f in futures)
            return sum(self.read_into((layer, e), slot) for e, slot in missed)
        except BaseException:
            wait(futures)
            raise

    def close(self) -> None:
        if self.io is not None:
            self.io.shutdown(wait=True)


class ExpertCache(Residency):
    """A Residency over slot pools shared by all MoE layers (`pools`), so the policy can give
    one layer more slots than another; counters in `counters`, observers of each layer call
    in `observers`.

    The decode thread calls tick() and fetch(); pre-warm and prefetch threads (`loader`,
    prefetch.BackgroundLoader) fill slots at the same time, so the bookkeeping is under a
    lock and a key being filled is waited for, never read twice.

    The cache owns its slot pools, the store and the loader; what owns the cache (api.Runtime)
    attaches a Prefetcher, adds observers and closes them, then the cache (`close_with`)."""

    def __init__(self, store, capacity: int, policy, pool_dtypes: list, io_threads: int = 4, profile=None) -> None:
        super().__init__(capacity, policy, defer_hits=True)
        self.store = store
        self.pools = SlotPools(store, capacity, pool_dtypes, io_threads)
        self.lock = threading.RLock()
        self.loader = BackgroundLoader(self)
        self.in_flight = self.loader.waiting
        self.profile = profile  # live ActivationProfile: learns from every layer call (learn)
        # called with each LayerCall, in order, after the live profile (a TraceWriter's observe)
        self.observers: list[Callable] = []
        self.close_with: Callable[[], None] | None = None  # what close() calls instead, where an owner closes the cache
        self.wants_router = policy.wants_router
        self.position = 0  # token position in the current sequence
        self.active = set()  # keys the current layer computes with: never evicted by background loads
        self.current_layer = -1
        self.prefetcher: Prefetcher | None = None  # when prefetching (attach)
        self.slot_table = None  # per layer an mx array [experts] of slots, once every expert is resident (experts.py)
        self.hold_resident = False  # True: no resident path yet, whatever is resident (see api.Runtime.agree_resident)
        self.step_tokens = 1

    def attach(self, prefetcher: Prefetcher | None) -> None:
        """Predict and load ahead with `prefetcher` (built on this cache), or stop (None);
        its owner closes it before the cache."""
        with self.lock:
            self.prefetcher = prefetcher

    def wants_probs(self) -> bool:
        """Whether a layer call's router distribution is used (policy, live profile, observers)."""
        return self.wants_router or self.profile is not None or bool(self.observers)

    def tick(self, tokens: int) -> None:
        """New tokens start (called by the first MoE layer)."""
        with self.lock:
            self.current_layer = -1
            self.counters.tokens += tokens
            self.step_tokens = tokens
            super().tick(tokens)
        self.call_position = self.position
        self.position += tokens

    def observe(self, call) -> None:
        """Give `call` (an experts.LayerCall, or a function making it) to the observers: left
        in `later` where the prefetcher's host thread does it (see Residency.catch_up), else now."""
        if self.prefetcher is not None and self.prefetcher.off_thread:
            self.later.append((self.notify, (call,)))
        else:
            with self.lock:
                self.notify(call)

    def notify(self, call) -> None:
        call = call() if callable(call) else call
        self.learn(call)
        for observer in self.observers:
            observer(call)

    def learn(self, call) -> None:
        """The live profile's observer: it learns every layer call (and its tokens at the first)."""
        if self.profile is not None:
            if call.ticked:
                self.profile.tick(call.ticked)
            self.profile.observe(call.layer, call.experts, call.scores, call.mean)

    def host_work(self) -> None:
        """Do what the decode thread left for later (the prefetcher's host thread calls it)."""
        if self.later:  # nothing left: spare the caller a wait for the lock
            with self.lock:
                self.catch_up()

    def flush(self) -> None:
        """Do all the host work left for later, now (its side arrays evaluated first)."""
        tic = time.perf_counter()
        with self.lock:
            side = [a for work, _ in self.later for a in getattr(work, "side", ())]
            if side:
                mx.eval(side)
            self.catch_up()
        self.counters.bookkeeping_seconds += time.perf_counter() - tic

    def new_sequence(self) -> None:
        """A new sequence starts at position 0 (the last one's host work done first)."""
        self.flush()
        self.position = 0

    def fetch(self, layer: int, experts: list, scores: list | None = None, probs: np.ndarray | None = None,
              routing: Callable | None = None) -> list:
        """Make the distinct `experts` of `layer` resident; return their slots. Interrupted
        (Ctrl-C in `chat`, which carries on) or failed anywhere, the keys of the call that no
        background read is filling leave the cache: a key given a slot but not yet read
        would otherwise pass for resident with another expert's bytes."""
        self.check_open()
        try:
            return self._fetch(layer, experts, scores, probs, routing)
        except BaseException:
            with self.lock:
                unsure = [(layer, e) for e in experts if (layer, e) not in self.in_flight]
            self.forget(unsure)
            raise

    def check_open(self) -> None:
        if self.loader.stop.is_set():
            raise MlxmoeError("this model's expert cache is closed; load the model again")

    def _fetch(self, layer: int, experts: list, scores: list | None, probs: np.ndarray | None,
               routing: Callable | None) -> list:
        keys = [(layer, e) for e in experts]
        with self.lock:
            while True:
                try:
                    slots, missed = self.access(layer, experts, scores, probs, routing)
                    break
                except Busy:
                    self.loader.wait_unlocked()
            # from here on background loads never evict what this layer computes with
            self.active = set(keys)
            self.current_layer = layer
            waits, useful = self.loader.arrivals(keys)
            if self.prefetcher is not None and self.step_tokens == 1:
                self.prefetcher.miss_costs(layer, len(waits) + useful, len(missed))
            if self.held:  # held until this visit: what this layer did not use was a wrong guess
                self.held.difference_update([k for k in self.held if k[0] == layer])
        tic = time.perf_counter()
        if missed:
            self.read_demand(layer, missed)
        if waits or self.loader.failed:
            self.loader.wait_for(waits, keys)
        self.counters.read_seconds += time.perf_counter() - tic
        return slots

    def read_demand(self, layer: int, missed: list) -> None:
        """Read `missed` [(expert, slot)] of `layer` on the decode thread, counted as demand
        loads. If a read fails or is interrupted (Ctrl-C in `chat`, which carries on), those
        keys leave the cache: left in, they would pass for resident with another expert's bytes."""
        try:
            self.counters.demand_bytes += self.pools.read(layer, missed)
        except BaseException:
            self.forget([(layer, e) for e, _ in missed])
            raise
        self.counters.loads_demand += len(missed)

    def forget(self, keys: list) -> None:
        """Take `keys` out of the cache: their slots are free again, holding nothing."""
        with self.lock:
            for key in keys:
                if key in self.slot_of:
                    self.free.append(self._release(key))

    def evicted(self, key: tuple) -> None:
        self.held.discard(key)
        self.loader.evicted(key)

    def prewarm(self, keys: list) -> int:
        return self.loader.prewarm(keys)

    def prewarm_done(self, timeout: float | None = None) -> bool:
        return self.loader.prewarm_done(timeout)

    def resident_per_layer(self) -> list[int]:
        with self.lock:  # prefetch workers may be changing it
            layers = [layer for layer, _ in self.slot_of]
        return np.bincount(layers, minlength=self.store.num_layers).tolist()

    def stats(self) -> dict:
        """The counters (CacheStats.as_dict) with the cache's size, residency, memory, the
        predictors' scores and the store's IO figures."""
        self.flush()
        counts = self.counters.as_dict()
        decode_tps = counts.pop("decode_tps")
        return dict(counts, cache_experts=self.capacity, cache_bytes=self.capacity * self.pools.slot_bytes,
                    resident_per_layer=self.resident_per_layer(), policy=self.policy.name,
                    peak_memory=mx.get_peak_memory(), peak_rss=peak_rss(), decode_tps=decode_tps,
                    predictors=self.prefetcher.stats() if self.prefetcher is not None else {},
                    io=self.store.io_stats())

    def reset_stats(self) -> None:
        self.flush()
        with self.lock:  # loads from before the reset are not this window's (prefetch_useful <= loads_prefetched)
            self.counters.reset()
            self.loader.prefetched.clear()

    def stop(self) -> None:
        """The first step of closing: no background load starts any more, the host work
        left for later is done (the observers have every layer call) and the pre-warm has
        ended. A prefetcher and the observers are closed after it, the cache last."""
        self.loader.stop.set()
        self.flush()
        self.loader.prewarm_done()

    def close(self) -> None:
        """Close the cache, its slot pools' IO threads and the store; where an owner closes
        the cache (`close_with`: api.Runtime.close_local, which closes the prefetcher and
        the trace first), that."""
        if self.close_with is not None:
            self.close_with()
            return
        self.stop()
        self.pools.close()
        self.store.close()
