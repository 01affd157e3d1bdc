"""Where the decode thread's time goes, stock mlx-lm beside mlxmoe: each in a process of its
own loads the checkpoint (mlxmoe with every expert resident, or --cache-experts N of them,
warmed by the same prompt), generates once to warm up, then generates --tokens greedy tokens
under cProfile (which sees the calling thread only: the decode thread) and prints the
functions that took the most of it, by their own time (tottime) and with what they call
(cumtime). cProfile slows Python code and not MLX's, so compare shares between the two, not
the times with an unprofiled run's; MLX's functions are not listed on their own (their time is
their caller's own), numpy's are.

    python bench/decode_profile.py [--checkpoint DIR] [--cache-experts N] [--tokens 32] [--top 25]

The checkpoint defaults to bench_runtime's Qwen3-shaped one (built there: `python
bench/bench_runtime.py --layers 8 --only stock-f32`).
"""

import argparse
import cProfile
import io
import pstats
import subprocess
import sys
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--cache-experts", type=int, default=None, help="mlxmoe's slots (default: every expert)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", default="Hello world")
    ap.add_argument("--top", type=int, default=25, help="functions listed per table")
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
