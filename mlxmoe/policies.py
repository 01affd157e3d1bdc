"""Victim choice for the expert cache. One implementation per policy, used both by the
runtime cache (cache.py) and by the trace replay simulator (trace.py).

A policy sees every access as `access(key, hit, score)` where key is (layer, expert)
and score is the router probability when known, then `insert(key)` for a key that
became resident, `remove(key)` for one that left, and answers `victim(protected)` with
the resident key to evict, never one in `protected` (the experts the current layer
needs right now).
"""

from collections import OrderedDict


class LRU:
    """Least recently used, over all resident experts of all layers."""

    name = "lru"

    def __init__(self, capacity, num_layers, num_experts, **_):
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
        raise RuntimeError("every resident expert is protected; the cache is below its minimum")


POLICIES = {p.name: p for p in (LRU,)}
DEFAULT_POLICY = "lru"


def make_policy(name, capacity, num_layers, num_experts, **kwargs):
    from .errors import MlxmoeError

    name = name or DEFAULT_POLICY
    if name not in POLICIES:
        raise MlxmoeError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](capacity, num_layers, num_experts, **kwargs)
