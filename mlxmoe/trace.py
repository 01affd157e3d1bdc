"""Routing traces (`mlxmoe.trace/1`): record them from a run, read them, and replay them
through the same Residency and policy code the runtime uses.

A trace is JSONL: a header line
  {"format": "mlxmoe.trace/1", "num_layers": L, "num_experts": E, "top_k": K, "model": ...}
then one line per token and MoE layer in execution order:
  {"s": sequence, "t": token position, "l": layer, "e": [expert ids], "p": [router probs],
   "r": [the router's distribution over all E experts]}
`p` and `r` are optional. `r` (written by the runtime, 3 significant digits) lets a replay
give the policy what the runtime gives it: the router's whole distribution, not only the
probabilities of the experts it chose. The runtime also writes `"n"`, the tokens of the
layer call a line came from, on the lines of a multi-token call (a prefill): a replay then
groups exactly those lines into one fetch, as the runtime did. Without it, consecutive
lines of one sequence and layer with rising positions are taken as one call, which cannot
tell a prefill from decode steps in a model of one MoE layer.
"""

import json
import math
import os
from pathlib import Path

import numpy as np

from .cache import Residency, token_chunks
from .errors import MlxmoeError
from .files import read_lines, temp_beside
from .policies import ONLINE, make_policy
from .prefetch import count_prediction, hottest_per_layer, precision_recall

FORMAT = "mlxmoe.trace/1"
MAX_EXPERTS = 1 << 22  # layers x experts a header may claim


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

    def write(self, token, layer, experts, probs=None, router=None, tokens=1):
        line = {"s": max(self.seq, 0), "t": token, "l": layer, "e": experts}
        if tokens > 1:
            line["n"] = tokens
        if probs is not None:
            line["p"] = [round(p, 5) for p in probs]
        if router is not None:
            line["r"] = [float(f"{p:.3g}") for p in router]
        self.file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self):
        if self.file.closed:
            return
        self.file.close()
        os.replace(self.tmp, self.path)

    def abort(self):
        """Drop the trace: nothing is left at `path` or beside it."""
        if not self.file.closed:
            self.file.close()
            os.unlink(self.tmp)


def _probabilities(values, what):
    if values is None:
        return None
    if not isinstance(values, list):
        raise ValueError(f"{what} must be a list of numbers")
    out = [float(x) for x in values]
    if not all(math.isfinite(x) and x >= 0 for x in out):
        raise ValueError(f"{what} must be finite and non-negative")
    return out


def _header_size(header, key):
    v = header.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_EXPERTS:
        raise ValueError(f"{key} must be an integer from 1 to {MAX_EXPERTS}, not {str(v)[:40]}")
    return v


def read_trace(path):
    """Return (header, records); records are (s, t, l, experts, probs or None, router
    distribution or None, tokens of its layer call or None). Every line is checked, so
    that a replay of what is returned cannot fail."""
    path = Path(path)
    lines = read_lines(path, "trace")
    if not lines:
        raise MlxmoeError(f"{path}: empty trace")
    try:
        header = json.loads(lines[0])
    except (json.JSONDecodeError, RecursionError) as e:
        raise MlxmoeError(f"{path}:1: not JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise MlxmoeError(f"{path}:1: not a {FORMAT} header")
    try:
        L, E = _header_size(header, "num_layers"), _header_size(header, "num_experts")
        if L * E > MAX_EXPERTS:
            raise ValueError(f"{L} layers x {E} experts is more than {MAX_EXPERTS} experts")
    except ValueError as e:
        raise MlxmoeError(f"{path}:1: malformed header ({e})") from None
    records, numbers = [], []
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            if not isinstance(r, dict) or not isinstance(r.get("e"), list) or not r["e"]:
                raise ValueError("a line is an object with a non-empty list of experts e")
            s, t, l, e = int(r["s"]), int(r["t"]), int(r["l"]), [int(x) for x in r["e"]]
            p, dist = _probabilities(r.get("p"), "p"), _probabilities(r.get("r"), "r")
            call = None if r.get("n") is None else int(r["n"])
            if call is not None and not 1 <= call <= len(lines):
                raise ValueError(f"n = {call}: a layer call has at least one token and at most the trace's lines")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError, RecursionError) as err:
            raise MlxmoeError(f"{path}:{n}: malformed trace line ({err})") from None
        if not 0 <= l < L or any(not 0 <= x < E for x in e):
            raise MlxmoeError(f"{path}:{n}: layer {l} or experts {e} out of range for {L} layers x {E} experts")
        if p is not None and len(p) != len(e):
            raise MlxmoeError(f"{path}:{n}: {len(p)} probabilities for {len(e)} experts")
        if dist is not None and len(dist) != E:
            raise MlxmoeError(f"{path}:{n}: a router distribution of {len(dist)} experts, the header says {E}")
        records.append((s, t, l, e, p, dist, call))
        numbers.append(n)
    if not records:
        raise MlxmoeError(f"{path}: a header and no routing lines")
    _check_calls(path, records, numbers)
    return header, records


def _check_calls(path, records, numbers):
    """A line's `n` says its layer call wrote n consecutive lines of one sequence and
    layer, each with the same n: refuse a trace where they are not there."""
    i = 0
    while i < len(records):
        size = records[i][6]
        if size is None:
            i += 1
            continue
        s, l = records[i][0], records[i][2]
        call = records[i:i + size]
        if len(call) < size or any((r[0], r[2], r[6]) != (s, l, size) for r in call):
            raise MlxmoeError(f"{path}:{numbers[i]}: n = {size}, but the next {size} lines are not one layer call "
                              "of that many tokens")
        i += size


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
    use (the runtime's prefill), split into runs that fit `capacity` as the runtime
    splits it; the first layer ticks the clock by the call's tokens. Scores and the
    distribution are means over the call's tokens, as the runtime gives them."""
    for call in layer_calls(records, num_layers):
        layer = call[0][2]
        for a, b in token_chunks([rec[3] for rec in call], capacity or math.inf):
            run = call[a:b]
            experts = sorted({x for rec in run for x in rec[3]})  # the runtime fetches them sorted too
            scores = dist = None
            if all(rec[5] is not None for rec in run):
                dist = np.mean([rec[5] for rec in run], axis=0)
                scores = dist[experts].tolist()
            elif all(rec[4] is not None for rec in run):
                mass = {}
                for rec in run:
                    for x, p in zip(rec[3], rec[4]):
                        mass[x] = mass.get(x, 0.0) + p / len(run)
                scores = [mass[x] for x in experts]
            yield (len(call) if layer == 0 and a == 0 else 0), layer, experts, scores, dist


def replay(header, records, policy, cache_experts, **policy_kw):
    """Hits of `policy` with `cache_experts` slots on this trace."""
    L, E = header["num_layers"], header["num_experts"]
    k = max((len(set(r[3])) for r in records), default=1)
    if cache_experts < k:
        raise MlxmoeError(f"--cache-experts must be at least {k} (the most experts one layer uses at once)")
    if policy == "belady":
        policy_kw["future"] = [(l, x) for _, l, experts, *_ in steps(records, L, cache_experts) for x in experts]
    residency = Residency(cache_experts, make_policy(policy, cache_experts, L, E, **policy_kw))
    for tokens, layer, experts, scores, dist in steps(records, L, cache_experts):
        if tokens:
            residency.tick(tokens)
        residency.access(layer, experts, scores, dist)
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
