"""IO benchmark: the store's IO modes side by side against `dd iflag=direct`, in one run.

On a synthetic checkpoint with Qwen3-30B-A3B's expert shapes (4-bit, 2.95 MB per expert
in 9 ranges: weight, scales and biases of gate, up and down), with the page cache
dropped before each measurement:

1. `dd if=<shard> of=/dev/null bs=4M iflag=direct` over a few shards (at the start and
   again at the end): the disk's own direct-read throughput;
2. each IO mode (mmap, pread, direct with O_DIRECT, direct with posix_fadvise) reading
   the same random sample of (layer, expert) pairs through `ExpertStore.read_expert`
   into MLX slot pools, with 1 and 4 threads (and the store's own workers, "wk", reading
   one expert's ranges at once: 4, and 1 for direct to show what they add): GB/s, ratio
   to dd, read amplification (the store's count, and the kernel's: /proc/self/io
   read_bytes), page cache growth (/proc/meminfo Cached, and the shards' own pages by
   fincore; another process dropping the page cache mid-run makes these read low);
3. one contiguous read per expert against the separate ranges of the stacked layout:
   the same sample read from the checkpoint and from its `mlxmoe convert --bundle` copy
   (built next to it once, `<checkpoint>-bundled`), pread and direct, into the MLX pools
   and (O_DIRECT with no bounce copy) into page-aligned slots, with the ratio
   bundled / stacked;
4. (unless --no-generate) the whole generate path once per mode, each in its own
   process: mlxmoe.load(cache_experts=25 % of all, io=MODE) + 16 tokens: decode tok/s,
   bytes read, page cache growth; and once on the bundled copy (io=direct);
5. reads vs dd at the same request size (--sizes: 16 KiB, 64 KiB, 256 KiB: the store's
   CHUNK, 1 MiB, one expert's size, 4 MiB), each size on one shard, in rounds (page cache
   dropped before each) in which every reader reads its share in turn, the order rotated
   round by round: `dd bs=SIZE count=N skip=K iflag=direct` (sequential, one request in
   flight) against the store's own O_DIRECT read path (`ExpertStore._read_run` of one
   range) at random SIZE-aligned offsets, into page-aligned buffers (straight into them)
   and into buffers 24 bytes past a page (as MLX's pools: through the bounce buffer and a
   copy), with 1 and 4 threads; as floors, Python's bare `os.preadv` loop, sequential like
   dd and at random offsets; each ratio to dd is taken within its round; per size the CPU
   time per read and what the bounce copy alone costs; for the expert-size row also whole
   experts (`read_expert` into `SlotPools`, as the runtime reads them: 9 ranges).

    python bench/bench_io.py                  # 8 layers, 300 experts, 2 repeats
    python bench/bench_io.py --quick          # 2 layers, 100 experts, 1 repeat
    python bench/bench_io.py --only-sizes     # only 5 (bench/out/io-sizes.json)
"""

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # mlxmoe, and synthetic.py (the checkpoints' builder tests and bench share)
sys.path.insert(0, str(HERE))

from system import check_outputs, disk_read_bytes, drop_page_cache, meminfo_cached, write_json  # noqa: E402

# (io, bypass, workers): workers are the store's threads reading one expert's ranges at once
MODES = [("mmap", None, 4), ("pread", None, 4), ("direct", "o_direct", 4), ("direct", "o_direct", 1),
         ("direct", "fadvise", 4)]
PROMPT = "Once upon a time there was a little fox who lived in the forest. Every morning the fox walked to the river"


# ---------------------------------------------------------------- system counters


def resident_bytes(files):
    """Bytes of `files` in the page cache (util-linux fincore), or None."""
    try:
        out = subprocess.run(["fincore", "-b", "-n", "-r", "-o", "RES", *map(str, files)],
                             capture_output=True, text=True, timeout=60).stdout
        return sum(int(x) for x in out.split())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def delta(a, b):
    return None if a is None or b is None else b - a


def dd_direct(files):
    """dd iflag=direct over `files` (page cache dropped first): (bytes, seconds, GB/s)."""
    drop_page_cache()
    total = seconds = 0
    for f in files:
        r = subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=4M", "iflag=direct"],
                           capture_output=True, text=True)
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", r.stderr)
        if r.returncode or not m:
            raise SystemExit(f"dd failed on {f}: {r.stderr.strip()}")
        total += int(m.group(1))
        seconds += float(m.group(2))
    return {"bytes": total, "seconds": seconds, "gbps": total / seconds / 1e9}


# ---------------------------------------------------------------- checkpoint and store


def ensure_checkpoint(path, layers):
    import synthetic

    path = Path(path)
    if (path / "config.json").exists() and (path / "model.safetensors.index.json").exists():
        config = json.loads((path / "config.json").read_text())
        if config.get("num_hidden_layers") == layers and config.get("moe_intermediate_size") == 768:
            return path
    print(f"[bench] building {path} ({layers} layers, Qwen3-30B-A3B expert shapes, 4-bit)", flush=True)
    return synthetic.build_large_checkpoint(path, num_layers=layers)


def slot_pools(store, n):
    """`n` slots per expert tensor in MLX pool memory (as the cache holds them), file dtypes."""
    import mlx.core as mx
    import numpy as np

    from mlxmoe.api import MX_DTYPES

    pools = []
    for shape, d in zip(store.tensor_shapes, store.tensor_dtypes):
        dtype = mx.uint16 if d == "BF16" else MX_DTYPES[d]
        pool = mx.zeros((n, *shape), dtype=dtype)
        mx.eval(pool)
        pools.append((pool, np.array(pool, copy=False)))
    return pools


def aligned_pools(store, n):
    """Like slot_pools, in page-aligned memory (MLX's CPU pools start 24 bytes past a page
    here): where O_DIRECT can read a bundled expert straight into its slot."""
    import mmap

    import numpy as np

    from mlxmoe.storage.shards import DTYPES

    pools = []
    for shape, d in zip(store.tensor_shapes, store.tensor_dtypes):
        size = n * int(np.prod(shape)) * np.dtype(DTYPES[d]).itemsize
        pools.append((None, np.frombuffer(mmap.mmap(-1, size), DTYPES[d]).reshape(n, *shape)))
    return pools


def ensure_bundled(path):
    """The `mlxmoe convert --bundle` copy of checkpoint `path`, built once."""
    from mlxmoe.storage.convert import bundle

    out = Path(str(path) + "-bundled")
    if not (out / "model.safetensors.index.json").exists():
        print(f"[bench] mlxmoe convert --bundle {path} {out}", flush=True)
        tic = time.perf_counter()
        bundle(path, out, progress=lambda line: print(f"[bench]   {line}", flush=True))
        print(f"[bench] converted in {time.perf_counter() - tic:.1f}s", flush=True)
    return out


def measure(store, sample, threads, pools, files, io, bypass=None, workers=4):
    """Cold reads of `sample` through store.read_expert with `threads` threads."""
    store.close()  # reopened on the first read, with these settings
    store.workers = workers
    store.set_io(io, bypass)
    store.reset_io_stats()
    nslots = len(pools[0][1])
    drop_page_cache()
    time.sleep(0.5)
    cached0, rb0, res0 = meminfo_cached(), disk_read_bytes(), resident_bytes(files)

    def read(i):
        l, e = sample[i]
        return store.read_expert(l, e, [v[i % nslots] for _, v in pools])

    tic = time.perf_counter()
    if threads == 1:
        useful = sum(map(read, range(len(sample))))
    else:
        with ThreadPoolExecutor(threads) as ex:
            useful = sum(ex.map(read, range(len(sample))))
    seconds = time.perf_counter() - tic
    cached1, rb1, res1 = meminfo_cached(), disk_read_bytes(), resident_bytes(files)
    s = store.io_stats()
    kernel = delta(rb0, rb1)
    return {"io": io, "method": s["method"], "threads": threads, "workers": workers, "experts": len(sample),
            "useful_bytes": useful, "reads_per_expert": s["reads"] / len(sample),
            "seconds": seconds, "gbps": useful / seconds / 1e9, "disk_bytes": s["disk_bytes"],
            "amplification": s["amplification"], "kernel_read_bytes": kernel,
            "kernel_amplification": kernel / useful if kernel is not None else None,
            "cached_growth": delta(cached0, cached1), "shard_pages_growth": delta(res0, res1),
            "fallback": s["fallback"]}


# ---------------------------------------------------------------- generate path (child process)


def run_generate(args):
    import mlxmoe

    files = sorted(Path(args.checkpoint).glob("*.safetensors"))
    drop_page_cache()
    cached0, res0 = meminfo_cached(), resident_bytes(files)
    config = json.loads((Path(args.checkpoint) / "config.json").read_text())
    total = config["num_hidden_layers"] * config["num_experts"]
    model, tokenizer = mlxmoe.load(args.checkpoint, cache_experts=total // 4, io=args.generate_one)
    cache = model.expert_cache
    store = cache.store
    cached1, res1 = meminfo_cached(), resident_bytes(files)
    store.reset_io_stats()
    response = None
    tokens = []
    for response in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=args.tokens):
        tokens.append(int(response.token))
    cached2, res2 = meminfo_cached(), resident_bytes(files)
    stats = cache.stats()
    io = store.io_stats()
    cache.close()
    return {"io": args.generate_one, "checkpoint": args.checkpoint, "method": io["method"], "tokens": tokens, "prompt_tps": response.prompt_tps,
            "decode_tps": response.generation_tps, "hit_rate": stats["hit_rate"], "bytes_read": stats["bytes_read"],
            "useful_bytes": io["useful_bytes"], "disk_bytes": io["disk_bytes"], "amplification": io["amplification"],
            "read_seconds": stats["read_seconds"], "cache_experts": stats["cache_experts"],
            "peak_rss": stats["peak_rss"], "cached_growth_load": delta(cached0, cached1),
            "cached_growth_generate": delta(cached1, cached2), "shard_pages_load": delta(res0, res1),
            "shard_pages_generate": delta(res1, res2)}


def generate_all(args, bundled):
    out = []
    for io, checkpoint, layout in [("mmap", args.checkpoint, "stacked"), ("pread", args.checkpoint, "stacked"),
                                   ("direct", args.checkpoint, "stacked"), ("direct", bundled, "bundled")]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as t:  # the child's --result: ours alone
            result = t.name
        cmd = [sys.executable, __file__, "--generate-one", io, "--checkpoint", str(checkpoint),
               "--tokens", str(args.tokens), "--result", result]
        print(f"[bench] generate with io={io} ({layout})", flush=True)
        r = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if r.returncode:
            raise SystemExit(f"generate with io={io} ({layout}) failed")
        out.append({**json.loads(Path(result).read_text()), "layout": layout})
        os.unlink(result)
    ref = out[0]["tokens"]
    for o in out:
        o["same_tokens"] = o["tokens"] == ref
    return out


# ---------------------------------------------------------------- request sizes

SIZES = "16K,64K,256K,1M,expert,4M"
SIZE_READS = (64, 2048)  # reads per measurement: --size-bytes // size, within these


def parse_size(text, expert_bytes):
    """"16K", "1M", "4096" or "expert" (one expert's bytes on disk, rounded up to a page) in bytes."""
    from mlxmoe.storage.store import align_up

    text = text.strip().upper()
    if text == "EXPERT":
        return align_up(expert_bytes)
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text.rstrip("KM")) * scale


def size_name(n):
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n < 1 << 20 and n % (1 << 10) == 0 else f"{n / (1 << 20):.2f}M"


def dd_at(shard, size, count, skip):
    """`dd bs=size count=count skip=skip iflag=direct`: bytes, seconds and GB/s from its own
    summary line."""
    r = subprocess.run(["dd", f"if={shard}", "of=/dev/null", f"bs={size}", f"count={count}", f"skip={skip}",
                        "iflag=direct"], capture_output=True, text=True)
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s, ([\d.]+ \S+)", r.stderr)
    if r.returncode or not m:
        raise SystemExit(f"dd failed on {shard}: {r.stderr.strip()}")
    nbytes, seconds = int(m.group(1)), float(m.group(2))
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9, "dd_says": m.group(3)}


def page_buffer(size, skew=0):
    """A numpy uint8 buffer of `size` bytes starting `skew` bytes past a page (an anonymous
    mmap is page aligned): skew 0 is read straight into by O_DIRECT, 24 (where MLX's CPU
    pools start) goes through the store's bounce buffer."""
    import mmap

    import numpy as np

    return np.frombuffer(mmap.mmap(-1, size + (skew and 4096)), np.uint8)[skew:skew + size]


def timed(fn, items, pool=None):
    """fn over items, one task per item on `pool` (a ThreadPoolExecutor kept for the whole
    size, as the runtime keeps its IO threads; None: a plain loop): {"seconds", "cpu"} (CPU:
    the whole process's, user + system)."""
    cpu, tic = time.process_time(), time.perf_counter()
    if pool is None:
        for x in items:
            fn(x)
    else:
        list(pool.map(fn, items))
    return {"seconds": time.perf_counter() - tic, "cpu": time.process_time() - cpu}


def on_each_thread(pool, threads, fn):
    """Run fn once on each of the `threads` threads of `pool` (the calling thread if None)."""
    import threading

    if pool is None:
        return fn()
    barrier = threading.Barrier(threads)
    list(pool.map(lambda _: (fn(), barrier.wait()), range(threads)))


def size_variants(store, shard, size, slots, per_round, rng, pools):
    """{name: fn() -> {"bytes", "seconds", "cpu"}}: one round's reads of `per_round` x `size`
    bytes of `shard` by each reader; each call takes fresh offsets. `pools`: {threads:
    executor or None}. Each thread's destination and bounce buffer are made and touched
    before the rounds (as in a runtime that has run a while), not in the timed reads."""
    import threading

    def sequential():  # a fresh run of per_round blocks
        skip = rng.randrange(slots - per_round + 1)
        return skip, [(skip + i) * size for i in range(per_round)]

    def scattered():
        return [k * size for k in rng.sample(range(slots), per_round)]

    def dd():
        d = dd_at(shard, size, per_round, sequential()[0])
        return {"bytes": d["bytes"], "seconds": d["seconds"], "cpu": None, "dd_says": d["dd_says"]}

    def preadv(seq):
        def run():
            buf = page_buffer(size)
            fd = os.open(shard, os.O_RDONLY | os.O_DIRECT)
            try:
                offsets = sequential()[1] if seq else scattered()
                return {"bytes": size * per_round, **timed(lambda off: os.preadv(fd, [buf], off), offsets)}
            finally:
                os.close(fd)
        return run

    def store_read(skew, t):
        local = threading.local()  # each thread its own destination, as each slot is its own

        def warm():
            local.d = page_buffer(size, skew)
            local.d[:] = 0
            store.reader._bounce(size)[:] = 0  # the store's per-thread bounce buffer

        def read(off):
            if store._read_run((shard, off, off + size, [(off, local.d)])) < size:
                raise SystemExit(f"short read of {shard} at {off}")
        on_each_thread(pools[t], t, warm)
        return lambda: {"bytes": size * per_round, **timed(read, scattered(), pools[t])}

    out = {"dd": dd, "preadv_seq": preadv(True), "preadv_rand": preadv(False)}
    for dest, skew in (("aligned", 0), ("bounce", 24)):
        for t in pools:
            out[f"{dest}_x{t}"] = store_read(skew, t)
    return out


def expert_variants(store, per_round, rng, pools):
    """{name: fn}: whole experts read as the runtime reads them, read_expert into SlotPools
    (a stacked checkpoint's 9 ranges on the store's 4 workers), in the runtime's pool
    dtypes (on CPU bf16 scales widen to float32) and in the file's (as on a GPU); a few
    experts read first, untimed, so that the store's workers have their bounce buffers."""
    from mlxmoe import backend
    from mlxmoe.api import MX_DTYPES
    from mlxmoe.caching.cache import SlotPools

    be = backend.detect()
    pairs = [(l, e) for l in range(store.num_layers) for e in range(store.num_experts)]
    out, slots = {}, []
    for label, dtypes in (("runtime", [be.pool_dtype(MX_DTYPES[d]) for d in store.tensor_dtypes]),
                          ("file", [MX_DTYPES[d] for d in store.tensor_dtypes])):
        p = SlotPools(store, 16, dtypes, io_threads=1)
        slots.append(p)
        for i in range(8):
            p.read_into(rng.choice(pairs), i)
        for t in pools:
            def run(p=p, t=t):
                sample = rng.sample(pairs, per_round)
                r = timed(lambda i: p.read_into(sample[i], i % 16), range(per_round), pools[t])
                return {"bytes": per_round * store.expert_file_bytes(), **r}
            out[f"expert_{label}_x{t}"] = run
    return out, slots


def size_row(store, shard, size, count, rng, threads, rounds, experts=False):
    """One request size on `shard` (see the module docstring, 5): `rounds` rounds, each after
    dropping the page cache, of count / rounds reads by every reader in turn, the order
    rotated each round so that the disk's drift falls on all alike; per reader its GB/s over
    all rounds and the median of its per-round ratio to dd's."""
    from mlxmoe.storage.store import align_down

    slots = align_down(shard.stat().st_size, size) // size  # whole SIZE-aligned blocks in the shard
    per_round = max(1, min(count, slots) // rounds)
    pools = {t: ThreadPoolExecutor(t) if t > 1 else None for t in threads}
    variants = size_variants(store, shard, size, slots, per_round, rng, pools)
    slot_pools = []
    if experts:
        more, slot_pools = expert_variants(store, per_round, rng, pools)
        variants.update(more)
    names = list(variants)
    rows = {n: [] for n in names}
    for k in range(rounds):
        drop_page_cache()
        time.sleep(0.5)
        for n in names[k % len(names):] + names[:k % len(names)]:
            rows[n].append(variants[n]())
    for p in slot_pools:
        p.close()
    for p in pools.values():
        if p is not None:
            p.shutdown()
    row = {"size": size, "reads": per_round * rounds, "rounds": rounds, "shard": str(shard)}
    for n in names:
        nbytes, seconds = sum(r["bytes"] for r in rows[n]), sum(r["seconds"] for r in rows[n])
        cpu = None if rows[n][0]["cpu"] is None else sum(r["cpu"] for r in rows[n])
        row[n] = {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9,
                  "x_dd": statistics.median(r["bytes"] / r["seconds"] / (d["bytes"] / d["seconds"])
                                            for r, d in zip(rows[n], rows["dd"])),
                  "cpu_us_per_read": None if cpu is None else 1e6 * cpu / (per_round * rounds), "rounds": rows[n]}
    # the bounce buffer's copy alone, no IO, in warm caches (a copy after a DMA read is colder)
    src, dst = page_buffer(size), page_buffer(size, 24)
    src[:] = 1
    dst[:] = src
    reps = max(8, min(256, (64 << 20) // size))
    tic = time.perf_counter()
    for _ in range(reps):
        dst[:] = src
    row["copy_us"] = 1e6 * (time.perf_counter() - tic) / reps
    return row


def sizes_all(args, store, files, threads):
    """Section 5 over `args.repeat` runs; each size on its own shard (the largest ones in turn)."""
    shards = sorted(files, key=lambda f: -f.stat().st_size)
    shards = [f for f in shards if f.stat().st_size >= shards[0].stat().st_size // 2]
    sizes = [parse_size(x, store.expert_file_bytes()) for x in args.sizes.split(",")]
    expert = parse_size("expert", store.expert_file_bytes())
    store.close()
    store.workers = 4
    store.set_io("direct", "o_direct")
    rng = random.Random(args.seed)
    reps = []
    for rep in range(1, args.repeat + 1):
        rows = []
        for i, size in enumerate(sizes):
            count = max(SIZE_READS[0], min(SIZE_READS[1], args.size_bytes // size))
            row = size_row(store, shards[i % len(shards)], size, count, rng, threads, args.size_rounds,
                           experts=size == expert)
            rows.append(row)
            print(f"[bench] run {rep} size {size_name(size)}: dd {row['dd']['gbps']:.3f} GB/s; x dd "
                  + ", ".join(f"{k} {v['x_dd']:.2f}" for k, v in row.items() if isinstance(v, dict) and k != "dd"),
                  flush=True)
        reps.append({"repeat": rep, "rows": rows})
    if store.fallback:
        print(f"[bench] {store.fallback}", flush=True)
    return {"sizes": sizes, "expert_size": expert, "threads": threads, "rounds": args.size_rounds, "runs": reps}


# ---------------------------------------------------------------- tables


def gb(x):
    return "-" if x is None else f"{x / 1e9:.3f}"


def mb(x):
    return "-" if x is None else f"{x / 1e6:+.0f}"


def print_modes(rep, dd_gbps):
    print(f"\nrun {rep['repeat']}: dd iflag=direct {rep['dd'][0]['gbps']:.2f} GB/s before, "
          f"{rep['dd'][1]['gbps']:.2f} GB/s after (mean {dd_gbps:.2f})")
    print(f"{'mode':<10}{'method':<10}{'thr':>4}{'wk':>3}{'GB/s':>8}{'x dd':>7}{'ampl':>7}{'kernel':>8}"
          f"{'Cached MB':>11}{'shard MB':>10}")
    for m in rep["modes"]:
        ka = "-" if m["kernel_amplification"] is None else f"{m['kernel_amplification']:.3f}"
        print(f"{m['io']:<10}{m['method']:<10}{m['threads']:>4}{m['workers']:>3}{m['gbps']:>8.2f}"
              f"{m['gbps'] / dd_gbps:>7.2f}"
              f"{m['amplification']:>7.3f}{ka:>8}{mb(m['cached_growth']):>11}{mb(m['shard_pages_growth']):>10}")


def print_bundle(rep, dd_gbps):
    print(f"\nrun {rep['repeat']}: the same experts from the bundled copy (one read each) and the stacked "
          "checkpoint (9 ranges each); bundled+al: into page-aligned slots, O_DIRECT with no bounce copy; "
          "x stacked: against stacked, same mode and threads, the store's 4 workers")
    print(f"{'layout':<12}{'mode':<10}{'thr':>4}{'wk':>3}{'reads':>6}{'GB/s':>8}{'x dd':>7}{'x stacked':>10}{'ampl':>7}")
    for m in rep["bundle"]:
        base = next(b for b in rep["bundle"] if b["layout"] == "stacked" and b["workers"] == 4
                    and (b["io"], b["threads"]) == (m["io"], m["threads"]))
        print(f"{m['layout']:<12}{m['method']:<10}{m['threads']:>4}{m['workers']:>3}{m['reads_per_expert']:>6.1f}"
              f"{m['gbps']:>8.2f}{m['gbps'] / dd_gbps:>7.2f}{m['gbps'] / base['gbps']:>10.2f}"
              f"{m['amplification']:>7.3f}")


def print_bundle_medians(reps):
    """Bundled against stacked (the store's 4 workers), same mode and threads, medians over the runs."""
    print(f"\nmedians over {len(reps)} runs: GB/s and ratio to stacked (4 workers) in the same run, "
          "and to the run's dd")
    print(f"{'layout':<12}{'mode':<10}{'thr':>4}{'GB/s':>8}{'x stacked':>10}{'x dd':>7}")
    for m in reps[0]["bundle"]:
        if m["layout"] == "stacked" and m["workers"] == 1:
            continue
        rows = []
        for r in reps:
            same = {(b["layout"], b["io"], b["threads"], b["workers"]): b for b in r["bundle"]}
            mine = same[(m["layout"], m["io"], m["threads"], m["workers"])]
            base = same[("stacked", m["io"], m["threads"], 4)]
            rows.append((mine["gbps"], mine["gbps"] / base["gbps"], mine["gbps"] / r["dd_gbps"]))
        med = [statistics.median(x) for x in zip(*rows)]
        print(f"{m['layout']:<12}{m['method']:<10}{m['threads']:>4}{med[0]:>8.2f}{med[1]:>10.2f}{med[2]:>7.2f}")


def print_generate(gen):
    print("\ngenerate path: mlxmoe.load(cache_experts=25 %, io=MODE), page cache dropped first")
    print(f"{'io':<8}{'layout':<9}{'method':<10}{'decode tok/s':>13}{'hit rate':>9}{'MB read':>9}{'ampl':>7}"
          f"{'Cached MB':>11}{'shard MB':>10}{'same tokens':>12}")
    for g in gen:
        print(f"{g['io']:<8}{g['layout']:<9}{g['method']:<10}{g['decode_tps']:>13.2f}{100 * g['hit_rate']:>8.1f}%"
              f"{g['bytes_read'] / 1e6:>9.0f}{g['amplification']:>7.3f}{mb(g['cached_growth_generate']):>11}"
              f"{mb(g['shard_pages_generate']):>10}{str(g['same_tokens']):>12}")


def print_sizes(res):
    """Section 5: GB/s and x dd (each the median over the runs; a run's x dd is the median of
    its rounds' ratios to the dd of the same round)."""
    reps = res["runs"]
    cols = ["preadv_seq", "preadv_rand"] + [f"{d}_x{t}" for d in ("aligned", "bounce") for t in res["threads"]]
    print(f"\nreads vs dd at the same request size: O_DIRECT, {res['rounds']} rounds per run, page cache dropped "
          "before each, the readers in rotating order; GB/s and x dd (the median of the rounds' ratios to the "
          f"same round's dd), medians of {len(reps)} runs. dd: sequential from a random skip=, one request in "
          "flight; pv seq / pv rnd: Python's bare os.preadv loop, sequential like dd / at random offsets; "
          "al / bnc: the store's _read_run at random SIZE-aligned offsets into page-aligned buffers (straight "
          "in) / buffers 24 bytes past a page (bounce buffer + copy), xT threads; cpu: process CPU (user + "
          "system) us per read, 1 thread; copy: the bounce copy alone in warm caches, us")
    head = f"{'size':>7}{'reads':>6}{'dd':>7}"
    for c in cols:
        short = c.replace("preadv_", "pv ").replace("aligned", "al").replace("bounce", "bnc").replace("_", " ")
        head += f"{short:>9}{'x dd':>6}"
    print(head + f"{'cpu al':>8}{'cpu bnc':>8}{'copy':>7}")

    def med(rows, f):
        return statistics.median(f(r) for r in rows)

    for i, size in enumerate(res["sizes"]):
        rows = [r["rows"][i] for r in reps]
        line = f"{size_name(size):>7}{rows[0]['reads']:>6}{med(rows, lambda r: r['dd']['gbps']):>7.3f}"
        for c in cols:
            line += f"{med(rows, lambda r: r[c]['gbps']):>9.3f}{med(rows, lambda r: r[c]['x_dd']):>6.2f}"
        cpu = [med(rows, lambda r: r[c]["cpu_us_per_read"]) for c in ("aligned_x1", "bounce_x1")]
        print(line + f"{cpu[0]:>8.0f}{cpu[1]:>8.0f}{med(rows, lambda r: r['copy_us']):>7.0f}")
    for i, size in enumerate(res["sizes"]):
        rows = [r["rows"][i] for r in reps]
        names = [k for k in rows[0] if k.startswith("expert_")]
        if not names:
            continue
        print(f"\nwhole experts ({size_name(size)} each, 9 ranges) read as the runtime does (read_expert into "
              "SlotPools, the store's 4 workers), in the same rounds as that row: runtime pools (on CPU the "
              "bf16 scales widen to float32) and file-dtype pools (as on a GPU); x dd: dd at the expert's size")
        print(f"{'pools':<9}{'thr':>4}{'GB/s':>8}{'x dd':>6}{'cpu us/expert':>14}")
        for n in names:
            _, pools, t = n.split("_")
            print(f"{pools:<9}{t[1:]:>4}{med(rows, lambda r: r[n]['gbps']):>8.3f}"
                  f"{med(rows, lambda r: r[n]['x_dd']):>6.2f}{med(rows, lambda r: r[n]['cpu_us_per_read']):>14.0f}")


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="/tmp/mlxmoe-bench/qwen3-30b-shapes-8L")
    ap.add_argument("--layers", type=int, default=8, help="Layers when the checkpoint must be built.")
    ap.add_argument("--sample", type=int, default=300, help="Random (layer, expert) pairs read per measurement.")
    ap.add_argument("--threads", default="1,4")
    ap.add_argument("--repeat", type=int, default=2, help="IO measurements repeated this many times.")
    ap.add_argument("--dd-shards", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2 layers, 100 experts, 1 repeat, 8 tokens.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", default=SIZES, help="Request sizes of section 5 (K, M, or expert: one expert's bytes).")
    ap.add_argument("--size-bytes", type=int, default=256 << 20,
                    help=f"Bytes per measurement of section 5 ({SIZE_READS[0]}-{SIZE_READS[1]} reads).")
    ap.add_argument("--size-rounds", type=int, default=4, help="Rounds per size in section 5 (readers rotated).")
    ap.add_argument("--only-sizes", action="store_true", help="Only section 5 (request sizes against dd).")
    ap.add_argument("--out", help="JSON out (default bench/out/io.json, with --only-sizes io-sizes.json).")
    ap.add_argument("--generate-one", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate_one:  # --result: a temp file run_child made for this child alone, not a user's path
        Path(args.result).write_text(json.dumps(run_generate(args)))
        return
    if args.quick:
        args.checkpoint = args.checkpoint.replace("-8L", "-2L")
        args.layers, args.sample, args.repeat, args.tokens = 2, 100, 1, 8
    args.out = args.out or str(HERE / "out" / ("io-sizes.json" if args.only_sizes else "io.json"))
    check_outputs({"--out": args.out},
                  {"--checkpoint": args.checkpoint, "its bundled copy": args.checkpoint + "-bundled"})
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from mlxmoe.loader import open_checkpoint

    args.checkpoint = ensure_checkpoint(args.checkpoint, args.layers)
    store = open_checkpoint(args.checkpoint).store
    files = sorted({r.file for experts in store.ranges for row in experts for r in row})
    threads = [int(t) for t in args.threads.split(",")]
    if args.only_sizes:
        print(f"[bench] {args.checkpoint}: {store.expert_file_bytes() / 1e6:.2f} MB per expert in "
              f"{len(store.tensors)} ranges; request sizes {args.sizes}", flush=True)
        sizes = sizes_all(args, store, files, threads)
        store.close()
        out = {"platform": f"{platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} cpus",
               "checkpoint": str(args.checkpoint), "expert_bytes": store.expert_file_bytes(),
               "ranges_per_expert": len(store.tensors), "request_sizes": sizes}
        print_sizes(sizes)
        write_json(args.out, out)
        print(f"\nwrote {args.out}")
        return
    shards = sorted(files, key=lambda f: -f.stat().st_size)[:args.dd_shards]
    rng = random.Random(args.seed)
    pairs = [(l, e) for l in range(store.num_layers) for e in range(store.num_experts)]
    sample = rng.sample(pairs, min(args.sample, len(pairs)))
    bundled = ensure_bundled(args.checkpoint)
    bstore = open_checkpoint(bundled).store
    bfiles = sorted({r.file for experts in bstore.ranges for row in experts for r in row})
    pools, apools = slot_pools(store, 16), aligned_pools(store, 16)
    print(f"[bench] {args.checkpoint}: {store.num_layers} layers x {store.num_experts} experts, "
          f"{store.expert_file_bytes() / 1e6:.2f} MB per expert in {len(store.tensors)} ranges; "
          f"sample {len(sample)} experts ({len(sample) * store.expert_file_bytes() / 1e9:.2f} GB)", flush=True)

    reps = []
    for rep in range(1, args.repeat + 1):
        r = {"repeat": rep, "dd": [dd_direct(shards)], "modes": [], "bundle": []}
        for io, bypass, workers in MODES:
            for t in threads:
                r["modes"].append(measure(store, sample, t, pools, files, io, bypass, workers))
                m = r["modes"][-1]
                print(f"[bench] run {rep} {io}/{m['method']} x{t} workers {workers}: {m['gbps']:.2f} GB/s", flush=True)
        # a bundled expert is one run: the store's workers do not apply
        layouts = [("stacked", store, files, pools, 1), ("stacked", store, files, pools, 4),
                   ("bundled", bstore, bfiles, pools, 1), ("bundled+al", bstore, bfiles, apools, 1)]
        for io, bypass in (("pread", None), ("direct", "o_direct")):
            for layout, s, fs, ps, workers in layouts:
                if layout == "bundled+al" and io == "pread":
                    continue
                for t in threads:
                    m = measure(s, sample, t, ps, fs, io, bypass, workers)
                    m["layout"] = layout
                    r["bundle"].append(m)
                    print(f"[bench] run {rep} {layout} {m['method']} x{t} workers {workers}: {m['gbps']:.2f} GB/s",
                          flush=True)
        r["dd"].append(dd_direct(shards))
        r["dd_gbps"] = statistics.mean(d["gbps"] for d in r["dd"])
        reps.append(r)
    sizes = sizes_all(args, store, files, threads)
    store.close()
    bstore.close()

    gen = None if args.no_generate else generate_all(args, bundled)
    from mlxmoe.storage.store import default_io

    out = {"platform": f"{platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} cpus",
           "checkpoint": str(args.checkpoint), "expert_bytes": store.expert_file_bytes(),
           "ranges_per_expert": len(store.tensors), "sample": len(sample), "bundled": str(bundled),
           "default_io": default_io(), "runs": reps, "request_sizes": sizes, "generate": gen}
    for r in reps:
        print_modes(r, r["dd_gbps"])
        print_bundle(r, r["dd_gbps"])
    print_bundle_medians(reps)
    print_sizes(sizes)
    if gen:
        print_generate(gen)
    write_json(args.out, out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
