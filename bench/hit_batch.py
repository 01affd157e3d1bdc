"""Host time of a decode token that hits at every MoE layer: the policy's updates as one
Residency._hit per layer (visit + an access per expert) against one Residency.hit_calls
(Policy.hits: the default's in a few numpy calls), 48 layers x 128 experts, top-8, float32
router distributions (as host_probs gives), half the experts resident. Medians per token of
alternated runs; the per-token tick is outside the timing.

    python bench/hit_batch.py [--tokens 200] [--runs 3] [--policy activation-floor]
"""

import argparse
import statistics
import time

import numpy as np

from mlxmoe.caching.cache import Residency
from mlxmoe.caching.policies import make_policy

L, E, K = 48, 128, 8


def tokens_of(rng, n, resident):
    """n tokens' calls, each layer's top-8 among its resident experts."""
    out = []
    for _ in range(n):
        calls = []
        for layer in range(L):
            probs = rng.dirichlet(np.ones(E) * 0.3).astype(np.float32)
            experts = sorted(rng.choice(resident[layer], size=K, replace=False).tolist())
            calls.append((layer, experts, [float(probs[e]) for e in experts], probs))
        out.append(calls)
    return out


def run(policy, batched, tokens, resident):
    capacity = sum(len(r) for r in resident)
    r = Residency(capacity, make_policy(policy, capacity, L, E), defer_hits=True)
    r.claim([(layer, int(e)) for layer in range(L) for e in resident[layer]])
    times = []
    for calls in tokens:
        r.tick(1)
        tic = time.perf_counter()
        if batched:
            r.hit_calls(calls)
        else:
            for call in calls:
                r.deferred.append((r._hit, (*call, None)))
        r.catch_up()
        times.append(time.perf_counter() - tic)
    return statistics.median(times[10:]) * 1e3, r.policy


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--policy", default="activation-floor")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    resident = [rng.choice(E, size=E // 2, replace=False) for _ in range(L)]
    tokens = tokens_of(rng, args.tokens, resident)
    print(f"{args.policy}: ms of host time per token ({L} layers x {E} experts, top-{K}, all hits)")
    for i in range(args.runs):
        loop, a = run(args.policy, False, tokens, resident)
        batch, b = run(args.policy, True, tokens, resident)
        print(f"run {i + 1}: per-layer _hit {loop:.3f}  hit_calls {batch:.3f}  ({loop / batch:.1f}x)")


if __name__ == "__main__":
    main()
