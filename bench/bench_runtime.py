"""Runtime benchmark of mlxmoe on a synthetic checkpoint with Qwen3-30B-A3B's expert shapes.

In one run it compares:

1. decode speed of stock mlx-lm (as-is, and with mlxmoe's dtype policy) with mlxmoe
   holding every expert (the output tokens must be identical);
2. mlxmoe with 50 % and 25 % of all experts cached, page cache dropped before the load
   (and, in the "-cold" runs, again at the first token so decode misses hit the disk):
   decode speed, hit rate, bytes read per decoded token, expert read throughput;
3. that throughput against `dd iflag=direct` on the largest shard;
4. peak memory against a memory budget of about half the checkpoint.

Every configuration runs in its own process (`--one CONFIG`) so memory and the page
cache do not leak between them; the parent prints the tables and writes JSON.

    python bench/bench_runtime.py --quick      # 2 layers, 8 tokens
    python bench/bench_runtime.py              # 8 layers, 32 tokens
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))  # synthetic.py (shared with tests); last: a baseline's mlxmoe on PYTHONPATH comes first

from system import check_outputs, cpu_ticks, disk_read_bytes, drop_page_cache, proc_status, stolen_share, write_json  # noqa: E402
ROOT = HERE.parent
# Short: on a 2-core CPU a prefill token costs about as much as a decoded one.
DEFAULT_PROMPT = "Once upon a time there was a little fox who lived in the forest."
WARMUP_PROMPT = "Hello world"
STOCK_CONFIGS = ("stock", "stock-f32", "resident")
CACHE_CONFIGS = {"cache50": 0.5, "cache25": 0.25, "cache50-cold": 0.5, "cache25-cold": 0.25,
                 "cache50-cold-noprefetch": 0.5, "cache25-cold-noprefetch": 0.25}
GiB = 1 << 30


# ---------------------------------------------------------------- helpers


def checkpoint_files(path):
    return sorted(Path(path).glob("*.safetensors"))


def checkpoint_bytes(path):
    return sum(f.stat().st_size for f in checkpoint_files(path))


def checkpoint_matches(path, args):
    """True if `path` holds a finished checkpoint with the requested shapes."""
    config_file = Path(path) / "config.json"
    index_file = Path(path) / "model.safetensors.index.json"
    if not config_file.exists() or not index_file.exists():
        return False
    config = json.loads(config_file.read_text())
    want = {"model_type": "qwen3_moe", "num_hidden_layers": args.layers, "num_experts": args.experts,
            "num_experts_per_tok": args.top_k, "hidden_size": 2048, "moe_intermediate_size": 768}
    if any(config.get(k) != v for k, v in want.items()):
        return False
    if config.get("quantization", {}).get("bits") != 4:
        return False
    if config.get("mlxmoe_synthetic", {}).get("residual_scale", 1.0) != args.residual_scale:
        return False
    shards = set(json.loads(index_file.read_text())["weight_map"].values())
    return all((Path(path) / s).exists() for s in shards)


# ---------------------------------------------------------------- generation


def no_repeat(window):
    """Logits processor banning the last `window` tokens. The synthetic model's greedy
    output falls into a 2-token cycle, whose few experts would all stay cached; with
    this, decoding stays greedy (argmax) and deterministic but every step routes anew."""

    def process(tokens, logits):
        if window and len(tokens) > 0:
            logits[:, tokens[-window:]] = float("-inf")
        return logits

    process.stateless = True  # mlxmoe's running ahead may call it to guess the next token
    return process


def generate_timed(generate_fn, model, tokenizer, prompt, max_tokens, snapshot=None, at_first=None, window=0):
    """Greedy generation; returns (run, snapshot at the first token, snapshot at the last).

    The decode window runs from the first token to the last: N-1 decode steps (mlx-lm
    builds step i+1 before it yields token i, so each yield closes one step).
    `at_first` runs at the first token, outside the window.
    """
    tokens = []
    tic = time.perf_counter()
    t0 = t1 = tic
    c0 = c1 = time.process_time()
    first = response = None
    processors = [no_repeat(window)] if window else None
    for response in generate_fn(model, tokenizer, prompt, max_tokens=max_tokens, logits_processors=processors):
        t1, c1 = time.perf_counter(), time.process_time()
        tokens.append(int(response.token))
        if len(tokens) == 1:
            if at_first:
                at_first()
            t0 = t1 = time.perf_counter()
            c0 = c1 = time.process_time()
            first = snapshot() if snapshot else None
    last = snapshot() if snapshot else None  # nothing runs between the last token and here
    steps = len(tokens) - 1
    return {
        "tokens": tokens,
        "prompt_tokens": response.prompt_tokens,
        "prefill_seconds": t0 - tic,
        "prompt_tps": response.prompt_tps,
        "decode_steps": steps,
        "decode_seconds": t1 - t0,
        "decode_tps": steps / (t1 - t0) if steps and t1 > t0 else 0.0,
        "decode_cpu_seconds": c1 - c0,  # CPU time of all this process's threads: less sensitive to other load
        "mlx_lm_generation_tps": response.generation_tps,
        "peak_memory": response.peak_memory * 1e9,
        "text": tokenizer.decode(tokens),
    }, first, last


def cache_snapshot(cache):
    s = dict(cache.stats())
    s["disk_read_bytes"] = disk_read_bytes()
    s["expert_file_bytes"] = cache.store.expert_file_bytes()
    return s


def window_stats(before, after):
    """Expert cache counters over the decode window."""
    hits = after["hits"] - before["hits"]
    misses = after["misses"] - before["misses"]
    read = after["bytes_read"] - before["bytes_read"]  # demand + background (prefetch) reads
    seconds = after["read_seconds"] - before["read_seconds"]  # the decode thread's waits only
    demand = (after["loads_demand"] - before["loads_demand"]) * after["expert_file_bytes"]
    disk = None
    if before["disk_read_bytes"] is not None and after["disk_read_bytes"] is not None:
        disk = after["disk_read_bytes"] - before["disk_read_bytes"]
    out = {"hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
           "bytes_read": read, "demand_bytes": demand, "read_seconds": seconds,
           "read_gbps": demand / seconds / 1e9 if seconds > 0 and demand else None,
           "disk_read_bytes": disk, "loads_demand": after["loads_demand"] - before["loads_demand"]}
    for key in ("loads_prefetched", "prefetch_useful", "prefetch_late"):  # newer mlxmoe
        if key in after:
            out[key] = after[key] - before[key]
    if "bookkeeping_seconds" in after:  # time mlxmoe's layers spent beyond mlx-lm's work (newer mlxmoe)
        out["bookkeeping_seconds"] = after["bookkeeping_seconds"] - before["bookkeeping_seconds"]
    return out


# ---------------------------------------------------------------- one configuration (child process)


def run_stock(args, dtype_policy):
    """Stock mlx-lm: mlx_lm.load + mlx_lm.stream_generate."""
    import mlx.core as mx
    import mlx_lm

    tic = time.perf_counter()
    model, tokenizer = mlx_lm.load(args.checkpoint)
    if dtype_policy:
        from mlxmoe import backend

        backend.detect().apply_dtype_policy(model)
        mx.eval(model.parameters())
    load_seconds = time.perf_counter() - tic
    runs = []
    # Stock as-is computes with bf16 scales, 5-10x slower on CPU: one run, no warm-up.
    warmup, nruns = (args.warmup, args.runs) if dtype_policy else (0, args.stock_runs)
    for _ in range(warmup):
        generate_timed(mlx_lm.stream_generate, model, tokenizer, WARMUP_PROMPT, 4)
    for _ in range(nruns):
        runs.append(generate_timed(mlx_lm.stream_generate, model, tokenizer, args.prompt, args.tokens,
                                   window=args.no_repeat)[0])
    return {"load_seconds": load_seconds, "runs": runs, "peak_memory": mx.get_peak_memory()}


def run_resident(args):
    """mlxmoe with a slot for every expert, all of them read before the measured runs
    (stock mlx-lm also reads every weight at load), so decode never misses."""
    import mlx.core as mx
    import mlxmoe

    tic = time.perf_counter()
    model, tokenizer = mlxmoe.load(args.checkpoint, cache_experts=args.layers * args.experts,
                                   **json.loads(args.load_kwargs))
    load_seconds = time.perf_counter() - tic
    cache = model.expert_cache
    tic = time.perf_counter()
    num_layers = len(cache.store.ranges)
    for layer in range(num_layers):
        cache.fetch(layer, list(range(cache.store.num_experts)))
    preload_seconds = time.perf_counter() - tic
    preload_bytes = cache.stats()["bytes_read"]
    for _ in range(args.warmup):
        generate_timed(mlxmoe.stream_generate, model, tokenizer, WARMUP_PROMPT, 4)
    runs = []
    for _ in range(args.runs):
        cache.reset_stats()
        run, before, after = generate_timed(mlxmoe.stream_generate, model, tokenizer, args.prompt, args.tokens,
                                            snapshot=lambda: cache_snapshot(cache), window=args.no_repeat)
        run["decode"] = window_stats(before, after)
        runs.append(run)
    return {"load_seconds": load_seconds, "preload_seconds": preload_seconds, "preload_bytes": preload_bytes,
            "runs": runs, "peak_memory": mx.get_peak_memory(), "plan": vars(model.expert_runtime.plan),
            "stats": cache.stats()}


def run_streaming(args, cache_experts=None, memory_budget=None, cold_decode=False, prefetch=True):
    """mlxmoe with part of the experts cached, page cache dropped right before the load;
    one generation, measured from the first token. Experts the prefill read and the
    cache evicted may still be in the page cache; `cold_decode` drops it again at the
    first token so that every decode read comes from disk."""
    import mlx.core as mx
    import mlxmoe

    dropped = drop_page_cache() if not args.no_drop else False
    rss_before, _ = proc_status()
    tic = time.perf_counter()
    kwargs = {**json.loads(args.load_kwargs), **({} if prefetch else {"prefetch": 0})}
    model, tokenizer = mlxmoe.load(args.checkpoint, memory_budget=memory_budget, cache_experts=cache_experts,
                                   **kwargs)
    load_seconds = time.perf_counter() - tic
    cache = model.expert_cache
    rss_loaded, _ = proc_status()
    at_first = drop_page_cache if cold_decode and not args.no_drop else None
    run, before, after = generate_timed(mlxmoe.stream_generate, model, tokenizer, args.prompt, args.tokens,
                                        snapshot=lambda: cache_snapshot(cache), at_first=at_first,
                                        window=args.no_repeat)
    run["decode"] = window_stats(before, after)
    stats = cache.stats()
    rss_end, hwm = proc_status()
    return {"page_cache_dropped": dropped, "cold_decode": cold_decode, "load_seconds": load_seconds, "runs": [run],
            "plan": vars(model.expert_runtime.plan),
            "stats": stats, "peak_memory": mx.get_peak_memory(), "rss_before_load": rss_before,
            "rss_after_load": rss_loaded, "rss_end": rss_end, "peak_rss": hwm}


def run_routing(args):
    """The same generation with every expert resident, its routing written as a trace:
    greedy output is the same at every cache size, so this is every run's routing."""
    import mlxmoe

    path = Path(tempfile.gettempdir()) / f"mlxmoe-bench-routing-{os.getpid()}.trace.jsonl"
    model, tokenizer = mlxmoe.load(args.checkpoint, cache_experts=args.layers * args.experts, trace_out=str(path))
    run, _, _ = generate_timed(mlxmoe.stream_generate, model, tokenizer, args.prompt, args.tokens,
                               window=args.no_repeat)
    model.expert_cache.close()  # completes the trace
    return {"trace": str(path), "tokens": run["tokens"], "decode_steps": run["decode_steps"]}


def optimal_loads(trace, capacity, policy="belady"):
    """Belady's MIN (or another `policy`, with no prefetch) with `capacity` slots replayed
    on the run's routing, one fetch per layer call as the runtime makes them: its loads over
    the decode window (decode steps 2..N, as window_stats counts them: mlx-lm has built two
    steps when it yields the first token)."""
    from mlxmoe.workload.trace import read_trace

    return decode_loads(*read_trace(trace), capacity, policy)


def decode_loads(header, records, capacity, policy="belady"):
    """optimal_loads of a trace already read."""
    from mlxmoe.caching.cache import Residency
    from mlxmoe.caching.policies import make_policy
    from mlxmoe.workload.trace import steps

    L, E = header["num_layers"], header["num_experts"]
    fetches = list(steps(records, L, capacity))
    future = [(layer, e) for _, layer, experts, *_ in fetches for e in experts]
    r = Residency(capacity, make_policy(policy, capacity, L, E, **({"future": future} if policy == "belady" else {})))
    step, loads = -1, 0
    for tokens, layer, experts, scores, dist in fetches:
        if tokens:
            r.tick(tokens)
            step += tokens == 1  # the single-token calls are the decode steps
        before = r.counters.misses
        r.access(layer, experts, scores, dist)
        loads += (r.counters.misses - before) if step >= 2 else 0
    return loads


def run_one(args):
    config = args.one
    if config == "build":
        from synthetic import build_large_checkpoint

        tic = time.perf_counter()
        build_large_checkpoint(args.checkpoint, num_layers=args.layers, num_experts=args.experts, top_k=args.top_k,
                               hidden_size=2048, moe_intermediate_size=768, quant="4bit", seed=0,
                               residual_scale=args.residual_scale)
        return {"build_seconds": time.perf_counter() - tic}
    if config == "stock":
        return run_stock(args, dtype_policy=False)
    if config == "stock-f32":
        return run_stock(args, dtype_policy=True)
    if config == "resident":
        return run_resident(args)
    if config in CACHE_CONFIGS:
        return run_streaming(args, cache_experts=int(args.layers * args.experts * CACHE_CONFIGS[config]),
                             cold_decode="-cold" in config, prefetch="noprefetch" not in config)
    if config == "budget":
        return run_streaming(args, memory_budget=args.budget_bytes)
    if config == "routing":
        return run_routing(args)
    raise SystemExit(f"unknown configuration {config!r}")


# ---------------------------------------------------------------- parent


def child_args(args):
    out = ["--checkpoint", str(args.checkpoint), "--layers", str(args.layers), "--experts", str(args.experts),
           "--top-k", str(args.top_k), "--residual-scale", str(args.residual_scale), "--tokens", str(args.tokens),
           "--runs", str(args.runs),
           "--warmup", str(args.warmup), "--stock-runs", str(args.stock_runs), "--prompt", args.prompt,
           "--no-repeat", str(args.no_repeat), "--load-kwargs", args.load_kwargs]
    if args.no_drop:
        out.append("--no-drop")
    if args.budget_bytes:
        out += ["--budget-bytes", str(args.budget_bytes)]
    return out


def spawn(config, args):
    """Run one configuration in a fresh interpreter; returns its result dict."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", config] + child_args(args)
    return run_child(cmd, config, args.timeout)


def run_child(cmd, label, timeout, env=None):
    """Run `cmd` + ["--result", FILE] (a benchmark's `--one CONFIG` child, its output on
    stderr); returns the dict it wrote to FILE, or {"error": ...}, with its wall time."""
    # the child's result: a temp file made here for it alone (not a user's path), read and removed
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_file = f.name
    print(f"[bench] {label} ...", file=sys.stderr, flush=True)
    tic, ticks = time.perf_counter(), cpu_ticks()
    try:
        proc = subprocess.run(cmd + ["--result", result_file], cwd=ROOT, timeout=timeout, stdout=sys.stderr,
                              env={**os.environ, **(env or {})})
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = f"timeout after {timeout}s"
    wall = time.perf_counter() - tic
    result = {"error": f"exit status {rc}"}
    if rc == 0:
        result = json.loads(Path(result_file).read_text())
    os.unlink(result_file)
    result["wall_seconds"] = wall
    result["loadavg_1min_end"] = os.getloadavg()[0]
    result["stolen"] = stolen_share(ticks, cpu_ticks())  # (the machine's CPU time the hypervisor took meanwhile)
    print(f"[bench] {label}: {'done' if rc == 0 else f'FAILED ({rc})'} in {wall:.1f}s", file=sys.stderr, flush=True)
    return result


def run_dd(path, args):
    """dd iflag=direct of `path` after dropping the page cache; returns GB/s (1e9)."""
    dropped = drop_page_cache() if not args.no_drop else False
    proc = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"],
                          capture_output=True, text=True)
    line = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    m = re.match(r"(\d+) bytes .* copied, ([0-9.eE+-]+) s", line)
    result = {"file": str(path), "line": line, "page_cache_dropped": dropped, "returncode": proc.returncode}
    if m:
        nbytes, seconds = int(m.group(1)), float(m.group(2))
        result.update(bytes=nbytes, seconds=seconds, gbps=nbytes / seconds / 1e9)
    return result


def useful_share(d):
    """Share of expert loads done ahead of use: prefetch_useful / (prefetch_useful + loads_demand)."""
    useful = d.get("prefetch_useful", 0)
    return useful / (useful + d["loads_demand"]) if useful + d["loads_demand"] else None


def median_run(result, key="decode_tps"):
    runs = result.get("runs") or []
    if not runs:
        return None
    return statistics.median(r[key] for r in runs)


def cpu_per_token(result):
    runs = [r for r in result.get("runs") or [] if r["decode_steps"]]
    return statistics.median(r["decode_cpu_seconds"] / r["decode_steps"] for r in runs) if runs else None


def fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def table(title, header, rows):
    if not rows:
        return
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print(line)
    for row in rows:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))))


def report(args, ckpt, results, dd):
    """Print the tables and return the summary."""
    ref = (results.get("stock-f32", {}).get("runs") or [{}])[0].get("tokens")
    summary = {}

    def same(name):
        runs = results.get(name, {}).get("runs")
        if not runs or ref is None:
            return None
        return all(r["tokens"] == ref for r in runs)

    total_experts = args.layers * args.experts
    print(f"\nCheckpoint: {ckpt['path']} ({ckpt['layers']} MoE layers x {args.experts} experts, top {args.top_k}, "
          f"4-bit): {ckpt['bytes'] / GiB:.2f} GiB in {ckpt['files']} shards, "
          f"{'reused' if ckpt['reused'] else 'built'}")
    first = next((r["runs"][0] for r in results.values() if r.get("runs")), None)
    if first:
        print(f"Prompt: {first['prompt_tokens']} tokens; {args.tokens} greedy tokens"
              + (f" (the last {args.no_repeat} tokens banned)" if args.no_repeat else "")
              + "; decode tok/s = (tokens - 1) / time from first to last token")
        print(f"Output of mlxmoe: {first['text']!r}")

    # 1. everything resident
    rows = []
    for name, label in (("stock", f"mlx-lm stock (as-is, bf16 scales; {args.stock_runs} run)"),
                        ("stock-f32", "mlx-lm stock + dtype policy"),
                        ("resident", f"mlxmoe, all {total_experts} experts cached")):
        r = results.get(name, {})
        if "error" in r:
            rows.append([label] + ["-"] * 9 + ["FAILED: " + r["error"]])
            continue
        if "runs" not in r:
            continue
        tps = [x["decode_tps"] for x in r["runs"]]
        rows.append([label, fmt(r["load_seconds"], ".1f"), fmt(median_run(r, "prompt_tps"), ".1f"),
                     fmt(median_run(r), ".2f"), f"{max(tps):.2f}", " / ".join(f"{t:.2f}" for t in tps),
                     fmt((cpu_per_token(r) or 0) * 1e3, ".0f"), fmt(r["peak_memory"] / GiB, ".2f"),
                     f"{r.get('loadavg_1min_end', 0):.1f}", fmt(r.get("stolen") and 100 * r["stolen"], ".0f"),
                     {None: "-", True: "yes", False: "NO"}[same(name)]])
    table(f"1. Decode, everything in memory ({args.rounds} alternating processes x {args.runs} runs "
          f"after {args.warmup} warm-up each)",
          ["configuration", "load s", "prefill tok/s", "decode tok/s", "best", "runs tok/s", "CPU ms/token",
           "MLX peak GiB", "load avg", "stolen %", "tokens == stock+policy"], rows)
    if rows:
        print("CPU ms/token: CPU time of the process (all threads) per decoded token, median; load avg: 1-minute "
              "load of this 2-core machine when the process ended; stolen %: the machine's CPU time its hypervisor "
              "gave other guests during the process (/proc/stat steal)")
    res, stock32, stock = (results.get(n, {}) for n in ("resident", "stock-f32", "stock"))
    if "error" not in res and "error" not in stock32 and res.get("runs") and stock32.get("runs"):
        med = median_run(res) / median_run(stock32)
        best = max(x["decode_tps"] for x in res["runs"]) / max(x["decode_tps"] for x in stock32["runs"])
        cpu = cpu_per_token(stock32) / cpu_per_token(res)
        summary.update(ratio_median=med, ratio_best=best, ratio_cpu=cpu, ratio_target=0.95,
                       ratio_pass=best >= 0.95)
        print(f"mlxmoe resident / stock + dtype policy: decode tok/s median {med:.3f}, best {best:.3f}, "
              f"CPU time per token {cpu:.3f} (target >= 0.95 on best-of: {'PASS' if best >= 0.95 else 'FAIL'})")
        if stock.get("runs"):
            summary["ratio_vs_stock_as_is"] = median_run(res) / median_run(stock)
            print(f"mlxmoe resident / stock as-is (bf16 scales): {median_run(res) / median_run(stock):.2f}")
    runs = results.get("resident", {}).get("runs") or []
    book = [r["decode"].get("bookkeeping_seconds") for r in runs]
    if runs and None not in book:
        per_token = statistics.median(b / max(r["decode_steps"], 1) for b, r in zip(book, runs))
        share = statistics.median(b / r["decode_seconds"] for b, r in zip(book, runs) if r["decode_seconds"])
        summary["resident_bookkeeping_ms_per_token"] = per_token * 1e3
        print(f"mlxmoe bookkeeping (routing copies, policy, slot remap) while decoding: "
              f"{per_token * 1e3:.1f} ms/token, {100 * share:.1f}% of decode time")
    if ref is not None:
        stock_same = same("stock")
        summary.update(tokens_identical_resident=same("resident"), tokens_identical_stock_as_is=stock_same)
        print(f"generated tokens identical: mlxmoe resident vs stock + dtype policy: "
              f"{ {None: '-', True: 'yes', False: 'NO'}[same('resident')] }; stock as-is vs stock + dtype policy: "
              f"{ {None: '-', True: 'yes', False: 'NO (bf16 vs float32 scales)'}[stock_same] }")

    # 2. streaming
    rows = []
    for name in (*CACHE_CONFIGS, "budget"):
        r = results.get(name, {})
        label = (f"mlxmoe, {int(CACHE_CONFIGS[name] * 100)} % cached" + (", cold decode" if "cold" in name else "")
                 + (", no prefetch" if "noprefetch" in name else "")
                 if name in CACHE_CONFIGS
                 else f"mlxmoe, budget {args.budget_bytes / GiB:.2f} GiB")
        if "error" in r:
            rows.append([label] + ["-"] * 11 + ["FAILED: " + r["error"]])
            continue
        if "runs" not in r:
            continue
        run, d = r["runs"][0], r["runs"][0]["decode"]
        steps = max(run["decode_steps"], 1)
        disk = d["disk_read_bytes"]
        rows.append([label, f"{r['plan']['cache_experts']} ({100 * r['plan']['cache_experts'] / total_experts:.0f}%)",
                     fmt(run["decode_tps"], ".2f"), f"{100 * d['hit_rate']:.1f}%",
                     fmt(d["bytes_read"] / steps / 1e6, ".1f"),
                     f"{d['loads_demand']} / {d.get('loads_prefetched', 0)} ({d.get('prefetch_useful', 0)})",
                     fmt(useful_share(d), ".2f"),
                     fmt(d["read_gbps"], ".2f"),
                     fmt(d["read_seconds"] / run["decode_seconds"] * 100 if run["decode_seconds"] else None, ".0f"),
                     fmt(100 * d["bookkeeping_seconds"] / run["decode_seconds"]
                         if run["decode_seconds"] and "bookkeeping_seconds" in d else None, ".1f"),
                     "-" if disk is None or not d["bytes_read"] else f"{100 * disk / d['bytes_read']:.0f}%",
                     fmt(r["load_seconds"], ".1f"),
                     {None: "-", True: "yes", False: "NO"}[same(name)]])
    policy = next((results[n]["stats"].get("policy") for n in CACHE_CONFIGS if "stats" in results.get(n, {})), "?")
    table(f"2. Streaming experts ({policy} policy), page cache dropped before the load "
          f"(decode window: tokens 2..{args.tokens})",
          ["configuration", "slots", "decode tok/s", "hit rate", "MB read/token", "demand / prefetched (useful)",
           "useful / (useful + demand)",
           "read GB/s", "% time waiting", "% bookkeeping", "from disk", "load s", "tokens == ref"], rows)
    if rows:
        print("MB read/token counts demand and prefetch reads; read GB/s = demand bytes / wall time the decode thread "
              "waited on reads (its own reads and late prefetches);\n% bookkeeping = host time the layers added "
              "beyond mlx-lm's own work and the reads (routing copies, policy, prefetch, remap) / decode time;\nfrom disk = bytes the block layer fetched "
              "(/proc/self/io, with readahead) / bytes read, the rest came from the page cache.\n"
              "Experts the prefill read and the cache evicted may still be in the page cache; "
              "'cold decode' drops it again at the first token so decode reads come from disk.")

    # 3. dd (not run where --only leaves it out)
    if dd:
        print(f"\n3. Disk: {dd.get('line') or 'dd failed'}")
    rows = []
    if dd.get("gbps"):
        rows.append([f"dd bs=4M iflag=direct {Path(dd['file']).name} ({dd['bytes'] / 1e6:.0f} MB)",
                     f"{dd['gbps']:.2f}", "1.00"])
        summary["dd_gbps"] = dd["gbps"]
        for name in (*CACHE_CONFIGS, "budget"):
            r = results.get(name, {})
            if "runs" in r and r["runs"][0]["decode"]["read_gbps"]:
                g = r["runs"][0]["decode"]["read_gbps"]
                rows.append([f"mlxmoe demand expert reads, {name}", f"{g:.2f}", f"{g / dd['gbps']:.2f}"])
                summary[f"read_vs_dd_{name}"] = g / dd["gbps"]
        table("   read throughput vs dd", ["reader", "GB/s", "ratio to dd"], rows)

    # 4. prefetch: with vs without, and time per token vs what compute and the disk allow
    res = results.get("resident", {})
    compute = statistics.median(1 / x["decode_tps"] for x in res["runs"]) if res.get("runs") else None
    rows = []
    for share in ("50", "25"):
        on, off = results.get(f"cache{share}-cold", {}), results.get(f"cache{share}-cold-noprefetch", {})
        if "runs" not in on or "runs" not in off:
            continue
        for label, r in (("prefetch", on), ("no prefetch", off)):
            run, d = r["runs"][0], r["runs"][0]["decode"]
            steps = max(run["decode_steps"], 1)
            io = d["bytes_read"] / steps / (dd["gbps"] * 1e9) if dd.get("gbps") else None
            bound = max(compute, io) if compute and io is not None else None
            rows.append([f"{share} % cached, cold decode, {label}", fmt(run["decode_tps"], ".2f"),
                         fmt(1e3 / run["decode_tps"] if run["decode_tps"] else None, ".0f"),
                         fmt(compute * 1e3 if compute else None, ".0f"), fmt(io * 1e3 if io is not None else None, ".0f"),
                         fmt(bound and (1 / run["decode_tps"]) / bound, ".2f"), fmt(useful_share(d), ".2f")])
            summary[f"cache{share}_{label.replace(' ', '_')}_tps"] = run["decode_tps"]
            summary[f"cache{share}_{label.replace(' ', '_')}_useful_share"] = useful_share(d)
    table("4. Prefetch: decode with and without, against max(compute, bytes read / dd throughput)",
          ["configuration", "decode tok/s", "ms/token", "compute ms/token (resident)", "IO ms/token at dd speed",
           "ms/token / max(compute, IO)", "useful / (useful + demand)"], rows)

    # 4b. bytes read per token against Belady's optimal cache of the same size
    trace = results.get("routing", {}).get("trace")
    rows = []
    if trace and Path(trace).exists():
        sys.path.insert(0, str(ROOT))
        for name in (*CACHE_CONFIGS, "budget"):
            r = results.get(name, {})
            if "runs" not in r or "-cold" not in name and name != "budget":
                continue
            run, d = r["runs"][0], r["runs"][0]["decode"]
            if run["tokens"] != results["routing"]["tokens"]:
                rows.append([name] + ["-"] * 5 + ["routing differs"])
                continue
            n = r["plan"]["cache_experts"]
            steps = max(run["decode_steps"], 1)
            best = optimal_loads(trace, n)
            loads = d["loads_demand"] + d.get("loads_prefetched", 0)
            rows.append([name, str(n), f"{loads / steps:.1f}", f"{d['loads_demand'] / steps:.1f}",
                         f"{best / steps:.1f}", fmt(loads / best if best else None, ".2f"),
                         fmt(d["loads_demand"] / best if best else None, ".2f")])
            summary[f"{name}_reads_over_belady"] = loads / best if best else None
            summary[f"{name}_demand_over_belady"] = d["loads_demand"] / best if best else None
        os.unlink(trace)
    table("4b. Expert reads per decoded token against Belady's MIN with the same slots on the same routing "
          "(design target: bytes read <= 1.3x Belady's)",
          ["configuration", "slots", "reads/token (demand + prefetch)", "demand reads/token",
           "Belady reads/token", "all / Belady", "demand / Belady"], rows)
    if rows:
        print("Belady replays the routing the run took (recorded by a run with every expert resident; greedy output "
              "is the same at every size), counted over the same decode window; every read is one expert.")

    # 5. memory vs budget
    r = results.get("budget", {})
    if "runs" in r:
        b = args.budget_bytes
        growth = r["rss_end"] - r["rss_before_load"]
        peak_growth = r["peak_rss"] - r["rss_before_load"]
        rows = [["memory budget", f"{b / GiB:.2f}", "1.00"],
                ["  plan: resident weights", f"{r['plan']['resident'] / GiB:.2f}", f"{r['plan']['resident'] / b:.2f}"],
                ["  plan: KV reserve + working", f"{(r['plan']['kv_reserve'] + r['plan']['working']) / GiB:.2f}",
                 f"{(r['plan']['kv_reserve'] + r['plan']['working']) / b:.2f}"],
                [f"  plan: expert cache ({r['plan']['cache_experts']} slots)", f"{r['plan']['expert_cache'] / GiB:.2f}",
                 f"{r['plan']['expert_cache'] / b:.2f}"],
                ["MLX peak memory", f"{r['peak_memory'] / GiB:.2f}", f"{r['peak_memory'] / b:.2f}"],
                ["peak RSS (VmHWM, whole process)", f"{r['peak_rss'] / GiB:.2f}", f"{r['peak_rss'] / b:.2f}"],
                ["peak RSS - RSS before load", f"{peak_growth / GiB:.2f}", f"{peak_growth / b:.2f}"],
                ["RSS growth, before load -> end", f"{growth / GiB:.2f}", f"{growth / b:.2f}"]]
        table(f"5. Memory vs budget (budget ~ half the checkpoint; "
              f"RSS before load {r['rss_before_load'] / GiB:.2f} GiB)",
              ["", "GiB", "/ budget"], rows)
        summary.update(budget=b, mlx_peak_over_budget=r["peak_memory"] / b, peak_rss_over_budget=r["peak_rss"] / b,
                       rss_growth_over_budget=growth / b, peak_rss_growth_over_budget=peak_growth / b)
    elif "error" in r:
        print(f"\n5. Memory vs budget: FAILED ({r['error']})")
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="Synthetic checkpoint folder (built if missing). "
                             "Default: /tmp/mlxmoe-bench/qwen3-30b-shapes-<layers>L")
    parser.add_argument("--layers", type=int, default=8, help="MoE layers of the synthetic checkpoint.")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--residual-scale", type=float, default=0.1,
                        help="Scale of the random blocks' output projections (see synthetic.build_large_checkpoint). "
                             "0.1 keeps the residual stream as trained models do: the next layer's router guesses "
                             "0.58 of the layer-ahead experts (the demo model: 0.56-0.60); at 1 routing collapses "
                             "onto a few experts in deep layers.")
    parser.add_argument("--tokens", type=int, default=32, help="Greedy tokens per generation.")
    parser.add_argument("--runs", type=int, default=2,
                        help="Measured generations per process of stock + policy and mlxmoe resident.")
    parser.add_argument("--rounds", type=int, default=2,
                        help="Processes of each of those, alternating (runs pool: rounds x runs).")
    parser.add_argument("--warmup", type=int, default=1, help="Warm-up generations (4 tokens) before those.")
    parser.add_argument("--stock-runs", type=int, default=1,
                        help="Measured generations of stock mlx-lm as-is (bf16 scales: slow on CPU, no warm-up).")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--no-repeat", type=int, default=32,
                        help="Ban the last N tokens when decoding (still greedy); 0: plain greedy, which on the "
                             "synthetic model cycles between 2 tokens and barely exercises the cache.")
    parser.add_argument("--memory-budget", default=None,
                        help="Budget of the memory run, e.g. 1.5GB (binary units). Default: half the checkpoint.")
    parser.add_argument("--load-kwargs", default="{}",
                        help='Extra mlxmoe.load arguments as JSON, e.g. \'{"prefetch": 0}\'.')
    parser.add_argument("--quick", action="store_true", help="Smoke run: 2 layers, 8 tokens, 1 run.")
    parser.add_argument("--no-drop", action="store_true", help="Do not drop the page cache (not root).")
    parser.add_argument("--only", default=None,
                        help="Comma-separated subset of stock,stock-f32,resident,cache50,cache25,"
                             "cache50-cold,cache25-cold,dd,budget.")
    parser.add_argument("--timeout", type=int, default=3600, help="Seconds per configuration.")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON results. Default: bench/out/runtime.json (runtime-quick.json with --quick).")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.tokens, args.runs, args.rounds = 2, 8, 1, 1
    if args.output is None:
        args.output = HERE / "out" / ("runtime-quick.json" if args.quick else "runtime.json")
    if args.checkpoint is None:
        args.checkpoint = Path(f"/tmp/mlxmoe-bench/qwen3-30b-shapes-{args.layers}L")

    if args.one:  # child: one configuration
        sys.path.insert(0, str(ROOT))
        result = run_one(args)
        # --result: a temp file run_child made for this child alone, not a user's path
        Path(args.result).write_text(json.dumps(result))
        return

    check_outputs({"--output": args.output}, {"--checkpoint": args.checkpoint})
    t_start = time.perf_counter()
    reused = checkpoint_matches(args.checkpoint, args)
    results = {}
    if not reused:
        results["build"] = spawn("build", args)
        if "error" in results["build"] or not checkpoint_matches(args.checkpoint, args):
            raise SystemExit(f"building the checkpoint at {args.checkpoint} failed")
    files = checkpoint_files(args.checkpoint)
    ckpt = {"path": str(args.checkpoint), "bytes": checkpoint_bytes(args.checkpoint), "files": len(files),
            "layers": args.layers, "reused": reused}
    print(f"[bench] checkpoint {args.checkpoint}: {ckpt['bytes'] / GiB:.2f} GiB "
          f"({ckpt['bytes'] / 1e9:.2f} GB) in {len(files)} shards", file=sys.stderr, flush=True)
    if args.memory_budget:
        sys.path.insert(0, str(ROOT))
        from mlxmoe.budget import parse_size

        args.budget_bytes = parse_size(args.memory_budget)
    else:
        args.budget_bytes = (ckpt["bytes"] // 2) >> 20 << 20

    only = set(args.only.split(",")) if args.only else None
    want = lambda config: only is None or config in only
    if want("stock"):
        results["stock"] = spawn("stock", args)
    # stock + policy and mlxmoe resident alternate, so that other load on the machine
    # hits both alike; their runs are pooled
    for i in range(args.rounds):
        for config in ("stock-f32", "resident"):
            if want(config):
                r = spawn(config, args)
                if config not in results or "error" in r:
                    results[config] = r if config not in results else {**results[config], "error": r["error"]}
                else:
                    results[config]["runs"] += r["runs"]
                    results[config]["wall_seconds"] += r["wall_seconds"]
                    results[config]["peak_memory"] = max(results[config]["peak_memory"], r["peak_memory"])
                    results[config].setdefault("rounds", [results[config]["load_seconds"]]).append(r["load_seconds"])
    for config in (*CACHE_CONFIGS, "budget"):
        if want(config):
            results[config] = spawn(config, args)
    if any("runs" in results.get(c, {}) for c in (*CACHE_CONFIGS, "budget")):
        results["routing"] = spawn("routing", args)
    dd = {}
    if only is None or "dd" in only:
        largest = max(files, key=lambda f: f.stat().st_size)
        dd = run_dd(largest, args)

    summary = report(args, ckpt, results, dd)
    wall = time.perf_counter() - t_start
    print(f"\nwall time {wall:.0f}s: " + ", ".join(f"{k} {v['wall_seconds']:.0f}s" for k, v in results.items()))
    out = {"argv": sys.argv, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                       "python": sys.version.split()[0]},
           "checkpoint": ckpt, "results": results, "dd": dd, "summary": summary, "wall_seconds": wall}
    write_json(args.output, out)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
