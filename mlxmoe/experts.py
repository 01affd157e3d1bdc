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


class StreamingExperts(nn.Module):
    def __init__(self, inner, layer, cache=None):
        super().__init__()
        # Underscored attributes are not parameters: load_weights and set_dtype skip them.
        self._inner = inner
        self._layer = layer
        self._cache = cache

    def __call__(self, x, indices):
        cache = self._cache
        idx = np.array(indices)  # evaluates the router (and with it every earlier layer)
        flat = idx.reshape(-1, idx.shape[-1])
        if self._layer == 0:
            cache.tokens += flat.shape[0]
        chunks = token_chunks(flat, cache.capacity)
        if len(chunks) == 1:
            return self._inner(x, self._slots(flat, idx))
        # More distinct experts than slots (long prefill at a small cache): compute each
        # run of tokens and evaluate it before the next run may reuse its slots.
        xs = x.reshape(-1, x.shape[-1])
        outs = []
        for a, b in chunks:
            y = self._inner(xs[a:b], self._slots(flat[a:b], flat[a:b]))
            mx.eval(y)
            outs.append(y)
        y = mx.concatenate(outs, axis=0)
        return y.reshape(*x.shape[:-1], *y.shape[1:])

    def _slots(self, rows, idx):
        experts, inverse = np.unique(rows, return_inverse=True)
        slots = np.asarray(self._cache.fetch(self._layer, experts.tolist()), dtype=np.uint32)
        return mx.array(slots[inverse].reshape(idx.shape))
