"""Expert reads on another thread while the decode thread runs Python: what a GPU's decode
does to mlxmoe's reads (there the decode thread builds graphs most of the time, on a CPU it
mostly waits for the device). A thread reads --experts experts of the checkpoint (as a
demand read, and as a background read in pieces), once with the main thread waiting, then with
it busy in a pure-Python loop, at Python's default thread switch interval (5 ms) and at the
one mlxmoe sets while experts stream (cache.READ_SWITCH_INTERVAL). A read thread needs the GIL
back after each system call and each piece, and a thread busy in Python gives it up once a
switch interval: the reads crawl where the interval is long.

    python bench/read_contention.py [--checkpoint DIR] [--experts 40]

The checkpoint defaults to bench_runtime's Qwen3-shaped one (2.8 MiB experts; `python
bench/bench_runtime.py --layers 8 --only stock-f32` builds it). Expert reads bypass the page
cache (O_DIRECT), so each is the disk's.
"""

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

import mlxmoe
from mlxmoe.caching.cache import READ_SWITCH_INTERVAL

from bench_disk import DEFAULT_MODEL


def timed_reads(store, outs, keys, paced, busy):
    """Median ms of reading `keys` one after the other on a thread, the main thread busy in
    Python meanwhile or waiting for it."""
    times = []

    def read():
        for layer, expert in keys:
            tic = time.perf_counter()
            store.read_expert(layer, expert, outs, pace=(lambda n: None) if paced else None)
            times.append(time.perf_counter() - tic)

    reader = threading.Thread(target=read)
    reader.start()
    x = 0
    while busy and reader.is_alive():  # (the decode thread building graphs: Python, no system call)
        for i in range(1000):
            x += i * i
    reader.join()
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--experts", type=int, default=40, help="experts read per figure (each a new one)")
    args = ap.parse_args()
    if not (args.checkpoint / "config.json").exists():
        raise SystemExit(f"{args.checkpoint}: no checkpoint there (build one: python bench/bench_runtime.py "
                         "--layers 8 --only stock-f32)")
    model, _ = mlxmoe.load(str(args.checkpoint), cache_experts=64, prefetch=0, prewarm=False)
    cache = model.expert_cache
    store, default = cache.store, 5e-3
    outs = [np.empty_like(v[0]) for v in cache.pools.views]
    L, E = store.num_layers, store.num_experts
    keys = iter([(k % L, (k * 37 + k // L) % E) for k in range(L * E)])  # (each figure reads experts of its own)
    size = store.expert_file_bytes() / 2**20
    print(f"{args.checkpoint}: {size:.2f} MiB an expert, io {store.io}; median ms an expert over {args.experts}")
    print(f"{'read':<22} {'main thread':<34} {'ms':>7} {'/ waiting':>9}")
    for paced in (False, True):
        idle = None
        for label, busy, interval in (("waiting", False, default), ("busy in Python, 5 ms", True, default),
                                      (f"busy in Python, {READ_SWITCH_INTERVAL * 1e3:.1f} ms", True,
                                       READ_SWITCH_INTERVAL)):
            sys.setswitchinterval(interval)
            ms = timed_reads(store, outs, [next(keys) for _ in range(args.experts)], paced, busy)
            idle = idle or ms
            print(f"{'background, in pieces' if paced else 'demand':<22} {label + ' switch interval':<34} "
                  f"{ms:7.2f} {ms / idle:8.1f}x")
    cache.close()


if __name__ == "__main__":
    main()
