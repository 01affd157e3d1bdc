"""Disk-bound benchmark: mlxmoe's decode and prefill where the disk, not compute, is the bottleneck.

The checkpoint is served through slowdisk.py (--slowdisk), a read-only FUSE mount on which
every read waits its turn on one simulated disk (latency + bytes / rate, FIFO) and the
kernel's page cache is bypassed (--cold), so a fast machine behaves as one whose disk is
slow against its compute. In one run, each configuration in its own process (`--one CONFIG`,
as in bench_runtime.py, whose helpers this imports):

1. compute bound: mlxmoe with every expert resident, read before the measured runs, from
   the checkpoint itself (not the slow disk): median decode seconds per token and time to
   first token over --runs generations; then the same generation once more with its routing
   recorded (greedy output is the same at every cache size), from which Belady's MIN gives
   the fewest expert reads any cache of each size could do (bench_runtime.optimal_loads);
2. for each disk rate: mount slowdisk over the checkpoint, and for each cache share and each
   configuration (`off`: mlxmoe.load(prefetch=0); `default`: mlxmoe.load() with no options;
   `baseline`: the default of an older commit, --baseline REF or --baseline-path DIR;
   `oracle`, a what-if: the default with every lookahead guess right, --oracle-depth layer
   calls ahead, from the recorded routing) load from the mount and generate --tokens greedy tokens: time to first token, decode
   ms/token, the cache's demand, prefetched and cancelled loads, the bytes the simulated
   disk served, the tokens; unmount;
   the rate `disk` is the machine's own disk instead (where FUSE is not available, e.g. a
   GPU machine): no mount; its rate is measured once with `dd if=<largest shard>
   of=/dev/null bs=4M iflag=direct` after dropping the page cache, each configuration
   loads the checkpoint folder itself with the page cache dropped just before (mlxmoe's
   expert reads are O_DIRECT on Linux: they bypass it anyway), and the disk's bytes and
   busy time are the cache's own (stats() bytes_read and disk_busy_seconds);
3. print, per rate, what it emulates (Belady's decode reads per token / rate against a
   token's compute: "reads = 3.1x compute" is disk-bound), one table with a row per (rate,
   cache, configuration) against the bounds, and the targets (docs/design.md,
   "Performance targets") as PASS / FAIL lines; write everything as JSON (--output).

    python bench/bench_disk.py --quick                           # 20MB/s, 25 %, off + default, 8 tokens (~4 min)
    python bench/bench_disk.py                                   # 400, 40, 20, 10 MB/s x 25, 50 % x off, default (~30 min)
    python bench/bench_disk.py --baseline HEAD~5                 # + the default of an older commit
    python bench/bench_disk.py --only-rates 10MB/s               # redo one rate, keep the rest of --output
    python bench/bench_disk.py --model demo --rates 2MB/s,0.5MB/s    # the bundled demo model
    python bench/bench_disk.py --rates disk                      # this machine's disk, no FUSE (GPU machines)
    python bench/bench_disk.py --rates disk --baseline-path /tmp/base  # old code: git archive REF mlxmoe | tar -x -C /tmp/base
    python bench/bench_disk.py --rates 40MB/s --configs default,oracle --oracle-depth 1   # a perfect predictor's ceiling
    python bench/bench_disk.py --rates 40MB/s --cache 0.5 --routing ROUTE.csv   # routed as a real model (bench/routed.py)

Rates are slowdisk's: binary units (20MB/s = 20 MiB/s), as are the MiB in the tables. An
emulated rate needs slowdisk.py (the project's FUSE disk emulator, kept outside this
repository: --slowdisk PATH or $MLXMOE_SLOWDISK), /dev/fuse, fusermount3 (fuse3), the
`mfusepy` package and permission to mount (root, or a user FUSE mount); the mount is always
unmounted at the end of its rate, also on Ctrl-C. The rate `disk` needs none of them, only
dd and root to drop the page cache (else it warns and runs warm).
The default checkpoint is built (bench_runtime.py --one build, 8 layers) when missing, as
is a synthetic one at a --model/--checkpoint PATH that does not exist yet.
"""

import argparse
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import routed  # noqa: E402
import bench_runtime as br  # noqa: E402  (its helpers: generate_timed, window_stats, optimal_loads, table...)
from system import baseline_code, baseline_env, check_outputs, imported_from, write_atomic, write_json  # noqa: E402

DEFAULT_MODEL = Path("/tmp/mlxmoe-bench/qwen3-30b-shapes-8L")  # bench_runtime.py's 8-layer checkpoint
# The synthetic checkpoint's tokenizer is nearly one token per character: this is 8 tokens
# (the demo model's: 3). A short prompt keeps the prefill's reads (every expert it routes
# to, from an empty cache) to a few hundred experts.
DEFAULT_PROMPT = "Hello world!"
DEMO_PROMPT = "Il file di configurazione"  # 5 tokens; on "Hello world!" the demo model ends at once
# 400: compute dominates; 10-40: the disk does. The same rates suit the demo model: its
# experts are 47x smaller (60 KiB) and its tokens about 100x faster (3-5 ms on 2 cores).
DEFAULT_RATES = "400MB/s,40MB/s,20MB/s,10MB/s"
DISK = "disk"  # the rate that is this machine's own disk: no mount, dd's rate
CONFIGS = ("off", "default", "baseline", "lossy", "oracle", "no-ahead", "device-copy")
# the online policies whose decode loads on the run's routing the report sets beside Belady's
ONLINE_POLICIES = ("lru", "lfu", "slru", "s3fifo", "layer-lru", "layer-lfu", "lfuda", "activation-floor")


def lossy_kwargs(text):
    """--lossy "cache_bias=0.75,trim=0.3,fallback=PATH" as mlxmoe.load's keywords."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        if key not in ("trim", "cache_bias", "fallback"):
            raise SystemExit(f"--lossy: {key!r} is not trim, cache_bias or fallback")
        out[key] = value if key == "fallback" else float(value)
    return out
MiB = 1 << 20


# ---------------------------------------------------------------- helpers


def slowdisk_module(path):
    """slowdisk.py as a module, for its parse_rate / parse_seconds (the same units it mounts with)."""
    spec = importlib.util.spec_from_file_location("slowdisk", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fuse_check(args):
    """What an emulated rate needs, checked before anything runs: slowdisk.py, fusermount3
    and mfusepy. Returns slowdisk as a module (imported only here: it imports mfusepy)."""
    missing = []
    if args.slowdisk is None:
        missing.append("slowdisk.py (--slowdisk PATH or $MLXMOE_SLOWDISK)")
    elif not args.slowdisk.exists():
        missing.append(f"{args.slowdisk} (--slowdisk)")
    if shutil.which("fusermount3") is None:
        missing.append("fusermount3 (fuse3)")
    if importlib.util.find_spec("mfusepy") is None:
        missing.append("the mfusepy package")
    if missing:
        raise SystemExit(f"an emulated rate needs {', '.join(missing)}; without FUSE use --rates {DISK}")
    return slowdisk_module(args.slowdisk)


def parse_rates(args, text):
    """[(text, bytes/s)] of --rates / --only-rates; `disk`'s bytes/s is None until dd has
    measured it (measure_disk). slowdisk is imported only for an emulated rate."""
    texts = [t.strip() for t in text.split(",") if t.strip()]
    sd = fuse_check(args) if any(t != DISK for t in texts) else None
    if sd:
        sd.parse_seconds(args.latency)
    return [(t, None if t == DISK else sd.parse_rate(t)) for t in texts]


def measure_disk(path):
    """The rate `disk`: dd iflag=direct of the checkpoint's largest shard after dropping the
    page cache (bench_runtime.run_dd); its dict, with the rate in bytes/s as "rate"."""
    largest = max(br.checkpoint_files(path), key=lambda f: f.stat().st_size)
    print(f"[bench] dd if={largest} of=/dev/null bs=4M iflag=direct (page cache dropped)", file=sys.stderr, flush=True)
    dd = br.run_dd(largest, argparse.Namespace(no_drop=False))
    if not dd.get("gbps"):
        raise SystemExit(f"dd iflag=direct of {largest} failed (status {dd['returncode']}): {dd['line']}")
    dd["rate"] = dd["gbps"] * 1e9
    print(f"[bench] {dd['line']}", file=sys.stderr, flush=True)
    return dd


def disk_stats(mount):
    """The simulated disk's counters: {"reads", "bytes", "busy_s", ...} (read through the mount)."""
    return json.loads((Path(mount) / ".slowdisk-stats").read_text())


def own_disk_stats(snapshot):
    """For the rate `disk`, the cache's own figures in disk_stats' form: the store's read calls,
    the bytes of the expert reads done (not the parts of cancelled ones), and the seconds
    during which any expert read was under way (None where the runtime does not report it)."""
    return {"reads": snapshot.get("io", {}).get("reads"), "bytes": snapshot["bytes_read"],
            "busy_s": snapshot.get("disk_busy_seconds")}


def disk_window(before, after):
    def diff(key):
        return None if before.get(key) is None or after.get(key) is None else after[key] - before[key]

    return {"disk_reads": diff("reads"), "disk_bytes": diff("bytes"), "disk_busy_seconds": diff("busy_s")}


def windows(before, after):
    """bench_runtime.window_stats over a window, with the cancelled background reads (newer
    mlxmoe) and the disk's counters (snapshot["disk"])."""
    out = {**br.window_stats(before, after), **disk_window(before["disk"], after["disk"])}
    for key in ("prefetch_cancelled", "demand_read_seconds", "verified_tokens", "replays"):  # newer mlxmoe
        if key in before and key in after:
            out[key] = after[key] - before[key]
    return out


def decode_thread(run, stats):
    """Where a run's decode thread spent its time, per token: reading (of which the demand
    reads themselves; the rest ran ahead meanwhile), bookkeeping, and its verified steps."""
    d, steps = run["decode"], max(run["decode_steps"], 1)
    per = {k: d.get(k) for k in ("read_seconds", "demand_read_seconds", "bookkeeping_seconds")}
    ms = ", ".join(f"{k.removesuffix('_seconds').replace('_', ' ')} {v / steps * 1e3:.1f}"
                   for k, v in per.items() if v is not None)
    verify = stats.get("verify") or {}
    return (f"decode thread ms/token: {ms}; verified {d.get('verified_tokens', 0) / steps:.0%} of steps, "
            f"{d.get('replays', 0) / steps:.2f} replays/step (verify {'on' if verify.get('on') else 'off'}: "
            f"{verify.get('reason', '-')})")


def rate_label(rate_text, rate, latency_text):
    if rate_text == DISK:
        return f"disk (dd {rate / 1e9:.2f} GB/s)"
    return f"{rate_text} {latency_text}"


# ---------------------------------------------------------------- one configuration (child process)


def run_info(args):
    """What the parent needs to size the caches: layers, experts, top-k, bytes of one expert."""
    import mlxmoe
    from mlxmoe.loader import open_checkpoint

    path = mlxmoe.DEMO_MODEL if args.checkpoint == "demo" else args.checkpoint
    ckpt = open_checkpoint(path)
    try:
        files = ckpt.store.files
        return {"path": str(Path(path).resolve()), "layers": ckpt.num_layers, "experts": ckpt.num_experts,
                "top_k": ckpt.top_k, "expert_bytes": ckpt.store.expert_file_bytes(),
                "model_type": ckpt.config.get("model_type"), "files": len(files),
                "bytes": sum(Path(f).stat().st_size for f in files), "mlxmoe": mlxmoe.__file__}
    finally:
        ckpt.store.close()


def run_belady(args):
    """Belady's MIN on the recorded routing for each cache size: its loads in the decode
    window (bench_runtime.optimal_loads) and before the first token (all its loads, from
    mlxmoe.workload.trace.replay, less those); the distinct (layer, expert) pairs of the prompt and of
    every layer call before the first token."""
    from mlxmoe.workload.trace import layer_calls, read_trace, replay

    header, records = read_trace(args.trace)
    L = header["num_layers"]
    step, prompt, first, decode_steps = -1, set(), set(), 0
    for call in layer_calls(records, L):
        layer = call[0][2]
        if layer == 0 and len(call) == 1:
            step += 1  # a decode step (the last prompt token's is step 0): as optimal_loads counts them
            decode_steps += step >= 2
        pairs = {(layer, e) for rec in call for e in rec[3]}
        if step <= 0:  # the prompt: mlx-lm's prefill call(s) of all but its last token, then the last token
            prompt |= pairs
        if step <= 1:  # mlx-lm builds (and mlxmoe's streaming layers compute) step 1 before the first yield
            first |= pairs
    out = {"prompt_pairs": len(prompt), "first_token_pairs": len(first), "decode_steps": decode_steps,
           "caches": {}}
    for n in args.caches.split(","):
        n = int(n)
        decode = br.decode_loads(header, records, n)
        r = replay(header, records, "belady", n)
        total = r["accesses"] - r["hits"]
        # what online eviction does on this routing: each simple baseline's and the default's
        # decode loads with no prefetch (none reads fewer than Belady; at 25 % far more)
        online = {name: br.decode_loads(header, records, n, name) for name in ONLINE_POLICIES}
        out["caches"][str(n)] = {"decode_loads": decode, "total_loads": total, "first_token_loads": total - decode,
                                 "online_decode_loads": online}
    return out


def run_disk(args):
    """One configuration on the slow disk: load from the mount (--mount), or for the rate
    `disk` from the checkpoint itself with the page cache dropped first; one timed greedy
    generation; the cache's counters and the disk's over the load, the prefill (to the
    first token) and the decode window (first token to last). The disk's counters are
    slowdisk's on a mount, else the cache's own (own_disk_stats) and, over the load, the
    bytes the block layer read for this process (/proc/self/io: with the page cache dropped,
    also the Python libraries mlxmoe.load imports)."""
    import mlxmoe
    from system import disk_read_bytes, drop_page_cache

    where = Path(mlxmoe.__file__).resolve()
    if args.one == "baseline":
        imported_from(mlxmoe, args.baseline_tree)
    mount = Path(args.mount) if args.mount else None
    kwargs = {"prefetch": 0} if args.one == "off" else lossy_kwargs(args.lossy) if args.one == "lossy" else {}
    if args.one == "oracle":
        kwargs = {"prefetch": args.oracle_depth}
        install_oracle(args.trace)
    if args.one == "device-copy":  # a what-if: the default with reads landed by CUDA's copy (backend.DeviceCopy)
        from mlxmoe import backend

        backend.DEVICE_COPY = True
    dropped = None if mount else drop_page_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d0 = disk_stats(mount) if mount else {"bytes": disk_read_bytes()}
        tic = time.perf_counter()
        model, tokenizer = mlxmoe.load(str(mount or args.checkpoint), cache_experts=args.cache_experts, **kwargs)
        load_seconds = time.perf_counter() - tic
        d1 = disk_stats(mount) if mount else {"bytes": disk_read_bytes()}
        cache = model.expert_cache
        if args.one == "no-ahead" and cache.speculator is not None:  # a what-if: the default without running ahead
            cache.speculator.close()
            cache.speculator = None

        def snap():
            s = br.cache_snapshot(cache)
            return {**s, "disk": disk_stats(mount) if mount else own_disk_stats(s)}

        start = snap()
        run, first, last = br.generate_timed(mlxmoe.stream_generate, model, tokenizer, args.prompt, args.tokens,
                                             snapshot=snap, window=args.no_repeat)
    run["prefill"] = windows(start, first)
    run["decode"] = windows(first, last)
    stats = cache.stats()
    cache_experts = stats.get("cache_experts", args.cache_experts)
    land = getattr(cache.store.reader, "land", None)
    model.expert_cache.close()
    return {"mlxmoe": str(where), "load_kwargs": kwargs, "load_seconds": load_seconds, "page_cache_dropped": dropped,
            "device_copies": getattr(land, "copies", None),  # (device-copy: its reads' copies; None: host stores)
            "load": disk_window(d0, d1), "runs": [run], "cache_experts": cache_experts,
            "stats": {k: v for k, v in stats.items() if k != "resident_per_layer"},
            "warnings": sorted({str(w.message) for w in caught}), "disk_end": last["disk"]}


def install_oracle(trace):
    """The `oracle` configuration, a what-if of this bench, not an mlxmoe setting: the default
    whose lookahead is given the run's own routing (`trace`, recorded with every expert
    resident; greedy, so the same at every cache size). At each decode layer call the router
    scores of the next --oracle-depth layer calls become a one-hot of the experts they will
    use: every guess right, read as early as that depth allows. What a perfect predictor
    would gain, the ceiling of any better lookahead."""
    import mlx.core as mx
    import numpy as np

    from mlxmoe.caching.prefetch import Prefetcher
    from mlxmoe.workload.trace import layer_calls, read_trace

    header, records = read_trace(trace)
    num_experts = header["num_experts"]
    # (token position, layer) -> the experts a decode step's call used: the position is the
    # cache's own (call_position), so verified steps, replays and running ahead, which make
    # no lookahead call, leave the guesses aligned
    used = {(call[0][1], call[0][2]): call[0][3] for call in layer_calls(records, header["num_layers"])
            if len(call) == 1}
    lookahead = Prefetcher.lookahead

    def oracle(self, layer, x, decode=True):
        out = lookahead(self, layer, x, decode)
        if decode:
            for ahead_step, target, ahead in self.calls_ahead(layer):
                experts = used.get((self.cache.call_position + ahead, target))
                if ahead_step in out and experts is not None:
                    scores = np.full((1, num_experts), -30.0, np.float32)
                    scores[0, experts] = 0.0
                    out[ahead_step] = mx.array(scores)
        return out

    Prefetcher.lookahead = oracle


def run_one(args):
    sys.path.append(str(ROOT))  # last: an installed mlxmoe, or PYTHONPATH's (the baseline's), comes first
    if args.routing and args.one != "info":
        routed.install(args.routing, args.prompt)  # every model loaded here routes as the recording
    if args.one == "info":
        return run_info(args)
    if args.one == "resident":
        return br.run_resident(args)
    if args.one == "routing":
        return br.run_routing(args)
    if args.one == "belady":
        return run_belady(args)
    if args.one in CONFIGS:
        return run_disk(args)
    raise SystemExit(f"unknown configuration {args.one!r}")


# ---------------------------------------------------------------- parent


def child_args(args, **extra):
    out = ["--checkpoint", str(args.checkpoint), "--prompt", args.prompt, "--tokens", str(args.tokens),
           "--no-repeat", str(args.no_repeat), "--runs", str(args.runs), "--warmup", str(args.warmup)]
    if args.layers:
        out += ["--layers", str(args.layers), "--experts", str(args.experts)]
    if args.lossy:
        out += ["--lossy", args.lossy]
    if args.routing:
        out += ["--routing", args.routing]
    for key, value in extra.items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def spawn(config, args, label=None, env=None, **extra):
    """Run one configuration in a fresh interpreter (bench_runtime's pattern, with this
    file's options); returns its result dict, or {"error": ...}."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", config] + child_args(args, **extra)
    return br.run_child(cmd, label or config, args.timeout, env)


def run_rate(args, rate_text, rate, caches, configs, tree, mp=None):
    """Every (cache, configuration) at one rate, each in its own process: from the mount
    `mp`, or (the rate `disk`, mp None) from the checkpoint itself. Returns their results."""
    out = []
    for share, n in caches:
        for config in configs:
            env = baseline_env(tree) if config == "baseline" else None
            label = rate_label(rate_text, rate, args.latency)
            r = spawn(config, args, label=f"{config}, {share * 100:.0f} % ({n} slots), {label}",
                      env=env, cache_experts=n, **({"mount": mp} if mp else {}),
                      **({"baseline_tree": tree} if config == "baseline" else {}),
                      **({"trace": args.trace, "oracle_depth": args.oracle_depth} if config == "oracle" else {}))
            r.update(rate=rate, rate_text=rate_text, latency=args.latency, share=share, slots=n, config=config)
            out.append(r)
            if "runs" in r:
                run = r["runs"][0]
                where = "so far" if mp else "in this run (the cache's)"
                print(f"[bench]   {run['decode_seconds'] / max(run['decode_steps'], 1) * 1e3:.0f} ms/token, "
                      f"TTFT {run['prefill_seconds']:.1f} s, disk {r['disk_end']['bytes'] / MiB:.0f} MiB "
                      f"in {r['disk_end']['reads']} requests {where}; {decode_thread(run, r['stats'])}",
                      file=sys.stderr, flush=True)
    return out


def mount(src, rate_text, args):
    """Start slowdisk over `src` at a new temp mountpoint; returns (mountpoint, process, log)."""
    mp = Path(tempfile.mkdtemp(prefix="mlxmoe-slowdisk-"))
    log = open(mp.with_name(mp.name + ".log"), "w+")  # beside our temp mountpoint: internal
    cmd = [sys.executable, str(args.slowdisk), str(src), str(mp), "--rate", rate_text, "--latency", args.latency,
           "--cold"]
    # its own session: Ctrl-C reaches this process and the child, never the disk under them
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (os.path.ismount(mp) and (mp / ".slowdisk-stats").exists()):
        if proc.poll() is not None or time.monotonic() > deadline:
            unmount(mp, proc, log)
            log.seek(0)
            raise SystemExit(f"slowdisk did not mount {src} at {mp}: {' '.join(cmd)}\n{log.read()[-2000:]}")
        time.sleep(0.1)
    return mp, proc, log


def unmount(mp, proc, log):
    """fusermount3 -u (lazily if still busy after a few tries), stop slowdisk, remove the mountpoint."""
    for attempt in range(10):
        if not os.path.ismount(mp):
            break
        r = subprocess.run(["fusermount3", "-u", str(mp)] + (["-z"] if attempt == 9 else []),
                           capture_output=True, text=True)
        if r.returncode == 0:
            break
        time.sleep(0.5)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if os.path.ismount(mp):
        print(f"[bench] WARNING: {mp} is still mounted: fusermount3 -u {mp}", file=sys.stderr, flush=True)
    else:
        try:
            mp.rmdir()
        except OSError:
            pass
    log.close()
    Path(log.name).unlink(missing_ok=True)


def wait_for_checkpoint(path, timeout, top_k=8):
    """The default checkpoint (or a missing --model PATH): build it (bench_runtime.py --one
    build, 8 layers) if absent, else wait while another process finishes building it
    (bench_runtime.checkpoint_matches)."""
    shapes = argparse.Namespace(layers=8, experts=128, top_k=top_k, residual_scale=0.1)
    if not path.exists():
        print(f"[bench] {path} is missing: building it (bench_runtime.py --one build --layers 8; a few minutes) ...",
              file=sys.stderr, flush=True)
        tic = time.perf_counter()
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            rc = subprocess.run([sys.executable, str(HERE / "bench_runtime.py"), "--one", "build", "--result", f.name,
                                 "--checkpoint", str(path), "--layers", "8", "--top-k", str(top_k)], cwd=ROOT,
                                stdout=sys.stderr).returncode
        if rc or not br.checkpoint_matches(path, shapes):
            raise SystemExit(f"building {path} failed (exit status {rc}); remove what is there and rerun")
        print(f"[bench] built {path} in {time.perf_counter() - tic:.0f}s ({br.checkpoint_bytes(path) / MiB:.0f} MiB)",
              file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout
    sizes = None
    while True:
        if br.checkpoint_matches(path, shapes):
            now = [f.stat().st_size for f in br.checkpoint_files(path)]
            if now == sizes:  # complete and no longer growing
                return
            sizes = now
        elif time.monotonic() > deadline:
            raise SystemExit(f"{path} is incomplete after {timeout}s (being built? else remove it and rerun)")
        else:
            print(f"[bench] waiting for {path} to be complete ...", file=sys.stderr, flush=True)
            sizes = None
        time.sleep(2 if sizes else 15)


def previous_results(args):
    """With --only-rates: the results in --output of a run of the same model, prompt and
    tokens (their compute bound, routing and the other rates' rows are reused)."""
    if not args.only_rates or not args.output.exists():
        return None
    try:
        prev = json.loads(args.output.read_text())
        same = all(prev["args"][k] == v for k, v in (("model", args.model), ("prompt", args.prompt),
                                                    ("tokens", args.tokens), ("no_repeat", args.no_repeat),
                                                    ("latency", args.latency), ("routing", args.routing)))
    except (OSError, ValueError, KeyError):
        return None
    if not same or "error" in prev.get("compute", {"error": 1}) or not Path(prev["routing"].get("trace", "")).exists():
        print(f"[bench] {args.output}: another setup or incomplete; measuring everything anew", file=sys.stderr)
        return None
    return prev


# ---------------------------------------------------------------- report


def analyse(args, info, compute, belady, runs):
    """One row dict per run, with its bounds."""
    xb = info["expert_bytes"]
    ref = compute["runs"][0]["tokens"]
    compute_s = statistics.median(r["decode_seconds"] / max(r["decode_steps"], 1) for r in compute["runs"])
    ttft_res = statistics.median(r["prefill_seconds"] for r in compute["runs"])
    rows = []
    for r in runs:
        row = {k: r[k] for k in ("rate", "rate_text", "share", "slots", "config")}
        if "error" in r:
            rows.append({**row, "error": r["error"]})
            continue
        run = r["runs"][0]
        d, p = run["decode"], run["prefill"]
        steps = max(run["decode_steps"], 1)
        b = belady["caches"][str(r["slots"])]
        bel_loads = b["decode_loads"] / max(belady["decode_steps"], 1)
        bel_s = bel_loads * xb / r["rate"]
        reads = (d["loads_demand"] + d.get("loads_prefetched", 0)) / steps
        # Belady's reads before the first token: the distinct pairs, more where the cache cannot hold them
        ttft_bound = ttft_res + compute_s + b["first_token_loads"] * xb / r["rate"]
        row.update(
            ms=run["decode_seconds"] / steps * 1e3, compute_ms=compute_s * 1e3, belady_ms=bel_s * 1e3,
            bound_ms=max(compute_s, bel_s) * 1e3, reads=reads, belady_reads=bel_loads,
            reads_over_belady=reads / bel_loads if bel_loads else None, demand=d["loads_demand"] / steps,
            useful=d.get("prefetch_useful", 0) / steps,
            cancelled=d["prefetch_cancelled"] / steps if "prefetch_cancelled" in d else None,
            disk_mib=d["disk_bytes"] / steps / MiB,
            disk_busy=d["disk_busy_seconds"] / run["decode_seconds"]
            if run["decode_seconds"] and d.get("disk_busy_seconds") is not None else None,
            ttft=run["prefill_seconds"], ttft_bound=ttft_bound, ttft_ratio=run["prefill_seconds"] / ttft_bound,
            prefill_reads=p["loads_demand"] + p.get("loads_prefetched", 0),
            prefill_disk_mib=p["disk_bytes"] / MiB, first_token_pairs=belady["first_token_pairs"],
            belady_first_token=b["first_token_loads"], ratio=bel_s / compute_s,
            identical=run["tokens"] == ref, steps=run["decode_steps"], load_seconds=r["load_seconds"],
            load_disk_mib=r["load"]["disk_bytes"] / MiB if r["load"]["disk_bytes"] is not None else None,
            page_cache_dropped=r.get("page_cache_dropped"),
            requests=(p["disk_reads"] or 0) + (d["disk_reads"] or 0), request_bytes=p["disk_bytes"] + d["disk_bytes"],
            loads=p["loads_demand"] + p.get("loads_prefetched", 0) + d["loads_demand"] + d.get("loads_prefetched", 0),
            method=r["stats"].get("io", {}).get("method"),
            fallback=r["stats"].get("io", {}).get("fallback"), warnings=r.get("warnings", []), stolen=r.get("stolen"),
            device_copies=r.get("device_copies"))
        row["ratio_ms"] = row["ms"] / row["bound_ms"]
        rows.append(row)
    for row in rows:  # against prefetch off at the same rate and cache
        off = next((o for o in rows if o["config"] == "off" and "error" not in o
                    and (o["rate"], o["slots"]) == (row["rate"], row["slots"])), None)
        row["vs_off"] = row["ms"] / off["ms"] if off and "error" not in row else None
    return rows, compute_s, ttft_res


def report(args, info, compute, belady, runs, baseline=None, dd=None):
    """Print what each rate emulates (or, for `disk`, what dd measured), the table and the
    targets; return the summary. `baseline`: where the baseline's mlxmoe came from."""
    yes = {None: "-", True: "yes", False: "NO"}
    print(f"\nCheckpoint: {info['path']} ({info['model_type']}, {info['layers']} MoE layers x {info['experts']} "
          f"experts, top {info['top_k']}): {info['bytes'] / MiB:.0f} MiB in {info['files']} files, "
          f"{info['expert_bytes'] / MiB:.3f} MiB per expert on disk")
    if args.routing:
        print(f"Routing: recorded, {args.routing} (its first {info['layers']} MoE layers; the lookahead still "
              "guesses with the model's own routers)")
    if "error" not in compute and not all(r["decode_steps"] for r in compute["runs"]):
        compute = {"error": "the resident runs decoded no token after the first"}
    if "error" in compute:
        print(f"compute bound (every expert resident): FAILED ({compute['error']}); no table")
        return {"error": "compute bound failed"}
    if "error" in belady:
        print(f"Belady's replay of the routing: FAILED ({belady['error']}); no table")
        return {"error": "belady failed"}
    rows, compute_s, ttft_res = analyse(args, info, compute, belady, runs)
    first = compute["runs"][0]
    print(f"Prompt: {first['prompt_tokens']} tokens ({args.prompt!r}); {len(first['tokens'])} greedy tokens, the last "
          f"{args.no_repeat} banned; decode window: tokens 2..{len(first['tokens'])} ({belady['decode_steps']} steps)"
          + (f" (asked for {args.tokens}: the model ended the text)" if len(first["tokens"]) < args.tokens else ""))
    print(f"Output: {first['text']!r}")
    print(f"Compute bound, every expert resident, read from the checkpoint's own disk (median of "
          f"{len(compute['runs'])} runs): decode {compute_s * 1e3:.0f} ms/token "
          f"({' / '.join(format(r['decode_seconds'] / r['decode_steps'] * 1e3, '.0f') for r in compute['runs'])}), "
          f"time to first token {ttft_res:.2f} s")
    print(f"Prefill from an empty cache: the prompt routes to {belady['prompt_pairs']} distinct (layer, expert) "
          f"pairs, every layer call before the first token (prompt + the step mlx-lm builds before yielding it) "
          f"to {belady['first_token_pairs']} ({belady['first_token_pairs'] * info['expert_bytes'] / MiB:.0f} MiB)")
    emulated = f"slowdisk --latency {args.latency} --cold (FIFO, page cache bypassed)"
    own = (f"disk = this machine's, page cache dropped before each load, its rate dd bs=4M iflag=direct"
           + (f" of {Path(dd['file']).name} ({dd['bytes'] / 1e6:.0f} MB): {dd['gbps']:.2f} GB/s" if dd else ""))
    kinds = {r["rate_text"] == DISK for r in runs}
    disk = "; ".join(([emulated] if False in kinds else []) + ([own] if True in kinds else []))
    print(f"\nDisks ({disk}); reads = Belady's decode bytes per token / rate / compute per token:")
    slots = sorted({(r["share"], r["slots"]) for r in runs})
    for rate_text, rate in sorted({(r["rate_text"], r["rate"]) for r in runs}, key=lambda x: -x[1]):
        parts = []
        for share, n in slots:
            b = belady["caches"][str(n)]["decode_loads"] / max(belady["decode_steps"], 1)
            ratio = b * info["expert_bytes"] / rate / compute_s
            parts.append(f"{share * 100:.0f} % ({n} slots): Belady {b:.1f} reads = "
                         f"{b * info['expert_bytes'] / MiB:.1f} MiB/token, reads = {ratio:.1f}x compute"
                         f" ({'disk-bound' if ratio >= 2 else 'compute-bound' if ratio < 1 else 'mixed'})")
        what = (f"dd {rate / 1e9:.2f} GB/s = {rate / MiB:.0f} MiB/s" if rate_text == DISK
                else f"{rate / MiB:g} MiB/s, {args.latency} per request")
        print(f"  {rate_text} = {what}: " + "; ".join(parts))
    for share, n in slots:  # what no prefetch can change: the reads of online eviction on this routing
        c = belady["caches"][str(n)]
        online = c.get("online_decode_loads")
        if online and c["decode_loads"]:
            best = min(online, key=online.get)
            print(f"  {share * 100:.0f} % ({n} slots), decode reads of online eviction (no prefetch) against "
                  f"Belady's {c['decode_loads']}: " + ", ".join(f"{k} {v / c['decode_loads']:.2f}x"
                                                                for k, v in online.items())
                  + f"; the fewest, {best}'s, put ms/bound at >= {online[best] / c['decode_loads']:.2f} where the "
                  "disk is the bottleneck")

    table_rows = []
    for row in rows:
        head = [rate_label(row["rate_text"], row["rate"], args.latency), f"{row['share'] * 100:.0f}% ({row['slots']})",
                row["config"]]
        if "error" in row:
            table_rows.append(head + ["-"] * 18 + ["FAILED: " + row["error"]])
            continue
        table_rows.append(head + [
            f"{row['ratio']:.1f}x", f"{row['ms']:.0f}", f"{row['bound_ms']:.0f}", f"{row['ratio_ms']:.2f}",
            br.fmt(row["vs_off"], ".3f") if row["config"] != "off" else "-",
            f"{row['reads']:.1f}", br.fmt(row["reads_over_belady"], ".2f"), f"{row['demand']:.1f}",
            f"{row['useful']:.1f}", br.fmt(row["cancelled"], ".1f"), f"{row['disk_mib']:.1f}", br.fmt(row["disk_busy"] and row["disk_busy"] * 100, ".0f"),
            f"{row['ttft']:.1f}", f"{row['ttft_bound']:.1f}", f"{row['ttft_ratio']:.2f}",
            f"{row['prefill_reads']}/{row['first_token_pairs']}", f"{row['load_seconds']:.1f}",
            br.fmt(row["stolen"] and row["stolen"] * 100, ".0f"), yes[row["identical"]]])
    br.table(f"Decode and prefill with the disk as the bottleneck ({disk}; per token: over the decode window)",
             ["disk (rate latency)", "cache (slots)", "config", "reads/compute", "ms/token", "bound ms", "ms/bound", "/ off",
              "reads/token", "/ Belady", "demand/token", "useful pf/token", "cancelled pf/token", "disk MiB/token",
              "disk busy %",
              "TTFT s", "TTFT bound s", "TTFT/bound", "prefill reads/pairs", "load s", "stolen %", "tokens == resident"],
             table_rows)
    print(f"bound ms = max(compute {compute_s * 1e3:.0f} ms, Belady's reads x {info['expert_bytes'] / MiB:.2f} MiB / "
          f"rate, dd's for `disk`); reads/token = demand + prefetched loads; useful pf = prefetched loads later used; "
          f"cancelled pf = background reads stopped part way (their layer call came without them; - where the "
          f"runtime does not count them); disk MiB = what crossed the mount (with O_DIRECT's alignment), for `disk` "
          f"the cache's bytes_read (expert reads done); disk busy = the disk's busy time / decode time, for `disk` "
          f"the cache's disk_busy_seconds (any expert read under way; - where the runtime does not report it); "
          f"stolen % = the machine's CPU time its hypervisor gave other guests during the run's process;\n"
          f"TTFT bound = resident TTFT {ttft_res:.2f} s + one step's compute (mlx-lm builds the second token's "
          f"step before yielding the first; mlxmoe's streaming layers compute it then) + Belady's reads before the "
          f"first token (the {belady['first_token_pairs']} distinct (layer, expert) pairs of those layer calls, "
          f"more if the cache cannot hold them: "
          + ", ".join(f"{n} slots {b['first_token_loads']}" for n, b in belady["caches"].items())
          + f") x expert bytes / rate; prefill reads/pairs = the cache's loads before the first token / those pairs"
          + (f"; baseline = {baseline}" if baseline else ""))
    for own_disk in (False, True):
        these = [r for r in rows if "error" not in r and (r["rate_text"] == DISK) == own_disk]
        if not these:
            continue
        methods = sorted({f"{r['method']}" + (f" (fallback: {r['fallback']})" if r["fallback"] else "")
                          for r in these})
        if own_disk:
            warm = sum(r["page_cache_dropped"] is False for r in these)
            print(f"expert reads from the disk itself: {', '.join(methods)}"
                  + (f"; page cache NOT dropped before {warm} of {len(these)} loads (not root?): numbers may be warm"
                     if warm else "; page cache dropped before every load (load s includes reading the libraries "
                     "mlxmoe.load imports)"))
            continue
        requests, nbytes, loads = (sum(r[k] for r in these) for k in ("requests", "request_bytes", "loads"))
        print(f"expert reads on the mount: {', '.join(methods)}; the disk served them in {requests} requests of "
              f"{nbytes / max(requests, 1) / 1024:.0f} KiB on average, {requests / max(loads, 1):.1f} per expert read "
              f"(the kernel splits a FUSE read at its max request size)")
    for r in rows:
        if r["config"] == "device-copy" and "error" not in r:
            print(f"device-copy at {r['rate_text']} {100 * r['share']:.0f} %: "
                  + (f"{r['device_copies']} copies by the CUDA runtime into slot memory" if r["device_copies"] is not None
                     else "no device copy (not CUDA, or its library did not load): the same as default"))
    warned = sorted({w for r in rows if "error" not in r for w in r["warnings"]})
    for w in warned:
        print(f"warning in a child: {w}")

    # targets (docs/design.md, "Performance targets")
    ok = [r for r in rows if "error" not in r]
    bound_rows = [r for r in ok if r["config"] == "default" and r["ratio"] >= 2]
    targets = []

    def target(name, rows_, test, show):
        if not rows_:
            print(f"{name}: no run to judge")
            targets.append({"target": name, "pass": None})
            return
        passed = all(test(r) for r in rows_)
        detail = ", ".join(f"{r['rate_text']} {r['share'] * 100:.0f}%: {show(r)}" for r in rows_)
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
        targets.append({"target": name, "pass": passed,
                        "rows": [{"rate": r["rate_text"], "share": r["share"], "value": show(r)} for r in rows_]})

    print("\nTargets (docs/design.md), default configuration:")
    target("ms/token <= 1.25x bound where reads >= 2x compute", bound_rows,
           lambda r: r["ratio_ms"] <= 1.25, lambda r: f"{r['ratio_ms']:.2f}")
    target("all reads <= 1.5x Belady's where reads >= 2x compute", bound_rows,
           lambda r: r["reads_over_belady"] is not None and r["reads_over_belady"] <= 1.5,
           lambda r: br.fmt(r["reads_over_belady"], ".2f"))
    target("default never more than 2 % slower than off (ms/token default / off)",
           [r for r in ok if r["config"] == "default" and r["vs_off"] is not None],
           lambda r: r["vs_off"] <= 1.02, lambda r: f"{r['vs_off']:.3f}")
    target("TTFT <= 1.3x its bound at 25 %", [r for r in ok if r["config"] == "default" and r["share"] == 0.25],
           lambda r: r["ttft_ratio"] <= 1.3, lambda r: f"{r['ttft_ratio']:.2f}")
    # with prefetch off every load before the first token is one the layer calls asked for: a
    # load past the pairs would be a re-read (the default's extra loads are wrong lookahead guesses)
    target("a prefill reads each (layer, expert) at most once (prefetch off: loads before the first token "
           "<= their distinct pairs)",
           [r for r in ok if r["config"] == "off"],
           lambda r: r["prefill_reads"] <= r["first_token_pairs"], lambda r: f"{r['prefill_reads']}/{r['first_token_pairs']}")
    target("tokens identical to the resident run", ok, lambda r: r["identical"], lambda r: yes[r["identical"]])
    return {"compute_ms_per_token": compute_s * 1e3, "resident_ttft_s": ttft_res, "rows": rows, "targets": targets}


# ---------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Progress goes to stderr ([bench] ...), the tables to stdout.")
    parser.add_argument("--model", default=None,
                        help="Checkpoint folder, or 'demo' for the bundled demo model (4 layers x 32 experts). The "
                             "default, bench_runtime.py's Qwen3-30B-A3B-shaped 8-layer checkpoint "
                             f"({DEFAULT_MODEL}), is built (bench_runtime.py --one build --layers 8; or waited "
                             "for, while another process builds it) when incomplete; so is a synthetic one at a "
                             "PATH that does not exist yet (to put it on the disk to measure). An existing folder "
                             "is used as it is.")
    parser.add_argument("--checkpoint", default=None, help="The same as --model.")
    parser.add_argument("--rates", default=None,
                        help=f"Disk rates, comma-separated, slowdisk's binary units (20MB/s = 20 MiB/s), and/or "
                             f"'{DISK}': this machine's own disk, no FUSE (the checkpoint folder itself, page cache "
                             f"dropped before each load, its rate measured once with dd iflag=direct on the "
                             f"largest shard; e.g. '--rates {DISK}' on a GPU machine, '--rates {DISK},20MB/s'). "
                             f"Default {DEFAULT_RATES} (also for --model demo): a fast one where compute dominates "
                             f"and slower ones where the disk does (Belady's reads 1-5x a token's compute, the "
                             f"range of the design's target).")
    parser.add_argument("--only-rates", default=None,
                        help="Run only these rates; the compute bound, the routing trace and the other rates' "
                             "rows come from --output when it holds a run of the same model, prompt, tokens "
                             "and latency (else they are measured anew), and the tables cover them all.")
    parser.add_argument("--latency", default="0.1ms", help="The simulated disk's latency per request (slowdisk's --latency). Default 0.1ms.")
    parser.add_argument("--cache", default="0.25,0.5",
                        help="Cache sizes as shares of all layers x experts, comma-separated. Default 0.25,0.5.")
    parser.add_argument("--configs", default=None,
                        help="Of off (prefetch=0), default (mlxmoe.load with no options), baseline (the default "
                             "of --baseline REF or --baseline-path DIR), lossy (the default with --lossy's options), "
                             "oracle (a what-if: see --oracle-depth), no-ahead (a what-if: the default with its "
                             "running ahead during reads, speculate.py, off), device-copy (a what-if: the default "
                             "with reads put into the slots by CUDA's copy, backend.DeviceCopy; the same as default "
                             "but on CUDA). "
                             "Default: off,default (and baseline with either).")
    parser.add_argument("--oracle-depth", type=int, default=3,
                        help="The 'oracle' configuration (a what-if: the default's lookahead given the run's own "
                             "routing, every guess right) predicts this many layer calls ahead. Default 3.")
    parser.add_argument("--lossy", default=None,
                        help="mlxmoe.load's lossy options for the 'lossy' configuration, e.g. cache_bias=0.75 or "
                             "trim=0.3,fallback=/tmp/fb2.safetensors (bench_lossy.py measures their quality).")
    parser.add_argument("--baseline", default=None, metavar="REF",
                        help="A commit whose mlxmoe runs the 'baseline' configuration: checked out once with "
                             "git worktree add --detach /tmp/mlxmoe-baseline-<sha> REF, imported through PYTHONPATH "
                             "(the child checks mlxmoe.__file__ is there). Remove it with git worktree remove.")
    parser.add_argument("--baseline-path", default=None, metavar="DIR",
                        help="Like --baseline, for machines without the git history: DIR already holds the old "
                             "code's mlxmoe/ package (made with: mkdir -p DIR && git archive REF mlxmoe | tar -x -C "
                             "DIR); the baseline child runs with PYTHONPATH=DIR and checks mlxmoe.__file__ is "
                             "under DIR.")
    parser.add_argument("--routing", default=None,
                        help="[FORMAT:]FILE: every run routes as this recording of a real model did (its first MoE "
                             "layers; bench/routed.py), the lookahead still guesses with the model's own routers; "
                             "the default checkpoint takes its top-k.")
    parser.add_argument("--prompt", default=None,
                        help=f"Prompt (short: the prefill reads every expert it routes to). Default {DEFAULT_PROMPT!r} "
                             f"(8 tokens on the synthetic checkpoint), {DEMO_PROMPT!r} for --model demo (5 tokens).")
    parser.add_argument("--tokens", type=int, default=24, help="Greedy tokens per generation. Default 24.")
    parser.add_argument("--no-repeat", type=int, default=32,
                        help="Ban the last N tokens (still greedy), so decoding keeps routing anew "
                             "(bench_runtime.no_repeat); 0: plain greedy. Default 32.")
    parser.add_argument("--runs", type=int, default=2,
                        help="Measured generations of the compute bound: the median (default 2; 1 for a smoke run).")
    parser.add_argument("--warmup", type=int, default=1, help="Warm-up generations (4 tokens) before those. Default 1.")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke run: 8 tokens, 20MB/s, 25 %% cache, off and default (the same checkpoint).")
    parser.add_argument("--timeout", type=int, default=1800, help="Seconds per child process (default 1800); one that runs longer is killed and its row "
                             "says so.")
    parser.add_argument("--wait", type=int, default=1800,
                        help="Seconds to wait for the default checkpoint while another process builds it. Default 1800.")
    parser.add_argument("--slowdisk", type=Path, default=os.environ.get("MLXMOE_SLOWDISK"),
                        help="slowdisk.py, the FUSE disk emulator an emulated rate mounts (default $MLXMOE_SLOWDISK).")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON results (and the routing trace beside it, .trace.jsonl). Default: "
                             "bench/out/disk[-demo][-quick].json (bench/out/ is git-ignored).")
    for hidden in ("--one", "--result", "--mount", "--trace", "--caches", "--baseline-tree"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--layers", "--experts", "--cache-experts"):
        parser.add_argument(hidden, type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.load_kwargs = "{}"  # bench_runtime.run_resident's

    if args.one:  # child: one configuration
        result = run_one(args)
        # --result: a temp file run_child (bench_runtime.py) made for this child alone, not a user's path
        Path(args.result).write_text(json.dumps(result))
        return

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally that unmounts
    if args.model and args.checkpoint and args.model != args.checkpoint:
        raise SystemExit("--model and --checkpoint name the same thing: give one")
    top_k = 8
    if args.routing:  # (the recording's top-k: a default checkpoint of its own)
        top_k = routed.read_or_exit(args.routing)[0]["top_k"]
        if not (args.model or args.checkpoint) and top_k != 8:
            args.model = str(DEFAULT_MODEL.with_name(f"{DEFAULT_MODEL.name}-top{top_k}"))
    args.model = args.model or args.checkpoint or str(DEFAULT_MODEL)
    demo = args.model == "demo"
    if args.quick:
        args.tokens = 8
        args.rates, args.cache, args.configs = args.rates or "20MB/s", "0.25", args.configs or "off,default"
    args.rates = args.rates or DEFAULT_RATES
    args.prompt = args.prompt or (DEMO_PROMPT if demo else DEFAULT_PROMPT)
    if args.baseline and args.baseline_path:
        raise SystemExit("--baseline REF or --baseline-path DIR, not both")
    has_baseline = bool(args.baseline or args.baseline_path)
    args.configs = args.configs or ("off,default,baseline" if has_baseline else "off,default")
    configs = args.configs.split(",")
    if any(c not in CONFIGS for c in configs):
        raise SystemExit(f"--configs: choose among {', '.join(CONFIGS)}")
    if ("lossy" in configs) != bool(args.lossy):
        raise SystemExit("--configs lossy goes with --lossy OPTIONS")
    lossy_kwargs(args.lossy)
    if "baseline" in configs and not has_baseline:
        raise SystemExit("--configs baseline needs --baseline REF or --baseline-path DIR")
    if args.runs < 1:
        raise SystemExit("--runs: at least 1 (the compute bound is their median)")
    if args.output is None:
        args.output = HERE / "out" / ("disk" + ("-demo" if demo else "") + ("-quick" if args.quick else "") + ".json")
    check_outputs({"--output": args.output, "the routing trace": args.output.with_suffix(".trace.jsonl")},
                  {"--model": ROOT / "mlxmoe" / "demo" if demo else args.model, "--slowdisk": args.slowdisk,
                   "--baseline-path": args.baseline_path, "--lossy fallback": lossy_kwargs(args.lossy).get("fallback"),
                   "--routing": args.routing and routed.recording(args.routing)[1]})
    rates = parse_rates(args, args.only_rates or args.rates)  # slowdisk and FUSE only for an emulated rate
    shares = [float(s) for s in args.cache.split(",")]
    if not demo and (Path(args.model).resolve() == DEFAULT_MODEL.resolve() or not Path(args.model).exists()):
        wait_for_checkpoint(Path(args.model).resolve(), args.wait, top_k)
    args.checkpoint = "demo" if demo else str(Path(args.model).resolve())
    sha = tree = baseline = None
    if "baseline" in configs:
        sha, tree, baseline = baseline_code(args.baseline, args.baseline_path)

    t_start = time.perf_counter()
    prev = previous_results(args)
    info = prev["checkpoint"] if prev else spawn("info", args)
    if "error" in info:
        raise SystemExit(f"reading {args.model} failed: {info['error']}")
    args.checkpoint = info["path"]
    args.layers, args.experts = info["layers"], info["experts"]
    total = args.layers * args.experts
    caches = [(s, max(info["top_k"], round(s * total))) for s in shares]
    print(f"[bench] {info['path']}: {args.layers} MoE layers x {args.experts} experts, top {info['top_k']}, "
          f"{info['expert_bytes'] / MiB:.3f} MiB per expert; caches {', '.join(str(n) for _, n in caches)} slots",
          file=sys.stderr, flush=True)
    trace_file = args.output.with_suffix(".trace.jsonl")
    if prev:
        compute, routing = prev["compute"], prev["routing"]
    else:
        compute = spawn("resident", args, label="compute bound (every expert resident, not on the slow disk)")
        routing = spawn("routing", args, label="routing trace (every expert resident)")
        if "trace" in routing:
            write_atomic(trace_file, Path(routing["trace"]).read_bytes())
            os.unlink(routing["trace"])
            routing["trace"] = str(trace_file)
    runs = [r for r in (prev or {}).get("runs", []) if r["rate_text"] not in {t for t, _ in rates}]
    belady = {"error": "no routing trace"}
    if "oracle" in configs and "trace" not in routing:
        raise SystemExit("--configs oracle: no routing trace was recorded")
    args.trace = routing.get("trace")  # the oracle configuration's routing
    if "trace" in routing:
        slots = sorted({n for _, n in caches} | {r["slots"] for r in runs})  # those of --only-rates' kept rows too
        belady = spawn("belady", args, label="Belady's MIN on the routing", trace=routing["trace"],
                       caches=",".join(map(str, slots)))
    src = info["path"]
    dd = None
    for rate_text, rate in rates:
        if rate_text == DISK:  # the disk itself: no mount; dd's rate, once
            dd = dd or measure_disk(src)
            runs += run_rate(args, DISK, dd["rate"], caches, configs, tree)
            continue
        print(f"[bench] mounting {src} through slowdisk --rate {rate_text} --latency {args.latency} --cold",
              file=sys.stderr, flush=True)
        mp, proc, log = mount(src, rate_text, args)
        try:
            runs += run_rate(args, rate_text, rate, caches, configs, tree, mp)
        finally:
            unmount(mp, proc, log)
            print(f"[bench] unmounted {mp}", file=sys.stderr, flush=True)
    if dd is None and any(r["rate_text"] == DISK for r in runs) and prev:  # --only-rates kept `disk` rows
        dd = prev.get("disk", {}).get("dd")
    order = {c: i for i, c in enumerate(CONFIGS)}
    runs.sort(key=lambda r: (-r["rate"], r["share"], order[r["config"]]))

    try:
        summary = report(args, info, compute, belady, runs, baseline, dd)
    except Exception as e:  # the measurements are written all the same
        import traceback

        traceback.print_exc()
        summary = {"error": f"report failed: {e!r}"}
    wall = time.perf_counter() - t_start
    print(f"\nwall time {wall:.0f}s")
    out = {"argv": sys.argv, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                       "python": sys.version.split()[0]},
           "disk": {"slowdisk": str(args.slowdisk), "latency": args.latency, "cold": True,
                    "rates": {t: (dd["rate"] if t == DISK else r) for t, r in rates}, "dd": dd},
           "baseline": {"ref": args.baseline, "sha": sha, "path": args.baseline_path, "tree": str(tree)}
           if tree else None,
           "checkpoint": info, "compute": compute, "routing": routing, "belady": belady, "runs": runs,
           "summary": summary, "wall_seconds": wall}
    write_json(args.output, out)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
