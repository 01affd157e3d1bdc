"""What `mlxmoe serve` adds for a browser: the page (web/index.html, GET /) and the
expert cache's residency it polls beside /v1/mlxmoe/stats (GET /v1/mlxmoe/residency).
Both stay API: the page is one static file, all it shows comes from these JSON routes."""

import dataclasses
from pathlib import Path

import numpy as np

from .api import generation_lock

PAGE = Path(__file__).parent / "web" / "index.html"
HOT_PER_TOP_K = 2  # hot experts shown per layer: this many times top-k


def page() -> bytes:
    """The page's HTML (read at each request: a small file)."""
    return PAGE.read_bytes()


def residency(generator) -> dict:
    """The expert cache of the server's runtime now (`generator`: server.ResponseGenerator),
    cheap enough to poll each second: per layer the resident experts and the hottest of the
    live profile, the keys being read in the background, the layer the decode thread is on,
    the counters the page charts (hit rate and MB read per token, from their differences),
    the memory plan's split and the profile in use (the request's, else the file the live one came from).
    Under pipeline stages: this rank's stage."""
    cache, active, live_profile = generator.runtime.cache, generator.active, generator.live
    with cache.lock:  # the decode thread and the readers change these under it
        keys = list(cache.slot_of)
        reading = sorted(cache.in_flight)
        counters = cache.counters
        counts = {"tokens": counters.tokens, "hits": counters.hits, "misses": counters.misses,
                  "bytes_read": counters.demand_bytes + counters.prefetch_bytes}
        layer, live, version = cache.current_layer, cache.profile, cache.version
    layers, experts = cache.store.num_layers, cache.store.num_experts
    resident = [[] for _ in range(layers)]
    for key_layer, expert in sorted(keys):
        resident[key_layer].append(expert)
    hot = [[] for _ in range(layers)]
    if live is not None:  # (a request's own profile while it runs)
        uses, shown = live.counts, HOT_PER_TOP_K * live.top_k
        for key_layer in range(min(layers, len(uses))):
            hot[key_layer] = [int(e) for e in np.argsort(-uses[key_layer], kind="stable")[:shown]
                              if uses[key_layer, e] > 0]
    profile = getattr(active, "profile", None) or getattr(live_profile, "source", None)
    return {"layers": layers, "experts": experts, "capacity": cache.capacity, "version": version,
            "resident": resident, "hot": hot, "reading": [list(key) for key in reading], "layer": layer,
            "busy": generation_lock(generator.model_provider.model).locked(), "counters": counts, "plan": dataclasses.asdict(generator.runtime.plan),
            "profile": profile and str(profile)}
