"""Victim choice for the expert cache: the registry of policies by name (make_policy).
One implementation per policy, used both by the runtime cache (cache.py) and by the trace
replay simulator (trace.py): the `Policy` interface and the simple baselines in
baselines.py, the default and its rules in default.py.

Keys are (layer, expert). The cache tells a policy:
- `tick(tokens)` when new tokens start (the first MoE layer of a forward pass),
- `visit(layer, experts, scores, probs)` once per layer call, before its accesses:
  the distinct experts it uses, their router probabilities (`scores`, or None) and,
  when known, the router's probabilities over all experts of the layer (`probs`;
  the runtime computes them only for policies with `wants_router = True`),
- `access(key, hit, score)` for every expert the layer uses,
- `insert(key)` when a key became resident, `remove(key)` when it left,
and asks `victim(protected)` for the resident key to evict, never one in `protected`
(the experts the current layer needs now).
"""

from ..errors import MlxmoeError
# (the names below are also imported from here: the baselines' and the default's own modules
# are where they are defined)
from .baselines import (HALF_LIFE_LFU, LFU, LFUDA, LRU, S3FIFO, SLRU, Belady, DecayedCounts, LayerLFU,
                        LayerLRU, LayerSplit, Policy, hottest, pins, policy_options)
from .default import (FLOOR_SLACK, HALF_LIFE_ACTIVATION, HALF_LIFE_FLOOR, HALF_LIFE_RECENCY, Activation,
                      NextUse)

HALF_LIFE_PROFILE = 4096  # a profile's counts, in tokens: it remembers a long session, and still adapts

POLICIES = {p.name: p for p in (LRU, LFU, SLRU, S3FIFO, LayerLRU, LayerLFU, LFUDA, Activation, Belady)}
# policies composed of another's parts with other options: name -> (the policy, its options)
COMPOSED = {"activation-floor": ("activation", {"half_life": HALF_LIFE_FLOOR, "floor_slack": FLOOR_SLACK})}
DEFAULT_POLICY = "activation-floor"
ONLINE = [name for name, p in POLICIES.items() if not p.offline]
ONLINE.insert(ONLINE.index("activation") + 1, "activation-floor")


def make_policy(name, capacity, num_layers, num_experts, **kwargs):
    name = name or DEFAULT_POLICY
    base, options = COMPOSED.get(name, (name, {}))
    if base not in POLICIES:
        raise MlxmoeError(f"unknown policy {name!r}; choose one of {', '.join(ONLINE + ['belady'])}")
    cls = POLICIES[base]
    unknown = [key for key in kwargs if key not in policy_options(cls)]
    if unknown:
        raise MlxmoeError(f"policy {name!r} has no option {', '.join(map(repr, unknown))} "
                          f"(its options: {', '.join(policy_options(cls)) or 'none'})")
    policy = cls(capacity, num_layers, num_experts, **{**options, **kwargs})
    policy.name = name
    return policy
