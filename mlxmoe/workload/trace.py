"""Routing traces (`mlxmoe.trace/1`): replay them through the same Residency and policy
code the runtime uses, and learn a profile from them. The file format (TraceWriter,
read_trace) is in tracefile.py, the importers of other engines' routing logs
(import_trace) in importers.py; their names are also imported from here.
"""

import math

import numpy as np

from ..caching.cache import Residency, expert_groups
from ..caching.policies import HALF_LIFE_PROFILE, ONLINE, make_policy
from ..caching.prefetch import count_prediction, hottest_per_layer, precision_recall
from ..errors import MlxmoeError
from .importers import IMPORT_FORMATS, PREFILL_STEP, import_trace  # noqa: F401
from .profile import ActivationProfile, prewarm_order
from .tracefile import FORMAT, MAX_EXPERTS, TraceWriter, read_trace, trace_fingerprint  # noqa: F401


def layer_calls(records, num_layers):
    """Group the trace's lines into the layer calls that made them: a multi-token call (a
    prefill) writes one line per token, consecutive, with the same sequence and layer, and
    (the runtime's traces) the call's token count `n`. Yields lists of records."""
    call, size = [], None  # size: the call's tokens where the trace says (n), else None
    for rec in records:
        if call:
            if size is not None:
                same = len(call) < size
            else:
                s, t, l = rec[:3]
                same = num_layers > 1 and (s, l) == (call[-1][0], call[-1][2]) and t > call[-1][1]
            if not same:
                yield call
                call = []
        if not call:
            size = rec[6] if len(rec) > 6 else None
        call.append(rec)
    if call:
        yield call


def steps(records, num_layers, capacity=None):
    """The cache's view of a trace, one item per fetch as the runtime makes them:
    (tokens to tick, layer, distinct experts, their router scores, the router's
    distribution over all experts). A layer call is one fetch of the experts its tokens
    use (the runtime's prefill), split into groups of experts that fit `capacity` as the
    runtime splits it; the first layer ticks the clock by the call's tokens. Scores and
    the distribution are means over the call's tokens, as the runtime gives them."""
    for call in layer_calls(records, num_layers):
        layer = call[0][2]
        dist = mass = None  # the router's mean distribution, else the experts' mean scores
        if all(rec[5] is not None for rec in call):
            dist = np.mean([rec[5] for rec in call], axis=0)
        elif all(rec[4] is not None for rec in call):
            mass = {}
            for rec in call:
                for x, p in zip(rec[3], rec[4]):
                    mass[x] = mass.get(x, 0.0) + p / len(call)
        for i, experts in enumerate(expert_groups([rec[3] for rec in call], capacity or math.inf)):
            scores = dist[experts].tolist() if dist is not None else None if mass is None else [mass[x] for x in experts]
            yield (len(call) if layer == 0 and i == 0 else 0), layer, experts, scores, dist


def replay(header, records, policy, cache_experts, profile=None, **policy_kw):
    """Hits of `policy` with `cache_experts` slots on this trace. With `profile` (an
    ActivationProfile) the cache starts as the runtime's does when loaded with it: the
    policy takes its rates as prior (and its pins from them), and the free slots are
    pre-warmed in its order, one claim per key as the pre-warm thread claims them (all of
    them before the first token: the runtime reads them in the background meanwhile)."""
    L, E = header["num_layers"], header["num_experts"]
    k = max((len(set(r[3])) for r in records), default=1)
    if cache_experts < k:
        raise MlxmoeError(f"--cache-experts must be at least {k} (the most experts one layer uses at once)")
    if policy == "belady":
        policy_kw["future"] = [(l, x) for _, l, experts, *_ in steps(records, L, min(cache_experts, L * E))
                               for x in experts]
    if profile is not None:
        if policy == "belady":
            raise MlxmoeError("belady starts from a cold cache: a profile is for the online policies")
        profile.check_model(trace_fingerprint(header), L, E, force=True, where=profile.name())  # shapes must agree
        policy_kw["prior"] = profile.rates()
    slots = min(cache_experts, L * E)  # a larger cache holds every expert too: the same hits, no huge tables
    residency = Residency(slots, make_policy(policy, slots, L, E, **policy_kw))
    if profile is not None:
        for key in prewarm_order(profile, L, E, slots)[:slots]:
            residency.claim([key])
    counters, step_tokens, decode = residency.counters, 0, [0, 0]  # decode: hits, accesses of one-token steps
    for tokens, layer, experts, scores, dist in steps(records, L, slots):
        if tokens:
            residency.tick(tokens)
            step_tokens = tokens
        hits, misses = counters.hits, counters.misses
        residency.access(layer, experts, scores, dist)
        if step_tokens == 1:
            decode[0] += counters.hits - hits
            decode[1] += counters.hits - hits + counters.misses - misses
    hits, accesses = counters.hits, counters.hits + counters.misses
    return {"policy": policy, "cache_experts": cache_experts, "accesses": accesses, "hits": hits,
            "hit_rate": hits / accesses if accesses else 0.0,
            "decode_hit_rate": decode[0] / decode[1] if decode[1] else 0.0}


def replay_all(header, records, policies, cache_experts, profile=None, done=None, **policy_kw):
    """replay() for each policy, each with `belady_hit_rate` of the same size (from a
    cold cache: the profile is for the online policies); `done(result)` as each ends."""
    best = replay(header, records, "belady", cache_experts)
    out = []
    for name in policies:
        r = dict(best) if name == "belady" else replay(header, records, name, cache_experts, profile, **policy_kw)
        r["belady_hit_rate"] = best["hit_rate"]
        out.append(r)
        if done is not None:
            done(r)
    return out


def build_profile(traces, workload="", half_life=HALF_LIFE_PROFILE):
    """An ActivationProfile learnt from traces [(name, header, records)] of one model, as
    the runtime's live profile learns from a run: the first layer of each layer call
    ticks it by the call's tokens, every call counts its distinct experts once, with their
    router scores (the whole distribution where the trace has it)."""
    name, first, _ = traces[0]
    L, E, fp = first["num_layers"], first["num_experts"], trace_fingerprint(first)
    for other, header, _ in traces[1:]:
        if (header["num_layers"], header["num_experts"], trace_fingerprint(header)) != (L, E, fp):
            raise MlxmoeError(f"{other} is of another model than {name}: {header['num_layers']} layers x "
                              f"{header['num_experts']} experts, fingerprint {trace_fingerprint(header)}; {name}: "
                              f"{L} x {E}, {fp}")
    top_k = max(int(h.get("top_k") or 0) for _, h, _ in traces)
    profile = ActivationProfile(L, E, top_k, half_life, str(first.get("model", "")), fp, workload)
    for _, header, records in traces:
        for tokens, layer, experts, scores, dist in steps(records, L):
            if tokens:
                profile.tick(tokens)
            profile.observe(layer, experts, scores, dist)
    return profile


def policy_names(name):
    return ONLINE + ["belady"] if name == "all" else [name]


def predictor_scores(records, prior=None, top_k=None):
    """Precision and recall, on a recorded trace, of the predictors that need no hidden
    state: `previous_token` (a layer's experts at the previous token) and, given a
    profile's rates [layers, experts], `profile` (the layer's top-k by rate)."""
    hottest = None if prior is None else hottest_per_layer(prior, top_k or max(len(r[3]) for r in records))
    counts = {"previous_token": [0, 0, 0], "profile": [0, 0, 0]}
    previous = {}
    for s, t, l, e, *_ in records:
        used = set(e)
        predictions = {"previous_token": previous.get((s, l))}
        if hottest is not None:
            predictions["profile"] = hottest[l]
        for name, predicted in predictions.items():
            if predicted is not None:
                count_prediction(counts[name], predicted, used)
        previous[(s, l)] = used
    return precision_recall(counts)
