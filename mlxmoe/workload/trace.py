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
tell a prefill from decode steps in a model of one MoE layer. `"ph": "prefill"` marks the
lines of prompt tokens where the recorder knew it (imported traces); lines without it are
generated tokens, or of unknown phase.

import_trace() converts routing recorded by other engines into this format (see
IMPORT_FORMATS).
"""

import base64
import csv
import json
import math
import os
import re
from pathlib import Path

import numpy as np

from ..caching.cache import Residency, expert_groups
from ..errors import MlxmoeError
from ..storage.files import read_lines, temp_beside
from ..caching.policies import HALF_LIFE_PROFILE, ONLINE, make_policy
from ..caching.prefetch import count_prediction, hottest_per_layer, precision_recall
from .profile import ActivationProfile, prewarm_order, shape_fingerprint

FORMAT = "mlxmoe.trace/1"
MAX_EXPERTS = 1 << 22  # layers x experts a header may claim


class TraceWriter:
    """Writes a trace to a temp file beside `path`, renamed into place by close()."""

    def __init__(self, path, num_layers, num_experts, top_k, model="", **extra):
        """`extra`: more header keys (an imported trace's source, its sequences' names)."""
        self.path = Path(path)
        fd, self.tmp = temp_beside(self.path)
        self.file = os.fdopen(fd, "w")
        header = {"format": FORMAT, "num_layers": num_layers, "num_experts": num_experts, "top_k": top_k,
                  "model": str(model), **extra}
        self.file.write(json.dumps(header) + "\n")
        self.seq = -1
        self.lines = 0  # routing lines written: a trace without any is not a trace

    def new_sequence(self):
        self.seq += 1

    def write(self, token, layer, experts, probs=None, router=None, tokens=1, prefill=False):
        line = {"s": max(self.seq, 0), "t": token, "l": layer, "e": experts}
        if tokens > 1:
            line["n"] = tokens
        if prefill:
            line["ph"] = "prefill"
        if probs is not None:
            line["p"] = [round(p, 5) for p in probs]
        if router is not None:
            line["r"] = [float(f"{p:.3g}") for p in router]
        self.file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self.lines += 1

    def observe(self, call) -> None:
        """An expert cache's observer: write a layer call (experts.LayerCall), one line per token."""
        for i, row in enumerate(call.rows.tolist()):
            if call.probs is None:
                self.write(call.position + i, call.layer, row, tokens=call.tokens)
            else:
                self.write(call.position + i, call.layer, row, call.probs[i][row].tolist(), call.probs[i].tolist(),
                           call.tokens)

    def close(self):
        """Rename the trace into place; one stopped before any routing is dropped (read_trace refuses it)."""
        if self.file.closed:
            return
        if self.lines == 0:
            return self.abort()
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


def _integer(v, what, allow_str=False):
    """`v` as an int: an int, or a float or (`allow_str`: CSV cells, JSON keys) a string
    that is one exactly; anything else (1.5, "1" in JSON, true) is a ValueError naming `what`."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if allow_str and isinstance(v, str) and re.fullmatch(r"-?\d+", v.strip()):
        return int(v)
    raise ValueError(f"{what} must be an integer, not {json.dumps(v)[:40] if _jsonable(v) else repr(v)[:40]}")


def _jsonable(v):
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _header_size(header, key):
    v = header.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_EXPERTS:
        raise ValueError(f"{key} must be an integer from 1 to {MAX_EXPERTS}, not {str(v)[:40]}")
    return v


def read_trace(path):
    """Return (header, records); records are (s, t, l, experts, probs or None, router
    distribution or None, tokens of its layer call or None, "prefill" or None). Every
    line is checked, so that a replay of what is returned cannot fail."""
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
        k = header.get("top_k")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E):
            raise ValueError(f"top_k must be an integer from 1 to the {E} experts, not {str(k)[:40]}")
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
            s, t, l = _integer(r["s"], "s"), _integer(r["t"], "t"), _integer(r["l"], "l")
            e = [_integer(x, "an expert id") for x in r["e"]]
            if len(set(e)) != len(e):
                raise ValueError(f"experts {e} repeat an id (a token routes to distinct experts)")
            p, dist = _probabilities(r.get("p"), "p"), _probabilities(r.get("r"), "r")
            call = None if r.get("n") is None else _integer(r["n"], "n")
            if call is not None and not 1 <= call <= len(lines):
                raise ValueError(f"n = {call}: a layer call has at least one token and at most the trace's lines")
            phase = r.get("ph")
            if phase not in (None, "prefill"):
                raise ValueError(f"ph = {phase!r}: the phase marker is \"prefill\" or absent")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError, RecursionError) as err:
            raise MlxmoeError(f"{path}:{n}: malformed trace line ({err})") from None
        if not 0 <= l < L or any(not 0 <= x < E for x in e):
            raise MlxmoeError(f"{path}:{n}: layer {l} or experts {e} out of range for {L} layers x {E} experts")
        if p is not None and len(p) != len(e):
            raise MlxmoeError(f"{path}:{n}: {len(p)} probabilities for {len(e)} experts")
        if dist is not None and len(dist) != E:
            raise MlxmoeError(f"{path}:{n}: a router distribution of {len(dist)} experts, the header says {E}")
        records.append((s, t, l, e, p, dist, call, phase))
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


def trace_fingerprint(header):
    """The model fingerprint a trace stands for: the one the runtime wrote in its header,
    else (an imported trace) its shape's (profile.shape_fingerprint)."""
    return header.get("fingerprint") or shape_fingerprint(header["num_layers"], header["num_experts"])


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


# Import: routing recorded by other engines, converted to mlxmoe.trace/1.
#
# Each reader returns (meta, sequences): meta holds what the source says of the model
# (num_layers, num_experts, top_k, model; None where it says nothing), sequences is a list
# of (name, entries), one per request, entries (token, layer, experts, probs or None,
# prefill, where) with `where` the source line (or JSON path) for messages. import_trace()
# then writes each sequence as mlxmoe's runtime would have run it: the prompt as layer calls
# of up to PREFILL_STEP tokens (all its tokens but the last, in one call per layer), then
# its last token and each generated token one at a time, through every layer.

PREFILL_STEP = 2048  # mlx-lm generate_step's prefill_step_size: the longest prefill call
REPEAT_RUN = 8  # a dump opening with this many tokens of one routing at every layer: a profiling run


def _json_lines(path):
    """(line number, object) for each non-blank line of a JSONL file."""
    for n, line in enumerate(read_lines(path, "routing file"), start=1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise MlxmoeError(f"{path}:{n}: not JSON ({e})") from None


def _json_file(path):
    text = "\n".join(read_lines(path, "routing file"))
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise MlxmoeError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None


def _route(ids, weights, where):
    """Expert ids (ints) and their weights (floats or None) of one token at one layer."""
    try:
        if not isinstance(ids, list) or not (weights is None or isinstance(weights, list)):
            raise TypeError("not lists")
        experts = [_integer(x, "an expert id") for x in ids]
        if weights is not None and any(isinstance(w, bool) or not isinstance(w, (int, float)) for w in weights):
            raise ValueError(f"weights {str(weights)[:60]} are not all numbers")
        probs = None if weights is None else [float(w) for w in weights]
    except (TypeError, ValueError, OverflowError) as e:
        raise MlxmoeError(f"{where}: expert ids and weights must be lists of numbers ({e})") from None
    if probs is not None and len(probs) != len(experts):
        raise MlxmoeError(f"{where}: {len(probs)} weights for {len(experts)} experts")
    if probs is not None and not all(math.isfinite(w) and w >= 0 for w in probs):
        raise MlxmoeError(f"{where}: weights must be finite and non-negative, not {probs}")
    return experts, probs


def _field(obj, key, where, allow_str=False):
    """An integer field of a source record, never coerced (1.5 or "1" refused)."""
    try:
        return _integer(obj[key], repr(key), allow_str)
    except KeyError:
        raise MlxmoeError(f"{where}: missing {key!r}") from None
    except ValueError as e:
        raise MlxmoeError(f"{where}: {e}") from None


def read_specmoe(path):
    """speculative-moe (github Mario928/speculative-moe, routing_data_collected/*.jsonl):
    Mixtral-8x7B-Instruct routing of generated tokens, one line per problem, layer and
    token: {"dataset", "problem_id", "layer", "token_idx", "experts", "gating_probs"}.
    Each problem is a sequence; every line is a generated token (decode)."""
    sequences = {}
    for n, r in _json_lines(path):
        where = f"{path}:{n}"
        if not isinstance(r, dict):
            raise MlxmoeError(f"{where}: not a routing record (a JSON object)")
        pid = _field(r, "problem_id", where, allow_str=True)
        experts, probs = _route(r.get("experts"), r.get("gating_probs"), where)
        entry = (_field(r, "token_idx", where), _field(r, "layer", where), experts, probs, False, where)
        sequences.setdefault((str(r.get("dataset", "")), pid), []).append(entry)
    meta = {"num_layers": 32, "num_experts": 8, "top_k": 2, "model": "Mixtral-8x7B-Instruct-v0.1"}
    return meta, [(f"{d}/{pid}" if d else str(pid), e) for (d, pid), e in sequences.items()]


def read_bigmoeonedge(path):
    """BigMoeOnEdge route_trace v1 (github Helldez/BigMoeOnEdge): a `#` preamble
    (`# model=... n_layer=L n_expert=E n_expert_used=K`), then CSV with a header
    `turn,phase,step,layer,slot,expert,weight,...`, one row per routed expert (phase 0
    prefill, 1 decode; step the context position; slot the rank by weight). Each turn is
    a sequence."""
    lines = read_lines(path, "routing file")
    meta = {"num_layers": None, "num_experts": None, "top_k": None, "model": None}
    keys = {"n_layer": "num_layers", "n_expert": "num_experts", "n_expert_used": "top_k"}
    body = 0
    while body < len(lines) and lines[body].startswith("#"):
        for word in lines[body][1:].split():
            k, _, v = word.partition("=")
            if k in keys and v.isdigit():
                meta[keys[k]] = int(v)
            elif k == "model":
                meta["model"] = os.path.splitext(os.path.basename(v))[0]
        body += 1
    rows = csv.reader(lines[body:])
    columns = next(rows, None)
    need = ("turn", "phase", "step", "layer", "slot", "expert")
    if columns is None or any(c not in columns for c in need):
        raise MlxmoeError(f"{path}:{body + 1}: expected a CSV header with {', '.join(need)}, found {columns}")
    col = {c: columns.index(c) for c in columns}
    cells, order = {}, []  # (turn, phase, step, layer) -> [(slot, expert, weight)], in file order
    for n, row in enumerate(rows, start=body + 2):
        if not row:
            continue
        where = f"{path}:{n}"
        try:
            turn, phase, step, layer, slot, expert = (int(row[col[c]]) for c in need)
            weight = float(row[col["weight"]]) if "weight" in col else None
        except (IndexError, ValueError) as e:
            raise MlxmoeError(f"{where}: malformed row ({e})") from None
        if phase not in (0, 1):
            raise MlxmoeError(f"{where}: phase {phase}: 0 (prefill) or 1 (decode)")
        key = (turn, phase, step, layer)
        if key not in cells:
            cells[key] = []
            order.append((key, where))
        cells[key].append((slot, expert, weight))
    sequences = {}
    for (turn, phase, step, layer), where in order:
        ranked = sorted(cells[(turn, phase, step, layer)])
        weights = None if any(w is None for *_, w in ranked) else [w for *_, w in ranked]
        entry = (step, layer, [e for _, e, _ in ranked], weights, phase == 0, where)
        sequences.setdefault(turn, []).append(entry)
    return meta, [(str(turn), e) for turn, e in sequences.items()]


def read_moe_ocs(path):
    """moe_ocs_learning (github jinlong-huo/moe_ocs_learning) routing JSON, recorded with
    vLLM or MLX: {"meta": {model_id, num_moe_layers, num_experts, top_k, ...}, "routes":
    [{"token_pos", "phase": "prefill"|"decode", "layers": {"0": {"experts", "weights"}}}]}.
    One sequence."""
    data = _json_file(path)
    if not isinstance(data, dict) or not isinstance(data.get("routes"), list):
        raise MlxmoeError(f"{path}: expected a JSON object with a \"routes\" list")
    m = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    meta = {"num_layers": m.get("num_moe_layers") or m.get("num_layers"), "num_experts": m.get("num_experts"),
            "top_k": m.get("top_k"), "model": m.get("model_id")}
    entries = []
    for i, route in enumerate(data["routes"]):
        where = f"{path}: routes[{i}]"
        if not isinstance(route, dict) or not isinstance(route.get("layers"), dict):
            raise MlxmoeError(f"{where}: expected an object with \"layers\"")
        token, phase = _field(route, "token_pos", where), route.get("phase")
        if phase not in ("prefill", "decode"):
            raise MlxmoeError(f"{where}: phase {phase!r}: \"prefill\" or \"decode\"")
        for layer, r in route["layers"].items():
            w = f"{where}.layers[{layer!r}]"
            if not isinstance(r, dict):
                raise MlxmoeError(f"{w}: expected {{\"experts\", \"weights\"}}")
            experts, probs = _route(r.get("experts"), r.get("weights"), w)
            if probs is not None:  # rank by weight, as the other formats list them
                ranked = sorted(zip(probs, experts), key=lambda pe: -pe[0])
                experts, probs = [e for _, e in ranked], [p for p, _ in ranked]
            entries.append((token, _field({"layer": layer}, "layer", w, allow_str=True), experts, probs,
                            phase == "prefill", w))
    return meta, [("0", entries)]


def read_vllm(path):
    """vLLM-style routing logs: one line per token and layer, {"type": "route", "req_id",
    "token_idx", "layer", "topk_ids", "topk_weights"} and an optional "phase"
    ("prefill"/"decode"); a {"type": "meta"} line may give model_id, num_experts, top_k;
    other types are skipped. Each req_id is a sequence. Without "phase", a run of a
    request's consecutive lines at one layer holding several tokens is a prefill (the
    engine logs a forward pass layer by layer), single tokens are decode; a log of one
    layer cannot show this and is taken as decode. A dump that opens with one routing
    repeated (vLLM's profiling run on dummy tokens) loses those rows, with a warning."""
    rows = []
    meta = {"num_layers": None, "num_experts": None, "top_k": None, "model": None}
    for n, r in _json_lines(path):
        where = f"{path}:{n}"
        if not isinstance(r, dict):
            raise MlxmoeError(f"{where}: not a routing record (a JSON object)")
        if r.get("type") == "meta":
            for key, name in (("num_experts", "num_experts"), ("top_k", "top_k"), ("model", "model_id")):
                meta[key] = r.get(name, meta[key])
        if r.get("type", "route") != "route":
            continue
        if "req_id" not in r:
            raise MlxmoeError(f"{where}: missing 'req_id'")
        experts, probs = _route(r.get("topk_ids"), r.get("topk_weights"), where)
        phase = r.get("phase")
        if phase not in (None, "prefill", "decode"):
            raise MlxmoeError(f"{where}: phase {phase!r}: \"prefill\" or \"decode\"")
        rows.append((str(r["req_id"]), _field(r, "token_idx", where), _field(r, "layer", where), experts, probs,
                     phase, where))
    warnings, rows = _drop_repeated_opening(path, rows)
    by_request = {}
    for row in rows:
        by_request.setdefault(row[0], []).append(row[1:])
    several_layers = len({row[2] for row in rows}) > 1
    sequences = []
    for req, lines in by_request.items():
        entries, i = [], 0
        while i < len(lines):  # runs of consecutive lines at one layer
            j = i + 1
            while j < len(lines) and lines[j][1] == lines[i][1]:
                j += 1
            for token, layer, experts, probs, phase, where in lines[i:j]:
                prefill = phase == "prefill" if phase else several_layers and j - i > 1
                entries.append((token, layer, experts, probs, prefill, where))
            i = j
        sequences.append((req, entries))
    return meta, sequences, warnings


def _drop_repeated_opening(path, rows):
    """Rows (req, token, layer, experts, ...) without an opening run in which every layer
    routes REPEAT_RUN or more tokens to one same set of experts: a profiling run's dummy
    batch, not a workload. Returns (warnings, rows)."""
    first, seen, end = {}, {}, 0
    for row in rows:
        layer, experts = row[2], sorted(row[3])
        if first.setdefault(layer, experts) != experts:
            break
        seen[layer] = seen.get(layer, 0) + 1
        end += 1
    if not seen or min(seen.values()) < REPEAT_RUN:
        return [], rows
    return [f"{path}: dropped the first {end} routing rows (through line {rows[end - 1][-1].rsplit(':', 1)[-1]}): one "
            f"routing repeated at every layer, as a profiling run on dummy tokens makes"], rows[end:]


def _decode_ids(value, dtype, where):
    """SGLang's routed_experts: base64 of a flat array (dtype int32 unless the response
    names another), or a plain (nested) list."""
    if isinstance(value, str):
        try:
            ids = np.frombuffer(base64.b64decode(value, validate=True), dtype=np.dtype(dtype or "int32"))
            if ids.dtype.kind not in "iu":
                raise ValueError(f"{ids.dtype} is not an integer type")
        except (ValueError, TypeError) as e:
            raise MlxmoeError(f"{where}: routed_experts is not base64 of {dtype or 'int32'} ({e})") from None
        return ids.astype(np.int64)
    try:
        ids = np.asarray(value)
        if ids.dtype.kind not in "iuf" or (ids.dtype.kind == "f" and not (
                np.all(np.isfinite(ids)) and np.all(np.mod(ids, 1) == 0) and np.all(np.abs(ids) < 2 ** 62))):
            raise ValueError("the ids are not all integers")
        return ids.astype(np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as e:
        raise MlxmoeError(f"{where}: routed_experts must be base64 or a list of ids ({e})") from None


def read_sglang(path, num_layers=None, top_k=None):
    """SGLang's `return_routed_experts` output (server flag --enable-return-routed-experts):
    a JSON file holding one response, a list of them, or JSONL with one per line. A
    /generate response has meta_info {"routed_experts": base64 of int32 (or of
    "routed_experts_dtype"), "prompt_tokens", "completion_tokens", "id"}; an OpenAI-style
    one has choices[i].sgl_ext.routed_experts and usage.prompt_tokens. The ids are a
    flat array of logical shape [tokens, layers, top_k] over positions [0, prompt +
    completion - 1) (the last generated token never runs through the model); its first
    prompt_tokens rows are the prefill. `num_layers` is needed to reshape it (top-k then
    follows from the token counts, else must be given); -1 marks a layer without routed
    experts (a dense layer): layers that are -1 everywhere are dropped."""
    if num_layers is None:
        raise MlxmoeError("sglang: give --num-layers (the layers in routed_experts' [tokens, layers, top_k] shape)")
    text = "\n".join(read_lines(path, "routing file"))
    try:
        docs = [(1, json.loads(text))]
    except json.JSONDecodeError:
        docs = list(_json_lines(path))
    responses = []
    for n, doc in docs:
        for i, obj in enumerate(doc if isinstance(doc, list) else [doc]):
            where = f"{path}:{n}" + (f" [{i}]" if isinstance(doc, list) else "")
            if not isinstance(obj, dict):
                raise MlxmoeError(f"{where}: expected a response object")
            if isinstance(obj.get("meta_info"), dict):
                m = obj["meta_info"]
                responses.append((str(m.get("id", len(responses))), m.get("routed_experts"), m.get("routed_experts_dtype"),
                                  m.get("prompt_tokens"), m.get("completion_tokens"), where))
            elif isinstance(obj.get("choices"), list):
                usage = obj.get("usage") or {}
                for c, choice in enumerate(obj["choices"]):
                    ext = choice.get("sgl_ext") or {} if isinstance(choice, dict) else {}
                    responses.append((f"{obj.get('id', len(responses))}/{c}", ext.get("routed_experts"),
                                      ext.get("routed_experts_dtype"), usage.get("prompt_tokens"), None, where))
            else:
                raise MlxmoeError(f"{where}: no meta_info.routed_experts nor choices[].sgl_ext.routed_experts")
    arrays = []
    for rid, value, dtype, prompt, completion, where in responses:
        for field, count in (("prompt_tokens", prompt), ("completion_tokens", completion)):
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
                raise MlxmoeError(f"{where}: {field} must be a token count (an integer, at least 0), not "
                                  f"{json.dumps(count)[:40]}")
        if value is None:
            raise MlxmoeError(f"{where}: no routed_experts (was the request sent with return_routed_experts?)")
        ids = _decode_ids(value, dtype, where)
        k = top_k
        if k is None and prompt is not None and completion is not None and prompt + completion > 1:
            k = len(ids) // ((prompt + completion - 1) * num_layers) or None
        if k is None:
            raise MlxmoeError(f"{where}: cannot tell top-k from the token counts: give --top-k")
        if len(ids) % (num_layers * k):
            raise MlxmoeError(f"{where}: {len(ids)} expert ids do not make [tokens, {num_layers}, {k}]")
        arrays.append((rid, ids.reshape(-1, num_layers, k), prompt or 0, where))
    routed = [l for l in range(num_layers) if any((a[:, l] >= 0).any() for _, a, _, _ in arrays)]
    sequences = []
    for rid, a, prompt, where in arrays:
        entries = [(t, new, [int(x) for x in a[t, old] if x >= 0], None, t < prompt, where)
                   for t in range(len(a)) for new, old in enumerate(routed) if (a[t, old] >= 0).any()]
        sequences.append((rid, entries))
    meta = {"num_layers": len(routed), "num_experts": None, "top_k": top_k, "model": None}
    return meta, sequences, ([f"{path}: dropped {num_layers - len(routed)} layers without routed experts "
                              f"(dense); the trace numbers the {len(routed)} MoE layers from 0"]
                             if len(routed) < num_layers else [])


IMPORT_FORMATS = {
    "specmoe": read_specmoe,
    "bigmoeonedge": read_bigmoeonedge,
    "moe-ocs": read_moe_ocs,
    "vllm": read_vllm,
    "sglang": read_sglang,
}


def import_trace(fmt, src, out, only=None, num_layers=None, num_experts=None, top_k=None, model=None):
    """Convert `src` (in IMPORT_FORMATS[fmt]) to an mlxmoe.trace/1 file at `out`, written
    atomically. `only`: the sequence names to keep (problem ids, request ids, turns).
    Shapes the source does not state are taken from the options, else from the largest
    ids seen. Returns (summary dict, warnings)."""
    if fmt not in IMPORT_FORMATS:
        raise MlxmoeError(f"unknown routing format {fmt!r}: one of {', '.join(IMPORT_FORMATS)}")
    reader = IMPORT_FORMATS[fmt]
    if fmt == "sglang":  # num_layers shapes its array; its meta then counts the MoE layers kept
        result, num_layers = reader(src, num_layers, top_k), None
    else:
        result = reader(src)
    meta, sequences, warnings = result if len(result) == 3 else (*result, [])
    warnings = list(warnings)
    if only is not None:
        wanted = {str(x) for x in only}
        names = {name for name, _ in sequences}
        kept = [(name, e) for name, e in sequences if name in wanted or name.rsplit("/", 1)[-1] in wanted]
        missing = sorted(w for w in wanted if w not in names and not any(n.rsplit("/", 1)[-1] == w for n in names))
        if missing:
            raise MlxmoeError(f"{src}: no sequence {', '.join(missing)} (it has {', '.join(sorted(names))})")
        sequences = kept
    entries = [e for _, seq in sequences for e in seq]
    if not entries:
        raise MlxmoeError(f"{src}: no routing to import")
    widest = max(len(e[2]) for e in entries)
    L = num_layers or meta["num_layers"] or max(e[1] for e in entries) + 1
    E = num_experts or meta["num_experts"] or max(x for e in entries for x in e[2]) + 1
    K = top_k or meta["top_k"] or widest
    for name, v in (("num_layers", L), ("num_experts", E), ("top_k", K)):  # what read_trace will accept
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_EXPERTS:
            if {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k}[name]:
                said = "--" + name.replace("_", "-")
            elif name != "top_k" and not meta[name]:  # taken from the largest id: name its line
                said = max(entries, key=lambda e: e[1] if name == "num_layers" else max(e[2]))[5]
            else:
                said = f"{src} (its {name})"
            raise MlxmoeError(f"{said}: {name} {str(v)[:40]} is more than {MAX_EXPERTS} (the largest id + 1 where "
                              "the file does not say) or below 1")
    if L * E > MAX_EXPERTS:
        raise MlxmoeError(f"{src}: {L} layers x {E} experts is more than {MAX_EXPERTS} experts (a layer or expert "
                          "id far beyond the model's? give --num-layers / --num-experts)")
    if K > E:
        raise MlxmoeError(f"{src}: top-k {K} is more than the {E} experts")
    if widest > K:
        raise MlxmoeError(f"{src}: a token routes to {widest} experts, more than top-k {K}")
    if K > widest:
        warnings.append(f"{src}: top-k {K}, but no token routes to more than {widest} experts")
    if not (num_experts or meta["num_experts"]):
        warnings.append(f"{src} does not say how many experts the model has: took {E} (the largest id + 1); "
                        "pass --num-experts if it has more")
    for token, layer, experts, _, _, where in entries:
        if not 0 <= layer < L or any(not 0 <= x < E for x in experts):
            raise MlxmoeError(f"{where}: layer {layer} or experts {experts} out of range for {L} layers x {E} experts")
        if len(set(experts)) != len(experts) or not experts:
            raise MlxmoeError(f"{where}: experts {experts} must be distinct and at least one")
        if token < 0:
            raise MlxmoeError(f"{where}: token position {token} is negative")
    writer = TraceWriter(out, L, E, K, model or meta["model"] or "", source=f"{fmt}:{os.path.basename(src)}",
                         sequences=[name for name, _ in sequences])
    counts = {"sequences": len(sequences), "tokens": 0, "prefill_tokens": 0, "duplicates": 0}
    try:
        for _, seq in sequences:
            writer.new_sequence()
            for key, n in _write_sequence(writer, seq).items():
                counts[key] += n
        writer.close()
    except BaseException:
        writer.abort()
        raise
    if counts["duplicates"]:
        warnings.append(f"{src}: {counts['duplicates']} (token, layer) routings given twice: kept the first")
    return {"out": str(out), "num_layers": L, "num_experts": E, "top_k": K, **counts}, warnings


def _write_sequence(writer, entries):
    """One sequence's lines in the runtime's order (see above). Returns its counts."""
    cell, dup = {}, 0
    for entry in entries:
        key = (entry[0], entry[1])
        if key in cell:
            dup += 1
        else:
            cell[key] = entry
    prompt = sorted({t for (t, _), e in cell.items() if e[4]})
    head = prompt[:-1]  # mlx-lm runs a prompt's last token alone, with the first sampling step
    chunks = [head[i:i + PREFILL_STEP] for i in range(0, len(head), PREFILL_STEP)]
    layers = sorted({l for _, l in cell})
    for chunk in chunks:
        for l in layers:
            run = [cell[(t, l)] for t in chunk if (t, l) in cell]
            for token, layer, experts, probs, _, _ in run:
                writer.write(token, layer, experts, probs, tokens=len(run), prefill=True)
    in_chunks = {t for c in chunks for t in c}
    for (token, layer), (_, _, experts, probs, prefill, _) in sorted(cell.items()):
        if token not in in_chunks:
            writer.write(token, layer, experts, probs, prefill=prefill)
    return {"tokens": len({t for t, _ in cell}), "prefill_tokens": len(prompt), "duplicates": dup}
