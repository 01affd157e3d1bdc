"""Where the decode thread's time goes, stock mlx-lm beside mlxmoe: each in a process of its
own loads the checkpoint (mlxmoe with every expert resident, or --cache-experts N of them,
warmed by the same prompt), generates once to warm up, then generates --tokens greedy tokens
under cProfile (which sees the calling thread only: the decode thread) and prints the
functions that took the most of it, by their own time (tottime) and with what they call
(cumtime). cProfile slows Python code and not MLX's, so compare shares between the two, not
the times with an unprofiled run's; MLX's functions are not listed on their own (their time is
their caller's own), numpy's are.

    python bench/decode_profile.py [--checkpoint DIR] [--cache-experts N] [--tokens 32] [--top 25]
    python bench/decode_profile.py --ops [--checkpoint DIR] [--cache-experts N]

--bookkeeping prints instead mlxmoe's bookkeeping counter's growth at each token (read as it
runs, no stats() call: that would do the host work left for later, and wait for the device, at
the read), and its mean over the tokens after the first (stock: nothing to print).

--ops counts instead the device's work a decode token hands MLX: the calls of mx.eval and
mx.async_eval, and the primitives of the graphs they evaluate (mx.export_to_dot of their
arrays: an evaluated array is a leaf), by kind, over the generation's tokens after the third.
On a GPU each primitive is a kernel launch (or a view) on the host, and an eval call a
dispatch: a figure this CPU can give for what the GPU's host and device would do beyond stock's.

The checkpoint defaults to bench_runtime's Qwen3-shaped one (built there: `python
bench/bench_runtime.py --layers 8 --only stock-f32`).
"""

import argparse
import cProfile
import io
import os
import pstats
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench_disk import DEFAULT_MODEL
from bench_runtime import WARMUP_PROMPT, generate_timed


def profiled(args) -> None:
    """This process's configuration (args.one: stock or mlxmoe), profiled; prints its lines."""
    if args.one == "stock":
        import mlx_lm

        from mlxmoe import backend

        model, tokenizer = mlx_lm.load(str(args.checkpoint))
        backend.detect().apply_dtype_policy(model)  # (float32 on the CPU, as mlxmoe computes; none on a GPU)
        generate = mlx_lm.stream_generate
    else:
        import mlxmoe

        model, tokenizer = mlxmoe.load(str(args.checkpoint), cache_experts=args.cache_experts)
        cache = model.expert_cache
        if args.cache_experts is None:  # every expert resident: read them all before the timing
            for layer in range(cache.store.num_layers):
                cache.fetch(layer, list(range(cache.store.num_experts)))
        generate = mlxmoe.stream_generate
    for _ in range(2):  # (the second: a partial cache warmed by the same prompt)
        generate_timed(generate, model, tokenizer, args.prompt, args.tokens)
    generate_timed(generate, model, tokenizer, WARMUP_PROMPT, 4)
    if args.ops:
        return count_ops(args.one, generate, model, tokenizer, args)
    if args.bookkeeping:
        return per_token_bookkeeping(args.one, generate, model, tokenizer, args)
    profile = cProfile.Profile()
    profile.enable()
    run, _, _ = generate_timed(generate, model, tokenizer, args.prompt, args.tokens)
    profile.disable()
    steps = max(run["decode_steps"], 1)
    print(f"{args.one}: {run['decode_tps']:.1f} tok/s profiled, {run['decode_seconds'] / steps * 1e3:.2f} ms a token "
          f"({run['prompt_tokens']} prompt tokens, {run['decode_steps']} decode steps)")
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.top)
        print(f"-- {args.one}, by {key} (seconds over the whole generation, prefill included):")
        lines = out.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
        print("\n".join(line for line in lines[start:] if line.strip()))


def per_token_bookkeeping(name, generate, model, tokenizer, args) -> None:
    """--bookkeeping: the cache's bookkeeping counter's growth at each token, ms."""
    if name == "stock":
        return print("stock: no bookkeeping")
    counters, grown, last = model.expert_cache.counters, [], None
    for _ in generate(model, tokenizer, args.prompt, max_tokens=args.tokens):
        now = counters.bookkeeping_seconds
        if last is not None:
            grown.append((now - last) * 1e3)
        last = now
    steps = max(len(grown), 1)
    print(f"{name}: bookkeeping {sum(grown) / steps:.3f} ms a token over {len(grown)} tokens after the first; "
          f"each: {' '.join(f'{g:.2f}' for g in grown)}")


def count_ops(name, generate, model, tokenizer, args, skip=3) -> None:
    """--ops: the eval calls and primitives per decode token past the first `skip` (mx.eval and
    mx.async_eval wrapped while counting; each call's arrays exported to a dot file and read)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    calls, kinds, counting = Counter(), Counter(), [False]
    fd, dot = tempfile.mkstemp(suffix=".dot")
    os.close(fd)

    def wrapped(name, real):
        def call(*arrays):
            if counting[0]:
                calls[name] += 1
                flat = [a for _, a in tree_flatten(list(arrays)) if isinstance(a, mx.array)]
                if flat:
                    mx.export_to_dot(dot, *flat)
                    kinds.update(re.findall(r'label ="([^"]+)", shape=rectangle', Path(dot).read_text()))
            return real(*arrays)
        return call

    real = {n: getattr(mx, n) for n in ("eval", "async_eval")}
    for n, f in real.items():
        setattr(mx, n, wrapped(n, f))
    tokens = 0
    try:
        for _ in generate(model, tokenizer, args.prompt, max_tokens=args.tokens):
            tokens += 1
            counting[0] = tokens >= skip
    finally:
        for n, f in real.items():
            setattr(mx, n, f)
        os.unlink(dot)
    steps = max(tokens - skip, 1)
    print(f"{name}: per decode token over {steps}: {sum(kinds.values()) / steps:.1f} primitives, "
          + ", ".join(f"{n} {c / steps:.2f}" for n, c in sorted(calls.items())))
    print("  " + ", ".join(f"{k} {v / steps:.1f}" for k, v in kinds.most_common(args.top)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--cache-experts", type=int, default=None, help="mlxmoe's slots (default: every expert)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", default="Hello world")
    ap.add_argument("--top", type=int, default=25, help="functions listed per table (--ops: kinds of primitive)")
    ap.add_argument("--ops", action="store_true", help="count the eval calls and primitives per decode token instead")
    ap.add_argument("--bookkeeping", action="store_true", help="mlxmoe's bookkeeping at each token instead")
    ap.add_argument("--one", choices=("stock", "mlxmoe"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return profiled(args)
    if not (args.checkpoint / "config.json").exists():
        raise SystemExit(f"{args.checkpoint}: no checkpoint there (build one: python bench/bench_runtime.py "
                         "--layers 8 --only stock-f32)")
    for one in ("stock", "mlxmoe"):
        print(flush=True)
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", one], check=False)


if __name__ == "__main__":
    main()
