"""The expert cache: slot pools, residency map, hits/misses, reads on a miss.

`Residency` is the bookkeeping alone (which key holds which slot, asking the policy for
victims); the trace replay simulator uses it as is, so a policy behaves the same in a
replay as in a run. `ExpertCache` adds the slot pools and the reads.
"""

import resource
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait

import mlx.core as mx
import numpy as np

from .errors import MlxmoeError


def peak_rss():
    """The process's peak resident memory in bytes (VmHWM on Linux: ru_maxrss there
    includes the parent's peak when this process was started by fork + exec)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(l for l in f if l.startswith("VmHWM")).split()[1]) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def token_chunks(rows, capacity):
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
    """`defer_hits`: a layer call whose experts are all resident needs nothing from the
    policy now, so its policy updates (visit, accesses) wait in `pending` until something
    needs the policy's state (a victim, a claim, a key leaving, a tick) and are then made in
    the same order: the same decisions as without deferring (the replay does not defer).
    Made in a run they cost less than one by one right after each layer's sync, where the
    host's caches are cold (about half in a replay loop paused between calls), and most
    are made by a prefetch worker, whose claim catches up first, off the decode thread."""

    def __init__(self, capacity, policy, defer_hits=False):
        if capacity < 1:
            raise MlxmoeError(f"the expert cache needs at least one slot, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.slot_of = {}  # (layer, expert) -> slot
        self.free = list(range(capacity - 1, -1, -1))
        self.in_flight = set()  # keys whose slot is being filled by a background read: never victims
        self.held = set()  # prefetched for a coming layer call: victims only when nothing else is
        self.hits = self.misses = self.evictions = 0
        self.defer_hits = defer_hits
        self.pending = []  # all-hit layer calls (layer, experts, scores, probs) the policy has not seen yet

    def catch_up(self):
        """Give the policy the layer calls deferred so far, in order."""
        pending, self.pending = self.pending, []
        for layer, experts, scores, probs in pending:
            self.policy.visit(layer, experts, scores, probs)
            for i, e in enumerate(experts):
                self.policy.access((layer, int(e)), True, None if scores is None else scores[i])

    def tick(self, tokens):
        """New tokens start: the policy's clock moves (after the calls deferred before)."""
        self.catch_up()
        self.policy.tick(tokens)

    def access(self, layer, experts, scores=None, probs=None):
        """Make `experts` (distinct ids) of `layer` resident; `scores` are their router
        probabilities and `probs` the router's distribution over all experts, when known.

        Returns (slots, missed) where slots[i] holds experts[i] and missed lists the
        (expert, slot) pairs that must be filled now.
        """
        if len(experts) > self.capacity:
            raise MlxmoeError(f"layer {layer} needs {len(experts)} experts at once; the cache holds {self.capacity}")
        if self.defer_hits:
            slots = [self.slot_of.get((layer, int(e))) for e in experts]
            if None not in slots:
                self.pending.append((layer, experts, scores, probs))
                self.hits += len(experts)
                return slots, []
            self.catch_up()
        protected = {(layer, int(e)) for e in experts} | self.in_flight
        if self.in_flight:  # background reads hold slots: wait for them rather than run out of victims
            missing = sum((layer, int(e)) not in self.slot_of for e in experts)
            evictable = len(self.slot_of) - len(protected & self.slot_of.keys())
            if missing > len(self.free) + evictable:
                raise Busy()
        self.policy.visit(layer, experts, scores, probs)
        slots, missed = [], []
        for i, e in enumerate(experts):
            key = (layer, int(e))
            hit = key in self.slot_of
            self.policy.access(key, hit, None if scores is None else scores[i])
            if hit:
                self.hits += 1
            else:
                self.misses += 1
                slot = self.free.pop() if self.free else self._evict(protected)
                self.slot_of[key] = slot
                self.policy.insert(key)
                missed.append((key[1], slot))
            slots.append(self.slot_of[key])
        return slots, missed

    def _evict(self, protected, victim=None):
        """Evict `victim`, or the policy's victim outside `protected`; return its slot."""
        victim = self.victim(protected) if victim is None else victim
        self.evictions += 1
        return self._release(victim)

    def _release(self, key):
        """Take resident `key` out of the policy and the residency map; return its slot."""
        self.catch_up()
        self.policy.remove(key)
        self.evicted(key)
        return self.slot_of.pop(key)

    def victim(self, protected):
        self.catch_up()
        if self.held:
            try:
                return self.policy.victim(protected | self.held)
            except MlxmoeError:
                pass
        return self.policy.victim(protected)

    def claim(self, keys, protected=(), evict=False, worth=None):
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
                    victim = self.victim(set(protected) | self.in_flight)
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

    def evicted(self, key):
        pass


class ExpertCache(Residency):
    """Slot pools shared by all MoE layers (every layer's experts have the same shapes),
    so the policy can give one layer more slots than another.

    The decode thread calls tick() and fetch(); a pre-warm thread may fill free slots at
    the same time, so the bookkeeping is under a lock and a key being filled is waited
    for, never read twice.
    """

    def __init__(self, store, capacity, policy, pool_dtypes, io_threads=4, profile=None):
        super().__init__(capacity, policy, defer_hits=True)
        self.store = store
        self.pools = []  # mx arrays [capacity, *shape], one per expert tensor
        self.views = []  # writable numpy views of the pools' memory
        self.compute = []  # what the experts compute with (a dtype view where numpy lacks the type)
        for shape, dtype in zip(store.tensor_shapes, pool_dtypes):
            storage = mx.uint16 if dtype == mx.bfloat16 else dtype
            # made on the CPU stream: on CUDA that is managed memory, host-writable with no
            # copy (a GPU-made array is moved to managed memory when numpy first views it)
            pool = mx.zeros((capacity, *shape), dtype=storage, stream=mx.cpu)
            mx.eval(pool)
            view = np.array(pool, copy=False)
            if not view.flags.writeable:
                raise MlxmoeError("this MLX build does not expose writable array memory; cannot stream experts")
            compute = pool.view(mx.bfloat16) if dtype == mx.bfloat16 else pool
            mx.eval(compute)
            self.pools.append(pool)
            self.views.append(view)
            self.compute.append(compute)
        self.pool_names = list(store.tensors)
        self.slot_bytes = sum(v[0].nbytes for v in self.views)
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="mlxmoe-io") if io_threads > 1 else None
        self.lock = threading.Lock()
        self.waiting = {}  # key -> threading.Event, set once its background read ended
        self.prefetched = set()  # loaded in the background and not used yet (for prefetch_useful)
        self.failed = set()  # keys whose background read failed: read again on demand
        self.profile = profile  # live ActivationProfile: learns from every layer call
        self.later = deque()  # its updates (method, args) left by the decode thread, made in order (see learn)
        self.trace = None  # TraceWriter when recording
        self.wants_router = policy.wants_router
        self.position = 0  # token position in the current sequence
        self.active = set()  # keys the current layer computes with: never evicted by background loads
        self.current_layer = -1
        self.prefetcher = None  # prefetch.Prefetcher when prefetching
        self.slot_table = None  # per layer an mx array [experts] of slots, once every expert is resident
        self.deferred = []  # per token: the host work of its layer calls on the resident path
        self._prewarm = None
        self._stop = threading.Event()
        # per layer, decayed [loads a prefetch hid, loads on the decode path] at decode steps:
        # the policy weighs a victim by the share of its layer's loads prefetch leaves to the
        # decode thread (see miss_costs)
        self.layer_loads = np.zeros((store.num_layers, 2))
        self.step_tokens = 1
        self.closed = False
        self.reset_stats()

    def tick(self, tokens):
        """New tokens start (called by the first MoE layer)."""
        with self.lock:
            self.current_layer = -1
            self.tokens += tokens
            self.step_tokens = tokens
            super().tick(tokens)
            if self.profile is not None:
                self.learn(self.profile.tick, tokens)
        self.call_position = self.position
        self.position += tokens

    def resident_slots(self):
        """Every expert's slot, per layer an mx array [experts], once all are resident and
        none is on its way (with room for all, nothing is evicted: they stay put), else None."""
        self._check_open()
        if self.slot_table is None:
            L, E = self.store.num_layers, self.store.num_experts
            if self.prefetcher is not None or self.in_flight or len(self.slot_of) < L * E:
                return None
            if self.failed:  # background reads that failed: read now (a second failure raises)
                self._read_failed()
            table = np.zeros((L, E), dtype=np.uint32)
            for (layer, e), slot in self.slot_of.items():
                table[layer, e] = slot
            self.slot_table = [mx.array(row) for row in table]  # one per layer: no slicing op per call
        return self.slot_table

    def defer(self, layer, work, side=()):
        """Queue `work`, the host side of a layer call on the resident path (it reads the
        call's routing), and do the queued work of the tokens before the previous one: mlx-lm
        builds a token's graph while the previous one computes, and waited for the one
        before, so reading that routing costs no sync. `side`: arrays `work` reads that the
        model's output does not need (the router's probabilities); they are queued for
        evaluation behind their token's own work, all at once when the next token starts
        (reading them unqueued would wait for everything queued before them). Returns the
        token's queued work, a list (`work` None: the caller adds to it)."""
        if layer == 0 or not self.deferred:
            if self.deferred and self.deferred[-1][1]:
                mx.async_eval(*self.deferred[-1][1])
            self.deferred.append(([], []))
            if len(self.deferred) > 2:
                self.flush(len(self.deferred) - 2)
        if work is not None:
            self.deferred[-1][0].append(work)
        self.deferred[-1][1].extend(side)
        return self.deferred[-1][0]

    def count_resident(self, layer, experts, scores=None, probs=None):
        """A layer call on the resident path: its experts are hits, the live profile learns
        from it; the policy is left out, as nothing will be evicted."""
        with self.lock:
            self.hits += len(experts)
            if self.profile is not None:
                self.profile.observe(layer, experts, scores, probs)

    def learn(self, update, *args):
        """A live profile update (its tick or observe; called under the lock): left for the
        prefetcher's host thread (host_work) where its predictions run in that thread, else
        made now. The numbers are the same either way: the updates keep their order."""
        if self.prefetcher is not None and self.prefetcher.off_thread:
            self.later.append((update, args))
        else:
            update(*args)

    def host_work(self):
        """What the decode thread left for later, done in order under the lock: the
        policy updates of all-hit layer calls (see Residency) and the live profile's."""
        if not (self.pending or self.later):  # nothing left: spare the decode thread a wait for the lock
            return
        with self.lock:
            self.catch_up()
            while self.later:
                update, args = self.later.popleft()
                update(*args)

    def flush(self, tokens=None):
        """Do the deferred host work (of the first `tokens` tokens queued; all by default)."""
        if self.later:
            self.host_work()
        tic = time.perf_counter()
        for works, _ in self.deferred[:tokens]:
            for work in works:
                work()
        del self.deferred[:tokens]
        self.bookkeeping_seconds += time.perf_counter() - tic

    def new_sequence(self):
        self.flush()
        self.position = 0
        if self.trace is not None:
            self.trace.new_sequence()

    def fetch(self, layer, experts, scores=None, probs=None):
        """Make the distinct `experts` of `layer` resident; return their slots. Interrupted
        (Ctrl-C in `chat`, which carries on) or failed anywhere, the keys of the call that no
        background read is filling leave the cache: a key given a slot but not yet read
        would otherwise pass for resident with another expert's bytes."""
        self._check_open()
        try:
            return self._fetch(layer, experts, scores, probs)
        except BaseException:
            with self.lock:
                unsure = [(layer, e) for e in experts if (layer, e) not in self.in_flight]
            self.forget(unsure)
            raise

    def _check_open(self):
        if self.closed:
            raise MlxmoeError("this model's expert cache is closed; load the model again")

    def _fetch(self, layer, experts, scores=None, probs=None):
        with self.lock:
            while True:
                try:
                    slots, missed = self.access(layer, experts, scores, probs)
                    break
                except Busy:  # wait, without the lock, for the background reads holding slots
                    pending = list(self.waiting.values())
                    self.lock.release()
                    try:
                        for done in pending:
                            done.wait()
                    finally:
                        self.lock.acquire()
            # from here on background loads never evict what this layer computes with
            self.active = {(layer, e) for e in experts}
            self.current_layer = layer
            if self.profile is not None:
                self.learn(self.profile.observe, layer, experts, scores, probs)
            waits, hidden = [], 0
            for e in experts:
                key = (layer, e)
                if key in self.waiting:
                    waits.append((key, self.waiting[key]))
                    hidden += 1  # a prefetch's read under way
                if key in self.prefetched:
                    self.prefetched.discard(key)
                    self.prefetch_useful += 1
                    hidden += 1
            if self.prefetcher is not None and self.step_tokens == 1:
                self.miss_costs(layer, hidden, len(missed))
            # held until this visit: what this layer did not use was a wrong guess
            self.held.difference_update([k for k in self.held if k[0] == layer])
        tic = time.perf_counter()
        if missed:
            self.demand_bytes += self._read(layer, missed)
            self.loads_demand += len(missed)
        for key, done in waits:
            if not done.is_set():
                self.prefetch_late += 1
                done.wait()
        if self.failed:  # a background read that failed marks its key before its wait ends
            self._read_failed([(layer, e) for e in experts])
        self.read_seconds += time.perf_counter() - tic
        return slots

    def miss_costs(self, layer, hidden, demand, keep=0.98, hidden_cost=0.25):
        """Count a decode step's loads of `layer`: `hidden` found resident or on their way
        thanks to a prefetch, `demand` read on the decode path. The policy's miss cost of
        the layer is then 1 - (1 - hidden_cost) x the share prefetch hides (a hidden load
        still takes the disk's time): a layer whose experts the lookahead predicts well
        gives up slots to one whose misses the decode thread would wait for (on the demo
        model, the next token's first layers, which no predictor sees coming)."""
        cost = self.policy.miss_cost
        if cost is None:
            return
        h, d = self.layer_loads[layer].tolist()  # Python floats: the same doubles, cheaper than numpy's
        h, d = h * keep + hidden, d * keep + demand
        self.layer_loads[layer] = h, d
        cost[layer] = 1.0 - (1.0 - hidden_cost) * (h / (h + d + 1.0))

    def _read(self, layer, missed):
        """Read `missed` [(expert, slot)] of `layer` on the decode thread (on the IO threads
        when several). If a read fails or is interrupted (Ctrl-C in `chat`, which carries
        on), those keys leave the cache once no thread writes into their slots any more:
        left in, they would pass for resident with another expert's bytes."""
        read = lambda es: self.store.read_expert(layer, es[0], [v[es[1]] for v in self.views])
        futures = []
        try:
            if self.io is not None and len(missed) > 1:
                futures = [self.io.submit(read, es) for es in missed]
                return sum(f.result() for f in futures)
            return sum(map(read, missed))
        except BaseException:
            wait(futures)
            self.forget([(layer, e) for e, _ in missed])
            raise

    def _read_failed(self, keys=None):
        """Read again on the decode thread those of `keys` (default: all) whose background
        read failed: a second failure raises its error, naming the file and offset."""
        with self.lock:
            retry = sorted(self.failed if keys is None else self.failed.intersection(keys))
            self.failed.difference_update(retry)
        for layer in sorted({l for l, _ in retry}):
            missed = [(e, self.slot_of[(l, e)]) for l, e in retry if l == layer]
            self.demand_bytes += self._read(layer, missed)
            self.loads_demand += len(missed)

    def forget(self, keys):
        """Take `keys` out of the cache: their slots are free again, holding nothing."""
        with self.lock:
            for key in keys:
                if key in self.slot_of:
                    self.free.append(self._release(key))

    def record(self, layer, rows, probs=None):
        """Write one trace line per token of this layer call; `probs[i]` is token i's router
        distribution over all experts, or None."""
        n = len(rows)
        for i, row in enumerate(rows):
            if probs is None:
                self.trace.write(self.call_position + i, layer, row, tokens=n)
            else:
                self.trace.write(self.call_position + i, layer, row, probs[i][row].tolist(), probs[i].tolist(), n)

    def evicted(self, key):
        self.prefetched.discard(key)
        self.held.discard(key)
        self.failed.discard(key)

    def prewarm(self, keys):
        """Fill free slots with `keys`, hottest first, in a background thread that claims a
        slot just before each read: the decode thread starts at once, takes free slots or
        evicts what is already in, and waits only for a key it needs that is on its way.
        (Claimed all at once, the slots left the first layer call nothing to take but
        reads in flight: the first token waited for the whole pre-warm.) Returns how many
        keys it will read, as far as the cache has free slots now."""
        with self.lock:
            keys = [k for k in keys if k not in self.slot_of]
            planned = min(len(keys), len(self.free))

        def run():
            for key in keys:
                with self.lock:
                    if self._stop.is_set() or not self.free:
                        return
                    taken = self._claim([key], evict=False)
                for key_slot in taken:
                    self._load(*key_slot)

        if planned:
            self._prewarm = threading.Thread(target=run, name="mlxmoe-prewarm", daemon=True)
            self._prewarm.start()
        return planned

    def prefetch(self, keys, token, layer, worth=None):
        """Load `keys` for `layer`'s call at token count `token` (the next token's for a
        cross-token guess), called from a prefetch worker. Dropped if the decode thread has
        reached that call already; may evict, but never what the current layer uses, what
        is already on its way, or (with `worth`, see claim) a victim worth more."""
        with self.lock:
            if self._stop.is_set() or (self.tokens, self.current_layer) >= (token, layer):
                self.prefetch_stale += 1
                return
            # leave at least as many slots evictable as are being filled, so wrong guesses
            # never make the decode thread wait long for a slot
            room = (self.capacity - len(self.active | self.in_flight)) // 2
            taken = self._claim(keys[:max(room, 0)], evict=True, worth=worth)
        for key, slot in taken:
            self._load(key, slot, until=(token, layer))

    def _claim(self, keys, evict, worth=None):
        taken = self.claim(keys, self.active, evict, worth)
        for key, _ in taken:
            self.waiting[key] = threading.Event()
            self.in_flight.add(key)
        return taken

    def _load(self, key, slot, until=None):
        """Background read of one claimed key; always ends its wait, even on error. A key
        loaded for a layer call `until` = (token, layer) still to come is held for it."""
        n = None
        tic = time.perf_counter()
        if not self._stop.is_set():
            try:
                n = self.store.read_expert(key[0], key[1], [v[slot] for v in self.views])
            except Exception:  # the decode thread reads it again and reports the error if it recurs
                pass
        with self.lock:
            self.background_read_seconds += time.perf_counter() - tic
            if n is not None:
                self.prefetch_bytes += n
                self.loads_prefetched += 1
                if key in self.active:  # the decode thread is already waiting for it
                    self.prefetch_useful += 1
                else:
                    self.prefetched.add(key)
                    if until is not None and (self.tokens, self.current_layer) < until:
                        self.held.add(key)
            else:
                self.failed.add(key)
            self.in_flight.discard(key)
            self.waiting.pop(key).set()

    def prewarm_done(self, timeout=None):
        if self._prewarm is not None:
            self._prewarm.join(timeout)
        return self._prewarm is None or not self._prewarm.is_alive()

    def resident_per_layer(self):
        counts = [0] * self.store.num_layers
        with self.lock:  # prefetch workers may be changing it
            keys = list(self.slot_of)
        for layer, _ in keys:
            counts[layer] += 1
        return counts

    def stats(self):
        self.flush()
        accesses = self.hits + self.misses
        return {
            "tokens": self.tokens,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / accesses if accesses else 0.0,
            "bytes_read": self.demand_bytes + self.prefetch_bytes,
            "loads_demand": self.loads_demand,
            "loads_prefetched": self.loads_prefetched,
            "prefetch_useful": self.prefetch_useful,
            "prefetch_late": self.prefetch_late,
            "prefetch_stale": self.prefetch_stale,
            "read_seconds": self.read_seconds,
            "bookkeeping_seconds": self.bookkeeping_seconds,
            "evictions": self.evictions,
            "cache_experts": self.capacity,
            "cache_bytes": self.capacity * self.slot_bytes,
            "resident_per_layer": self.resident_per_layer(),
            "policy": self.policy.name,
            "peak_memory": mx.get_peak_memory(),
            "peak_rss": peak_rss(),
            "decode_tps": self.decode_tps,
            "predictors": self.prefetcher.stats() if self.prefetcher is not None else {},
            "io": self.store.io_stats(),
        }

    def reset_stats(self):
        if getattr(self, "deferred", None):
            self.flush()
        self.hits = self.misses = self.evictions = self.tokens = 0
        # the decode thread counts demand reads, the pre-warm thread (under the lock) its own
        self.demand_bytes = self.prefetch_bytes = 0
        self.loads_demand = self.loads_prefetched = self.prefetch_useful = self.prefetch_late = 0
        self.prefetch_stale = 0  # predictions dropped because the decode thread got there first
        with self.lock:  # loads from before the reset are not this window's (prefetch_useful <= loads_prefetched)
            self.prefetched.clear()
        self.read_seconds = 0.0
        self.background_read_seconds = 0.0  # pre-warm and prefetch reads (the prefetcher paces itself by it)
        self.bookkeeping_seconds = 0.0  # time StreamingExperts spent on top of mlx-lm's own work
        self.decode_tps = 0.0

    def abort(self):
        """close() after a failure: a trace being written is dropped, not completed."""
        if self.trace is not None:
            self.trace.abort()
        self.close()

    def close(self):
        self.closed = True
        self.flush()
        self._stop.set()
        self.prewarm_done()
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.trace is not None:
            self.trace.close()
        if self.io is not None:
            self.io.shutdown(wait=True)
        self.store.close()
