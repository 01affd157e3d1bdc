"""The expert cache: slot pools, residency map, hits/misses, reads on a miss.

`Residency` is the bookkeeping alone (which key holds which slot, asking the policy for
victims); the trace replay simulator uses it as is, so a policy behaves the same in a
replay as in a run. `ExpertCache` adds the slot pools and the reads.
"""

import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

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


class Residency:
    def __init__(self, capacity, policy):
        if capacity < 1:
            raise MlxmoeError(f"the expert cache needs at least one slot, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.slot_of = {}  # (layer, expert) -> slot
        self.free = list(range(capacity - 1, -1, -1))
        self.hits = self.misses = self.evictions = 0

    def access(self, layer, experts, scores=None):
        """Make `experts` (distinct ids) of `layer` resident.

        Returns (slots, missed) where slots[i] holds experts[i] and missed lists the
        (expert, slot) pairs that must be filled now.
        """
        if len(experts) > self.capacity:
            raise MlxmoeError(f"layer {layer} needs {len(experts)} experts at once; the cache holds {self.capacity}")
        protected = {(layer, int(e)) for e in experts}
        slots, missed = [], []
        for i, e in enumerate(experts):
            key = (layer, int(e))
            hit = key in self.slot_of
            self.policy.access(key, hit, None if scores is None else scores[i])
            if hit:
                self.hits += 1
            else:
                self.misses += 1
                if self.free:
                    slot = self.free.pop()
                else:
                    victim = self.policy.victim(protected)
                    self.policy.remove(victim)
                    slot = self.slot_of.pop(victim)
                    self.evictions += 1
                self.slot_of[key] = slot
                self.policy.insert(key)
                missed.append((key[1], slot))
            slots.append(self.slot_of[key])
        return slots, missed


class ExpertCache(Residency):
    """Slot pools shared by all MoE layers (every layer's experts have the same shapes),
    so the policy can give one layer more slots than another."""

    def __init__(self, store, capacity, policy, pool_dtypes, io_threads=4):
        super().__init__(capacity, policy)
        self.store = store
        self.pools = []  # mx arrays [capacity, *shape], one per expert tensor
        self.views = []  # writable numpy views of the pools' memory
        self.compute = []  # what the experts compute with (a dtype view where numpy lacks the type)
        for shape, dtype in zip(store.tensor_shapes, pool_dtypes):
            storage = mx.uint16 if dtype == mx.bfloat16 else dtype
            pool = mx.zeros((capacity, *shape), dtype=storage)
            mx.eval(pool)
            view = np.array(pool, copy=False)
            if not view.flags.writeable:
                raise MlxmoeError("this MLX build does not expose writable array memory; cannot stream experts")
            compute = pool.view(mx.bfloat16) if dtype == mx.bfloat16 else pool
            mx.eval(compute)
            self.pools.append(pool)
            self.views.append(view)
            self.compute.append(compute)
        self.slot_bytes = sum(v[0].nbytes for v in self.views)
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="mlxmoe-io") if io_threads > 1 else None
        self.tokens = 0
        self.bytes_read = 0
        self.loads_demand = 0
        self.read_seconds = 0.0  # wall time the decode thread spent waiting on reads
        self.decode_tps = 0.0
        self.pool_names = list(store.tensors)

    def fetch(self, layer, experts):
        """Make the distinct `experts` of `layer` resident; return their slots."""
        slots, missed = self.access(layer, experts)
        if missed:
            tic = time.perf_counter()
            read = lambda es: self.store.read_expert(layer, es[0], [v[es[1]] for v in self.views])
            if self.io is not None and len(missed) > 1:
                self.bytes_read += sum(self.io.map(read, missed))
            else:
                self.bytes_read += sum(map(read, missed))
            self.loads_demand += len(missed)
            self.read_seconds += time.perf_counter() - tic
        return slots

    def stats(self):
        accesses = self.hits + self.misses
        return {
            "tokens": self.tokens,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / accesses if accesses else 0.0,
            "bytes_read": self.bytes_read,
            "loads_demand": self.loads_demand,
            "read_seconds": self.read_seconds,
            "loads_prefetched": 0,
            "prefetch_useful": 0,
            "evictions": self.evictions,
            "cache_experts": self.capacity,
            "cache_bytes": self.capacity * self.slot_bytes,
            "policy": self.policy.name,
            "peak_memory": mx.get_peak_memory(),
            "peak_rss": peak_rss(),
            "decode_tps": self.decode_tps,
        }

    def reset_stats(self):
        self.hits = self.misses = self.evictions = self.tokens = 0
        self.bytes_read = self.loads_demand = 0
        self.read_seconds = 0.0

    def close(self):
        if self.io is not None:
            self.io.shutdown(wait=True)
        self.store.close()
