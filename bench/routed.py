"""Recorded routing for a bench model: each MoE layer routes as a real model did (bench_host.py and
bench_disk.py --routing), for stock mlx-lm and mlxmoe alike, from outside the runtime.

A recording (`mlxmoe trace import`'s formats: BigMoeOnEdge CSV, moe_ocs JSON, ...) gives each
context position's experts and weights at each layer. The model's routers still compute (their
matmul and its cost stay), but the logits a MoE block routes by are the recording's at the
token's position: log(weight) for its experts, far below for the rest, so the block's top-k and
normalised scores are the recording's. The position is the KV cache's offset when the model is
called, so a verified step's replay of a token routes as its first pass did. Where the
recording lacks a cell, the position before it (at that layer) stands in. Positions map onto
the recording so that the first generated token is its first decode step, and wrap past its end.
A model with fewer MoE layers routes as the recording's first ones (the model's top-k must be the
recording's); install() makes every model a process loads follow it (bench_disk.py's children,
bench_batch.py's servers through bench/roundtrip.py).

A batch (mlx-lm's BatchKVCache: an offset a row) routes each row at its own position. A
recording is one sequence, so rows of distinct requests at the same position would route alike
and a batch's experts would be one row's: with `by_token` a row's position in the recording also
moves by its input token (position + 7919 x token, on the device), so distinct requests route as
distinct steps of the real model (its experts' popularity kept, the rows independent) and a
request routes the same alone as in a batch; a sequence's consecutive tokens then land on
unrelated steps (no locality from token to token, a harder case for a cache than real routing).

Only the block's own router call follows the recording: a prefetcher's lookahead (another
layer's router on this hidden state) scores with the random weights, so it predicts nothing;
while running ahead (the later blocks themselves called on this hidden state) and a verified
pass's later layers route as they will (a real model's drift is absent), so their guesses are
exact. Figures with it bracket a real model's: a useless lookahead, perfect running ahead.
"""

import math

import numpy as np

UNROUTED = -60.0  # an unrouted expert's logit: exp() of it is nothing beside a routed weight's
ROUTED = {}  # id(a MoE block's router) -> (state, logits on the device, its MoE layer, position shift)


def read_or_exit(spec):
    """read(), a bad recording ending the bench with the error (which names the file)."""
    from mlxmoe.errors import MlxmoeError

    try:
        return read(spec)
    except MlxmoeError as e:
        raise SystemExit(f"--routing: {e}") from None


def recording(spec):
    """(format, path) of a recording named `FORMAT:PATH` or PATH (.csv: bigmoeonedge, else moe-ocs)."""
    from mlxmoe.workload.importers import IMPORT_FORMATS

    fmt, _, path = spec.partition(":")
    if fmt not in IMPORT_FORMATS:
        fmt, path = ("bigmoeonedge" if spec.endswith(".csv") else "moe-ocs"), spec
    return fmt, path


def read(spec):
    """(meta, logits [positions, layers, experts] float32, first decode position) of the
    recording `spec` (recording()), its first sequence."""
    from mlxmoe.errors import MlxmoeError
    from mlxmoe.workload.importers import IMPORT_FORMATS

    fmt, path = recording(spec)
    meta, sequences = IMPORT_FORMATS[fmt](path)
    if not sequences or not sequences[0][1]:
        raise MlxmoeError(f"{path}: no routing in it")
    entries = sequences[0][1]
    steps = sorted({e[0] for e in entries})
    layers = meta["num_layers"] or 1 + max(e[1] for e in entries)
    experts = meta["num_experts"] or 1 + max(x for e in entries for x in e[2])
    k = meta["top_k"] or max(len(e[2]) for e in entries)
    at = {s: i for i, s in enumerate(steps)}
    logits = np.full((len(steps), layers, experts), np.nan, dtype=np.float32)
    for step, layer, ids, weights, _, where in entries:
        if len(set(ids)) != k:
            raise MlxmoeError(f"{where}: {len(set(ids))} distinct experts, the recording's top-k is {k}")
        row = np.full(experts, UNROUTED, dtype=np.float32)
        row[ids] = [math.log(max(w, 1e-6)) for w in weights] if weights else 0.0
        logits[at[step], layer] = row
    for i in range(len(steps)):  # a missing cell: the position before it, else the next one filled
        for layer in np.flatnonzero(np.isnan(logits[i, :, 0])):
            near = [j for j in [*range(i - 1, -1, -1), *range(i + 1, len(steps))] if not np.isnan(logits[j, layer, 0])]
            if not near:
                raise MlxmoeError(f"{path}: layer {layer} has no routing")
            logits[i, layer] = logits[near[0], layer]
    first_decode = min((at[e[0]] for e in entries if not e[4]), default=0)
    return dict(meta, num_layers=layers, num_experts=experts, top_k=k, positions=len(steps)), logits, first_decode


def follow(model, logits, first_decode, prompt_tokens, by_token=False):
    """Make `model` (mlx-lm's, or mlxmoe's) route as `logits` say (see the module's doc)."""
    import mlx.core as mx
    import mlx.nn as nn

    # shift: the first generated token's position -> the first decode step; steps: the recording's
    # step of each row and position of the model's call under way (_at_position)
    state = {"shift": first_decode - prompt_tokens, "positions": logits.shape[0], "by_token": by_token,
             "steps": None, "layer": None}
    blocks = [layer.mlp for layer in model.layers if hasattr(getattr(layer, "mlp", None), "gate")]
    k = int((logits[0, 0] > UNROUTED).sum())
    if not blocks or len(blocks) > logits.shape[1] or any(getattr(b, "top_k", k) != k for b in blocks) \
            or any(getattr(b, "num_experts", logits.shape[2]) < logits.shape[2] for b in blocks):
        raise SystemExit(f"the model ({len(blocks)} MoE layers, top-{getattr(blocks[0], 'top_k', '?') if blocks else '?'}) "
                         f"cannot route as the recording ({logits.shape[1]} layers x {logits.shape[2]} experts, "
                         f"top-{k}): it needs its top-k and at most its layers")
    experts = getattr(blocks[0], "num_experts", logits.shape[2])
    logits = np.pad(logits[:, :len(blocks)], ((0, 0), (0, 0), (0, experts - logits.shape[2])),
                    constant_values=UNROUTED)  # (a model with fewer layers: the recording's first ones)
    table = mx.array(logits)
    for base in (nn.Linear, nn.QuantizedLinear):  # (at the class: mlxmoe's tapped router calls its base's directly)
        if not hasattr(base, "_unrouted_call"):
            base._unrouted_call = base.__call__
            base.__call__ = _routed_call
    for i, block in enumerate(blocks):
        ROUTED[id(block.gate)] = (state, table, i)
        _subclass(block, lambda self, x, i=i: _in_block(self, x, state, i))
    _subclass(model, lambda self, inputs, *a, **kw: _at_position(self, inputs, a, kw, state))


def install(spec, prompt, by_token=False):
    """Every model this process loads from here on (mlx_lm.load, mlx_lm.utils.load as
    mlx_lm.server imports it, mlxmoe.load) follows the recording `spec` (read()), its positions
    counted for `prompt`."""
    import mlx_lm
    import mlx_lm.utils
    import mlxmoe

    _, logits, first_decode = read_or_exit(spec)
    for module in (mlx_lm, mlx_lm.utils, mlxmoe):
        def load(*args, _load=module.load, **kwargs):
            loaded = _load(*args, **kwargs)  # (model, tokenizer[, config])
            follow(loaded[0], logits, first_decode, len(loaded[1].encode(prompt)), by_token)
            return loaded

        module.load = load


def _routed_call(self, x):
    out = type(self)._unrouted_call(self, x)
    routing = ROUTED.get(id(self))
    if routing is None or routing[0]["layer"] != routing[2]:  # not this block's own routing
        return out
    state, table, layer = routing
    steps = state["steps"] if state["steps"] is not None else _steps(state, x.shape[-2], 0, None)
    return out * 0 + table[steps, layer].astype(out.dtype)


def _steps(state, length, offset, inputs):
    """The recording's step of each position of a model call of `length` tokens from `offset`
    (a batch's: an array, a row's offset each), moved by the `inputs` tokens with by_token."""
    import mlx.core as mx

    if isinstance(offset, mx.array) and offset.ndim == 1:
        offset = offset[:, None]
    steps = mx.arange(length) + offset + state["shift"]
    if state["by_token"] and inputs is not None:
        steps = steps + 7919 * inputs.astype(mx.int32)
    return steps % state["positions"]


def _subclass(obj, call):
    cls = type(obj)
    obj.__class__ = type(f"Routed{cls.__name__}", (cls,), {"__call__": call, "_routed_base": cls})


def _in_block(block, x, state, layer):
    state["layer"] = layer
    try:
        return block._routed_base.__call__(block, x)
    finally:
        state["layer"] = None


def _at_position(model, inputs, args, kwargs, state):
    cache = kwargs.get("cache", args[0] if args else None)
    state["steps"] = _steps(state, inputs.shape[-1], cache[0].offset if cache else 0, inputs)  # (once, for every layer)
    return model._routed_base.__call__(model, inputs, *args, **kwargs)
