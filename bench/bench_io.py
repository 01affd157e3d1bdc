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
   bytes read, page cache growth; and once on the bundled copy (io=direct).

    python bench/bench_io.py                  # 8 layers, 300 experts, 2 repeats
    python bench/bench_io.py --quick          # 2 layers, 100 experts, 1 repeat
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))  # synthetic.py, the test checkpoints' builder

from system import disk_read_bytes, drop_page_cache, meminfo_cached  # noqa: E402

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

    from mlxmoe.shards import DTYPES

    pools = []
    for shape, d in zip(store.tensor_shapes, store.tensor_dtypes):
        size = n * int(np.prod(shape)) * np.dtype(DTYPES[d]).itemsize
        pools.append((None, np.frombuffer(mmap.mmap(-1, size), DTYPES[d]).reshape(n, *shape)))
    return pools


def ensure_bundled(path):
    """The `mlxmoe convert --bundle` copy of checkpoint `path`, built once."""
    from mlxmoe.convert import bundle

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
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as t:
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
    ap.add_argument("--out", default=str(HERE / "out" / "io.json"))
    ap.add_argument("--generate-one", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate_one:
        Path(args.result).write_text(json.dumps(run_generate(args)))
        return
    if args.quick:
        args.checkpoint = args.checkpoint.replace("-8L", "-2L")
        args.layers, args.sample, args.repeat, args.tokens = 2, 100, 1, 8
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from mlxmoe.loader import open_checkpoint

    args.checkpoint = ensure_checkpoint(args.checkpoint, args.layers)
    store = open_checkpoint(args.checkpoint).store
    files = sorted({r.file for experts in store.ranges for row in experts for r in row})
    shards = sorted(files, key=lambda f: -f.stat().st_size)[:args.dd_shards]
    threads = [int(t) for t in args.threads.split(",")]
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
    store.close()
    bstore.close()

    gen = None if args.no_generate else generate_all(args, bundled)
    from mlxmoe.store import default_io

    out = {"platform": f"{platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} cpus",
           "checkpoint": str(args.checkpoint), "expert_bytes": store.expert_file_bytes(),
           "ranges_per_expert": len(store.tensors), "sample": len(sample), "bundled": str(bundled),
           "default_io": default_io(), "runs": reps, "generate": gen}
    for r in reps:
        print_modes(r, r["dd_gbps"])
        print_bundle(r, r["dd_gbps"])
    print_bundle_medians(reps)
    if gen:
        print_generate(gen)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
