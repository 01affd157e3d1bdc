"""What the decode thread's host work costs right after the thread did something else for a
while, against the same work warm (right after itself): the pieces the per-layer path runs
after each wait on the device, timed after t ms of (a) `mx.eval` of queued device work, (b) a
sleep, (c) a busy loop in Python. The pieces: a router's softmax on the host (backend.host_probs
of one bfloat16 router's logits, 128 experts) and the default policy's update for one layer call
that hit (Policy.hits of one call, 48 layers x 128 experts, top-8, hit_batch.py's calls). Medians of --samples.

Where the after-t figures exceed the warm ones, a bookkeeping figure measured between a model's
layers (bench_profiles.py --only-bookkeeping) is what the host work costs there, not what it
costs warm: the per-layer path pays it after every wait, stock after one a token. Run it on the
machine the figure is for (on a GPU, (a) waits for the device while the CPU idles).

    python bench/host_warmth.py [--samples 200] [--ms 0.2,1,4,8]
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from mlxmoe.backend import host_probs
from mlxmoe.caching.policies import make_policy
from hit_batch import E, L, tokens_of
from system import cpu_ticks, stolen_share


def policy_piece(rng):
    """A function that tells the default policy the next of a stream of all-hit layer calls."""
    policy = make_policy("activation-floor", L * E // 2, L, E)
    resident = [rng.choice(E, size=E // 2, replace=False) for _ in range(L)]
    for layer in range(L):
        for e in resident[layer]:
            policy.insert((layer, int(e)))
    calls = tokens_of(rng, 1, resident)[0]
    step = [0]

    def hit():
        layer = step[0] % L
        if layer == 0:
            policy.tick(1)
        policy.hits([calls[layer]])
        step[0] += 1
    return hit


def device_work(ms):
    """A function that evaluates chained matmuls taking about `ms` (measured here)."""
    w = mx.random.normal((128, 128)) * (1 / 128)
    x = mx.random.normal((128, 128))
    mx.eval(w, x)
    tic = time.perf_counter()
    for _ in range(20):
        mx.eval(x @ w)
    one = (time.perf_counter() - tic) / 20
    n = max(1, round(ms * 1e-3 / one))

    def run():
        y = x
        for _ in range(n):
            y = y @ w
        mx.eval(y)
    return run


def spin(ms):
    def run():
        end = time.perf_counter() + ms * 1e-3
        while time.perf_counter() < end:
            pass
    return run


def median_us(piece, before, samples):
    times = []
    for _ in range(samples):
        before()
        tic = time.perf_counter()
        piece()
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=200, help="timings per figure")
    ap.add_argument("--ms", default="0.2,1,4,8", help="comma-separated: how long the thread does something else")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(1, 1, E)).astype(np.float32)).astype(mx.bfloat16)
    mx.eval(logits)
    pieces = {"host_probs, one router": lambda: host_probs([logits]), "Policy.hits, one call": policy_piece(rng)}
    start = cpu_ticks()
    print(f"{'us, median of ' + str(args.samples):>28} {'warm':>8}" + "".join(
        f" {kind + ' ' + ms + 'ms':>16}" for ms in args.ms.split(",") for kind in ("eval", "sleep", "spin")))
    for name, piece in pieces.items():
        row = [median_us(piece, lambda: None, args.samples)]
        for ms in (float(m) for m in args.ms.split(",")):
            for before in (device_work(ms), lambda ms=ms: time.sleep(ms * 1e-3), spin(ms)):
                row.append(median_us(piece, before, args.samples))
        print(f"{name:>28}" + f" {row[0]:8.1f}" + "".join(f" {v:16.1f}" for v in row[1:]))
    stolen = stolen_share(start, cpu_ticks())
    print(f"CPU stolen by the hypervisor over the run: {'-' if stolen is None else f'{100 * stolen:.1f} %'}")


if __name__ == "__main__":
    main()
