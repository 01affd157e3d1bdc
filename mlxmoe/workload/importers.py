"""Routing recorded by other engines, converted to mlxmoe.trace/1 (import_trace,
IMPORT_FORMATS).

Each reader returns (meta, sequences): meta holds what the source says of the model
(num_layers, num_experts, top_k, model; None where it says nothing), sequences is a list
of (name, entries), one per request, entries (token, layer, experts, probs or None,
prefill, where) with `where` the source line (or JSON path) for messages. import_trace()
then writes each sequence as mlxmoe's runtime would have run it: the prompt as layer calls
of up to PREFILL_STEP tokens (all its tokens but the last, in one call per layer), then
its last token and each generated token one at a time, through every layer.
"""

import base64
import contextlib
import csv
import json
import math
import os

import numpy as np

from ..errors import MlxmoeError
from ..storage.files import read_lines
from .tracefile import MAX_EXPERTS, TraceWriter, as_integer

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
        experts = [as_integer(x, "an expert id") for x in ids]
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
        return as_integer(obj[key], repr(key), allow_str)
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
    arrays = [_sglang_array(response, num_layers, top_k) for response in _sglang_responses(path)]
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


def _sglang_responses(path):
    """(id, routed_experts, its dtype, prompt_tokens, completion_tokens, where) of each
    response of an SGLang output file (see read_sglang)."""
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
    return responses


def _sglang_array(response, num_layers, top_k):
    """(id, its expert ids as [tokens, num_layers, top_k], prompt tokens, where) of one
    response; top-k from the token counts where not given."""
    rid, value, dtype, prompt, completion, where = response
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
    return rid, ids.reshape(-1, num_layers, k), prompt or 0, where

IMPORT_FORMATS = {
    "specmoe": read_specmoe,
    "bigmoeonedge": read_bigmoeonedge,
    "moe-ocs": read_moe_ocs,
    "vllm": read_vllm,
    "sglang": read_sglang,
}


def import_trace(fmt, src, out, only=None, num_layers=None, num_experts=None, top_k=None, model=None,
                 progress=contextlib.nullcontext):
    """Convert `src` (in IMPORT_FORMATS[fmt]) to an mlxmoe.trace/1 file at `out`, written
    atomically. `only`: the sequence names to keep (problem ids, request ids, turns).
    Shapes the source does not state are taken from the options, else from the largest
    ids seen. `progress(sequences)`: a context giving them back to write, the source read
    (click.progressbar: a bar as each is written). Returns (summary dict, warnings)."""
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
        sequences = _only(src, sequences, only)
    entries = [e for _, seq in sequences for e in seq]
    if not entries:
        raise MlxmoeError(f"{src}: no routing to import")
    L, E, K = _shape(src, meta, entries, {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k},
                     warnings)
    _check_entries(entries, L, E)
    writer = TraceWriter(out, L, E, K, model or meta["model"] or "", source=f"{fmt}:{os.path.basename(src)}",
                         sequences=[name for name, _ in sequences])
    counts = {"sequences": len(sequences), "tokens": 0, "prefill_tokens": 0, "duplicates": 0}
    try:
        with progress(sequences) as written:
            for _, seq in written:
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


def _only(src, sequences, only):
    """The sequences named in `only` (by their whole name or its last part)."""
    wanted = {str(x) for x in only}
    names = {name for name, _ in sequences}
    kept = [(name, e) for name, e in sequences if name in wanted or name.rsplit("/", 1)[-1] in wanted]
    missing = sorted(w for w in wanted if w not in names and not any(n.rsplit("/", 1)[-1] == w for n in names))
    if missing:
        raise MlxmoeError(f"{src}: no sequence {', '.join(missing)} (it has {', '.join(sorted(names))})")
    return kept


def _shape(src, meta, entries, given, warnings):
    """(layers, experts, top_k) of the trace: as `given` (the options), else as the source
    says (`meta`), else from the largest ids seen; checked as read_trace will check them,
    warnings added to `warnings`."""
    widest = max(len(e[2]) for e in entries)
    L = given["num_layers"] or meta["num_layers"] or max(e[1] for e in entries) + 1
    E = given["num_experts"] or meta["num_experts"] or max(x for e in entries for x in e[2]) + 1
    K = given["top_k"] or meta["top_k"] or widest
    for name, v in (("num_layers", L), ("num_experts", E), ("top_k", K)):  # what read_trace will accept
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_EXPERTS:
            if given[name]:
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
    if not (given["num_experts"] or meta["num_experts"]):
        warnings.append(f"{src} does not say how many experts the model has: took {E} (the largest id + 1); "
                        "pass --num-experts if it has more")
    return L, E, K


def _check_entries(entries, L, E):
    for token, layer, experts, _, _, where in entries:
        if not 0 <= layer < L or any(not 0 <= x < E for x in experts):
            raise MlxmoeError(f"{where}: layer {layer} or experts {experts} out of range for {L} layers x {E} experts")
        if len(set(experts)) != len(experts) or not experts:
            raise MlxmoeError(f"{where}: experts {experts} must be distinct and at least one")
        if token < 0:
            raise MlxmoeError(f"{where}: token position {token} is negative")


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
