"""Where the decode thread's host time per streamed MoE layer call goes (demo model, 50 %
cache, default policy and prefetch): each part timed on the decode thread by wrapping it,
medians of alternated runs, with the prefetcher's scoring and predicting on the decode
thread and in their own thread (Prefetcher.off_thread). tok_s counts the prompt too. Parts
nest (the decode step includes fetch, which includes its lock wait, the policy and the demand
reads; a prefill's routing is `routing to host`); `bookkeeping` is the
cache's own figure (everything StreamingExperts adds beyond mlx-lm's work, reads and the
sync excluded), `bookkeeping_pct` its share of the run's time. --trace: a routing trace is
written during the runs. --cpu: the cache's own figures (bookkeeping, demand reads) in the
decode thread's CPU time (time.thread_time) instead of wall time: what the decode thread
itself spends, not the time other processes or threads take its core from it (this 2-core
machine, shared, moves wall figures by 2x between runs).

    python bench/decode_host_time.py [--runs 5] [--tokens 128] [--trace] [--cpu]
"""

import argparse
import os
import tempfile
import threading
import time
import types
from collections import defaultdict

import numpy as np

import mlxmoe
import mlxmoe.caching.cache
import mlxmoe.caching.experts
from bookkeeping import _share, no_eos
from mlxmoe.caching.cache import ExpertCache
from mlxmoe.caching.experts import StreamingExperts
from mlxmoe.caching.prefetch import Prefetcher

PROMPT = "Il gatto dorme sul divano mentre fuori piove, e la nonna racconta"
PARTS = {"lookahead (graph)": (Prefetcher, "lookahead"), "routing to host": (StreamingExperts, "_routing"),
         "decode step": (StreamingExperts, "_step"),  # its routing, fetch and remap
         "fetch": (ExpertCache, "fetch"), "prefetch observe": (Prefetcher, "observe"),
         "prefetch after_layer": (Prefetcher, "after_layer")}


class TimedLock:
    """cache.lock with the decode thread's waits to acquire it timed."""

    def __init__(self, lock, spent, thread):
        self.lock, self.spent, self.thread = lock, spent, thread

    def acquire(self, *a, **kw):
        tic = time.perf_counter()
        got = self.lock.acquire(*a, **kw)
        if threading.get_ident() == self.thread:
            self.spent["fetch: lock wait"] += time.perf_counter() - tic
        return got

    def release(self):
        self.lock.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


def timed(fn, name, spent, thread):
    def run(*a, **kw):
        if threading.get_ident() != thread:
            return fn(*a, **kw)
        tic = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[name] += time.perf_counter() - tic
    return run


def one_run(tokens, off_thread, trace=False):
    path = mlxmoe.DEMO_MODEL
    trace_out = os.path.join(tempfile.mkdtemp(prefix="mlxmoe-bench-"), "run.trace.jsonl") if trace else None
    model, tokenizer = mlxmoe.load(str(path), cache_experts=_share(path, 0.5), trace_out=trace_out)
    cache = model.expert_cache
    cache.prefetcher.off_thread = off_thread
    mlxmoe.generate(model, tokenizer, PROMPT, max_tokens=8)
    cache.reset_stats()
    spent, thread = defaultdict(float), threading.get_ident()
    originals = {name: getattr(cls, attr, None) for name, (cls, attr) in PARTS.items()}  # None: not in this version
    for name, (cls, attr) in PARTS.items():
        if originals[name] is not None:
            setattr(cls, attr, timed(originals[name], name, spent, thread))
    cache.lock = TimedLock(cache.lock, spent, thread)
    tic = time.perf_counter()
    try:
        n = sum(1 for _ in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=tokens,
                                                   logits_processors=[no_eos(tokenizer)]))
    finally:
        for name, (cls, attr) in PARTS.items():
            if originals[name] is not None:
                setattr(cls, attr, originals[name])
    elapsed = time.perf_counter() - tic
    s = cache.stats()
    cache.lock = cache.lock.lock
    cache.close()
    if trace_out is not None:
        os.remove(trace_out)
        os.rmdir(os.path.dirname(trace_out))
    calls = n * len(s["resident_per_layer"])
    spent["bookkeeping"] = s["bookkeeping_seconds"]
    spent["fetch: demand reads"] = s["read_seconds"]
    out = {name: 1e6 * v / calls for name, v in spent.items()}
    return dict(out, bookkeeping_pct=100 * s["bookkeeping_seconds"] / elapsed, tok_s=n / elapsed,
                hit_pct=100 * s["hit_rate"], demand=s["loads_demand"], useful=s["prefetch_useful"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--trace", action="store_true", help="write a routing trace during the runs")
    ap.add_argument("--cpu", action="store_true", help="the cache's own figures in decode-thread CPU time")
    args = ap.parse_args()
    if args.cpu:  # the clock experts.py and cache.py time bookkeeping and reads with
        mlxmoe.caching.experts.time = mlxmoe.caching.cache.time = types.SimpleNamespace(perf_counter=time.thread_time)
    variants = {"predictions on the decode thread": False, "predictions in their own thread": True}
    runs = {label: [] for label in variants}
    for i in range(args.runs):  # alternated, the order flipping each round
        for label in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
            runs[label].append(one_run(args.tokens, variants[label], args.trace))
    print(f"decode thread host time per streamed layer call, us (demo model, 50 % cache, {args.tokens} tokens"
          f"{', trace written' if args.trace else ''}{', bookkeeping in CPU time' if args.cpu else ''}, median of "
          f"{args.runs} alternated runs)")
    for label, rs in runs.items():
        print(f"  {label}:")
        for name in ["bookkeeping", "bookkeeping_pct", *PARTS, "fetch: lock wait", "fetch: demand reads", "tok_s",
                     "hit_pct", "demand", "useful"]:
            v = [r.get(name, 0.0) for r in rs]
            print(f"  {name:>24}: {np.median(v):6.1f}  (runs: {', '.join(f'{x:.1f}' for x in v)})")


if __name__ == "__main__":
    main()
