"""Profiles and the activation-aware cache on the bundled demo model, in one run:

1. pre-warm: hit rate over the first 64 generated tokens of Italian prompts at 50 % cache,
   with the Italian profile, with none, and with the English profile;
   and, replayed on the held-out traces of bench_policies.py --demo (bench/out), the hit
   rate of the default policy with the matching profile as prior, with none, and with the
   other language's (a mismatched profile: its pins must let go);
2. profile switch: a session that starts in Italian (Italian profile) and changes to
   English: how many tokens the default policy (and LRU, S3-FIFO) need to get back to their English
   steady-state hit rate, replayed on traces recorded from the model;
3. bookkeeping: the time StreamingExperts spends beyond mlx-lm's own work (lookahead and
   router probabilities, routing copies, policy, live profile, prefetch predictions,
   remapping) as a share of generation time, with the default settings and with LRU and
   no prefetch (median of 3 runs each, alternated); and decode tok/s of mlxmoe with every
   expert resident against stock mlx-lm with the same dtype policy (median of 5 alternated
   rounds): that ratio is the end-to-end cost of all mlxmoe adds, per-layer syncs included;
   with --baseline REF (or --baseline-path DIR) the default's bookkeeping beside an older
   commit's too, each run in its own process (bookkeeping.py: a figure per layer call is the
   machine's, the baseline's measured in the same run is its yardstick);
4. prefetch: hit rate and loads during decode (prefill left out) without it and with
   each variant, at 25 % and 50 % cache, and the precision of the router predictors.
Results go to bench/out/profiles.json.

    python bench/bench_profiles.py [--model DIR] [--profiles profiles/]
    python bench/bench_profiles.py --only-bookkeeping   # section 3 alone (about a minute)
    python bench/bench_profiles.py --only-bookkeeping --baseline fa37cae   # + an older commit's, side by side
    python bench/bench_profiles.py --only-prior         # section 1's replays alone (seconds)
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxmoe
from bookkeeping import _experts, _share, bookkeeping, no_eos, per_call_us, side_by_side
from heldout import prompts
from system import baseline_code, check_outputs, write_json
from mlxmoe.caching.cache import Residency
from mlxmoe.loader import DEMO_MODEL
from mlxmoe.storage.files import model_folder
from mlxmoe.caching.policies import DEFAULT_POLICY, make_policy
from mlxmoe.workload.profile import ActivationProfile
from mlxmoe.workload.trace import layer_calls, read_trace, replay, steps

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


def prewarm(model_path, profiles_dir, italian, tokens=64, share=0.5):
    """Hit rate over the first `tokens` generated tokens of each Italian prompt."""
    rows = {}
    for name in ("italian", None, "english"):
        profile = None if name is None else str(profiles_dir / f"{name}.json")
        rates = []
        for prompt in italian:
            model, tokenizer = mlxmoe.load(model_path, cache_experts=_share(model_path, share), profile=profile,
                                           prefetch=0)
            cache = model.expert_cache
            before = None
            for i, r in enumerate(mlxmoe.stream_generate(model, tokenizer, prompt, max_tokens=tokens + 1,
                                                         logits_processors=[no_eos(tokenizer)])):
                if i == 0:  # the prompt is in: count from the first generated token on
                    before = (cache.counters.hits, cache.counters.misses)
            hits, misses = cache.counters.hits - before[0], cache.counters.misses - before[1]
            rates.append(hits / max(hits + misses, 1))
            cache.close()
        rows[name or "none"] = float(np.mean(rates))
        print(f"  profile {name or 'none':>8}: hit rate over the first {tokens} generated tokens "
              f"{100 * rows[name or 'none']:.1f}%")
    return rows


def prior_replays(profiles_dir, shares=(0.25, 0.5, 0.75)):
    """The default policy's hit rate replayed on the held-out Italian and English traces with
    each profile as prior and with none (the traces of bench_policies.py --demo)."""
    rates = {name: ActivationProfile.load(profiles_dir / f"{name}.json").rates() for name in ("italian", "english")}
    rows = {}
    for lang in ("it", "en"):
        path = OUT / f"demo-{lang}.trace.jsonl"
        if not path.exists():
            print(f"  {path} missing: run python bench/bench_policies.py --demo first")
            continue
        header, records = read_trace(path)
        n = header["num_layers"] * header["num_experts"]
        for name in ("italian", "english", None):
            kw = {} if name is None else {"prior": rates[name]}
            hit = [replay(header, records, DEFAULT_POLICY, int(n * s), **kw)["hit_rate"] for s in shares]
            rows[f"{lang}/{name or 'none'}"] = hit
            print(f"  {lang} held-out, {name or 'no'} profile: " + " / ".join(f"{100 * h:.2f}%" for h in hit)
                  + " at " + " / ".join(f"{s:.0%}" for s in shares))
    return rows


def record(model_path, lines, path, tokens=16):
    """A trace of the model on `lines` (prompt tokens teacher-forced, then `tokens` generated)."""
    model, tokenizer = mlxmoe.load(model_path, trace_out=str(path), prefetch=0)
    for line in lines:
        for _ in mlxmoe.stream_generate(model, tokenizer, line, max_tokens=tokens):
            pass
    model.expert_cache.close()
    return read_trace(path)


def switch(header, it_records, en_records, profile, policy, share=0.5, window=16):
    """Hit rate per token across an Italian -> English switch, replayed one layer call at a
    time as the runtime fetches (a prefill's hits count at its last token); tokens after
    the switch until the hit rate over the last `window` tokens is back within 2 points of
    the English steady state (its last half)."""
    L, E = header["num_layers"], header["num_experts"]
    size = int(L * E * share)
    r = Residency(size, make_policy(policy, size, L, E, prior=profile.rates() if profile else None))
    records = list(it_records) + [(rec[0] + 10 ** 6,) + rec[1:] for rec in en_records]
    hits, accesses = {}, {}  # (sequence, token) -> counts, in order of first appearance
    for call in layer_calls(records, L):
        position = call[-1][:2]
        for tokens, layer, experts, scores, dist in steps(call, L, size):
            if tokens:
                r.tick(tokens)
            before = r.counters.hits
            r.access(layer, experts, scores, dist)
            hits[position] = hits.get(position, 0) + r.counters.hits - before
            accesses[position] = accesses.get(position, 0) + len(experts)
    h, a = np.array(list(hits.values()), dtype=float), np.array(list(accesses.values()), dtype=float)
    switch_at = sum(1 for s, _ in hits if s < 10 ** 6)
    en_h, en_a = h[switch_at:], a[switch_at:]
    half = len(en_h) // 2
    steady = en_h[half:].sum() / en_a[half:].sum()
    rolling = np.convolve(en_h, np.ones(window), "valid") / np.convolve(en_a, np.ones(window), "valid")
    recovered = next((i + window for i, v in enumerate(rolling) if v >= steady - 0.02), None)
    return {"steady_english": float(steady), "italian": float(h[:switch_at].sum() / a[:switch_at].sum()),
            "first_window_after_switch": float(rolling[0]), "tokens_to_recover": recovered, "window": window}


def decode_timed(generate_fn, model, tokenizer, prompt, tokens):
    """(decode tok/s from the first token to the last, the tokens) of one greedy generation."""
    out, t0 = [], None
    for r in generate_fn(model, tokenizer, prompt, max_tokens=tokens, logits_processors=[no_eos(tokenizer)]):
        out.append(int(r.token))
        if t0 is None:
            t0 = time.perf_counter()
    return (len(out) - 1) / (time.perf_counter() - t0), out


def resident_vs_stock(model_path, prompt, tokens=128, rounds=5):
    """Decode tok/s of mlxmoe with every expert resident and of stock mlx-lm with the same
    dtype policy, in alternated rounds (the order flips each round): medians and ratio."""
    import mlx.core as mx
    import mlx_lm

    from mlxmoe import backend

    stock, stock_tok = mlx_lm.load(model_path)
    backend.detect().apply_dtype_policy(stock)
    mx.eval(stock.parameters())
    L, E = _experts(model_path)
    model, tokenizer = mlxmoe.load(model_path, cache_experts=L * E)
    cache = model.expert_cache
    for layer in range(L):  # everything read before timing (stock reads every weight at load)
        cache.fetch(layer, list(range(E)))
    runs = {"mlx-lm": (mlx_lm.stream_generate, stock, stock_tok), "mlxmoe": (mlxmoe.stream_generate, model, tokenizer)}
    for fn, m, t in runs.values():  # warm-up
        decode_timed(fn, m, t, prompt, 8)
    tps, same, shares, misses = {name: [] for name in runs}, True, [], cache.counters.misses
    cpu = {name: [] for name in runs}  # process CPU seconds per generation: less moved by other load
    for i in range(rounds):
        toks = {}
        for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            cache.reset_stats()
            tic, cpu_tic = time.perf_counter(), time.process_time()
            rate, toks[name] = decode_timed(*runs[name], prompt, tokens)
            cpu[name].append(time.process_time() - cpu_tic)
            tps[name].append(rate)
            if name == "mlxmoe":
                shares.append(cache.counters.bookkeeping_seconds / (time.perf_counter() - tic))
                misses += cache.counters.misses
        same = same and toks["mlx-lm"] == toks["mlxmoe"]
    misses -= L * E
    cache.close()
    med = {name: float(np.median(v)) for name, v in tps.items()}
    paired = [a / b for a, b in zip(tps["mlxmoe"], tps["mlx-lm"])]
    return {"stock_tps": med["mlx-lm"], "resident_tps": med["mlxmoe"], "ratio": med["mlxmoe"] / med["mlx-lm"],
            "paired_ratio": float(np.median(paired)), "cpu_ratio": float(np.median(cpu["mlx-lm"]) / np.median(cpu["mlxmoe"])),
            "runs": tps, "tokens_identical": same, "misses_after_preload": misses,
            "bookkeeping_share": float(np.median(shares))}


def bookkeeping_section(model_path, prompt, out, runs=3, baseline=None):
    """Section 3; `baseline` (label, folder of its mlxmoe/): its bookkeeping beside this tree's too."""
    print("3. bookkeeping share of generation time (demo model, 50 % cache, 128 tokens, median of "
          f"{runs} alternated runs)")
    configs = {f"{DEFAULT_POLICY} + prefetch (default)": {}, "lru, no prefetch": {"policy": "lru", "prefetch": 0}}
    results = {label: [] for label in configs}
    for _ in range(runs):
        for label, kwargs in configs.items():
            results[label].append(bookkeeping(model_path, prompt, **kwargs))
    out["bookkeeping"] = {}
    for label, rs in results.items():
        b = sorted(rs, key=lambda r: r["share"])[len(rs) // 2]
        out["bookkeeping"][label] = dict(b, runs=rs)
        print(f"  {label:>32}: {1000 * b['bookkeeping_seconds']:.1f} ms of {1000 * b['generate_seconds']:.1f} ms: "
              f"{100 * b['share']:.2f}%, {per_call_us(b):.0f} us per layer call "
              f"({b['tokens_per_second']:.1f} tok/s including the prompt; hit rate {100 * b['hit_rate']:.1f}%, "
              f"{b['loads_demand']} demand loads, {b['prefetch_useful']} useful prefetches)")
    if baseline is not None:
        out["bookkeeping_vs_baseline"] = side_by_side(model_path, prompt, baseline[1], baseline[0], runs)
    r = out["resident_vs_stock"] = resident_vs_stock(model_path, prompt, rounds=max(5, runs))
    print(f"  every expert resident: mlxmoe {r['resident_tps']:.1f} tok/s, stock mlx-lm + dtype policy "
          f"{r['stock_tps']:.1f} tok/s (decode, median of {len(r['runs']['mlxmoe'])} alternated rounds): "
          f"ratio {r['ratio']:.3f} (median of per-round ratios {r['paired_ratio']:.3f}, by CPU time per generation "
          f"{r['cpu_ratio']:.3f}), of which bookkeeping {100 * r['bookkeeping_share']:.1f}% of mlxmoe's time; "
          f"tokens identical: {r['tokens_identical']}")


def fixed_chance(x):
    """Prefetcher attributes that hold min_chance at x whatever the IO load."""
    return {"min_chance": x, "chance_floor": x, "busy_target": (0.0, float("inf"))}


# label -> (load arguments, Prefetcher attributes)
PREFETCH_VARIANTS = (
    ("off", {"prefetch": 0}, {}),
    ("next layer, sure guesses", {}, {"cross_token": False, "candidates": 0}),
    ("+ cross-token", {}, {"candidates": 0}),
    ("+ top-2k and co-activation where the policy agrees, min chance fixed 0.1", {}, fixed_chance(0.1)),
    ("default (min chance paced by the IO load, floor 0.05)", {}, {}),
    ("min chance fixed 0 (every guess the policy agrees with)", {}, fixed_chance(0.0)),
    ("min chance fixed 0.3", {}, fixed_chance(0.3)),
    ("default, depth 2", {"prefetch": 2}, {}),
)
DECODE_KEYS = ("hits", "misses", "loads_demand", "loads_prefetched", "prefetch_useful", "prefetch_late")


def prefetch(model_path, lines, tokens=64):
    """Decode only: each prompt's counts start at its first generated token (the prompt's
    prefill and its loads are left out), with the background loads drained at both ends."""
    rows = {}
    print("  | cache | prefetch | hit rate | demand loads | prefetched (used) | useful / (useful + demand) "
          "| reads / token | router precision (next token) |")
    print("  |---|---|---|---|---|---|---|---|")
    for share in (0.25, 0.5):
        for label, kwargs, attrs in PREFETCH_VARIANTS:
            model, tokenizer = mlxmoe.load(model_path, cache_experts=_share(model_path, share), **kwargs)
            cache = model.expert_cache
            pf = cache.prefetcher
            for name, value in attrs.items():
                setattr(pf.bar if hasattr(pf.bar, name) else pf, name, value)
            total, made = dict.fromkeys(DECODE_KEYS, 0), 0
            for line in lines:
                for i, _ in enumerate(mlxmoe.stream_generate(model, tokenizer, line, max_tokens=tokens,
                                                             logits_processors=[no_eos(tokenizer)])):
                    if i == 0:
                        if pf is not None:
                            pf.drain()
                        before = cache.stats()
                made += i
                if pf is not None:
                    pf.drain()
                after = cache.stats()
                for k in DECODE_KEYS:
                    total[k] += after[k] - before[k]
            s = cache.stats()
            cache.close()
            useful, demand = total["prefetch_useful"], total["loads_demand"]
            row = dict(total, hit_rate=total["hits"] / max(total["hits"] + total["misses"], 1),
                       useful_share=useful / max(useful + demand, 1),
                       reads_per_token=(demand + total["loads_prefetched"]) / max(made, 1),
                       predictors=s["predictors"])
            rows[f"{share}/{label}"] = row
            pr = row["predictors"]
            precision = " / ".join(f"{pr[n]['precision']:.2f}" for n in ("router", "router_next_token") if n in pr)
            print(f"  | {share:.0%} | {label} | {100 * row['hit_rate']:.1f} % | {demand} | "
                  f"{total['loads_prefetched']} ({useful}) | {row['useful_share']:.2f} | "
                  f"{row['reads_per_token']:.2f} | {precision or '-'} |", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--profiles", default=str(ROOT / "profiles"))
    ap.add_argument("--prompts", type=int, default=4, help="Held-out prompts per language.")
    ap.add_argument("--runs", type=int, default=3, help="Alternated runs of the bookkeeping section.")
    ap.add_argument("--only-prefetch", action="store_true", help="Run section 4 alone.")
    ap.add_argument("--only-bookkeeping", action="store_true", help="Run section 3 alone (bench/out/bookkeeping.json).")
    ap.add_argument("--only-prior", action="store_true", help="Run section 1's replays with profiles as prior alone.")
    ap.add_argument("--baseline", metavar="REF", help="Section 3 also measures this older commit's bookkeeping "
                    "beside this tree's, alternated, each run in its own process (a git worktree in /tmp).")
    ap.add_argument("--baseline-path", metavar="DIR", help="As --baseline, with the old code's mlxmoe/ already "
                    "in DIR (git archive REF mlxmoe | tar -x -C DIR).")
    args = ap.parse_args()
    profiles = Path(args.profiles)
    full = not (args.only_prefetch or args.only_prior or args.only_bookkeeping)
    check_outputs({"the results": None if args.only_prior else OUT / ("bookkeeping.json" if args.only_bookkeeping
                                                                     else "profiles.json"),
                   "the traces": [OUT / "switch-it.trace.jsonl", OUT / "switch-en.trace.jsonl"] if full else None},
                  {"--model": model_folder(args.model), "--profiles": profiles,
                   "--baseline-path": args.baseline_path})
    baseline = None
    if args.baseline or args.baseline_path:
        if args.only_prefetch or args.only_prior:
            raise SystemExit("--baseline and --baseline-path go with section 3 (--only-bookkeeping, or the whole bench)")
        _, tree, label = baseline_code(args.baseline, args.baseline_path)
        baseline = label, tree
    # cut mid-text, so that the model continues in the prompt's language
    it, en = prompts("it", args.prompts, max_chars=200), prompts("en", args.prompts, max_chars=200)
    out = {}
    if args.only_prefetch:
        return prefetch_section(args.model, out)
    if args.only_prior:
        prior_replays(profiles)
        return
    if args.only_bookkeeping:
        bookkeeping_section(args.model, it[0], out, args.runs, baseline)
        write_json(OUT / "bookkeeping.json", out)
        return
    print("1. pre-warm at 50 % cache (Italian prompts)")
    out["prewarm"] = prewarm(args.model, profiles, it)
    out["prior_replays"] = prior_replays(profiles)
    print("2. profile switch: Italian -> English, replayed at 50 % cache")
    header, it_rec = record(args.model, prompts("it", 4 * args.prompts), OUT / "switch-it.trace.jsonl")
    _, en_rec = record(args.model, prompts("en", 4 * args.prompts), OUT / "switch-en.trace.jsonl")
    italian = ActivationProfile.load(profiles / "italian.json")
    out["switch"] = {}
    for policy in (DEFAULT_POLICY, "lru", "s3fifo"):
        r = switch(header, it_rec, en_rec, italian if policy == DEFAULT_POLICY else None, policy)
        out["switch"][policy] = r
        print(f"  {policy:>16}: Italian {100 * r['italian']:.1f}%, English steady {100 * r['steady_english']:.1f}%, "
              f"first {r['window']} tokens after the switch {100 * r['first_window_after_switch']:.1f}%, "
              f"back within 2 points after {r['tokens_to_recover']} tokens")
    bookkeeping_section(args.model, it[0], out, args.runs, baseline)
    prefetch_section(args.model, out)


def prefetch_section(model_path, out):
    print("4. prefetch, decode only (Italian and English prompts, 64 generated tokens each)")
    out["prefetch"] = prefetch(model_path, prompts("it", 4, max_chars=200) + prompts("en", 4, max_chars=200))
    write_json(OUT / "profiles.json", out)


if __name__ == "__main__":
    sys.exit(main())
