"""Check `mlxmoe fit` (the forecast of memory, decode tok/s and time to first token)
against measured runs: the forecast first, then the model itself at each budget, side by
side in one run.

    python bench/bench_forecast.py --slowdisk PATH                  # local disk + 40 and 20 MB/s, 25/50/100 %
    python bench/bench_forecast.py --rates local --shares 0.25,0.5  # no FUSE
    python bench/bench_forecast.py --rates disk                     # GPU machines: the machine's disk (= local)

1. A profile is recorded from --profile-prompts (`mlxmoe profile record`, with its curve):
   the forecast's hit rate comes from it. The measured runs generate from --prompt, which
   is not among them (out of sample). The synthetic checkpoint's routing is not a real
   model's, so the real-routing table `fit` uses without a profile does not apply to it.
2. For each disk: the checkpoint folder itself (`local`), or mounted through
   slowdisk.py (--slowdisk or $MLXMOE_SLOWDISK) at a rate (bench_disk.py's mount): `mlxmoe fit --json` for
   the budgets that hold each --shares of the experts (timed: it must take < 10 s), then
   each budget in its own process: mlxmoe.load(memory_budget=..., profile=...), a 4-token
   warm-up generation (kernels built: one-time costs are not forecast) and a timed
   greedy generation (bench_runtime.generate_timed): decode tok/s over the tokens after the
   first, time to first token, and the memory the model took: MLX's peak (weights, slot
   pools, KV cache, activations; on a GPU its memory) and, beside it, what the process's
   RSS grew by (that also holds MLX's cache of freed buffers and Python's objects).
3. A table of forecast (low / likely / high) against measured, and the targets: measured
   inside the range in every row, the likely value within +-25 % in >= 80 % of rows,
   memory within +-5 %.

What `fit` assumes that is tuned (forecast.OVERLAP_LEFT, from bench_disk's 50 % rows) is
printed; this run's rows are out of that sample.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench_disk as bd  # noqa: E402  (mount, unmount, fuse_check, the default checkpoint)
import bench_runtime as br  # noqa: E402  (run_child, generate_timed)
from system import check_outputs, write_json  # noqa: E402

WARMUP_PROMPT = "Hi there"  # a warm-up generation before the timed one: one-time costs are not the forecast's
PROFILE_PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning was", "Numbers: 1, 2, 3,"]


def run_measured(args):
    """One budget: load from --path with the profile, one timed greedy generation."""
    import mlx.core as mx  # (imported before the baseline RSS: not the model's memory)

    import mlxmoe
    from system import proc_status

    before = proc_status()[0]
    mx.reset_peak_memory()
    tic = time.perf_counter()
    model, tokenizer = mlxmoe.load(args.path, memory_budget=args.budget, profile=args.profile, backend=args.backend)
    load_seconds = time.perf_counter() - tic
    model.expert_cache.prewarm_done(timeout=600)  # the forecast's pre-warmed cache: measured from there
    for _ in mlxmoe.stream_generate(model, tokenizer, WARMUP_PROMPT, max_tokens=4):  # kernels built (JIT on CUDA)
        pass
    snap = lambda: br.cache_snapshot(model.expert_cache)  # noqa: E731
    run, first, last = br.generate_timed(mlxmoe.stream_generate, model, tokenizer, args.prompt, args.tokens,
                                         snapshot=snap, window=args.no_repeat)
    run["decode"] = br.window_stats(first, last)
    stats = model.expert_cache.stats()
    model.expert_cache.close()
    return {"load_seconds": load_seconds, "run": {k: v for k, v in run.items() if k != "text"},
            "memory_bytes": mx.get_peak_memory(), "rss_growth_bytes": proc_status()[1] - before,
            "cache_experts": stats.get("cache_experts")}


def fit(args, path, profile, budgets, prompt_tokens):
    cmd = [sys.executable, "-m", "mlxmoe", "fit", "-m", str(path), "--profile", str(profile), "--json",
           "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(args.tokens)]
    cmd += [a for b in budgets for a in ("--memory-budget", str(b))] + (["--backend", args.backend] if args.backend else [])
    tic = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode:
        raise SystemExit(f"mlxmoe fit failed: {out.stderr[-2000:]}")
    f = json.loads(out.stdout)
    f["wall_seconds"] = time.perf_counter() - tic
    return f


def budgets_for(path, shares, backend=None):
    """The budget that holds each share of the experts (what `mlxmoe fit` forecasts by default)."""
    from mlxmoe import backend as backends
    from mlxmoe.forecast import share_budgets
    from mlxmoe.loader import open_checkpoint

    be = backends.detect(backend)
    ckpt = open_checkpoint(str(path))
    be.apply_dtype_policy(ckpt.model)
    return share_budgets(ckpt, be, shares)


def record_profile(args, out):
    prompts = Path(out).with_suffix(".txt")  # beside the profile, in main's temp folder: internal files
    prompts.write_text("\n".join(PROFILE_PROMPTS) + "\n")
    cmd = [sys.executable, "-m", "mlxmoe", "profile", "record", "-m", str(args.checkpoint), "--prompts", str(prompts),
           "--max-tokens", str(args.tokens), "-o", str(out), "--workload", "forecast-check"]
    print(f"[bench] {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=sys.stderr)


def within(x, lo, hi):
    return lo * 0.999 <= x <= hi * 1.001


def report(rows, overlap):
    print(f"\nforecast (mlxmoe fit) against measured; OVERLAP_LEFT = {overlap} (tuned on bench_disk's 50 % rows)")
    print(f"{'disk':>8} {'budget':>9} {'cache':>6}  {'tok/s low / likely / high':>27} {'measured':>9} {'in':>3} "
          f"{'likely err':>10}  {'TTFT s fcst (lo-hi)':>20} {'meas':>6}  {'memory fcst':>11} {'meas':>9} {'err':>6}  fit s")
    for r in rows:
        d, m = r["forecast"]["decode_tps"], r["measured"]
        t = r["forecast"]["ttft_seconds"]
        print(f"{r['disk']:>8} {r['budget'] / 2**30:8.2f}G {100 * r['forecast']['share_of_experts']:5.0f}%  "
              f"{d['low']:8.2f} / {d['likely']:6.2f} / {d['high']:6.2f} {m['decode_tps']:9.2f} "
              f"{'yes' if r['inside'] else 'NO':>3} {100 * r['likely_error']:+9.1f}%  "
              f"{t['low']:9.2f} - {t['high']:6.2f} {m['ttft']:6.2f}  {r['forecast']['memory_bytes'] / 2**30:10.2f}G "
              f"{m['memory_bytes'] / 2**30:8.2f}G {100 * r['memory_error']:+5.1f}%  {r['fit_seconds']:5.1f}")
    n = len(rows)
    inside = sum(r["inside"] for r in rows)
    close = sum(abs(r["likely_error"]) <= 0.25 for r in rows)
    mem = sum(abs(r["memory_error"]) <= 0.05 for r in rows)
    print(f"\n{'PASS' if inside == n else 'FAIL'}  measured decode tok/s inside the forecast range: {inside}/{n}")
    print(f"{'PASS' if close >= 0.8 * n else 'FAIL'}  likely value within +-25 %: {close}/{n} (target >= 80 %)")
    print(f"{'PASS' if mem == n else 'FAIL'}  memory within +-5 %: {mem}/{n}")
    slow = max(r["fit_seconds"] for r in rows)
    print(f"{'PASS' if slow < 10 else 'FAIL'}  the forecast takes < 10 s: at most {slow:.1f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(bd.DEFAULT_MODEL), help=f"Default {bd.DEFAULT_MODEL} (built if missing).")
    parser.add_argument("--rates", default="local,40MB/s,20MB/s",
                        help="Disks: 'local' (or 'disk': the checkpoint folder itself) and slowdisk rates. "
                             "Default local,40MB/s,20MB/s.")
    parser.add_argument("--shares", default="0.25,0.5,1.0", help="Shares of the experts the budgets hold.")
    parser.add_argument("--prompt", default=bd.DEFAULT_PROMPT, help="The measured runs' prompt (not a profile prompt).")
    parser.add_argument("--tokens", type=int, default=24, help="Greedy tokens per generation. Default 24.")
    parser.add_argument("--no-repeat", type=int, default=32, help="bench_disk's no-repeat window.")
    parser.add_argument("--backend", choices=["cpu", "metal", "cuda"], help="Default: the best available.")
    parser.add_argument("--latency", default="0.1ms", help="slowdisk's latency per request.")
    parser.add_argument("--slowdisk", type=Path, default=os.environ.get("MLXMOE_SLOWDISK"),
                        help="slowdisk.py, the FUSE disk emulator a rate mounts (default $MLXMOE_SLOWDISK).")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--output", type=Path, default=HERE / "out" / "forecast.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--budget", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # --result: a temp file run_child made for this child alone, not a user's path
        sys.path.append(str(ROOT))
        Path(args.result).write_text(json.dumps(run_measured(args)))
        return

    sys.path.append(str(ROOT))
    args.checkpoint = Path(args.checkpoint)
    check_outputs({"--output": args.output}, {"--checkpoint": args.checkpoint, "--slowdisk": args.slowdisk})
    if args.checkpoint == bd.DEFAULT_MODEL:
        bd.wait_for_checkpoint(args.checkpoint, 1800)
    shares = [float(s) for s in args.shares.split(",")]
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    if any(r not in ("local", "disk") for r in rates):
        bd.fuse_check(args)
    budgets = budgets_for(args.checkpoint, shares, args.backend)
    from mlxmoe.forecast import OVERLAP_LEFT

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile.json"
        record_profile(args, profile)
        prompt_tokens = None
        for rate in rates:
            mounted = None if rate in ("local", "disk") else bd.mount(args.checkpoint, rate, args)
            path = mounted[0] if mounted else args.checkpoint
            try:
                if prompt_tokens is None:  # the measured prompt's length, for the forecast's TTFT
                    from mlxmoe.loader import read_tokenizer
                    prompt_tokens = len(read_tokenizer(args.checkpoint).encode(args.prompt))
                f = fit(args, path, profile, budgets, prompt_tokens)
                for budget, fb in zip(budgets, f["budgets"]):
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "run", "--path", str(path),
                           "--budget", str(budget), "--profile", str(profile), "--prompt", args.prompt,
                           "--tokens", str(args.tokens), "--no-repeat", str(args.no_repeat)]
                    cmd += ["--backend", args.backend] if args.backend else []
                    m = br.run_child(cmd, f"{rate} {budget / 2**30:.2f} GB", args.timeout)
                    if "error" in m:
                        print(f"[bench] {rate} {budget}: {m['error']}", file=sys.stderr)
                        continue
                    run = m["run"]
                    steps = max(1, run["decode_steps"])
                    measured = {"decode_tps": run["decode_tps"], "ttft": run["prefill_seconds"],
                                "memory_bytes": m["memory_bytes"], "decode_steps": run["decode_steps"],
                                "hit_rate": run["decode"]["hit_rate"],
                                "read_bytes_per_token": run["decode"]["bytes_read"] / steps}
                    d = fb["decode_tps"]
                    rows.append({"disk": rate, "budget": budget, "forecast": fb, "measured": measured,
                                 "fit_seconds": f["wall_seconds"],
                                 "inside": within(measured["decode_tps"], d["low"], d["high"]),
                                 "likely_error": d["likely"] / measured["decode_tps"] - 1,
                                 "memory_error": fb["memory_bytes"] / measured["memory_bytes"] - 1,
                                 "fit": {k: f[k] for k in ("measured", "assumed", "disk_bytes_per_second",
                                                           "compute_seconds_per_token")}})
            finally:
                if mounted:
                    bd.unmount(*mounted)
    write_json(args.output, {"checkpoint": str(args.checkpoint), "backend": args.backend, "prompt": args.prompt,
                             "tokens": args.tokens, "rows": rows})
    for disk, measured in {r["disk"]: r["fit"]["measured"] for r in rows}.items():  # what fit measured, per disk
        print(f"[{disk}] " + "; ".join(measured), file=sys.stderr)
    report(rows, OVERLAP_LEFT)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
