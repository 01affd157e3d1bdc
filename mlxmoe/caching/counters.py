"""The expert cache's counters (ExpertCache.counters), one object reset in one call."""

from dataclasses import dataclass, fields


@dataclass
class CacheStats:
    """The cache's counters since the last reset. The decode thread counts its own reads
    (demand_*, read_seconds); pre-warm and prefetch count theirs under the cache's lock."""

    tokens: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demand_bytes: int = 0
    prefetch_bytes: int = 0
    loads_demand: int = 0
    loads_prefetched: int = 0
    prefetch_useful: int = 0  # background loads a layer call used (<= loads_prefetched)
    prefetch_late: int = 0  # ... that the layer call had to wait for
    prefetch_stale: int = 0  # predictions dropped because the decode thread got there first
    prefetch_cancelled: int = 0  # background reads stopped part way: their layer call came without them
    cancelled_bytes: int = 0  # ... the bytes they had read (not in bytes_read)
    skipped: int = 0  # routed experts a lossy mode left out (top-k trimming on a miss)
    biased: int = 0  # experts chosen only thanks to cache-aware routing's bonus
    substituted: int = 0  # routed experts computed with their low-bit copies (fallback.py)
    verified_tokens: int = 0  # decode steps with one wait at their end (verify.py)
    replays: int = 0  # ... forwards run again from a layer that missed
    replayed_layers: int = 0  # ... decoder layers those computed again
    drafted: int = 0  # tokens speculative decoding proposed (a draft model's, or n-gram lookup's: drafting.py)
    accepted: int = 0  # ... that the model's own step confirmed
    read_seconds: float = 0.0  # the decode thread's reads
    demand_seconds: float = 0.0  # ... of which the demand reads themselves (not running ahead meanwhile)
    bookkeeping_seconds: float = 0.0  # what StreamingExperts adds beyond mlx-lm's own work
    decode_tps: float = 0.0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def as_dict(self) -> dict:
        """The counters as ExpertCache.stats() reports them."""
        accesses = self.hits + self.misses
        return {"tokens": self.tokens, "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / accesses if accesses else 0.0,
                "bytes_read": self.demand_bytes + self.prefetch_bytes, "loads_demand": self.loads_demand,
                "loads_prefetched": self.loads_prefetched, "prefetch_useful": self.prefetch_useful,
                "prefetch_late": self.prefetch_late, "prefetch_stale": self.prefetch_stale,
                "prefetch_cancelled": self.prefetch_cancelled, "cancelled_bytes": self.cancelled_bytes,
                "read_seconds": self.read_seconds, "demand_read_seconds": self.demand_seconds,
                "bookkeeping_seconds": self.bookkeeping_seconds,
                "evictions": self.evictions, "skipped": self.skipped, "biased": self.biased,
                "substituted": self.substituted, "verified_tokens": self.verified_tokens,
                "replays": self.replays, "replayed_layers": self.replayed_layers, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "decode_tps": self.decode_tps}
