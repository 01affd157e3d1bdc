"""Prefetch: predict the experts of the next MoE layer(s) while the current one computes,
and read them in background threads so the decode thread finds them resident.

Predictors, each scored for precision and recall on every layer it predicted:
- `router`: the next layer's router applied to the current layer's hidden state (the
  lookahead of mixtral-offloading; hidden states change little from layer to layer),
- `previous_token`: the experts the same layer used at the previous token,
- `profile`: the layer's hottest experts in the profile prior.
What is loaded: the router's confident guesses, and those it shares with the previous
token. Only decode steps prefetch (a prefill step
touches most experts anyway).
"""

from concurrent.futures import ThreadPoolExecutor, wait

import mlx.core as mx
import numpy as np

PREDICTORS = ("router", "previous_token", "profile")


def hottest_per_layer(rates, k):
    """The profile predictor: each layer's k experts with the highest rate."""
    return [set(np.argsort(-row, kind="stable")[:k].tolist()) for row in np.asarray(rates)]


def count_prediction(counts, predicted, used):
    """Add one prediction to counts = [correct, predicted, actually used]."""
    counts[0] += len(predicted & used)
    counts[1] += len(predicted)
    counts[2] += len(used)


def precision_recall(counts):
    """{predictor: {precision, recall}} for the predictors that predicted anything."""
    return {name: {"precision": c[0] / c[1], "recall": c[0] / c[2] if c[2] else 0.0}
            for name, c in counts.items() if c[1]}


class Prefetcher:
    def __init__(self, cache, routers, top_k, depth=1, workers=2, prior=None, confidence=0.1):
        """`routers[l]`: x -> router scores over layer l's experts (None if unknown);
        `prior`: profile rates [layers, experts] or None."""
        self.cache, self.routers, self.top_k, self.depth = cache, routers, top_k, depth
        self.confidence = confidence  # router probability above which a lookahead guess is loaded alone
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="mlxmoe-prefetch")
        self.jobs = []  # futures of queued and running loads
        self.previous = {}  # layer -> experts it used at the last token
        self.pending = {}  # layer -> {predictor: set of experts predicted for its next visit}
        self.hottest = None if prior is None else hottest_per_layer(prior, top_k)
        # predictor -> [correct, predicted, actually used]
        self.counts = {name: [0, 0, 0] for name in PREDICTORS}

    def observe(self, layer, experts, decode=True):
        """The experts `layer` really used (at the last token of the call): score what
        was predicted for it, if this is the decode step it was predicted for."""
        used = set(experts)
        pending = self.pending.pop(layer, {})
        for name, predicted in pending.items() if decode else ():
            count_prediction(self.counts[name], predicted, used)
        self.previous[layer] = used

    def after_layer(self, layer, x, token):
        """Called once `layer` has its experts (decode only): predict and queue the next
        layers' loads, to run while this layer computes."""
        for target in range(layer + 1, min(layer + 1 + self.depth, len(self.routers))):
            predicted, confident = {}, set()
            if self.routers[target] is not None:
                scores = self.routers[target](x).reshape(-1).astype(mx.float32)
                probs = mx.softmax(scores, axis=-1, precise=True)
                top = mx.argpartition(-scores, self.top_k - 1)[: self.top_k]
                top_probs = probs[top]
                mx.eval(top, top_probs)
                top, top_probs = np.array(top).tolist(), np.array(top_probs).tolist()
                predicted["router"] = set(top)
                confident = {e for e, p in zip(top, top_probs) if p >= self.confidence}
            if target in self.previous:
                predicted["previous_token"] = self.previous[target]
            if self.hottest is not None:
                predicted["profile"] = self.hottest[target]
            self.pending[target] = predicted
            # What is not resident is mostly what the predictors got wrong, and a wrong
            # load costs a read and evicts something useful: load what the router is sure
            # of, or what it agrees on with the previous token.
            chosen = confident | (predicted.get("router", set()) & predicted.get("previous_token", set()))
            keys = [(target, e) for e in sorted(chosen) if (target, e) not in self.cache.slot_of]
            if keys:
                self.jobs = [j for j in self.jobs if not j.done()]
                self.jobs.append(self.pool.submit(self.cache.prefetch, keys, token, target))

    def stats(self):
        return precision_recall(self.counts)

    def drain(self):
        """Wait until every queued load has ended."""
        wait(self.jobs)
        self.jobs = []

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)
