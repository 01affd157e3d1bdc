"""The expert cache: slot pools, residency map, hits/misses, reads on a miss.

`Residency` is the bookkeeping alone (which key holds which slot, asking the policy for
victims); the trace replay simulator uses it as is, so a policy behaves the same in a
replay as in a run. `ExpertCache` adds the slot pools (`SlotPools`), the reads, the
counters (`CacheStats`) and the observers of each layer call (experts.LayerCall).
"""

import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext, suppress
from typing import Callable

import mlx.core as mx
import numpy as np

from ..budget import peak_rss
from .counters import CacheStats
from ..errors import MlxmoeError
from .prefetch import Prefetcher, decayed
from ..storage.store import CHUNK, start_expert

# Background pieces (ReadGate.chunk): about this long at the disk's rate, within these sizes
# (a demand read waits behind store.PIECES_AHEAD of them at most).
PIECE_SECONDS = 0.002
MIN_CHUNK, MAX_CHUNK = 64 << 10, 1 << 20


# Python hands the GIL from a thread busy in Python to one waiting for it once a switch
# interval (5 ms by default), and a read thread waits for it after each system call: while the
# decode thread builds graphs (a GPU's decode is host-bound) a 2.8 MiB expert's read on another
# thread took 100 ms instead of 2 here, 6 ms at 0.2 ms.
READ_SWITCH_INTERVAL = 2e-4
_lowered = {"holders": 0, "before": None}
_lowered_lock = threading.Lock()


def lower_switch_interval() -> Callable:
    """Lower Python's thread switch interval to READ_SWITCH_INTERVAL (never raise it) while a
    streaming cache is open; returns the undo, which puts it back when the last one closes
    (unless someone set another meanwhile); undoing again does nothing."""
    with _lowered_lock:
        if _lowered["holders"] == 0:
            _lowered["before"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_lowered["before"], READ_SWITCH_INTERVAL))
        _lowered["holders"] += 1
        ours = sys.getswitchinterval()
    held = {"on": True}

    def undo() -> None:
        with _lowered_lock:
            if not held["on"]:
                return
            held["on"] = False
            _lowered["holders"] -= 1
            if _lowered["holders"] == 0 and sys.getswitchinterval() == ours:
                sys.setswitchinterval(_lowered["before"])
    return undo


def no_prefetch() -> dict:
    """ExpertCache.stats()'s prefetch entries where no prefetcher is attached."""
    return {"predictors": {}, "prefetch": {"on": False, "reason": "not used"}}


def expert_groups(rows, capacity) -> list[list[int]]:
    """The distinct experts of `rows` (each token's expert ids, a list of lists or an array
    [tokens, k]), sorted, in groups of at most `capacity`: one fetch each. A layer call with
    more distinct experts than slots (a long prefill at a small cache) computes group by
    group, so it reads each expert at most once."""
    experts = sorted({int(e) for row in (rows.tolist() if hasattr(rows, "tolist") else rows) for e in row})
    if len(experts) <= capacity:
        return [experts]
    return [experts[i:i + capacity] for i in range(0, len(experts), capacity)]


def low_bit(cache, layer, experts):
    """Those of `experts` of `layer` not ready in `cache` (absent, on their way, or whose read
    failed): computed with their low-bit copies."""
    waiting, failed = cache.in_flight, cache.loader.failed
    return {e for e in experts
            if (layer, e) not in cache.slot_of or (layer, e) in waiting or (layer, e) in failed}


class Busy(Exception):
    """Not enough slots outside those being filled in the background: wait for them."""


class Residency:
    """Which key holds which slot; victims from the policy. `defer_hits`: a layer call
    whose experts are all resident needs nothing from the policy now, so its policy updates
    wait in `deferred` (see catch_up): the same decisions as without deferring (the replay
    does not defer), made off the decode thread where a prefetcher runs."""

    def __init__(self, capacity: int, policy, defer_hits: bool = False) -> None:
        if capacity < 1:
            raise MlxmoeError(f"the expert cache needs at least one slot, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.slot_of = {}  # (layer, expert) -> slot
        self.lock = threading.RLock()  # over the residency where threads share it
        self.version = 0  # changes whenever slot_of does
        self.free = list(range(capacity - 1, -1, -1))
        self.home = None  # key -> the slot it always takes, where every key has one (ExpertCache)
        self.in_flight = {}  # key -> Event set once the background read filling its slot ended: never victims
        self.awaited = set()  # prefetched for a coming layer call: victims only when nothing else is
        self.counters = CacheStats()
        self.defer_hits = defer_hits
        self.deferred = deque()  # host work left for later, (function, args), in order: see catch_up
        self.unread = deque(maxlen=4096)  # experts.StepRouting not yet read: read together when one is
        self.observed = deque()  # the observers' calls a policy-only catch-up left, (call, profile): before `deferred`
        self.observers: list[Callable] = []  # called with each LayerCall in order, after the live profile (watch)
        self.catching_up = False

    def catch_up(self, until: Callable | None = None, policy_only: bool = False) -> None:
        """Do the host work left in `deferred`, in order (up to the entry of function `until`).

        The one rule for host work a layer call leaves for later: what changes no decision
        now waits in `deferred` (the policy updates of a call that hit, the observers' calls,
        on the resident path each token's accounting) and is done in order, under the cache's
        lock, before anything reads the policy's state (a victim, a claim, a key leaving, a
        tick), else by whoever gets to it first: the prefetcher's host thread (after predicting,
        and while the device computes: experts.host_work_meanwhile), the resident path two
        tokens on, flush(). Work done here that calls for it again finds it under way.
        `policy_only` (a read of the policy's state within a token): the observers' calls among
        the policy's updates wait in `observed` for the next catch-up (no observer reads the
        policy, nor the policy an observer), so that a token's observers learn in one go."""
        if self.catching_up:
            return
        self.catching_up = True
        try:
            while self.deferred and self.deferred[0][0] is not until:
                work, args = self.deferred[0]
                if getattr(work, "__func__", None) in (Residency._hit, Residency.notify):
                    self._together(until, policy_only)
                    continue
                # (other work: all of it, in order)
                policy_only = policy_only and work in (self.policy.hits, self.policy.tick)
                if not policy_only:
                    self._learn()  # (what a policy-only catch-up left: older)
                self.deferred.popleft()
                work(*args)
            if not policy_only:
                self._learn()
        finally:
            self.catching_up = False

    def _together(self, until: Callable | None, policy_only: bool = False) -> None:
        """The deferred _hit and notify entries first in `deferred`, in one go: the hits' routings read
        together, the policy's updates as one policy.hits (the same decisions as one _hit after the
        other), then the observers' calls (_learn; `policy_only`: left in `observed` instead)."""
        hits, notes = [], []
        while self.deferred and self.deferred[0][0] is not until:
            func = getattr(self.deferred[0][0], "__func__", None)
            if func is Residency._hit:
                hits.append(self.deferred.popleft()[1])
            elif func is Residency.notify:
                (self.observed if policy_only else notes).append(self.deferred.popleft()[1])
            else:
                break
        calls = [(layer, experts, *(routing() if routing is not None else (scores, probs)))
                 for layer, experts, scores, probs, routing in hits]
        if calls:
            self.policy.hits(calls)
        if not policy_only:
            self._learn(notes)

    def _learn(self, notes=()) -> None:
        """The observers' calls [(call, profile)] in order, after `observed`'s (the live profile alone: at once)."""
        if self.observed:
            notes = [*self.observed, *notes]
            self.observed.clear()
        if not notes:
            return
        profile = notes[0][1]
        if self.observers or not hasattr(profile, "learn_calls") or any(p is not profile for _, p in notes):
            for args in notes:
                self.notify(*args)
        else:
            profile.learn_calls([call() if callable(call) else call for call, _ in notes])

    def notify(self, call, profile) -> None:
        """`profile` learns `call` (and its tokens at the first layer), then the observers get it."""
        call = call() if callable(call) else call
        if profile is not None:
            profile.learn(call)
        for observer in self.observers:
            observer(call)

    def _hit(self, layer: int, experts: list, scores: list | None, probs: np.ndarray | None,
             routing: Callable | None = None) -> None:
        """The policy updates of a layer call that hit."""
        if routing is not None:
            scores, probs = routing()
        self.policy.visit(layer, experts, scores, probs)
        for i, e in enumerate(experts):
            self.policy.access((layer, int(e)), True, None if scores is None else scores[i])

    def hit_calls(self, calls: list) -> None:
        """The policy updates of a token's layer calls that hit, [(layer, experts, scores,
        probs)] in layer order (not changed after), as one entry in `deferred`: the same
        decisions as one _hit entry each (policy.hits), in a few numpy calls where the
        policy can (now, after those deferred before, where hits are not deferred). The caller
        counts the hits."""
        if self.defer_hits:
            self.deferred.append((self.policy.hits, (calls,)))
        else:
            self.catch_up()
            self.policy.hits(calls)

    def tick(self, tokens: int, later: bool = False) -> None:
        """New tokens start: the policy's clock moves after the calls deferred before (`later`: in `deferred` too)."""
        if later and self.defer_hits:
            return self.deferred.append((self.policy.tick, (tokens,)))
        self.catch_up()
        self.policy.tick(tokens)

    def access(self, layer: int, experts: list, scores: list | None = None, probs: np.ndarray | None = None,
               routing: Callable | None = None) -> tuple[list, list]:
        """Make `experts` (distinct ids) of `layer` resident; `scores` are their router
        probabilities and `probs` the router's distribution over all experts, when known, or
        `routing()` gives both when first needed (at once on a miss, else in `deferred`).

        Returns (slots, missed) where slots[i] holds experts[i] and missed lists the
        (expert, slot) pairs that must be filled now.
        """
        if len(experts) > self.capacity:
            raise MlxmoeError(f"layer {layer} needs {len(experts)} experts at once; the cache holds {self.capacity}")
        if self.defer_hits:
            slots = [self.slot_of.get((layer, int(e))) for e in experts]
            if None not in slots:
                self.deferred.append((self._hit, (layer, experts, scores, probs, routing)))
                self.counters.hits += len(experts)
                return slots, []
            self.catch_up(policy_only=True)
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
                slot = free_slot(self, key) if self.free else self._evict(protected)
                self.slot_of[key] = slot
                self.version += 1
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
        self.catch_up(policy_only=True)
        self.policy.remove(key)
        self.evicted(key)
        self.version += 1
        return self.slot_of.pop(key)

    def victim(self, protected: set) -> tuple:
        self.catch_up(policy_only=True)
        if self.awaited:
            try:
                return self.policy.victim(protected | self.awaited)
            except MlxmoeError:
                pass
        return self.policy.victim(protected)

    def claim(self, keys: list, protected=(), evict: bool = False, beats_victim: Callable | None = None) -> list:
        """Give slots to the non-resident `keys` (most important first) ahead of their use:
        free slots, and victims outside `protected` when `evict`, as far as they go. A key
        with `beats_victim(key, victim)` false stops the claim there rather than evict that victim.
        The policy sees the most important inserted last. Returns [(key, slot)]."""
        self.catch_up(policy_only=True)
        taken = []
        for key in keys:
            if key in self.slot_of:
                continue
            if self.free:
                slot = free_slot(self, key)
            elif evict:
                try:
                    victim = self.victim(set(protected) | self.in_flight.keys())
                except MlxmoeError:
                    break
                if beats_victim is not None and not beats_victim(key, victim):
                    break
                slot = self._evict(None, victim)
            else:
                break
            self.slot_of[key] = slot
            self.version += 1
            taken.append((key, slot))
        for key, _ in reversed(taken):
            self.policy.insert(key)
        return taken

    def resize(self, capacity: int) -> list:
        """Hold `capacity` slots from now on (nothing in flight): the policy's victims leave
        until the rest fits, and the rest move to slots 0, 1... in the order of their old
        slots. Returns their old slots in that order (SlotPools.resize moves the bytes)."""
        if capacity < 1:
            raise MlxmoeError(f"the expert cache needs at least one slot, got {capacity}")
        while len(self.slot_of) > capacity:
            self._evict(set())
        kept = sorted(self.slot_of.items(), key=lambda item: item[1])
        self.slot_of = {key: new for new, (key, _) in enumerate(kept)}
        self.capacity = capacity
        self.free, self.home = list(range(capacity - 1, len(kept) - 1, -1)), None  # (no homes: keys at 0, 1...)
        self.version += 1
        self.policy.resized(capacity)
        return [old for _, old in kept]

    def forget(self, keys: list) -> None:
        """Take `keys` out of the cache: their slots are free again, holding nothing."""
        with self.lock:
            for key in keys:
                if key in self.slot_of:
                    self.free.append(self._release(key))

    def evicted(self, key: tuple) -> None:
        pass


def free_slot(residency: Residency, key: tuple) -> int:
    """A free slot for `key`: its home where keys have one (free until it takes it), else the one freed last."""
    if residency.home is None:
        return residency.free.pop()
    slot = residency.home(key)
    residency.free.remove(slot)
    return slot


def home_slots(store, capacity: int) -> Callable | None:
    """Where `capacity` slots hold every expert of `store`: key -> its home, a layer's experts in
    expert order (the resident path computes from the pools in place: experts.SlotTable); else None."""
    E = store.num_experts
    return (lambda key: key[0] * E + key[1]) if capacity >= store.num_layers * E else None


class SlotPools:
    """The slots' memory, shared by all MoE layers (every layer's experts have the same
    shapes), and the reads into it: per expert tensor an mx array [capacity, *shape]
    (`pools`), a writable numpy view of its memory (`views`) and what the experts compute
    with (`compute`, a dtype view where numpy lacks the type). `spare`: one slot more, past
    the cache's, holding zeros: the placeholder of verified decode steps (verify.py)."""

    def __init__(self, store, capacity: int, pool_dtypes: list, io_threads: int = 4, spare: bool = False) -> None:
        self.store, self.dtypes, self.spare = store, pool_dtypes, spare
        self.resize(capacity)
        self.names = list(store.tensors)
        self.slot_bytes = sum(v[0].nbytes for v in self.views)
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="mlxmoe-io") if io_threads > 1 else None

    def resize(self, capacity: int, kept: list = ()) -> None:
        """New pools of `capacity` slots (and the spare), slot i holding what old slot
        kept[i] held. The old arrays are left as they are: a computation queued with them
        (the token in flight) still reads them, and they are freed after it."""
        pools, views, compute = [], [], []
        for i, (shape, dtype) in enumerate(zip(self.store.tensor_shapes, self.dtypes)):
            storage = mx.uint16 if dtype == mx.bfloat16 else dtype
            # made on the CPU stream: on CUDA that is managed memory, host-writable with no
            # copy (a GPU-made array is moved to managed memory when numpy first views it)
            pool = mx.zeros((capacity + self.spare, *shape), dtype=storage, stream=mx.cpu)
            mx.eval(pool)
            view = np.array(pool, copy=False)
            if not view.flags.writeable:
                raise MlxmoeError("this MLX build does not expose writable array memory; cannot stream experts")
            if len(kept):  # (straight into the new pool: no third copy)
                np.take(self.views[i], list(kept), axis=0, out=view[:len(kept)])
            pools.append(pool)
            views.append(view)
            compute.append(pool.view(mx.bfloat16) if dtype == mx.bfloat16 else pool)
        mx.eval(compute)
        self.pools, self.views, self.compute = pools, views, compute
        self.slots = {}  # slot -> slot(slot), made at its first read
        self.like = [(v.dtype, v[0].nbytes) for v in views]

    def slot(self, slot: int) -> tuple:
        """A slot's memory: per tensor its row of the pool, and that row's bytes."""
        if slot not in self.slots:
            rows = [v[slot] for v in self.views]
            self.slots[slot] = rows, [row.reshape(-1).view(np.uint8) for row in rows]
        return self.slots[slot]

    def read_into(self, key: tuple, slot: int, pace: Callable | None = None, chunk: int = CHUNK,
                  check: bool = True) -> int:
        """Read expert `key` into `slot`; return the bytes read. `pace`: a background read's
        (see ReadGate.reading), called before each piece of it (of `chunk` bytes at most);
        `check`: its shard checked (else the caller checks it: ExpertStore.check_shards)."""
        return self.store.read_expert(key[0], key[1], [v[slot] for v in self.views], pace=pace, chunk=chunk,
                                      check=check)

    def read(self, layer: int, missed: list) -> int:
        """Read `missed` [(expert, slot)] of `layer`: read_keys."""
        return self.read_keys([((layer, e), slot) for e, slot in missed])

    def read_keys(self, keyed: list) -> int:
        """Read `keyed` [(key, slot)] (on the IO threads when several), their shards checked
        once each when all are read; return the bytes read. On an error, once no thread
        writes into those slots any more."""
        futures = []
        try:
            if self.io is not None and len(keyed) > 1:  # the first read here, the rest meanwhile
                futures = [self.io.submit(self.read_into, key, slot, check=False) for key, slot in keyed[1:]]
                n = self.read_into(*keyed[0], check=False) + sum(f.result() for f in futures)
            else:
                n = sum(self.read_into(key, slot, check=False) for key, slot in keyed)
        except BaseException:
            wait(futures)
            raise
        self.store.check_shards([key for key, _ in keyed])
        return n

    def start(self, keyed: list) -> Callable:
        """read_keys of `keyed` [(key, slot)], asked of the kernel at once where it can
        (store.start_expert); returns finish(), which waits for them, reads the rest (after
        whatever the caller built meanwhile), checks their shards once each and returns the
        bytes read. Until it has returned, nothing may compute with those slots, nor the cache
        give them to other keys."""
        started, asked, later = [], [], []
        try:
            for lane, (key, slot) in enumerate(keyed):
                rows, dests = self.slot(slot)
                finish = start_expert(self.store, *key, rows, lane, dests, self.like, False)  # (its shard: checked in _finish)
                if finish is None:
                    later.append((key, slot))
                else:
                    started.append(finish)
                    asked.append(key)
        except BaseException:
            finish_all(started)
            raise
        return lambda: self._finish(started, asked, later)

    def _finish(self, started: list, asked: list, later: list) -> int:
        n = finish_all(started)
        self.store.check_shards(asked)
        return n + (self.read_keys(later) if later else 0)

    def close(self) -> None:
        if self.io is not None:
            self.io.shutdown(wait=True)


def finish_all(started: list) -> int:
    """Each of the reads `started` (their finish()) waited for, even after one failed (the
    kernel writes into their buffers until then); their bytes, or the first error."""
    n, error = 0, None
    for finish in started:
        try:
            n += finish() or 0
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error
    return n


class ExpertCache(Residency):
    """A Residency over slot pools shared by all MoE layers (`pools`), so the policy can give
    one layer more slots than another; counters in `counters`, observers of each layer call
    in `observers`.

    The decode thread calls tick() and fetch(); pre-warm and prefetch threads (`loader`,
    a BackgroundLoader) fill slots at the same time, so the bookkeeping is under a lock and
    a key being filled is waited for, never read twice. Its reads go before theirs (`gate`).

    The cache owns its slot pools, the store, the loader, the prefetcher attached to it
    and what watch() gives it to close: close() closes them all, in the one order that
    loses nothing. `hold_resident`: no resident path (see experts.resident_table) until
    the owner clears it (api.Runtime.agree_resident, under the tensor split)."""

    def __init__(self, store, capacity: int, policy, pool_dtypes: list, io_threads: int = 4, profile=None,
                 hold_resident: bool = False, spare: bool = False) -> None:
        super().__init__(capacity, policy, defer_hits=True)
        self.store = store
        self.pools = SlotPools(store, capacity, pool_dtypes, io_threads, spare)
        self.home = home_slots(store, capacity)
        self.loader = BackgroundLoader(self)
        self.in_flight = self.loader.waiting
        self.profile = profile  # live ActivationProfile: learns from every layer call (learn)
        self.closers: list[Callable] = []  # closed after the prefetcher, in order (watch)
        self.position = 0  # token position in the current sequence
        self.active = set()  # keys the current layer computes with: never evicted by background loads
        self.current_layer = -1
        self.prefetcher: Prefetcher | None = None  # when prefetching: built on this cache, close() closes it
        self.speculator = None  # speculate.Speculator: runs ahead while decode steps wait for reads (close() closes it)
        self.verifier = None  # verify.Verifier where decode steps wait once, at their end
        self.unverified = "not used"  # why there is none (api._unverified)
        self.keep_busy = nullcontext()  # around demand reads: backend.KeepBusy on Metal
        self.layer_wait = None  # decayed seconds a decode step's layer call waited for the device
        self.layer_seconds = None  # decayed seconds from a decode layer call's fetch to the next's (a right guess saves it)
        self.fetched = (0.0, -1)  # (when, layer) of the last fetch
        self.slot_table = None  # per layer an mx array [experts] of slots, once every expert is resident (experts.py)
        self.hold_resident = hold_resident
        self.step_tokens = 1
        self.fallback = None  # fallback.FallbackLoader where low-bit copies stand in for missing experts
        self.fallback_bytes = 0  # their memory
        self.resizes = deque(maxlen=32)  # the latest resizes, {"from", "to", "reason", "at"} (governor.py)
        self.rows = None  # batching.CallRows of a batched model call under way: its layer calls count and learn per row

    def watch(self, observer: Callable, close: Callable | None = None) -> None:
        """Give each layer call to `observer` from now on; close() calls `close` after the
        prefetcher's (a trace writer: completed once every layer call is in)."""
        with self.lock:
            self.catch_up()  # (work left for later goes where it would have gone: not to this observer)
            self.observers.append(observer)
            if close is not None:
                self.closers.append(close)

    def wants_probs(self) -> bool:
        """Whether a layer call's router distribution is used (policy, live profile, observers)."""
        return self.policy.wants_router or self.profile is not None or bool(self.observers) or self.rows is not None

    def tick(self, tokens: int, later: bool = False) -> None:
        """New tokens start (called by the first MoE layer). A verified step's (`later`) leaves
        the policy's clock in `deferred` unlocked, as its hits: it does not wait for the host
        thread's catch-up on the step before until it reads the policy's state (at a miss)."""
        with nullcontext() if later and self.defer_hits else self.lock:
            self.current_layer = -1
            self.counters.tokens += tokens
            self.step_tokens = tokens
            super().tick(tokens, later)
        self.call_position = self.position
        self.position += tokens

    def observe(self, call, profile=None, later: bool = False) -> None:
        """Give `call` (an experts.LayerCall, or a function making it) to the observers, learnt by
        `profile`, else the batched call's rows, else the live profile: left in `deferred` where the
        prefetcher's host thread does it (Residency.catch_up) or `later` (a decode step's: done with
        the next tick's or miss's, warm, not alone after its wait on the device), else now."""
        if profile is None:
            profile = self.profile if self.rows is None else self.rows
        if later or (self.prefetcher is not None and self.prefetcher.off_thread):
            return self.deferred.append((self.notify, (call, profile)))
        with self.lock:
            if self.observed or self.deferred:  # (older calls first: a verified step's tick leaves them)
                self.catch_up()
            self.notify(call, profile)

    def host_work(self) -> None:
        """Do what the decode thread left for later (the prefetcher's host thread calls it)."""
        if self.deferred or self.observed:  # nothing left: spare the caller a wait for the lock
            with self.lock:
                self.catch_up()

    def flush(self) -> None:
        """Do all the host work left for later, now (its side arrays evaluated first)."""
        tic = time.perf_counter()
        with self.lock:
            side = [a for work, _ in self.deferred for a in getattr(work, "side", ())]
            if side:
                mx.eval(side)
            self.catch_up()
        self.counters.bookkeeping_seconds += time.perf_counter() - tic

    def new_sequence(self) -> None:
        """A new sequence starts at position 0 (the last one's host work done first); what
        running ahead found of calls that never came, and the last step's timing, are dropped."""
        self.flush()
        self.position = 0
        self.fetched = (0.0, -1)
        self.loader.routed_ahead.clear()
        if self.prefetcher is not None:
            self.prefetcher.bar.paced = None  # the pause between sequences is no decode step

    def fetch(self, layer: int, experts: list, scores: list | None = None, probs: np.ndarray | None = None,
              routing: Callable | None = None, early: Callable | None = None, misses: list | None = None) -> list:
        """Make the distinct `experts` of `layer` resident; return their slots. Where some
        must be read on the decode thread, `early({expert: slot})` is first given those
        already resident, so that it can start computing with them while the rest are read.
        `misses`, where given, gets the experts that missed (those counted as misses).
        Interrupted (Ctrl-C in `chat`, which carries on) or failed anywhere, the keys of the
        call that no background read is filling leave the cache: a key given a slot but not
        yet read would otherwise pass for resident with another expert's bytes."""
        self.check_open()
        if self.step_tokens == 1 and layer == self.fetched[1] + 1:
            self.layer_seconds = decayed(self.layer_seconds, time.perf_counter() - self.fetched[0])
        try:
            return self._fetch(layer, experts, scores, probs, routing, early, misses)
        except BaseException:
            with self.lock:
                unsure = [(layer, e) for e in experts if (layer, e) not in self.in_flight]
            self.forget(unsure)
            raise
        finally:
            self.fetched = (time.perf_counter(), layer)

    def check_open(self) -> None:
        if self.loader.stop.is_set():
            raise MlxmoeError("this model's expert cache is closed; load the model again")

    def _fetch(self, layer: int, experts: list, scores: list | None, probs: np.ndarray | None,
               routing: Callable | None, early: Callable | None, misses: list | None = None) -> list:
        keys = [(layer, e) for e in experts]
        with self.lock:
            while True:
                try:
                    slots, missed = self.access(layer, experts, scores, probs, routing)
                    break
                except Busy:
                    self.loader.wait_unlocked()
            if misses is not None:
                misses.extend(e for e, _ in missed)
            # from here on background loads never evict what this layer computes with
            self.active = set(keys)
            self.current_layer = layer
            waits, useful = self.loader.arrivals(keys)
            if self.prefetcher is not None and self.step_tokens == 1 and self.policy.estimate is not None:
                self.policy.estimate.count_loads(layer, len(waits) + useful, len(missed))
            if self.verifier is not None and self.step_tokens == 1:  # (where a verified step would miss)
                self.verifier.switch.direct.checked([layer], 0 if missed else None)
            if self.awaited:  # awaited until this visit: what this layer did not use was a wrong guess
                self.awaited.difference_update([k for k in self.awaited if k[0] == layer])
            ready = None
            if missed and early is not None:
                unread = {e for e, _ in missed} | {e for (_, e), _ in waits}
                unread |= {e for l, e in self.loader.failed if l == layer}
                ready = {e: s for e, s in zip(experts, slots) if e not in unread}
        tic, read_before = time.perf_counter(), self.counters.read_seconds
        read_missed(self, layer, missed, waits, early, ready)
        if waits or self.loader.failed:
            self.loader.wait_for(waits, keys)
        self.counters.read_seconds = read_before + time.perf_counter() - tic  # (read_later's own counts within)
        return slots

    def read_demand(self, layer: int, missed: list) -> None:
        """Read `missed` [(expert, slot)] of `layer` on the decode thread, counted as demand
        loads, ahead of any background read (the gate). If a read fails or is interrupted
        (Ctrl-C in `chat`, which carries on), those keys leave the cache: left in, they would
        pass for resident with another expert's bytes."""
        try:
            tic = time.perf_counter()
            with self.loader.gate.demand(), self.keep_busy:
                n = self.pools.read(layer, missed)
            self.counters.demand_seconds += (seconds := time.perf_counter() - tic)
            self.loader.gate.timed(n, seconds)
            self.counters.demand_bytes += n
        except BaseException:
            self.forget([(layer, e) for e, _ in missed])
            raise
        self.counters.loads_demand += len(missed)

    def evicted(self, key: tuple) -> None:
        self.awaited.discard(key)
        self.loader.evicted(key)

    def prewarm(self, keys: list) -> int:
        return self.loader.prewarm(keys)

    def prewarm_done(self, timeout: float | None = None) -> bool:
        return self.loader.prewarm_done(timeout)

    def stats(self) -> dict:
        """The counters (CacheStats.as_dict) with the cache's size, residency, memory, the
        predictors' scores and the store's IO figures."""
        self.flush()
        counts = self.counters.as_dict()
        decode_tps = counts.pop("decode_tps")
        with self.lock:  # prefetch workers may be changing it
            layers = [layer for layer, _ in self.slot_of]
        resident = np.bincount(layers, minlength=self.store.num_layers).tolist()
        return dict(counts, cache_experts=self.capacity, cache_bytes=self.capacity * self.pools.slot_bytes,
                    resident_per_layer=resident, policy=self.policy.name,
                    peak_memory=mx.get_peak_memory(), peak_rss=peak_rss(), decode_tps=decode_tps,
                    fallback_bytes=self.fallback_bytes, resizes=list(self.resizes),
                    disk_busy_seconds=self.loader.gate.busy_seconds(),
                    demand_delay_seconds=self.loader.gate.delayed_seconds(),
                    **(self.prefetcher.stats() if self.prefetcher is not None else no_prefetch()),
                    verify=self.verifier.stats() if self.verifier is not None else {"on": False, "reason": self.unverified},
                    io=self.store.io_stats())

    def reset_stats(self) -> None:
        self.flush()
        with self.lock:  # loads from before the reset are not this window's (prefetch_useful <= loads_prefetched)
            self.counters.reset()
            self.loader.prefetched.clear()
            self.loader.routed_ahead.clear()  # keyed by token counts, which restart
            self.loader.gate.reset()

    def stop(self) -> None:
        """The first step of closing: no background load starts any more, the host work
        left for later is done (the observers have every layer call) and the pre-warm has
        ended. A prefetcher and the observers are closed after it, the cache last."""
        self.loader.stop.set()
        self.flush()
        self.loader.prewarm_done()

    def close(self) -> None:
        """Close in the one order that loses nothing: stop (no background load starts, the
        observers have every layer call), the prefetcher (its threads end), what watch() was
        given (a trace: completed, renamed into place), the slot pools' IO threads and the
        store last. Closing again does nothing more."""
        self.stop()
        if self.prefetcher is not None:
            self.prefetcher.close()
        for close in self.closers:
            close()
        if self.speculator is not None:
            self.speculator.close()
        self.pools.close()
        self.store.close()


def read_missed(cache: ExpertCache, layer: int, missed: list, waits: list, early: Callable | None,
                ready: dict | None) -> None:
    """A layer call's reads on the decode thread (ExpertCache.fetch): its misses [(expert, slot)]
    asked of the disk at once and read while `early(ready)` builds the experts it holds (where
    `ready` has any); a first demand read, which measures the disk's rate (ReadGate.timed), on
    its own; where running ahead, on the demand thread (speculate.py)."""
    ahead = cache.speculator is not None and cache.step_tokens == 1 and (missed or waits) \
        and not cache.speculator.paused()
    reads = read_later(cache, layer, missed, []) if missed and not ahead and cache.loader.gate.rate else None
    if ready:
        try:
            early(ready)
        except BaseException:
            if reads is not None:  # (no read may still write into the slots once this returns)
                with suppress(BaseException):
                    reads()
            raise
    if ahead:
        cache.speculator.read_meanwhile(layer, missed, waits)
    elif reads is not None:
        reads()
    elif missed:
        cache.read_demand(layer, missed)


def read_later(cache: ExpertCache, layer: int, missed: list, taken: list) -> Callable:
    """ExpertCache.read_demand() of `missed` [(expert, slot)] of `layer` with a read of `taken` [(key,
    slot)] (guesses), all asked of the disk at once (SlotPools.start), so that the decode
    thread builds meanwhile; returns finish(), which waits for them, counts them (returns
    the guesses' bytes) and, where a read failed or was interrupted, takes all their keys
    out of the cache."""
    keyed = [((layer, e), slot) for e, slot in missed] + taken
    gate = cache.loader.gate
    gate.demand_begins()
    tic = time.perf_counter()
    try:
        reads = cache.pools.start(keyed)
    except BaseException:
        gate.demand_ends()
        cache.forget([key for key, _ in keyed])
        raise
    asking = time.perf_counter() - tic
    cache.counters.read_seconds += asking

    def finish() -> int:
        tic = time.perf_counter()
        try:
            with cache.keep_busy:
                n = reads()
        except BaseException:
            cache.forget([key for key, _ in keyed])
            raise
        finally:
            gate.demand_ends()
        # the decode thread's time on them (no rate of the disk: they ended unseen)
        waited = time.perf_counter() - tic
        cache.counters.read_seconds += waited
        seconds = asking + waited
        guessed = len(taken) * cache.store.expert_file_bytes()
        if missed:
            cache.counters.demand_seconds += seconds
            cache.counters.demand_bytes += n - guessed
            cache.counters.loads_demand += len(missed)
        return guessed
    return finish


class Cancelled(Exception):
    """A background read no longer wanted: the layer call it was for came and did not use it."""


class ReadGate:
    """Demand reads first. A background read asks the disk for its pieces (chunk()) a few
    at a time (store.PIECES_AHEAD) and waits for its turn before each: not while a demand
    read is under way, unless the decode thread is waiting for that very key (`urgent`). So
    a demand read waits behind the pieces already asked of the disk, never behind a queue
    of guesses, and one background read runs at a time (`background`, held by the loader
    around each).

    It measures the seconds during which any read was under way (busy_seconds, the
    occupancy the prefetcher paces its guesses by), the seconds demand reads waited for a
    guess's piece under way (delayed_seconds, what guesses cost the decode thread where the
    disk has time for them), and the disk's rate as the background reads find it, which
    sizes their pieces (chunk())."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.demand_reads = 0  # demand reads under way
        self.urgent: set = set()  # keys the decode thread waits for: read at demand priority
        self.background = threading.Lock()
        self.under_way = 0  # reads under way: demand calls, a background read between its turns
        self.since = time.perf_counter()
        self.busy = 0.0
        self.piece = None  # None, or whether the background pieces asked of the disk are an urgent key's
        self.waited_from = None  # when a demand read began to wait behind them
        self.demands = 0  # demand reads begun
        self.delayed = 0.0
        self.rate = None  # bytes a second, from background reads that had the disk to themselves

    def _reading(self, n: int) -> None:
        """`n` more reads under way (under cond): the busy time so far added up first."""
        now = time.perf_counter()
        if self.under_way:
            self.busy += now - self.since
        self.since, self.under_way = now, self.under_way + n

    def busy_seconds(self) -> float:
        with self.cond:
            return self.busy + (time.perf_counter() - self.since if self.under_way else 0.0)

    def reset(self) -> None:
        with self.cond:
            self._reading(0)
            self.busy = self.delayed = 0.0

    def delayed_seconds(self) -> float:
        with self.cond:
            return self.delayed + (time.perf_counter() - self.waited_from if self.waited_from is not None else 0.0)

    def timed(self, nbytes: int, seconds: float) -> None:
        """A demand read of `nbytes` took `seconds`: the disk's rate until a background read measures it."""
        with self.cond:
            if self.rate is None and seconds > 0:
                self.rate = nbytes / seconds

    def chunk(self) -> int:
        """A background piece's bytes: what the disk reads in about PIECE_SECONDS at its
        measured rate (a demand read that comes meanwhile waits behind those asked), a power
        of two from MIN_CHUNK to MAX_CHUNK; store.CHUNK until the rate is known."""
        if self.rate is None:
            return CHUNK
        size = MIN_CHUNK
        while size < MAX_CHUNK and 2 * size <= self.rate * PIECE_SECONDS:
            size *= 2
        return size

    def _piece_ended(self) -> None:
        """The oldest background piece asked (if any) ended now (under cond): a demand read
        that waited for it adds its wait to `delayed` (a lower bound: the next piece asked
        may still be read after it)."""
        if self.piece is not None and self.waited_from is not None:
            self.delayed += time.perf_counter() - self.waited_from
            self.waited_from = None
        self.piece = None

    @contextmanager
    def demand(self):
        """Around the decode thread's reads: background reads pause at their next piece."""
        self.demand_begins()
        try:
            yield
        finally:
            self.demand_ends()

    def demand_begins(self) -> None:
        with self.cond:
            self.demand_reads += 1
            self.demands += 1
            if self.piece is False and self.waited_from is None:
                self.waited_from = time.perf_counter()
            self._reading(1)

    def demand_ends(self) -> None:
        with self.cond:
            self.demand_reads -= 1
            self._reading(-1)
            self.cond.notify_all()

    def hurry(self, keys: list, on: bool = True) -> None:
        """The decode thread waits for `keys` (being read in the background): read them at
        demand priority (on=False: no longer)."""
        with self.cond:
            if on:
                self.urgent.update(keys)
                self.cond.notify_all()
            else:
                self.urgent.difference_update(keys)

    @contextmanager
    def reading(self, key: tuple, wanted: Callable[[], bool], granted: list):
        """Around a background read of `key`: yields its pace(nbytes), called before each
        piece, which waits for the piece's turn, raises Cancelled once `wanted()` is false,
        and else adds the piece's bytes to granted[0]. A read that ended (or was cancelled)
        with no demand read begun since its first piece gives the disk's rate: its bytes over
        its time (its pieces are asked ahead of each other, store.PIECES_AHEAD: none has a
        time of its own)."""
        first = [None, None]  # when its first piece was asked; the demand reads begun by then (None: one was under way)

        def pace(nbytes):
            with self.cond:
                self._piece_ended()
                if self.demand_reads and key not in self.urgent:
                    self._reading(-1)  # paused: the disk serves the demand reads
                    while self.demand_reads and key not in self.urgent:
                        self.cond.wait()
                    self._reading(1)
                if not wanted():
                    raise Cancelled()
                self.piece = key in self.urgent
                if first[0] is None:
                    first[:] = [time.perf_counter(), None if self.demand_reads else self.demands]
            granted[0] += nbytes

        with self.cond:
            self._reading(1)
        failed = False
        try:
            yield pace
        except Cancelled:
            raise
        except BaseException:
            failed = True  # (its pieces may not all have been read)
            raise
        finally:
            with self.cond:
                self._piece_ended()
                now = time.perf_counter()
                if not failed and first[1] == self.demands and not self.demand_reads and now > first[0]:
                    rate = granted[0] / (now - first[0])
                    self.rate = rate if self.rate is None else 0.8 * self.rate + 0.2 * rate
                self._reading(-1)


class BackgroundLoader:
    """Pre-warm and prefetch loads into an ExpertCache's slots, in background threads, one
    read at a time at background priority (`gate`). Each key is given its slot (evicting,
    for a prefetch) just before its read, so a guess that is never read evicts nothing. A
    key whose slot is being filled is in `waiting` (the cache's `in_flight`: key -> Event
    set once its read ended): never a victim, and a layer call that needs it waits for it,
    at demand priority. A loaded key not used yet is in `prefetched`; one whose read failed
    is in `failed`, read again on the decode thread when needed."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.gate = ReadGate()
        self.waiting: dict = {}
        self.prefetched: set = set()
        self.failed: set = set()
        # (token count, layer) -> the experts running ahead found that layer call routes to
        # (speculate.py): a background read of another is no longer wanted
        self.routed_ahead: dict = {}
        self.stop = threading.Event()  # set when the cache closes
        self.prewarm_thread: threading.Thread | None = None

    def prewarm(self, keys: list) -> int:
        """Fill free slots with `keys`, hottest first, in a background thread that claims a
        slot just before each read: the decode thread starts at once, takes free slots or
        evicts what is already in, and waits only for a key it needs that is on its way.
        Returns how many keys it will read, as far as the cache has free slots now."""
        cache = self.cache
        with cache.lock:
            keys = [k for k in keys if k not in cache.slot_of]
            planned = min(len(keys), len(cache.free))

        def run():
            for key in keys:
                with self.gate.background:
                    with cache.lock:
                        if self.stop.is_set() or not cache.free:
                            return
                        taken = self.claim([key], evict=False)
                    for key_slot in taken:
                        self.load(*key_slot)

        if planned:
            self.prewarm_thread = threading.Thread(target=run, name="mlxmoe-prewarm", daemon=True)
            self.prewarm_thread.start()
        return planned

    def prewarm_done(self, timeout: float | None = None) -> bool:
        if self.prewarm_thread is not None:
            self.prewarm_thread.join(timeout)
        return self.prewarm_thread is None or not self.prewarm_thread.is_alive()

    def reached(self, until: tuple) -> bool:
        """Whether the decode thread has reached the layer call `until` = (tokens, layer)."""
        return (self.cache.counters.tokens, self.cache.current_layer) >= until

    def prefetch(self, keys: list, token: int, layer: int, beats_victim=None) -> None:
        """Load `keys` (most likely first) for `layer`'s call at token count `token` (the next
        token's for a cross-token guess), called from a prefetch worker, one at a time; the
        rest is dropped once the decode thread reaches that call. May evict, but never what
        the current layer uses, what is on its way, or (with `beats_victim`, see Residency.claim) a
        victim worth more; at most half the slots not in use are being filled, so wrong
        guesses never make the decode thread wait long for a slot."""
        cache, until = self.cache, (token, layer)
        for key in keys:
            with self.gate.background:
                with cache.lock:
                    if self.stop.is_set() or self.reached(until):
                        cache.counters.prefetch_stale += 1
                        return
                    if key in cache.slot_of or not self.wanted(key, until):
                        continue
                    # (under `background` no other background read is on its way)
                    room = (cache.capacity - len(cache.active)) // 2
                    taken = self.claim([key], evict=True, beats_victim=beats_victim) if room > 0 else []
                    if not taken:
                        return
                self.load(key, taken[0][1], until)

    def wanted(self, key: tuple, until: tuple) -> bool:
        """Whether a guess `key` for the layer call `until` = (token, layer) is still worth
        reading: running ahead has not found that call routes elsewhere."""
        routed = self.routed_ahead.get(until)
        return routed is None or key[1] in routed

    def claim(self, keys: list, evict: bool, beats_victim=None) -> list:
        """Give slots to `keys` (under the lock) and mark them on their way; [(key, slot)]."""
        taken = self.cache.claim(keys, self.cache.active, evict, beats_victim)
        for key, _ in taken:
            self.waiting[key] = threading.Event()
        return taken

    def load(self, key: tuple, slot: int, until: tuple | None = None) -> None:
        """Background read of one claimed key; always ends its wait, even on error. A key
        loaded for a layer call `until` = (token, layer) still to come is awaited by it; once
        that call has come without it, the rest of its read is cancelled and its slot freed."""
        cache, n, cancelled, granted = self.cache, None, False, [0]

        def wanted():
            if self.stop.is_set():
                return False
            # reached before active: the decode thread sets a call's active keys before it marks
            # the call reached, so a call that arrives between the two reads keeps its key
            return until is None or not self.reached(until) and self.wanted(key, until) or key in cache.active

        try:
            with self.gate.reading(key, wanted, granted) as pace:
                n = cache.pools.read_into(key, slot, pace, self.gate.chunk())
        except Cancelled:
            cancelled = True
        except Exception:  # the decode thread reads it again and reports the error if it recurs
            pass
        with cache.lock:
            counters = cache.counters
            done = self.waiting.pop(key)
            if n is not None:
                counters.prefetch_bytes += n
                counters.loads_prefetched += 1
                if key in cache.active:  # the decode thread is already waiting for it
                    counters.prefetch_useful += 1
                else:
                    self.prefetched.add(key)
                    if until is not None and not self.reached(until):
                        cache.awaited.add(key)
            elif cancelled and key not in cache.active:
                counters.prefetch_cancelled += 1
                counters.cancelled_bytes += granted[0]
                cache.forget([key])
            else:  # failed, or cancelled as its layer call came to use it: a demand read
                self.failed.add(key)
            done.set()

    def wait_unlocked(self) -> None:
        """Wait for the keys on their way now without the cache's lock, which the caller holds
        (a layer call that needs more slots than those not being filled)."""
        pending = list(self.waiting.values())
        self.cache.lock.release()
        try:
            for done in pending:
                done.wait()
        finally:
            self.cache.lock.acquire()

    def arrivals(self, keys: list) -> tuple[list, int]:
        """For a layer call's `keys` (under the cache's lock): those on their way, as
        [(key, Event)], read at demand priority from now on, and how many were loaded ahead
        and not used until now, counted useful (once)."""
        waits = [(k, self.waiting[k]) for k in keys if k in self.waiting]
        if waits:
            self.gate.hurry([k for k, _ in waits])
        found = self.prefetched.intersection(keys)
        self.prefetched -= found
        self.cache.counters.prefetch_useful += len(found)
        return waits, len(found)

    def wait_for(self, waits: list, keys: list) -> None:
        """On the decode thread: wait for a layer call's keys on their way (`waits`, counting
        those not there yet as late), then read again those of `keys` whose read failed."""
        try:
            for _, done in waits:
                if not done.is_set():
                    self.cache.counters.prefetch_late += 1
                    done.wait()
        finally:
            if waits:
                self.gate.hurry([k for k, _ in waits], on=False)
        if self.failed:  # a background read that failed marks its key before its wait ends
            self.read_failed(keys)

    def read_failed(self, keys: list | None = None) -> None:
        """Read again on the decode thread those of `keys` (default: all) whose background
        read failed: a second failure raises its error, naming the file and offset."""
        cache = self.cache
        with cache.lock:
            retry = sorted(self.failed if keys is None else self.failed.intersection(keys))
            self.failed.difference_update(retry)
        for layer in sorted({l for l, _ in retry}):
            cache.read_demand(layer, [(e, cache.slot_of[(l, e)]) for l, e in retry if l == layer])

    def evicted(self, key: tuple) -> None:
        self.prefetched.discard(key)
        self.failed.discard(key)
