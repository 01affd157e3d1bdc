"""Pipeline stages on one host: decode speed and bytes read per rank for 1, 2 and 3 ranks.

The Qwen3-shaped checkpoint of bench_runtime.py (Qwen3-30B-A3B's expert shapes, fewer
layers) is streamed by 1 process, then by 2 and 3 ranks under `mlx.launch --backend ring`
on 127.0.0.1, at the same total expert cache (each rank caches `--cache-share` of its own
stage's experts). Configurations alternate over `--rounds`; the page cache is dropped before
each (root). Every configuration must produce the same greedy tokens.

    python bench/bench_distributed.py            # 6 layers, 12 tokens, 2 rounds
    python bench/bench_distributed.py --serve    # mlxmoe serve under 1 and 2 ranks

--serve: `mlxmoe serve` as 1 process and as ranks under mlx.launch (rank 0 serves HTTP),
each rank caching --cache-share of its stage's experts; one client sends held-out prompts
(bench/data/heldout) as greedy completions in turn; tokens/s of the completions, end to end,
and every configuration must answer the same text.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))  # mlxmoe, and synthetic.py (the checkpoints' builder tests and bench share)

from bench_runtime import DEFAULT_PROMPT, checkpoint_bytes, checkpoint_matches, generate_timed  # noqa: E402
from system import check_outputs, drop_page_cache, write_json  # noqa: E402

from mlxmoe.distributed import free_port_base  # noqa: E402


def rank_run(args):
    """One rank (or the one process): load, warm up, one timed greedy generation."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.utils import sharded_load

    import mlxmoe
    from mlxmoe import backend, distributed

    group = distributed.init()
    size = 1 if group is None else group.size()
    tic = time.perf_counter()
    if args.mode == "stock":  # mlx-lm's own pipeline, every weight loaded, mlxmoe's dtype policy
        model, tokenizer = sharded_load(str(args.checkpoint), pipeline_group=group) if group else \
            mlx_lm.load(str(args.checkpoint))
        backend.detect().apply_dtype_policy(model)
        mx.eval(model.parameters())
        generate, cache = mlx_lm.stream_generate, None
    else:
        share = 1.0 if args.mode == "resident" else args.cache_share
        cache_experts = int(share * args.experts * args.layers / size)  # mlx-lm splits the layers evenly
        model, tokenizer = mlxmoe.load(args.checkpoint, cache_experts=cache_experts, group=group)
        generate, cache = mlxmoe.stream_generate, model.expert_cache
        cache.prewarm_done()  # resident: every expert read before the measured run, as stock reads its weights
    load_seconds = time.perf_counter() - tic
    generate_timed(generate, model, tokenizer, "Hello world", 4)
    stats = (lambda: dict(cache.stats())) if cache is not None else None
    run, before, after = generate_timed(generate, model, tokenizer, args.prompt, args.tokens, snapshot=stats,
                                        window=32)
    if group is not None:  # (mlxmoe.stream_generate ends so; stock does not)
        distributed.barrier(group)
    result = {"rank": 0 if group is None else group.rank(), "size": size, "load_seconds": load_seconds,
              "tokens": run["tokens"], "decode_tps": run["decode_tps"], "decode_steps": run["decode_steps"],
              "decode_cpu_seconds": run["decode_cpu_seconds"], "decode_seconds": run["decode_seconds"],
              "peak_memory": mx.get_peak_memory(), "decode_bytes": 0, "cache_experts": 0}
    if cache is not None:
        cache.close()
        result.update(cache_experts=cache.capacity, decode_bytes=after["bytes_read"] - before["bytes_read"],
                      bytes_read=after["bytes_read"], peak_rss=after["peak_rss"],
                      decode_hits=after["hits"] - before["hits"], decode_misses=after["misses"] - before["misses"])
    # --out: the temp folder launch() made for this run's ranks, not a user's path
    Path(args.out, f"rank{result['rank']}.json").write_text(json.dumps(result))


def launch(args, mode, ranks):
    out = tempfile.mkdtemp(prefix=f"mlxmoe-dist{ranks}-")
    own = ["--checkpoint", str(args.checkpoint), "--layers", str(args.layers), "--experts", str(args.experts),
           "--tokens", str(args.tokens), "--cache-share", str(args.cache_share), "--prompt", args.prompt,
           "--one", mode, "--out", out]
    script = [sys.executable, str(Path(__file__).resolve()), *own]
    if ranks > 1:
        script = ["mlx.launch", "--backend", "ring", "-n", str(ranks), "-p", str(free_port_base(ranks)), "--", *script]
    if not args.no_drop:
        drop_page_cache()
    r = subprocess.run(script, capture_output=True, text=True, timeout=args.timeout)
    try:
        results = [json.loads(Path(out, f"rank{k}.json").read_text()) for k in range(ranks)]
    except FileNotFoundError:
        raise SystemExit(f"{ranks} ranks failed:\n{r.stdout}\n{r.stderr}")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return results


def ring(ranks):
    """The environments of ranks 1.. and of rank 0 for the ring backend on 127.0.0.1, set as
    mlx.launch sets them (started without it: its per-rank threads spin, a core on this host)."""
    if ranks == 1:
        return [], None
    base = free_port_base(ranks)
    hosts = Path(tempfile.mkdtemp(prefix="mlxmoe-ring-"), "hosts.json")  # in a temp folder of our own
    hosts.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(ranks)]))
    envs = [dict(os.environ, MLX_HOSTFILE=str(hosts), MLX_RANK=str(r)) for r in range(ranks)]
    return envs[1:], envs[0]


def serve_bench(args, counts):
    from bench_server import Server
    from heldout import prompts

    pool = [p for lang in ("en", "it", "de") for p in prompts(lang, args.requests, max_chars=200)]
    runs, texts = {k: [] for k in counts}, {}
    for round_ in range(args.rounds):
        for k in (counts if round_ % 2 == 0 else counts[::-1]):
            cache_experts = int(args.cache_share * args.experts * args.layers / k)
            argv = [sys.executable, "-m", "mlxmoe", "serve", "-m", str(args.checkpoint), "--cache-experts",
                    str(cache_experts)]
            if not args.no_drop:
                drop_page_cache()
            followers, env = ring(k)
            followers = [subprocess.Popen(argv, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                         for e in followers]
            server = Server(argv, timeout=args.timeout, env=env)
            try:
                server.post("POST", "/v1/completions", {"prompt": "Hello world", "max_tokens": 4})  # warm-up
                got, tokens, tic = [], 0, time.perf_counter()
                for prompt in pool:
                    status, _, data = server.post("POST", "/v1/completions", {
                        "prompt": prompt, "max_tokens": args.tokens, "temperature": 0})
                    assert status == 200, data
                    body = json.loads(data)
                    got.append(body["choices"][0]["text"])
                    tokens += body["usage"]["completion_tokens"]
                runs[k].append(tokens / (time.perf_counter() - tic))
            finally:
                server.stop()  # rank 0: every rank stops
                for p in followers:
                    p.wait(60)
            assert texts.setdefault("text", got) == got, f"{k} rank(s) answered other text"
            print(f"[bench] serve round {round_ + 1}, {k} rank(s): {runs[k][-1]:.2f} tok/s", file=sys.stderr,
                  flush=True)
    print(f"\nmlxmoe serve, {len(pool)} held-out prompts x {args.tokens} greedy tokens in turn, each rank caching "
          f"{args.cache_share:.0%} of its stage's experts; medians of {args.rounds} alternated runs")
    print("| ranks | completion tok/s | ratio to 1 |")
    print("|---|---|---|")
    for k in counts:
        tps = statistics.median(runs[k])
        print(f"| {k} | {tps:.2f} | {tps / statistics.median(runs[counts[0]]):.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="Default: /tmp/mlxmoe-bench/qwen3-30b-shapes-<layers>L (built if missing)")
    parser.add_argument("--layers", type=int, default=6, help="MoE layers (6 split evenly over 1, 2 and 3 ranks).")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--cache-share", type=float, default=0.5, help="Each rank's cache: this share of its experts.")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ranks", default="1,2,3")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--no-drop", action="store_true", help="Do not drop the page cache (not root).")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--modes", default="stock,resident,cache")
    parser.add_argument("--report", action="store_true", help="Print the tables of the last run's JSON again.")
    parser.add_argument("--serve", action="store_true", help="Measure mlxmoe serve instead (ranks: --ranks).")
    parser.add_argument("--requests", type=int, default=2, help="--serve: held-out prompts per language (3).")
    parser.add_argument("--one", dest="mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.checkpoint is None:
        args.checkpoint = Path(f"/tmp/mlxmoe-bench/qwen3-30b-shapes-{args.layers}L")
    if args.mode:
        return rank_run(args)
    counts, modes = [int(k) for k in args.ranks.split(",")], args.modes.split(",")
    out = HERE / "out" / "distributed.json"
    if args.report:
        saved = {tuple(key.rsplit("-", 1)): rs for key, rs in json.loads(out.read_text()).items()}
        runs = {(m, int(k)): rs for (m, k), rs in saved.items()}
        args.rounds = len(next(iter(runs.values())))
        return report(args, runs, counts, modes)
    check_outputs({"the results": out}, {"--checkpoint": args.checkpoint})
    args.top_k, args.residual_scale = 8, 0.1  # bench_runtime.py's checkpoint
    if not checkpoint_matches(args.checkpoint, args):
        from synthetic import build_large_checkpoint

        print(f"[bench] building {args.checkpoint}", file=sys.stderr, flush=True)
        build_large_checkpoint(args.checkpoint, num_layers=args.layers, num_experts=args.experts, top_k=8,
                               hidden_size=2048, moe_intermediate_size=768, quant="4bit", seed=0, residual_scale=0.1)
    print(f"[bench] {args.checkpoint}: {checkpoint_bytes(args.checkpoint) / 1e9:.2f} GB", file=sys.stderr)
    if args.serve:
        return serve_bench(args, counts)
    runs = {(m, k): [] for m in modes for k in counts}
    for round_ in range(args.rounds):
        for m in modes:
            for k in counts:
                tic = time.perf_counter()
                runs[m, k].append(launch(args, m, k))
                print(f"[bench] round {round_ + 1}: {m}, {k} rank(s): {time.perf_counter() - tic:.0f} s, "
                      f"{runs[m, k][-1][0]['decode_tps']:.2f} tok/s", file=sys.stderr, flush=True)
    write_json(out, {f"{m}-{k}": rs for (m, k), rs in runs.items()})
    report(args, runs, counts, modes)


def report(args, runs, counts, modes):
    """The tables, from {(mode, ranks): [per run: [per rank: result]]}."""
    tokens = {tuple(r[0]["tokens"]) for rs in runs.values() for r in rs}
    assert len(tokens) == 1, "the configurations generated different tokens"
    med = lambda m, k, f: statistics.median(f(r) for r in runs[m, k])
    tps = {key: med(*key, lambda r: r[0]["decode_tps"]) for key in runs}
    print(f"\n{args.layers} MoE layers x {args.experts} experts, {args.tokens} greedy tokens, medians of "
          f"{args.rounds} alternated runs; decode tok/s (ratio to 1 rank of the same mode)")
    print("| ranks | " + " | ".join(modes) + (" | resident / stock" if {"stock", "resident"} <= set(modes) else "")
          + " |")
    print("|---" * (len(modes) + 1 + ({"stock", "resident"} <= set(modes))) + "|")
    for k in counts:
        cells = [f"{tps[m, k]:.2f} ({tps[m, k] / tps[m, counts[0]]:.2f})" for m in modes]
        if {"stock", "resident"} <= set(modes):
            cells.append(f"{tps['resident', k] / tps['stock', k]:.2f}")
        print(f"| {k} | " + " | ".join(cells) + " |")
    # CPU time of all ranks' processes per decoded token: less sensitive than tok/s to other load
    cpu = {key: med(*key, lambda r: sum(x["decode_cpu_seconds"] for x in r) / r[0]["decode_steps"]) for key in runs}
    print("\nCPU seconds per decoded token, all ranks together")
    print("| ranks | " + " | ".join(modes) + " |")
    print("|---" * (len(modes) + 1) + "|")
    for k in counts:
        print(f"| {k} | " + " | ".join(f"{cpu[m, k]:.3f}" for m in modes) + " |")
    if "cache" in modes:
        print(f"\nmlxmoe, each rank caching {args.cache_share:.0%} of its stage's experts (the same total cache): "
              "expert bytes read per decoded token")
        print("| ranks | MB/token per rank (rank 0: last layers) | MB/token, all ranks | cache experts per rank |")
        print("|---|---|---|---|")
        for k in counts:
            per_rank = [med("cache", k, lambda r: r[i]["decode_bytes"] / r[i]["decode_steps"] / 1e6) for i in range(k)]
            print(f"| {k} | {' / '.join(f'{m:.1f}' for m in per_rank)} | {sum(per_rank):.1f} | "
                  f"{' / '.join(str(runs['cache', k][0][i]['cache_experts']) for i in range(k))} |")


if __name__ == "__main__":
    main()
