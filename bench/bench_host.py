"""Host-bound decode: stock mlx-lm against mlxmoe where building a token's graph on the host is
most of a token, as on a GPU, with an emulated round trip to the device (issue 42, items 1-2).

The checkpoint has Qwen3-30B-A3B's counts (qwen3_moe, 48 MoE layers, 128 experts, top-8, 4-bit
affine, group 32) and tiny matrices (hidden 64, moe_intermediate 32, 2 heads / 1 KV head of 32,
a 400-token vocabulary): 29 MB, built by synthetic.build_checkpoint (mlx-lm's own classes and
save functions) on first use. Configurations, each in its own process, alternated over rounds
(the order reversed every other round): `stock` (mlx_lm.load + mlx_lm.stream_generate),
`stock-layerwait` (stock, each MoE layer reading its routing on the host before its experts
compute, as any runtime must at a layer that misses: the floor of a wait per layer),
`resident` (mlxmoe.load holding every expert, all read before the timing), `hit99`, `hit95`,
`hit90` (mlxmoe with the cache whose warm decode hit rate is about 99, 95, 90 %: sizes found by
a calibration run, kept beside --output), `cacheN` (N experts). Each process warms
with --warmups generations of the same workload (2: its cache then holds what the workload uses,
and the verified mode's switch has left a cold cache's first steps behind), then times one
generation per emulated round trip: greedy, the same prompt, the decode window from
the first token to the last; the hit rate is that window's (expert_cache.stats() deltas).

Emulated round trip (--rtt S, microseconds; a list runs each in a process of its own, as a
device's round trip does not change within one and the verified mode's switch learns the one it
runs at; bench/roundtrip.py, which bench_batch.py also runs servers under): on the decode thread
only (the child's main thread, which runs the generator) the bench patches
mx.eval, mx.synchronize, np.array and np.asarray (given an mx.array), and mx.array's item,
tolist, __bool__, __int__ and __float__; stock and mlxmoe alike, from outside the runtime. A
patched call is a *wait* when the decode thread slept in it (its voluntary context switches,
getrusage(RUSAGE_THREAD).ru_nvcsw, went up): the device had not finished what it reads. Each
wait then costs S more, added when it returns (the device is done; the host learns it S
later), by time.sleep with the thread's timer slack at 1 ns, shortened by the sleeps' mean
overshoot so far (so they add S on average where S exceeds the machine's wake-up delay; the
added time is measured and printed). A call that did not sleep but reads an array of the
thread's last mx.async_eval less than S after it is a wait of what is left of S (the round trip
runs from the submission). `--spin` busy-waits instead: exact, but it takes a core,
which on a 2-core machine the device's compute shares (its CPU time is left out of the host
time). A
read of an array already computed returns without sleeping and costs nothing (on a GPU it costs
no round trip either): stock's `y.item()` where the host is slower than the device, the resident
path reading the routing of two tokens back, `.tolist()` after an `mx.eval` of the same array.
`--every-call` charges S to every patched call instead (an upper bound). `queued ms/token`: the
decode thread's wall time inside mx.async_eval: MLX's own work on the host for each primitive it
queues (~2 us here, 7804 primitives a token for stock: most of stock's token, busy on the host
thread, not waiting) and, while more tasks than MLX allows are in flight (a task an op on the CPU
backend; a GPU's task is a command buffer of many), its wait for the device.
Not covered: reads through the buffer protocol elsewhere (memoryview(a), np.frombuffer, numpy
functions other than np.array/np.asarray given an mx.array), functions bound before the patch
(`from mlx.core import eval`: none in mlxmoe or mlx_lm's decode path when this was written), waits off the
decode thread (IO and prefetch threads). A GIL hand-over to another Python thread inside a
patched call also reads as a wait (rare: ~1 % of the reads of evaluated arrays, seen with the
prefetcher's thread running).

Emulated host reads (--read-us R): the first host read of each array of more than 8 bytes on
the decode thread costs R more (CUDA moves a device-made array to managed memory at its first
host read: 55 us on an H200; Metal's unified memory costs nothing; bench/roundtrip.py).
`--rtt 77 --read-us 55` is the H200's measured pair (bench/device_costs.py). `reads/token` counts
such reads whatever R.

One process runs up to 1.5x slower than the next on this VM (the same work, both threads), so a
ratio of medians over processes moves by ~10 % from run to run. `--paired` takes the ratio
within each process: every mlxmoe configuration's process also loads stock mlx-lm (the same
weights, the same emulation) and times stock, mlxmoe, mlxmoe, stock at each round trip after
warming both; the "paired" columns are the medians of those per-process ratios.

Columns: waits and calls (patched calls) per decoded token; decode-thread host ms per token:
time.thread_time() of the decode thread over the decode window, per token (a sleep and a wait
on the device take none; it includes the counting's own cost, ~1-2 us a patched call, printed);
"/ stock" and "host / stock's" against stock at the same round trip, medians over the rounds.

    python bench/bench_host.py --tokens 16 --rounds 1 --rtt 0,150          # smoke
    python bench/bench_host.py --rtt 0,150,1000                            # issue 42's rows
    python bench/bench_host.py --configs stock,hit99,hit99:new --variant new='{"prefetch": 0}'
    python bench/bench_host.py --rtt 77 --read-us 55                       # as an H200 would
    python bench/bench_host.py --rtt 150 --rounds 5 --paired               # ratios within each process
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import routed  # noqa: E402
from roundtrip import DeviceWaits  # noqa: E402
from bench_runtime import DEFAULT_PROMPT, fmt, no_repeat, run_child, table  # noqa: E402
from system import check_outputs, cpu_ticks, stolen_share, write_json  # noqa: E402

ROOT = HERE.parent
DEFAULT_CHECKPOINT = Path("/tmp/mlxmoe-bench/host-bound-qwen3-48L")
# qwen3_moe config.json values over synthetic.py's tiny ones: Qwen3-30B-A3B's counts, tiny matrices
SHAPES = {"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "hidden_size": 64,
          "moe_intermediate_size": 32, "intermediate_size": 128, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 4096}
HIT_TARGETS = {"hit99": 0.99, "hit95": 0.95, "hit90": 0.90}
STOCKS = ("stock", "stock-layerwait")  # stock mlx-lm configurations (no cache)


# ---------------------------------------------------------------- one configuration (child process)


def timed_generation(generate, model, tokenizer, args, waits=None, cache=None):
    """One greedy generation; the decode window's figures, from the first token to the last
    (the cache's counters: to the generation's end, which accounts the last tokens' hits)."""
    processors = [no_repeat(args.no_repeat)] if args.no_repeat else None
    tokens, first, stats0 = [], None, None

    def mark():
        m = waits.mark() if waits is not None else {}
        return dict(m, wall=time.perf_counter(), host=time.thread_time(), cpu=time.process_time())

    for response in generate(model, tokenizer, args.prompt, max_tokens=args.tokens, logits_processors=processors):
        tokens.append(int(response.token))
        if first is None:
            stats0 = cache.stats() if cache is not None else None
            first = last = mark()
            ticks = cpu_ticks()  # (once at each end: reading /proc/stat is host work)
        else:
            last = mark()
    stolen = stolen_share(ticks, cpu_ticks())
    d = {k: last[k] - first[k] for k in first if k != "sites"}
    steps = max(len(tokens) - 1, 1)
    out = {"tokens": tokens, "decode_steps": len(tokens) - 1, "tok_s": steps / d["wall"] if d["wall"] else None,
           "ms_per_token": 1e3 * d["wall"] / steps,
           "host_ms_per_token": 1e3 * (d["host"] - d.get("emulation_cpu", 0.0)) / steps,
           "process_cpu_ms_per_token": 1e3 * d["cpu"] / steps, "stolen": stolen}
    if waits is not None:
        sites0 = first["sites"]
        sites = {k: (n - sites0.get(k, 0)) / steps for k, n in last["sites"].items() if n > sites0.get(k, 0)}
        out.update(waits_per_token=d["waits"] / steps, calls_per_token=d["calls"] / steps,
                   reads_per_token=d["reads"] / steps,
                   queued_ms_per_token=1e3 * d["queued"] / steps,
                   added_us_per_wait=1e6 * d["added"] / d["waits"] if d["waits"] else None,
                   wait_sites=dict(sorted(sites.items(), key=lambda kv: -kv[1])[:8]))
    if cache is not None:
        stats1 = cache.stats()
        delta = {k: v - stats0[k] for k, v in stats1.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(stats0.get(k), (int, float))}
        hits, misses = delta.get("hits", 0), delta.get("misses", 0)
        out.update(hits=hits, misses=misses, hit_rate=hits / (hits + misses) if hits + misses else None,
                   stats_delta=delta, verify=stats1.get("verify"))
    return out


def load_arguments(text):
    """mlxmoe.load's arguments from --load-kwargs JSON, less the bench's own `flag_reads_us`:
    the first host read's cost above which verified checks read flags (verify.FLAG_READS; 1e12:
    never, the indices read as where reads are free), set in this process."""
    kwargs = json.loads(text)
    if "flag_reads_us" in kwargs:
        from mlxmoe.caching import verify

        verify.FLAG_READS = float(kwargs.pop("flag_reads_us")) * 1e-6
    return kwargs


def open_stock(args, checkpoint):
    """Stock mlx-lm's (model, tokenizer, stream_generate) of `checkpoint`, routed as --routing says."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(checkpoint))
    follow_routing(args, model, tokenizer)
    return model, tokenizer, mlx_lm.stream_generate


def open_model(args):
    """(model, tokenizer, stream_generate, expert cache or None) of this process's configuration."""
    if args.slots is None:
        model, tokenizer, generate = open_stock(args, args.checkpoint)
        if args.one == "stock-layerwait":
            wait_per_layer(model)
        return model, tokenizer, generate, None
    import mlxmoe

    kwargs = {**load_arguments(args.load_kwargs), "cache_experts": args.slots}
    model, tokenizer = mlxmoe.load(str(args.checkpoint), **kwargs)
    follow_routing(args, model, tokenizer)
    cache = model.expert_cache
    if args.slots >= SHAPES["num_hidden_layers"] * SHAPES["num_experts"] and hasattr(cache, "prewarm_done"):
        cache.prewarm_done(timeout=args.timeout)  # every expert read in the background before the timing
    return model, tokenizer, mlxmoe.stream_generate, cache


def use_routing(args):
    """With --routing: the checkpoint's counts become the recording's (its layers, experts and
    top-k), built at a path of their own unless --checkpoint is given; args.recorded kept.
    args.own_checkpoint: whether the checkpoint is one of this bench's defaults (rebuilt there)."""
    args.recorded, args.own_checkpoint = None, args.checkpoint == DEFAULT_CHECKPOINT
    if not args.routing:
        return
    meta, logits, first_decode = routed.read_or_exit(args.routing)
    args.recorded = (logits, first_decode)
    SHAPES.update(num_hidden_layers=meta["num_layers"], num_experts=meta["num_experts"],
                  num_experts_per_tok=meta["top_k"])
    if args.own_checkpoint:
        args.checkpoint = DEFAULT_CHECKPOINT.with_name(
            f"host-bound-{meta['num_layers']}x{meta['num_experts']}-top{meta['top_k']}")


def follow_routing(args, model, tokenizer):
    """With --routing: `model` routes as the recording did (bench/routed.py)."""
    if args.recorded is not None:
        logits, first_decode = args.recorded
        routed.follow(model, logits, first_decode, len(tokenizer.encode(args.prompt)))


def wait_per_layer(model):
    """Stock's experts, each MoE layer's after its routing was evaluated (mx.eval looked up at
    the call: the emulated round trip applies)."""
    import mlx.core as mx

    for layer in model.layers:
        experts = layer.mlp.switch_mlp
        cls = type(experts)

        def call(self, x, indices, cls=cls):
            mx.eval(indices)
            return cls.__call__(self, x, indices)

        experts.__class__ = type(f"Waiting{cls.__name__}", (cls,), {"__call__": call})


def run_config(args):
    """Warm with args.warmups generations, then one timed generation per round trip in args.rtt;
    --paired: stock's generations in the same process too, alternated with ours (stock, ours,
    ours, stock a round trip), each side's medians in `paired`."""
    rtts = [float(x) for x in args.rtt.split(",")]
    model, tokenizer, generate, cache = open_model(args)
    pair = open_stock(args, args.pair_checkpoint) if args.paired and cache is not None else None  # (--paired)
    waits = DeviceWaits(args.spin, args.every_call, read_us=args.read_us)
    cost = waits.install()
    waits.set_rtt(rtts[0])
    ours = lambda: timed_generation(generate, model, tokenizer, args, waits, cache)  # noqa: E731
    stock = lambda: timed_generation(pair[2], pair[0], pair[1], args, waits)  # noqa: E731
    for _ in range(args.warmups):  # the same workload: the cache warms, the verified mode's switch settles
        ours()
        if pair is not None:
            stock()
    rows, paired = [], []
    for rtt in rtts:
        waits.set_rtt(rtt)
        if pair is None:
            rows.append(dict(ours(), rtt_us=rtt))
            continue
        s1, o1, o2, s2 = stock(), ours(), ours(), stock()
        rows += [dict(o1, rtt_us=rtt), dict(o2, rtt_us=rtt)]
        med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
        paired.append({"rtt_us": rtt, "tok_s": med([o1, o2], "tok_s"), "stock_tok_s": med([s1, s2], "tok_s"),
                       "host_ms_per_token": med([o1, o2], "host_ms_per_token"),
                       "stock_host_ms_per_token": med([s1, s2], "host_ms_per_token"),
                       "stock_tokens": [s1["tokens"], s2["tokens"]]})
    out = {"rows": rows, "paired": paired, "count_cost_us": cost, "slots": args.slots}
    if cache is not None:
        out["cache_experts"] = cache.stats().get("cache_experts", args.slots)
        runtime = getattr(model, "expert_runtime", None)
        if runtime is not None:
            runtime.close()
    return out


def calibrate(args):
    """Cache sizes whose warm decode hit rate is about each target (no round trip emulated):
    a search over sizes, one load and two generations each (warm, measured)."""
    import mlxmoe

    total = SHAPES["num_hidden_layers"] * SHAPES["num_experts"]
    floor = 2 * SHAPES["num_experts_per_tok"]
    points = {}

    def rate(n):
        if n not in points:
            model, tokenizer = mlxmoe.load(str(args.checkpoint), **{**load_arguments(args.load_kwargs), "cache_experts": n})
            follow_routing(args, model, tokenizer)
            timed_generation(mlxmoe.stream_generate, model, tokenizer, args, cache=model.expert_cache)
            points[n] = timed_generation(mlxmoe.stream_generate, model, tokenizer, args,
                                         cache=model.expert_cache)["hit_rate"] or 0.0
            model.expert_runtime.close()
            print(f"[calibrate] {n} experts ({100 * n / total:.1f} %): hit rate {100 * points[n]:.2f} %",
                  file=sys.stderr, flush=True)
        return points[n]

    sizes = {}
    for name, target in sorted(HIT_TARGETS.items(), key=lambda kv: -kv[1]):
        for _ in range(args.calibration_probes):
            lo = max([n for n, r in points.items() if r < target] + [floor])
            hi = min([n for n, r in points.items() if r >= target] + [total])
            if hi - lo <= 1:
                break
            n = round(math.sqrt(lo * hi))
            if lo in points and hi in points and points[hi] < 1:  # log miss rate, linear in log size
                m_lo, m_hi = math.log(1 - points[lo]), math.log(1 - points[hi])
                f = (math.log(1 - target) - m_lo) / (m_hi - m_lo)
                n = round(math.exp(math.log(lo) + f * (math.log(hi) - math.log(lo))))
            n = min(max(n, lo + 1), hi - 1)
            if abs((1 - rate(n)) - (1 - target)) <= 0.25 * (1 - target):
                break
        sizes[name] = min(points, key=lambda n: abs(points[n] - target)) if points else total
    return {"sizes": sizes, "points": {str(n): r for n, r in sorted(points.items())}}


def run_one(args):
    sys.path.insert(0, str(ROOT))
    if args.one == "build":
        from synthetic import build_checkpoint

        build_checkpoint(args.checkpoint, "qwen3_moe", quant="4bit", dtype="float32", seed=0, config_overrides=SHAPES)
        return {}
    if args.one == "calibrate":
        return calibrate(args)
    return run_config(args)


# ---------------------------------------------------------------- parent


def checkpoint_ready(path):
    config, index = Path(path) / "config.json", Path(path) / "model.safetensors.index.json"
    if not config.exists() or not index.exists():
        return False
    c = json.loads(config.read_text())
    shards = set(json.loads(index.read_text())["weight_map"].values())
    return (c.get("model_type") == "qwen3_moe" and all(c.get(k) == v for k, v in SHAPES.items())
            and c.get("quantization", {}).get("bits") == 4 and all((Path(path) / s).exists() for s in shards))


def spawn(args, one, load_kwargs="{}", slots=None, rtts=None):
    checkpoint = args.stock_checkpoint if slots is None and args.stock_checkpoint else args.checkpoint
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", one, "--checkpoint", str(checkpoint),
           "--tokens", str(args.tokens), "--prompt", args.prompt, "--no-repeat", str(args.no_repeat),
           "--load-kwargs", load_kwargs, "--timeout", str(args.timeout),
           "--calibration-probes", str(args.calibration_probes), "--warmups", str(args.warmups)] \
        + ["--routing", args.routing] * bool(args.routing)
    if slots is not None:
        cmd += ["--slots", str(slots)]
        if args.paired:
            cmd += ["--paired", "--pair-checkpoint", str(args.stock_checkpoint or args.checkpoint)]
    if rtts is not None:
        cmd += ["--rtt", ",".join(str(r) for r in rtts)]
    cmd += ["--spin"] * args.spin + ["--every-call"] * args.every_call + ["--read-us", str(args.read_us)]
    return run_child(cmd, one if slots is None else f"{one} ({slots} experts)", args.timeout)


def calibration_file(args):
    """Where the calibration of the `hit` sizes is kept, per checkpoint and workload: beside --output."""
    return args.output.with_name(args.output.stem + "-calibration.json")


def cache_sizes(args, configs):
    """Experts of each partially cached configuration: --cache-experts, else the calibration
    kept beside --output for this checkpoint and workload, else a calibration run now."""
    given = dict(item.split("=") for item in args.cache_experts.split(",")) if args.cache_experts else {}
    sizes = {name: int(n) for name, n in given.items()}
    for c in configs:
        if c.startswith("cache") and c[5:].isdigit():
            sizes[c] = int(c[5:])
    wanted = [c for c in configs if c in HIT_TARGETS and c not in sizes]
    if not wanted:
        return sizes, None
    file = calibration_file(args)
    key = json.dumps([str(Path(args.checkpoint).resolve()), args.tokens, args.prompt, args.no_repeat,
                      json.loads(args.load_kwargs)] + [args.routing] * bool(args.routing), sort_keys=True)
    kept = json.loads(file.read_text()) if file.exists() else {}
    if key not in kept or args.recalibrate:
        result = spawn(args, "calibrate", args.load_kwargs)
        if "error" in result:
            raise SystemExit(f"calibration failed: {result['error']}")
        kept[key] = {"sizes": result["sizes"], "points": result["points"]}
        write_json(file, kept)
    sizes.update({c: kept[key]["sizes"][c] for c in wanted})
    return sizes, kept[key]


def parse_configs(args):
    """[(name, base configuration, mlxmoe.load kwargs as JSON)], a ':VARIANT' suffix adding --variant's."""
    variants = dict(v.split("=", 1) for v in args.variant)
    base = json.loads(args.load_kwargs)
    out = []
    for name in args.configs.split(","):
        config, _, variant = name.partition(":")
        if variant and variant not in variants:
            raise SystemExit(f"{name}: no --variant {variant}=JSON")
        ok = config in (*STOCKS, "resident", *HIT_TARGETS) or config.startswith("cache") and config[5:].isdigit()
        if not ok or config in STOCKS and variant:
            raise SystemExit(f"unknown configuration {name!r}")
        out.append((name, config, json.dumps({**base, **json.loads(variants.get(variant, "{}"))})))
    return out


def pooled(runs, rtt):
    """One configuration's rows at round trip `rtt` over the rounds, pooled (medians, means, sums)."""
    rows = [row for r in runs for row in r.get("rows", []) if row["rtt_us"] == rtt]
    if not rows:
        return None
    med = lambda k: statistics.median(x[k] for x in rows) if all(x.get(k) is not None for x in rows) else None
    mean = lambda k: statistics.fmean(x[k] for x in rows) if all(x.get(k) is not None for x in rows) else None
    out = {k: med(k) for k in ("tok_s", "ms_per_token", "host_ms_per_token", "process_cpu_ms_per_token",
                               "queued_ms_per_token")}
    out.update({k: mean(k) for k in ("waits_per_token", "calls_per_token", "reads_per_token", "added_us_per_wait",
                                     "stolen")})
    if "hits" in rows[0]:
        hits, misses = sum(x["hits"] for x in rows), sum(x["misses"] for x in rows)
        out["hit_rate"] = hits / (hits + misses) if hits + misses else None
        # which path the decode steps took: verified (verify.py), else per layer or resident
        steps = sum(x["decode_steps"] for x in rows) or 1
        delta = lambda k: sum(x["stats_delta"].get(k, 0) for x in rows)  # noqa: E731
        out["verified_share"] = delta("verified_tokens") / steps
        out["replays_per_token"] = delta("replays") / steps
        # each round's share and the switch's last reason where the mode was off for some steps
        out["verified_each"] = [x["stats_delta"].get("verified_tokens", 0) / max(x["decode_steps"], 1) for x in rows]
        out["verify_reasons"] = sorted({(x.get("verify") or {}).get("reason") or "" for x in rows} - {""})
    pairs = [q for r in runs for q in r.get("paired", []) if q["rtt_us"] == rtt]
    if pairs:  # (--paired: each process's ratio to the stock generations it ran itself)
        out["paired_vs_stock"] = statistics.median(q["tok_s"] / q["stock_tok_s"] for q in pairs)
        out["paired_host_vs_stock"] = statistics.median(q["host_ms_per_token"] / q["stock_host_ms_per_token"]
                                                        for q in pairs)
        out["paired_each"] = [q["tok_s"] / q["stock_tok_s"] for q in pairs]
    out["tokens"] = [x["tokens"] for x in rows] + [t for q in pairs for t in q["stock_tokens"]]
    out["rounds"] = len(rows)
    sites = {}
    for x in rows:
        for s, n in x["wait_sites"].items():
            sites[s] = sites.get(s, 0) + n / len(rows)
    out["wait_sites"] = dict(sorted(sites.items(), key=lambda kv: -kv[1])[:4])
    return out


def report(args, configs, sizes, results, rtts):
    """The table (or JSON lines), one row per configuration and round trip; returns the rows."""
    total = SHAPES["num_hidden_layers"] * SHAPES["num_experts"]
    stock = {rtt: pooled(results.get("stock", []), rtt) for rtt in rtts}
    ref = next((s["tokens"][0] for s in stock.values() if s), None)
    if ref is None:  # (no stock configuration: the stock runs of --paired)
        ref = next((q["stock_tokens"][0] for runs in results.values() for r in runs for q in r.get("paired", [])), None)
    rows, lines = [], []
    for rtt in rtts:
        for name, config, kwargs in configs:
            p = pooled(results[name], rtt)
            if p is None:
                rows.append([name, f"{rtt:g}"] + ["-"] * 12 + ["FAILED", "-"])
                continue
            s = stock[rtt]
            slots = None if config in STOCKS else total if config == "resident" else sizes[config]
            same = None if ref is None else all(t == ref for t in p["tokens"])
            line = {"config": name, "rtt_us": rtt, "cache_experts": slots, "cache_share": slots and slots / total,
                    "load_kwargs": None if config in STOCKS else json.loads(kwargs),
                    **{k: v for k, v in p.items() if k != "tokens"},
                    "vs_stock": p["tok_s"] / s["tok_s"] if s and p["tok_s"] and s["tok_s"] else None,
                    "host_vs_stock": p["host_ms_per_token"] / s["host_ms_per_token"] if s else None,
                    "tokens_identical": same}
            lines.append(line)
            rows.append([name, f"{rtt:g}", "-" if slots is None else f"{slots} ({100 * slots / total:.1f} %)",
                         "-" if p.get("hit_rate") is None else f"{100 * p['hit_rate']:.1f} %",
                         fmt(p["tok_s"], ".1f"), fmt(line["vs_stock"], ".2f"), fmt(p["waits_per_token"], ".1f"),
                         fmt(p["calls_per_token"], ".1f"), fmt(p.get("reads_per_token"), ".1f"),
                         fmt(p["host_ms_per_token"], ".2f"),
                         fmt(line["host_vs_stock"], ".2f"), fmt(p["queued_ms_per_token"], ".1f"),
                         fmt(p.get("verified_share") and 100 * p["verified_share"], ".0f"),
                         fmt(p.get("replays_per_token"), ".2f"),
                         {None: "-", True: "yes", False: "NO"}[same],
                         fmt(p["stolen"] and 100 * p["stolen"], ".0f")]
                        + [fmt(p.get("paired_vs_stock"), ".2f"), fmt(p.get("paired_host_vs_stock"), ".2f")] * args.paired)
    if args.json:
        for line in lines:
            print(json.dumps(line))
        return lines
    for rtt in rtts:
        s = stock[rtt]
        if s:
            print(f"stock mlx-lm at {rtt:g} us: {s['tok_s']:.1f} tok/s ({s['ms_per_token']:.1f} ms a token), "
                  f"decode-thread host {s['host_ms_per_token']:.1f} ms a token = "
                  f"{100 * s['host_ms_per_token'] / s['ms_per_token']:.0f} % of it")
    table(f"Host-bound decode, {SHAPES['num_hidden_layers']} MoE layers x {SHAPES['num_experts']} experts, top "
          f"{SHAPES['num_experts_per_tok']}, 4-bit, hidden {SHAPES['hidden_size']}, routing "
          f"{'recorded: ' + args.routing if args.routing else 'of the random weights'} (decode window: tokens "
          f"2..{args.tokens}, {args.rounds} round{'s' * (args.rounds > 1)}, medians)",
          ["config", "rtt us", "cache (experts, %)", "hit rate", "tok/s", "/ stock", "waits/token", "calls/token",
           "reads/token", "host ms/token", "host / stock's", "queued ms/token", "verified %", "replays/token",
           "tokens identical", "stolen %"] + ["/ stock, paired", "host / stock's, paired"] * args.paired, rows)
    added = [l["added_us_per_wait"] for l in lines if l["rtt_us"] and l.get("added_us_per_wait")]
    cost = [r["count_cost_us"] for runs in results.values() for r in runs if "count_cost_us" in r]
    rule = "every patched call (--every-call)" if args.every_call else "patched calls on the decode thread that slept"
    print(f"waits: {rule}; calls: all patched calls; reads: first host reads of arrays of more than 8 bytes"
          + (f", each {args.read_us:g} us more (--read-us)" if args.read_us else "")
          + f"; added per wait {'(spin)' if args.spin else '(sleep)'}: "
          + (f"{min(added):.0f}-{max(added):.0f} us measured" if added else "-")
          + (f"; counting cost {statistics.median(cost):.1f} us a call, in the host time" if cost else ""))
    print("queued: wall time of the decode thread inside mx.async_eval: MLX's own host work for each primitive "
          "it queues, and its wait while more tasks than it allows are in flight (on the CPU backend one an op)")
    print("verified %: the decode steps verified (checked a window behind, one wait at the step's end: "
          "verify.py), the rest on the per-layer path (a wait a layer call) or resident; replays: a verified "
          "step's passes again from a layer that missed")
    print("stolen %: the machine's CPU time its hypervisor gave other guests in the decode window "
          "(/proc/stat steal): a row with a few % or more is slowed by a shared host, not by its code")
    if args.paired:
        print("paired: each mlxmoe process ran stock mlx-lm too, alternated (stock, mlxmoe, mlxmoe, stock), and "
              "its ratio is taken within it (median over the processes): " + "; ".join(
                  f"{l['config']} at {l['rtt_us']:g} us " + " / ".join(f"{v:.2f}" for v in l["paired_each"])
                  for l in lines if l.get("paired_each")))
    for l in lines:  # (a switch that kept the mode off for a tenth of a round or more: why)
        if l.get("verified_each") and min(l["verified_each"]) < 0.9:
            print(f"{l['config']} at {l['rtt_us']:g} us: verified "
                  + " / ".join(f"{100 * v:.0f}" for v in l["verified_each"]) + " % of each round's steps; the "
                  f"switch's last reasons: {'; '.join(l['verify_reasons']) or '-'}")
    rtt = max(rtts)
    print(f"waits per token by call site at {rtt:g} us: " + "; ".join(
        f"{l['config']} " + ", ".join(f"{k} {v:.1f}" for k, v in l["wait_sites"].items())
        for l in lines if l["rtt_us"] == rtt and l["wait_sites"]))
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT, help="Built here if missing.")
    parser.add_argument("--stock-checkpoint", type=Path, default=None,
                        help="Where stock mlx-lm loads the same weights from (default: --checkpoint), for a "
                             "--checkpoint stock cannot load: one `mlxmoe convert --bundle` made.")
    parser.add_argument("--configs", default="stock,resident," + ",".join(HIT_TARGETS),
                        help="Comma-separated: stock, stock-layerwait, resident, hit99, hit95, hit90, cacheN (N experts); "
                             "NAME:VARIANT adds --variant VARIANT's load arguments.")
    parser.add_argument("--rtt", default="0,150,1000", help="Emulated round trips, us, comma-separated.")
    parser.add_argument("--tokens", type=int, default=64, help="Greedy tokens per generation.")
    parser.add_argument("--rounds", type=int, default=2, help="Processes of each configuration, alternated.")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--no-repeat", type=int, default=32,
                        help="Ban the last N tokens (still greedy; see bench_runtime.no_repeat); 0: plain greedy.")
    parser.add_argument("--load-kwargs", default="{}", help='mlxmoe.load arguments as JSON, e.g. \'{"prefetch": 0}\'; the bench\'s own "flag_reads_us": '
                             'the first host read\'s cost above which verified checks read flags (1e12: never).')
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=JSON: load arguments over --load-kwargs for configurations NAME:VARIANT.")
    parser.add_argument("--cache-experts", default=None,
                        help="Sizes instead of the calibration, e.g. hit99=1100,hit95=700.")
    parser.add_argument("--recalibrate", action="store_true", help="Calibrate again (else the kept sizes are used).")
    parser.add_argument("--calibration-probes", type=int, default=6, help="Sizes tried at most per hit-rate target.")
    parser.add_argument("--warmups", type=int, default=2,
                        help="Generations of the same workload before the timed one, in each process: the cache "
                             "warms and the verified mode's switch settles (it starts on a cold cache's many misses).")
    parser.add_argument("--spin", action="store_true", help="Busy-wait the round trip instead of sleeping.")
    parser.add_argument("--read-us", type=float, default=0.0,
                        help="Add this many us to the first host read of each array of more than 8 bytes (CUDA's "
                             "move to managed memory: 55 on an H200; bench/roundtrip.py).")
    parser.add_argument("--every-call", action="store_true", help="Charge the round trip to every patched call.")
    parser.add_argument("--json", action="store_true", help="JSON lines (one per row) instead of the table.")
    parser.add_argument("--output", type=Path, default=HERE / "out" / "host.json", help="All results, JSON.")
    parser.add_argument("--timeout", type=int, default=1800, help="Seconds per process.")
    parser.add_argument("--routing", default=None,
                        help="[FORMAT:]FILE: route as this recording of a real model did (bench/routed.py; "
                             "`mlxmoe trace import` formats, .csv: bigmoeonedge, .json: moe-ocs); the checkpoint "
                             "takes its layers, experts and top-k (built beside the default one).")
    parser.add_argument("--paired", action="store_true",
                        help="Stock mlx-lm in each mlxmoe configuration's process too, alternated with it: the "
                             "ratio within a process, where the machine runs one process up to 1.5x slower "
                             "than the next (the '/ stock, paired' columns: medians over the processes).")
    parser.add_argument("--pair-checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--slots", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()

    use_routing(args)
    if args.one:  # child; --result: a temp file run_child made for it alone, not a user's path
        Path(args.result).write_text(json.dumps(run_one(args)))
        return

    # the calibration is written beside --output, never into the checkpoint (an input)
    check_outputs({"--output": args.output, "the calibration": calibration_file(args)},
                  {"--checkpoint": args.checkpoint, "--stock-checkpoint": args.stock_checkpoint,
                   "--routing": args.routing and routed.recording(args.routing)[1]})
    t_start, load_start = time.perf_counter(), os.getloadavg()
    configs = parse_configs(args)
    rtts = [float(x) for x in args.rtt.split(",")]
    if not checkpoint_ready(args.checkpoint):
        if Path(args.checkpoint).exists() and any(Path(args.checkpoint).iterdir()) and not args.own_checkpoint:
            raise SystemExit(f"{args.checkpoint} does not hold this bench's checkpoint ({SHAPES['num_hidden_layers']} "
                             f"layers x {SHAPES['num_experts']} experts, top-{SHAPES['num_experts_per_tok']}); "
                             "give a missing folder to build it in, or none for the default")
        if "error" in spawn(args, "build") or not checkpoint_ready(args.checkpoint):
            raise SystemExit(f"building the checkpoint at {args.checkpoint} failed")
    sizes, calibration = cache_sizes(args, [c for _, c, _ in configs])
    total = SHAPES["num_hidden_layers"] * SHAPES["num_experts"]
    results = {name: [] for name, _, _ in configs}
    for i in range(args.rounds):
        order = configs if i % 2 == 0 else configs[::-1]
        for rtt in rtts if i % 2 == 0 else rtts[::-1]:
            for name, config, kwargs in order:
                slots = None if config in STOCKS else total if config == "resident" else sizes[config]
                results[name].append(spawn(args, name, kwargs, slots, [rtt]))
    load_end = os.getloadavg()
    if not args.json:
        stock_from = f" (stock mlx-lm: {args.stock_checkpoint})" if args.stock_checkpoint else ""
        print(f"checkpoint {args.checkpoint}{stock_from}; load average {' '.join(f'{x:.2f}' for x in load_start)} at the start, "
              f"{' '.join(f'{x:.2f}' for x in load_end)} at the end ({os.cpu_count()} CPUs)")
        if calibration:
            print("calibration (experts: warm decode hit rate): "
                  + ", ".join(f"{n}: {100 * r:.1f} %" for n, r in calibration["points"].items()))
    lines = report(args, configs, sizes, results, rtts)
    out = {"argv": sys.argv, "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                         "loadavg_start": load_start, "loadavg_end": load_end},
           "shapes": SHAPES, "sizes": sizes, "calibration": calibration, "rows": lines, "results": results,
           "wall_seconds": time.perf_counter() - t_start}
    write_json(args.output, out)
    if not args.json:
        print(f"wrote {args.output} ({out['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
