"""The bookkeeping of bench_profiles.py's section 3: the time StreamingExperts spends beyond
mlx-lm's own work (the reads and the waits on the device left out) over a greedy generation
on the demo model at 50 % cached, per layer call; and the same beside an older commit's
mlxmoe (bench_profiles.py --baseline REF or --baseline-path DIR): this tree's runs and the
baseline's alternated, each in its own process, their medians and ratio printed together.

A figure per layer call is the machine's: the host work right after a wait on the device runs
5-15x slower than warm on this VM (host_warmth.py), so another machine's figure is no yardstick.
The baseline's, measured in the same run on the same model, prompt and cache, is.

Where this file runs one measurement (`--one`, a child) it imports nothing of mlxmoe but the
package itself (load, generate, stream_generate, the cache's stats): an older commit's
mlxmoe, first on PYTHONPATH, loads and runs as it is.

    python bench/bookkeeping.py --one --model DIR --prompt TEXT --cache-experts N --result FILE [--tree DIR]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from system import ROOT, baseline_env, imported_from  # noqa: E402


def no_eos(tokenizer):
    """A logits processor that keeps generation going for the measured number of tokens."""
    import mlx.core as mx

    eos = list(tokenizer.eos_token_ids)

    def process(tokens, logits):
        logits[..., eos] = -mx.inf
        return logits

    return process


_sizes = {}


def _experts(model_path):
    """(MoE layers, experts per layer) of the checkpoint."""
    if model_path not in _sizes:
        from mlxmoe.loader import open_checkpoint

        ckpt = open_checkpoint(model_path)
        _sizes[model_path] = ckpt.num_layers, ckpt.num_experts
    return _sizes[model_path]


def _share(model_path, share):
    L, E = _experts(model_path)
    return int(L * E * share)


def bookkeeping(model_path, prompt, tokens=128, share=0.5, cache_experts=None, **load_kwargs):
    """One warm greedy generation of `tokens` (after 8 of warm-up) at `cache_experts` slots
    (else `share` of all experts): the cache's bookkeeping, the time, tok/s and hit rate."""
    import mlxmoe

    slots = cache_experts or _share(model_path, share)
    model, tokenizer = mlxmoe.load(model_path, cache_experts=slots, **load_kwargs)
    cache = model.expert_cache
    mlxmoe.generate(model, tokenizer, prompt, max_tokens=8)
    cache.reset_stats()
    tic = time.perf_counter()
    n = sum(1 for _ in mlxmoe.stream_generate(model, tokenizer, prompt, max_tokens=tokens,
                                               logits_processors=[no_eos(tokenizer)]))
    elapsed = time.perf_counter() - tic
    s = cache.stats()
    cache.close()
    return {"bookkeeping_seconds": s["bookkeeping_seconds"], "generate_seconds": elapsed,
            "share": s["bookkeeping_seconds"] / elapsed, "tokens_per_second": n / elapsed,
            "layer_calls": n * len(s["resident_per_layer"]), "hit_rate": s["hit_rate"],
            "loads_demand": s["loads_demand"], "prefetch_useful": s["prefetch_useful"],
            "verified_tokens": s.get("verified_tokens"), "tokens": n}


def verified_share(r):
    """The share of a run's tokens decoded in verified steps (the rest on the per-layer path), or
    None where its mlxmoe does not count them."""
    v = r.get("verified_tokens")
    return None if v is None else v / r["tokens"]


def per_call_us(r):
    return 1e6 * r["bookkeeping_seconds"] / r["layer_calls"]


def side_by_side(model_path, prompt, tree, label, runs=3, tokens=128, timeout=600):
    """`runs` measurements of this tree's mlxmoe and of the baseline's (its mlxmoe/ in folder
    `tree`), alternated (the order flips each run), each in its own process, at the same
    slots; prints both medians and their ratio and returns them with every run."""
    from bench_runtime import run_child

    slots = _share(model_path, 0.5)
    sides = {"this tree": (ROOT, None), "baseline": (Path(tree), baseline_env(tree))}
    results = {name: [] for name in sides}
    for i in range(runs):
        for name in list(sides)[:: 1 if i % 2 == 0 else -1]:
            folder, env = sides[name]
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--model", str(model_path),
                   "--prompt", prompt, "--cache-experts", str(slots), "--tokens", str(tokens), "--tree", str(folder)]
            r = run_child(cmd, f"bookkeeping, {name}, run {i + 1} of {runs}", timeout, env)
            if "error" in r:
                raise SystemExit(f"bookkeeping, {name}: {r['error']}")
            results[name].append(r)
    out = {"baseline_code": label, "slots": slots, "tokens": tokens, "runs": results}
    for name, rs in results.items():
        out[name] = {"us_per_layer_call": statistics.median(per_call_us(r) for r in rs),
                     "tokens_per_second": statistics.median(r["tokens_per_second"] for r in rs),
                     "hit_rate": statistics.median(r["hit_rate"] for r in rs),
                     "verified": [verified_share(r) for r in rs]}
    mine, base = out["this tree"], out["baseline"]
    out["ratio"] = mine["us_per_layer_call"] / base["us_per_layer_call"]
    print(f"  side by side with the baseline, {label} ({runs} alternated runs each, each in its own process, "
          f"{slots} slots):")
    for name in results:
        r = out[name]
        print(f"  {name:>12}: {r['us_per_layer_call']:.0f} us per layer call, {r['tokens_per_second']:.1f} tok/s "
              f"including the prompt, hit rate {100 * r['hit_rate']:.1f}% (runs: "
              f"{', '.join(f'{per_call_us(x):.0f}' for x in results[name])} us; verified steps: "
              f"{', '.join('-' if v is None else f'{100 * v:.0f}' for v in r['verified'])} %)")
    print(f"  this tree / baseline: bookkeeping per layer call {out['ratio']:.2f}x, tok/s "
          f"{mine['tokens_per_second'] / base['tokens_per_second']:.2f}x")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", action="store_true", help="Run one measurement (a child of side_by_side).")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--cache-experts", type=int, required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--tree", required=True, help="The folder whose mlxmoe/ must be the one imported.")
    ap.add_argument("--result", required=True, help="Where the child writes its result (JSON).")
    args = ap.parse_args()
    if not args.one:
        raise SystemExit("run it through bench_profiles.py --only-bookkeeping --baseline REF (this is its child)")
    sys.path.append(str(ROOT))  # last: PYTHONPATH's mlxmoe (the baseline's) or an installed one comes first
    import mlxmoe

    where = imported_from(mlxmoe, args.tree)
    r = bookkeeping(args.model, args.prompt, args.tokens, cache_experts=args.cache_experts)
    Path(args.result).write_text(json.dumps(dict(r, mlxmoe=str(where))))


if __name__ == "__main__":
    main()
