"""What the lossy modes (mlxmoe/lossy.py: --trim, --trim-mass, --cache-bias; mlxmoe/fallback.py: --fallback)
cost in quality and save in reads, measured honestly.

1. The demo model (bundled, or --model) at --residency of its experts (default 25 %), one
   fresh load per setting (low-bit copies built first, into a temporary folder), --prefetch
   as given (default 1), a second exact run last as the control: held-out text of each language
   (bench/heldout.py) teacher-forced one token per step (decode steps: where the modes act),
   giving perplexity per language, the mean KL(exact || mode) of the next-token
   distributions against exact at the same residency, bytes read and demand loads per token
   and what the mode did (experts skipped, biased in, per token); then greedy agreement
   with exact over --gen tokens from --gen-prompts held-out openings per language (share
   of positions with the same token, and the first position that differs). The recommended
   cache bias: the largest bias alone within +2 % perplexity in every language, written into
   the profiles named by --recommend-into (what `--cache-bias profile` takes).
2. Real routing (the files of the real-routing folder of bench/README.md, --routing or
   $MLXMOE_ROUTING, imported with mlxmoe's own trace import; --skip-real leaves it out): replayed through mlxmoe's Residency with the default policy, each
   single-token layer call trimmed as the runtime trims it (a non-resident expert below the
   threshold share of the token's top-k weight, or with --trim-mass beyond the share its
   stronger experts carry, is skipped, never read; the top one is kept where nothing else
   would be). Per setting and residency: the share of routing weight
   dropped, the experts skipped, and the share of routed experts served without a read
   (hits + skipped over routed) beside exact's hit rate. These traces carry only the top-k
   weights, not the router's logits, so cache-aware routing cannot be replayed on them.

    python bench/bench_lossy.py                          # demo + real routing (~15 min on a shared 2-core CPU)
    python bench/bench_lossy.py --prefetch 0 --skip-real # demo, prefetch off: reads deterministic
    python bench/bench_lossy.py --skip-real --tokens 40 --gen 16 --gen-prompts 1   # smoke run (~2 min)
    python bench/bench_lossy.py --skip-demo              # real routing only (~1 min)

Writes JSON (--output, default bench/out/lossy.json) and prints the tables.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from heldout import LANGUAGES, prompts  # noqa: E402
from system import check_outputs, write_json  # noqa: E402

import mlxmoe  # noqa: E402
import mlxmoe.api  # noqa: E402
from mlxmoe.caching.cache import Residency  # noqa: E402
from mlxmoe.caching.lossy import Lossy  # noqa: E402
from mlxmoe.caching.policies import DEFAULT_POLICY, make_policy  # noqa: E402
from mlxmoe.storage.files import model_folder  # noqa: E402
from mlxmoe.workload.trace import import_trace, layer_calls, read_trace  # noqa: E402

REAL_FILES = [("bigmoeonedge", "bigmoeonedge/qwen.route.csv"), ("bigmoeonedge", "bigmoeonedge/gemma.route.csv"),
              ("bigmoeonedge", "bigmoeonedge/gptoss.route.csv"),
              ("moe-ocs", "moe-ocs-learning-qwen3.6/routing_pretrained.vllm.7534a717.json"),
              ("moe-ocs", "moe-ocs-learning-qwen3.6/routing_pretrained.mlx.ece94543.json")]
SETTINGS = [{}, {"trim": 0.1}, {"trim": 0.2}, {"trim": 0.3}, {"trim": 0.4}, {"trim": 0.5}, {"trim": 1.0},
            {"cache_bias": 0.25}, {"cache_bias": 0.5}, {"cache_bias": 0.75}, {"cache_bias": 1.0}, {"cache_bias": 2.0},
            {"cache_bias": 4.0}, {"cache_bias": 0.5, "trim": 0.3}, {"trim_mass": 0.8}, {"trim_mass": 0.9},
            {"cache_bias": 0.75, "trim_mass": 0.9}, {"fallback": 2}, {"fallback": 3},
            {"fallback": 2, "cache_bias": 0.5}, {"same_memory": 2}, {"same_memory": 3},
            {}]  # the last: exact again, the control
THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.5)
MASSES = (0.95, 0.9, 0.85, 0.8)  # --trim-mass on real routing, where it differs from --trim (top-8)
RESIDENCIES = (0.1, 0.25, 0.5)


NAMES = {"cache_bias": "bias {:g}", "trim": "trim {:g}", "trim_mass": "trim mass {:g}", "fallback": "{}-bit fallback",
         "same_memory": "exact, cache + the {}-bit copies' memory"}


def name(setting):
    return ", ".join(NAMES[k].format(v) for k, v in setting.items()) or "exact"


def texts(tokenizer, lang, tokens, max_seq=128):
    """Held-out sequences of `lang` (one prompt each, at most max_seq tokens) adding up to about `tokens`."""
    seqs, total = [], 0
    for p in prompts(lang):
        ids = tokenizer.encode(p)[:max_seq]
        if len(ids) < 8:
            continue
        seqs.append(ids)
        total += len(ids) - 1
        if total >= tokens:
            break
    return seqs


def teacher_forced(model, seqs):
    """Each sequence fed one token per step (decode steps): the next-token log-probs [positions, vocab]."""
    from mlx_lm.models.cache import make_prompt_cache

    out = []
    for ids in seqs:
        model.expert_runtime.new_sequence()
        kv = make_prompt_cache(model)
        rows = []
        for t in ids[:-1]:
            logits = model(mx.array([[t]]), cache=kv)[0, -1].astype(mx.float32)
            rows.append(logits - mx.logsumexp(logits))
            mx.eval(rows[-1])
        out.append(np.array(mx.stack(rows)))
    return out


def greedy(model, tokenizer, openings, n):
    return [[r.token for r in mlxmoe.stream_generate(model, tokenizer, o, max_tokens=n)] for o in openings]


def agreement(a, b, n):
    """(share of the n positions with the same token, first position that differs or n)."""
    a, b = a + [-1] * (n - len(a)), b + [-1] * (n - len(b))
    same = [x == y for x, y in zip(a[:n], b[:n])]
    return sum(same) / n, same.index(False) if False in same else n


def run_demo(args):
    model, tokenizer = mlxmoe.load(args.model, prewarm=False)  # (the shapes)
    ckpt = model.expert_runtime.checkpoint
    slot_bytes = model.expert_cache.pools.slot_bytes
    total = ckpt.num_layers * ckpt.num_experts
    cache_experts = max(ckpt.top_k, round(args.residency * total))
    model.expert_runtime.close()
    data = {lang: texts(tokenizer, lang, args.tokens) for lang in LANGUAGES}
    openings = {lang: [tokenizer.decode(tokenizer.encode(p)[:24]) for p in prompts(lang)[:args.gen_prompts]]
                for lang in LANGUAGES}
    rows, exact_lp, exact_gen = [], {}, {}
    tmp = tempfile.TemporaryDirectory()
    copies, memory = {}, {}  # bits -> the file, the copies' bytes in memory
    for bits in sorted({s.get("fallback") or s.get("same_memory") for s in SETTINGS} - {None}):
        copies[bits] = Path(tmp.name) / f"fallback{bits}.safetensors"
        mlxmoe.api.build_fallback(ckpt.path, copies[bits], bits)
        model, _ = mlxmoe.load(args.model, cache_experts=cache_experts, prewarm=False, fallback=copies[bits])
        memory[bits] = model.expert_cache.fallback_bytes
        model.expert_runtime.close()
    for i, setting in enumerate(SETTINGS):
        tic = time.perf_counter()
        kw, size = dict(setting), cache_experts
        if "fallback" in kw:
            kw["fallback"] = copies[kw["fallback"]]
        if "same_memory" in kw:  # exact, its cache given the copies' memory
            size += memory[kw.pop("same_memory")] // slot_bytes
        model, tokenizer = mlxmoe.load(args.model, cache_experts=size, prefetch=args.prefetch, **kw)
        cache = model.expert_cache
        row = {"setting": name(setting) if i + 1 < len(SETTINGS) else "exact again", **setting, "cache_experts": size,
               "ppl": {}, "kl": {}, "agree": {}, "first_diff": {}}
        cache.reset_stats()
        for lang in LANGUAGES:
            lps = teacher_forced(model, data[lang])
            nll = np.concatenate([-lp[np.arange(len(ids) - 1), ids[1:]] for lp, ids in zip(lps, data[lang])])
            row["ppl"][lang] = float(np.exp(nll.mean()))
            if i == 0:
                exact_lp[lang] = lps
            row["kl"][lang] = float(np.mean(np.concatenate(
                [(np.exp(e) * (e - m)).sum(axis=-1) for e, m in zip(exact_lp[lang], lps)])))
        s = cache.stats()
        tokens = s["tokens"]
        row.update(tokens=tokens, bytes_per_token=s["bytes_read"] / tokens, demand_per_token=s["loads_demand"] / tokens,
                   skipped_per_token=s["skipped"] / tokens, biased_per_token=s["biased"] / tokens,
                   low_bit_per_token=s["substituted"] / tokens, late_per_token=s["prefetch_late"] / tokens,
                   hit_rate=s["hit_rate"], fallback_bytes=s["fallback_bytes"])
        for lang in LANGUAGES:
            gen = greedy(model, tokenizer, openings[lang], args.gen)
            if i == 0:
                exact_gen[lang] = gen
            pairs = [agreement(a, b, args.gen) for a, b in zip(exact_gen[lang], gen)]
            row["agree"][lang] = float(np.mean([p[0] for p in pairs]))
            row["first_diff"][lang] = float(np.mean([p[1] for p in pairs]))
        model.expert_runtime.close()
        row["seconds"] = time.perf_counter() - tic
        rows.append(row)
        print(f"  {row['setting']}: {row['seconds']:.0f} s", file=sys.stderr)
    tmp.cleanup()
    base = rows[0]
    for row in rows:
        row["ppl_change"] = {lang: row["ppl"][lang] / base["ppl"][lang] - 1 for lang in LANGUAGES}
        row["bytes_change"] = row["bytes_per_token"] / base["bytes_per_token"] - 1
    return {"model": str(ckpt.path), "prefetch": args.prefetch, "cache_experts": cache_experts, "all_experts": total,
            "recommended_cache_bias": recommended_bias(rows),
            "tokens_per_language": {lang: sum(len(i) - 1 for i in data[lang]) for lang in LANGUAGES},
            "gen_tokens": args.gen, "gen_prompts": args.gen_prompts, "rows": rows}


def recommended_bias(rows, worst=0.02):
    """The largest cache bias alone (SETTINGS' order) whose perplexity is within `worst` of
    exact's in every language, or None."""
    return max((s["cache_bias"] for s, r in zip(SETTINGS, rows)
                if set(s) == {"cache_bias"} and max(r["ppl_change"].values()) <= worst), default=None)


def recommend_into(paths, bias):
    """Write the recommended cache bias into each profile of `paths` (profile record --recommend-bias's field)."""
    from mlxmoe.workload.profile import ActivationProfile

    for path in paths:
        p = ActivationProfile.load(path)
        p.recommended_cache_bias = bias
        p.save(path)
        print(f"{path}: recommended cache bias {bias}", file=sys.stderr)


def trimmed_replay(records, L, E, cache_experts, trim, trim_mass=0.0):
    """The default policy's replay of a trace where each single-token layer call is trimmed
    at `trim` / `trim_mass` as the runtime trims it (lossy.Lossy.kept on the top-k weights)."""
    rule = Lossy("topk", trim=trim, trim_mass=trim_mass)
    slots = min(cache_experts, L * E)
    residency = Residency(slots, make_policy(DEFAULT_POLICY, slots, L, E))
    routed = skipped = hits = 0
    mass = dropped = 0.0
    for call in layer_calls(records, L):
        layer = call[0][2]
        if layer == 0:
            residency.tick(len(call))
        if len(call) > 1:  # a prefill chunk: exact
            experts = sorted({x for rec in call for x in rec[3]})
            residency.access(layer, experts)
            continue
        experts, p = call[0][3], call[0][4]
        share = np.asarray(p, dtype=np.float64) / sum(p)
        keep = rule.kept(share, [(layer, x) in residency.slot_of for x in experts])
        routed += len(experts)
        mass += 1.0
        dropped += float(sum(s for s, k in zip(share, keep) if not k))
        skipped += len(keep) - sum(keep)
        kept = sorted(x for x, k in zip(experts, keep) if k)
        before = residency.counters.hits
        residency.access(layer, kept, [float(share[experts.index(x)]) for x in kept])
        hits += residency.counters.hits - before
    return {"routed": routed, "skipped": skipped, "mass_dropped": dropped / mass if mass else 0.0,
            "served_without_read": (hits + skipped) / routed if routed else 0.0,
            "decode_hit_rate": hits / (routed - skipped) if routed > skipped else 0.0}


def run_real(args):
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, rel in REAL_FILES:
            src = args.routing / rel
            if not src.exists():
                print(f"  {src}: missing, skipped", file=sys.stderr)
                continue
            dst = Path(tmp) / (Path(rel).stem + ".trace.jsonl")
            import_trace(fmt, str(src), str(dst))
            header, records = read_trace(dst)
            if any(r[4] is None for r in records):
                print(f"  {src}: no top-k weights, skipped", file=sys.stderr)
                continue
            L, E = header["num_layers"], header["num_experts"]
            for res in RESIDENCIES:
                cache_experts = max(header["top_k"], round(res * L * E))
                exact = trimmed_replay(records, L, E, cache_experts, 0.0)
                for trim, trim_mass in [(t, 0.0) for t in THRESHOLDS] + [(0.0, m) for m in MASSES]:
                    r = trimmed_replay(records, L, E, cache_experts, trim, trim_mass)
                    out.append({"trace": rel, "top_k": header["top_k"], "residency": res,
                                "setting": f"trim {trim:g}" if trim else f"trim mass {trim_mass:g}",
                                "exact_served_without_read": exact["served_without_read"], **r})
    return out


def print_demo(demo):
    langs = LANGUAGES
    print(f"\ndemo model {demo['model']}: cache {demo['cache_experts']} of {demo['all_experts']} experts, "
          f"prefetch {demo['prefetch']}, "
          f"tokens per language {demo['tokens_per_language']}, greedy {demo['gen_tokens']} tokens x "
          f"{demo['gen_prompts']} prompts per language")
    print("| setting | cache | bytes/token | vs exact | demand loads/token | skipped/token | biased/token | "
          "low-bit/token | "
          + " | ".join(f"ppl {lang}" for lang in langs) + " | worst ppl change | mean KL (nats) | greedy agreement |")
    print("|---" * (11 + len(langs)) + "|")
    for r in demo["rows"]:
        worst = max(r["ppl_change"].values())
        low = f" + {r['fallback_bytes'] / 2 ** 20:.1f} MiB" if r.get("fallback_bytes") else ""
        print(f"| {r['setting']} | {r['cache_experts']}{low} | {r['bytes_per_token'] / 1024:.0f} KiB | "
              f"{100 * r['bytes_change']:+.0f} % | {r['demand_per_token']:.2f} | {r['skipped_per_token']:.2f} | "
              f"{r['biased_per_token']:.2f} | {r.get('low_bit_per_token', 0):.2f} | "
              + " | ".join(f"{r['ppl'][lang]:.2f}" for lang in langs)
              + f" | {100 * worst:+.1f} % | {np.mean(list(r['kl'].values())):.4f} | "
              f"{100 * np.mean(list(r['agree'].values())):.0f} % |")
    print(f"recommended cache bias (the largest within +2 % perplexity in every language): "
          f"{demo['recommended_cache_bias']}")


def print_real(real):
    print("\nreal routing, default policy, single-token layer calls trimmed")
    print("| trace | top-k | residency | setting | routing weight dropped | skipped / routed | served without a read "
          "(exact) |")
    print("|---|---|---|---|---|---|---|")
    for r in real:
        print(f"| {r['trace']} | {r['top_k']} | {100 * r['residency']:.0f} % | {r['setting']} | "
              f"{100 * r['mass_dropped']:.1f} % | {100 * r['skipped'] / max(r['routed'], 1):.1f} % | "
              f"{100 * r['served_without_read']:.1f} % ({100 * r['exact_served_without_read']:.1f} %) |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model folder. Default: the bundled demo model.")
    parser.add_argument("--residency", type=float, default=0.25, help="Share of all experts the cache holds.")
    parser.add_argument("--prefetch", type=int, default=1, help="mlxmoe.load's prefetch (0: off). Default 1.")
    parser.add_argument("--tokens", type=int, default=400, help="Teacher-forced tokens per language (about).")
    parser.add_argument("--gen", type=int, default=64, help="Greedy tokens per prompt.")
    parser.add_argument("--gen-prompts", type=int, default=3, help="Greedy prompts per language.")
    parser.add_argument("--recommend-into", nargs="*", default=[], metavar="PROFILE",
                        help="Write the recommended cache bias into these profiles (of the same model).")
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--routing", type=Path, default=os.environ.get("MLXMOE_ROUTING"),
                        help="The real-routing folder (default $MLXMOE_ROUTING); without it the real part is skipped.")
    parser.add_argument("--output", default=str(Path(__file__).resolve().parent / "out" / "lossy.json"))
    args = parser.parse_args(argv)
    # the profiles of --recommend-into are read and written back: outputs, each its own
    check_outputs({"--output": args.output, "--recommend-into": args.recommend_into},
                  {"--model": model_folder(args.model), "--routing": args.routing})
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if not args.skip_demo:
        result["demo"] = run_demo(args)
        print_demo(result["demo"])
        if args.recommend_into and result["demo"]["recommended_cache_bias"] is not None:
            recommend_into(args.recommend_into, result["demo"]["recommended_cache_bias"])
        elif args.recommend_into:
            print("no cache bias kept perplexity within +2 % in every language: the profiles are left as they were",
                  file=sys.stderr)
    if not args.skip_real and args.routing is None:
        print("real routing skipped: give its folder with --routing or $MLXMOE_ROUTING", file=sys.stderr)
    elif not args.skip_real:
        result["real"] = run_real(args)
        print_real(result["real"])
    write_json(args.output, result)
    print(f"\nwrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
