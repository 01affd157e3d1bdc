"""StreamingExperts: stands in for mlx-lm's SwitchGLU/SwitchMLP.

It keeps the original module (its activation, bias handling, sorting and
gather_qmm/gather_mm call) but points its weights at the cache's slot pools, and calls
it with expert ids remapped to slot ids. So the arithmetic is mlx-lm's own.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def token_chunks(indices, capacity):
    """Split rows of `indices` [tokens, k] into runs whose distinct experts fit the cache."""
    chunks, start, seen = [], 0, set()
    for t, row in enumerate(indices.tolist()):
        new = seen.union(row)
        if len(new) > capacity:
            chunks.append((start, t))
            start, new = t, set(row)
        seen = new
    chunks.append((start, len(indices)))
    return chunks


def router_probs(block):
    """A function x -> the router's probabilities over all experts, from the MoE block
    that holds the experts (its `gate` or `router`), or None if it has neither."""
    gate = block.get("gate", block.get("router")) if isinstance(block, nn.Module) else None
    if isinstance(gate, (nn.Linear, nn.QuantizedLinear)):
        return lambda x: mx.softmax(gate(x).astype(mx.float32), axis=-1, precise=True)
    weight = getattr(gate, "weight", None)
    if isinstance(weight, mx.array) and weight.ndim == 2:  # e.g. deepseek's MoEGate: sigmoid scores
        def probs(x):
            s = mx.sigmoid((x @ weight.T).astype(mx.float32))
            return s / s.sum(axis=-1, keepdims=True)
        return probs
    return None


class StreamingExperts(nn.Module):
    def __init__(self, inner, layer, router=None, cache=None):
        super().__init__()
        # Underscored attributes are not parameters: load_weights and set_dtype skip them.
        self._inner = inner
        self._layer = layer
        self._router = router
        self._cache = cache

    def __call__(self, x, indices):
        cache = self._cache
        probs = None
        if self._router is not None and (cache.wants_router or cache.trace is not None or cache.profile is not None):
            probs = self._router(x)
            mx.eval(indices, probs)
            probs = np.array(probs).reshape(-1, probs.shape[-1])
        idx = np.array(indices)  # evaluates the router (and with it every earlier layer)
        flat = idx.reshape(-1, idx.shape[-1])
        if self._layer == 0:
            cache.tick(flat.shape[0])
        if cache.trace is not None:
            rows = flat.tolist()
            cache.record(self._layer, rows, None if probs is None else
                         np.take_along_axis(probs, flat.astype(np.int64), axis=1).tolist())
        chunks = token_chunks(flat, cache.capacity)
        if len(chunks) == 1:
            return self._inner(x, self._slots(flat, idx, probs))
        # More distinct experts than slots (long prefill at a small cache): compute each
        # run of tokens and evaluate it before the next run may reuse its slots.
        xs = x.reshape(-1, x.shape[-1])
        outs = []
        for a, b in chunks:
            y = self._inner(xs[a:b], self._slots(flat[a:b], flat[a:b], None if probs is None else probs[a:b]))
            mx.eval(y)
            outs.append(y)
        y = mx.concatenate(outs, axis=0)
        return y.reshape(*x.shape[:-1], *y.shape[1:])

    def _slots(self, rows, idx, probs):
        experts, inverse = np.unique(rows, return_inverse=True)
        mean = None if probs is None else probs.mean(axis=0)
        scores = None if mean is None else mean[experts].tolist()
        slots = self._cache.fetch(self._layer, experts.tolist(), scores, mean)
        return mx.array(np.asarray(slots, dtype=np.uint32)[inverse].reshape(idx.shape))
