"""Routing traces (`mlxmoe.trace/1`): record them from a run, read them, and replay them
through the same Residency and policy code the runtime uses.

A trace is JSONL: a header line
  {"format": "mlxmoe.trace/1", "num_layers": L, "num_experts": E, "top_k": K, "model": ...}
then one line per token and MoE layer in execution order:
  {"s": sequence, "t": token position, "l": layer, "e": [expert ids], "p": [router probs]}
"""

import json
import os
from pathlib import Path

from .cache import Residency
from .errors import MlxmoeError, read_lines
from .policies import ONLINE, make_policy
from .prefetch import count_prediction, hottest_per_layer, precision_recall
from .profile import temp_beside

FORMAT = "mlxmoe.trace/1"


class TraceWriter:
    """Writes a trace to a temp file beside `path`, renamed into place by close()."""

    def __init__(self, path, num_layers, num_experts, top_k, model=""):
        self.path = Path(path)
        fd, self.tmp = temp_beside(self.path)
        self.file = os.fdopen(fd, "w")
        header = {"format": FORMAT, "num_layers": num_layers, "num_experts": num_experts, "top_k": top_k,
                  "model": str(model)}
        self.file.write(json.dumps(header) + "\n")
        self.seq = -1

    def new_sequence(self):
        self.seq += 1

    def write(self, token, layer, experts, probs=None):
        line = {"s": max(self.seq, 0), "t": token, "l": layer, "e": experts}
        if probs is not None:
            line["p"] = [round(p, 5) for p in probs]
        self.file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self):
        if self.file.closed:
            return
        self.file.close()
        os.replace(self.tmp, self.path)


def read_trace(path):
    """Return (header, records); records are (s, t, l, experts, probs or None)."""
    path = Path(path)
    lines = read_lines(path, "trace")
    if not lines:
        raise MlxmoeError(f"{path}: empty trace")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError as e:
        raise MlxmoeError(f"{path}:1: not JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise MlxmoeError(f"{path}:1: not a {FORMAT} header")
    try:
        L, E = int(header["num_layers"]), int(header["num_experts"])
    except (KeyError, TypeError, ValueError):
        raise MlxmoeError(f"{path}:1: header needs num_layers and num_experts") from None
    records = []
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            s, t, l, e, p = int(r["s"]), int(r["t"]), int(r["l"]), [int(x) for x in r["e"]], r.get("p")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise MlxmoeError(f"{path}:{n}: malformed trace line ({err})") from None
        if not 0 <= l < L or any(not 0 <= x < E for x in e):
            raise MlxmoeError(f"{path}:{n}: layer {l} or experts {e} out of range for {L} layers x {E} experts")
        if p is not None and len(p) != len(e):
            raise MlxmoeError(f"{path}:{n}: {len(p)} probabilities for {len(e)} experts")
        records.append((s, t, l, e, p))
    return header, records


def steps(records):
    """The cache's view of a trace: (new_token, layer, distinct experts, their scores)."""
    last = None
    for s, t, l, e, p in records:
        seen, experts, scores = set(), [], []
        for i, x in enumerate(e):
            if x not in seen:
                seen.add(x)
                experts.append(x)
                scores.append(None if p is None else p[i])
        yield (s, t) != last, l, experts, (scores if p is not None else None)
        last = (s, t)


def replay(header, records, policy, cache_experts, **policy_kw):
    """Hits of `policy` with `cache_experts` slots on this trace."""
    L, E = header["num_layers"], header["num_experts"]
    k = max((len(set(r[3])) for r in records), default=1)
    if cache_experts < k:
        raise MlxmoeError(f"--cache-experts must be at least {k} (the most experts one layer uses at once)")
    if policy == "belady":
        policy_kw["future"] = [(l, x) for _, l, experts, _ in steps(records) for x in experts]
    residency = Residency(cache_experts, make_policy(policy, cache_experts, L, E, **policy_kw))
    for new_token, layer, experts, scores in steps(records):
        if new_token:
            residency.policy.tick(1)
        residency.access(layer, experts, scores)
    accesses = residency.hits + residency.misses
    return {"policy": policy, "cache_experts": cache_experts, "accesses": accesses, "hits": residency.hits,
            "hit_rate": residency.hits / accesses if accesses else 0.0}


def replay_all(header, records, policies, cache_experts, **policy_kw):
    """replay() for each policy, each with `belady_hit_rate` of the same size."""
    best = replay(header, records, "belady", cache_experts)
    out = []
    for name in policies:
        r = dict(best) if name == "belady" else replay(header, records, name, cache_experts, **policy_kw)
        r["belady_hit_rate"] = best["hit_rate"]
        out.append(r)
    return out


def policy_names(name):
    return ONLINE + ["belady"] if name == "all" else [name]


def predictor_scores(records, prior=None, top_k=None):
    """Precision and recall, on a recorded trace, of the predictors that need no hidden
    state: `previous_token` (a layer's experts at the previous token) and, given a
    profile's rates [layers, experts], `profile` (the layer's top-k by rate)."""
    hottest = None if prior is None else hottest_per_layer(prior, top_k or max(len(r[3]) for r in records))
    counts = {"previous_token": [0, 0, 0], "profile": [0, 0, 0]}
    previous = {}
    for s, t, l, e, _ in records:
        used = set(e)
        predictions = {"previous_token": previous.get((s, l))}
        if hottest is not None:
            predictions["profile"] = hottest[l]
        for name, predicted in predictions.items():
            if predicted is not None:
                count_prediction(counts[name], predicted, used)
        previous[(s, l)] = used
    return precision_recall(counts)
