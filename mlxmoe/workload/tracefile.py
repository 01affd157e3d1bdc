"""The routing trace file (`mlxmoe.trace/1`): write one (TraceWriter, the runtime's
recorder and the importers' output) and read one back, every line checked (read_trace).
Replay is in trace.py, the importers of other engines' logs in importers.py.

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
"""

import json
import math
import os
import re
from pathlib import Path

from ..errors import MlxmoeError
from ..storage.files import read_lines, temp_beside, write_target
from .profile import shape_fingerprint

FORMAT = "mlxmoe.trace/1"
MAX_EXPERTS = 1 << 22  # layers x experts a header may claim


class TraceWriter:
    """Writes a trace to a temp file beside `path` (a symlink's target: the link is kept),
    fsync'd and renamed into place by close()."""

    def __init__(self, path, num_layers, num_experts, top_k, model="", **extra):
        """`extra`: more header keys (an imported trace's source, its sequences' names)."""
        self.path = write_target(path)
        fd, self.tmp = temp_beside(self.path)
        self.file = os.fdopen(fd, "w")
        header = {"format": FORMAT, "num_layers": num_layers, "num_experts": num_experts, "top_k": top_k,
                  "model": str(model), **extra}
        self.file.write(json.dumps(header) + "\n")
        self.seq = -1
        self.lines = 0  # routing lines written: a trace without any is not a trace

    def new_sequence(self):
        self.seq += 1

    def line(self, token, layer, experts, probs=None, router=None, tokens=1, prefill=False) -> str:
        line = {"s": max(self.seq, 0), "t": token, "l": layer, "e": experts}
        if tokens > 1:
            line["n"] = tokens
        if prefill:
            line["ph"] = "prefill"
        if probs is not None:
            line["p"] = [round(p, 5) for p in probs]
        if router is not None:
            line["r"] = [float(f"{p:.3g}") for p in router]
        return json.dumps(line, separators=(",", ":")) + "\n"

    def write(self, *args, **kwargs):
        self.file.write(self.line(*args, **kwargs))
        self.lines += 1

    def observe(self, call) -> None:
        """An expert cache's observer: write a layer call (experts.LayerCall), one line per token,
        all in one write (a Ctrl-C while they are made leaves no call in part: read_trace refuses that)."""
        rows = call.rows.tolist()
        if call.probs is None:
            lines = [self.line(call.position + i, call.layer, row, tokens=call.tokens) for i, row in enumerate(rows)]
        else:
            lines = [self.line(call.position + i, call.layer, row, call.probs[i][row].tolist(), call.probs[i].tolist(),
                               call.tokens) for i, row in enumerate(rows)]
        self.file.write("".join(lines))
        self.lines += len(lines)

    def close(self):
        """Rename the trace into place; one stopped before any routing is dropped (read_trace refuses it)."""
        if self.file.closed:
            return
        if self.lines == 0:
            return self.abort()
        self.file.flush()
        os.fsync(self.file.fileno())
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


def as_integer(v, what, allow_str=False):
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
            s, t, l = as_integer(r["s"], "s"), as_integer(r["t"], "t"), as_integer(r["l"], "l")
            e = [as_integer(x, "an expert id") for x in r["e"]]
            if len(set(e)) != len(e):
                raise ValueError(f"experts {e} repeat an id (a token routes to distinct experts)")
            p, dist = _probabilities(r.get("p"), "p"), _probabilities(r.get("r"), "r")
            call = None if r.get("n") is None else as_integer(r["n"], "n")
            if call is not None and not 1 <= call <= len(lines):
                raise ValueError(f"n = {call}: a layer call has at least one token and at most the trace's lines")
            phase = r.get("ph")
            if phase not in (None, "prefill"):
                raise ValueError(f"ph = {phase!r}: the phase marker is \"prefill\" or absent")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError, RecursionError) as err:
            raise MlxmoeError(f"{path}:{n}: malformed trace line ({err})") from None
        if not 0 <= l < L or any(not 0 <= x < E for x in e):
            raise MlxmoeError(f"{path}:{n}: layer {l} or experts {e} out of range for {L} layers x {E} experts")
        if k is not None and len(e) > k:
            raise MlxmoeError(f"{path}:{n}: {len(e)} experts {e[:8]} in a top-{k} trace (a token routes to at most "
                              f"{k})")
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


def trace_fingerprint(header):
    """The model fingerprint a trace stands for: the one the runtime wrote in its header,
    else (an imported trace) its shape's (profile.shape_fingerprint)."""
    return header.get("fingerprint") or shape_fingerprint(header["num_layers"], header["num_experts"])
