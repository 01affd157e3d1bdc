"""Policy benchmark: hit rates of every policy against Belady at 25/50/75 % of all
experts, on two families of routing, in one run:

- synthetic traces whose per-layer popularity follows Qwen3-30B-A3B's real expert heat
  (../shared/data/qwen3-30b-a3b-expert-heat.json) with temporal locality (bench/traces.py),
- the same generator with even popularity in Mixtral-8x7B's shape (32 layers x 8 experts,
  top-2): routing far less skewed, where pinning and frequency help little,
- traces recorded from the bundled demo model on held-out text in five languages
  (--demo: `mlxmoe trace record` on 16 held-out prompts per language, 64 generated tokens
  each, into bench/out/demo-LANG.trace.jsonl, kept for later runs; or --traces FILES).

Replay fetches one layer call at a time as the runtime does, and gives the policies the
router's whole distribution where the trace has it (the runtime's traces and the
synthetic ones do).

For each size it prints the hit rates, Belady's, and the share of the LRU->Belady gap the
default `activation` policy closes. Results go to bench/out/policies.json.

    python bench/bench_policies.py                 # synthetic only (about a minute)
    python bench/bench_policies.py --demo          # plus the demo model's traces (a few minutes)

--lofo scores the candidate CANDIDATE with its parameter chosen leave-one-family-out: the
families are the recorded traces grouped by the source they were imported from (the
header's "source" up to ':') plus the synthetic Qwen3-heat and even traces; the parameter
is the one of GRID with the best mean lead over the best baseline on every row of every
family but the one scored (out of sample), printed beside the one chosen on all families
(in sample), with Belady and the share of the LRU->Belady gap each closes.

    python bench/bench_policies.py --lofo --traces /work/data/traces/*.trace.jsonl
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from heldout import LANGUAGES, write_prompts  # noqa: E402
from traces import describe, load_heat, synthetic_records  # noqa: E402

from mlxmoe.policies import DEFAULT_POLICY, ONLINE  # noqa: E402
from mlxmoe.trace import read_trace, replay  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
SHARES = (0.25, 0.5, 0.75)
SMALL_SHARES = (0.05, 0.1, 0.25)  # --lofo, models of 64+ experts: a short trace hits Belady's ceiling by 50 %
CANDIDATE = "activation-floor"
GRID = ("floor_share", (0.0, 0.5, 0.75, 1.0))
BASELINES = ("lru", "lfu", "slru", "s3fifo", "layer-lru", "layer-lfu", "lfuda")


def table(name, header, records, shares=SHARES):
    """Replay every policy and Belady at each share of all experts; print and return rows."""
    L, E = header["num_layers"], header["num_experts"]
    rows = []
    print(f"\n{name}: {L} layers x {E} experts, {len(records)} layer calls "
          f"({describe(records, L, E)['reuse_prev_token']:.0%} of a token's experts reused from the previous token, "
          f"hottest 25% carry {describe(records, L, E)['top25_share']:.0%})")
    print(f"{'cache':>8}" + "".join(f"{p:>12}" for p in ONLINE + ["belady"]) + f"{'gap closed':>12}")
    for share in shares:
        size = int(L * E * share)
        rates = {}
        for policy in ONLINE + ["belady"]:
            tic = time.perf_counter()
            rates[policy] = replay(header, records, policy, size)["hit_rate"]
            rates[policy + "_seconds"] = time.perf_counter() - tic
        gap = rates["belady"] - rates["lru"]
        closed = (rates["activation"] - rates["lru"]) / gap if gap > 0 else float("nan")
        print(f"{share:>7.0%} " + "".join(f"{100 * rates[p]:11.2f}%" for p in ONLINE + ["belady"]) + f"{closed:12.2f}")
        rows.append({"share": share, "cache_experts": size, "rates": rates, "gap_closed": closed,
                     "activation_beats_all": all(rates["activation"] > rates[p] for p in ONLINE if p != "activation")})
    return rows


def synthetic(args):
    heat, k = load_heat()
    results = []
    for seed in range(args.seeds):
        records = synthetic_records(heat, k, args.tokens, layers=args.layers, seed=seed)
        header = {"num_layers": args.layers or heat.shape[0], "num_experts": heat.shape[1], "top_k": k}
        results.append(table(f"synthetic Qwen3-30B-A3B heat, seed {seed}", header, records))
    even = np.ones((32, 8))  # Mixtral-8x7B's shape, every expert equally popular in the long run
    for seed in range(args.seeds):
        records = synthetic_records(even, 2, args.tokens // 2, seed=seed)
        header = {"num_layers": 32, "num_experts": 8, "top_k": 2}
        results.append(table(f"synthetic even popularity, Mixtral shape, seed {seed}", header, records))
    return results


def record_demo_traces(prompts=16, tokens=64):
    """Record the demo model's traces on held-out text, once (kept in bench/out)."""
    paths = []
    for lang in LANGUAGES:
        path = OUT / f"demo-{lang}.trace.jsonl"
        if not path.exists():
            text = write_prompts(lang, OUT / f"heldout-{lang}.txt", prompts)
            print(f"recording {path.name} ...", flush=True)
            subprocess.run([sys.executable, "-m", "mlxmoe", "trace", "record", "--prompts", str(text),
                            "--max-tokens", str(tokens), "-o", str(path)], check=True)
        paths.append(str(path))
    return paths


def recorded(args):
    results = {}
    for path in args.traces:
        header, records = read_trace(path)
        results[Path(path).name] = table(f"{header.get('model') or 'trace'}, {Path(path).name}", header, records,
                                         args.shares)
    return results


def lofo_rows(args):
    """Every (family, trace, share) row with the baselines', the default's, Belady's and each
    GRID value of the candidate's hit rates, and the seconds per layer call of the default
    and the candidate (at GRID's last value)."""
    traces = []
    for path in args.traces:
        header, records = read_trace(path)
        family = header.get("source", Path(path).name).split(":")[0] + f" ({header.get('model', '?')})"
        family = family if not family.startswith(("bigmoeonedge", "moe-ocs")) else family.split(" (")[0]
        shares = SHARES if header["num_experts"] <= 32 else SMALL_SHARES
        traces.append((family, Path(path).name.split(".trace")[0], header, records, shares))
    if args.synthetic:
        heat, k = load_heat()
        header = {"num_layers": args.layers, "num_experts": heat.shape[1], "top_k": k}
        traces.append(("synthetic Qwen3 heat", "seed 0", header,
                       synthetic_records(heat, k, args.tokens, layers=args.layers, seed=0), SHARES))
        header = {"num_layers": 32, "num_experts": 8, "top_k": 2}
        traces.append(("synthetic even", "seed 0", header,
                       synthetic_records(np.ones((32, 8)), 2, args.tokens // 2, seed=0), SHARES))
    key, values = GRID
    rows, seconds = [], {DEFAULT_POLICY: 0.0, CANDIDATE: 0.0}
    for family, name, header, records, shares in traces:
        size = header["num_layers"] * header["num_experts"]
        for share in shares:
            cap = max(int(size * share), header["top_k"])
            rates = {}
            for policy in BASELINES + (DEFAULT_POLICY, "belady"):
                tic = time.perf_counter()
                rates[policy] = replay(header, records, policy, cap)["hit_rate"]
                if policy in seconds:
                    seconds[policy] += (time.perf_counter() - tic) / len(records)
            for value in values:
                tic = time.perf_counter()
                rates[value] = replay(header, records, CANDIDATE, cap, **{key: value})["hit_rate"]
                if value == values[-1]:
                    seconds[CANDIDATE] += (time.perf_counter() - tic) / len(records)
            rows.append({"family": family, "trace": name, "share": share, "rates": rates})
            print(f"  {family} {name} {share:.0%} done", file=sys.stderr, flush=True)
    calls = len(rows)
    return rows, {p: s / calls for p, s in seconds.items()}


def lofo(args):
    rows, seconds = lofo_rows(args)
    key, values = GRID

    def lead(row, rate):
        return rate - max(row["rates"][p] for p in BASELINES)

    def best(on):
        return max(values, key=lambda v: sum(lead(r, r["rates"][v]) for r in on))

    inside = best(rows)
    print(f"\nleave-one-family-out: {CANDIDATE}, {key} chosen from {values} by the mean lead over the best "
          f"baseline ({', '.join(BASELINES)}) on the other families; in sample: {key}={inside} on all")
    print(f"{'family':<34}{'trace':<30}{'cache':>6}{'best baseline':>22}{DEFAULT_POLICY:>11}"
          f"{'out of sample':>20}{'in sample':>11}{'belady':>8}{'gap closed: default / out / in':>33}")
    wins = {DEFAULT_POLICY: 0, "out": 0, "in": 0}
    for family in dict.fromkeys(r["family"] for r in rows):
        outside = best([r for r in rows if r["family"] != family])
        for r in (r for r in rows if r["family"] == family):
            rates = r["rates"]
            base = max(BASELINES, key=rates.get)
            figures = {DEFAULT_POLICY: rates[DEFAULT_POLICY], "out": rates[outside], "in": rates[inside]}
            gap = rates["belady"] - rates["lru"]
            closed = " / ".join(f"{(v - rates['lru']) / gap:.2f}" if gap > 0 else "nan" for v in figures.values())
            for name, v in figures.items():
                wins[name] += v > rates[base]
            print(f"{family:<34}{r['trace'][:29]:<30}{r['share']:>6.0%}{base:>12} {100 * rates[base]:8.2f}%"
                  f"{100 * figures[DEFAULT_POLICY]:10.2f}%{100 * figures['out']:10.2f}% ({key[:5]} {outside:4})"
                  f"{100 * figures['in']:10.2f}%{100 * rates['belady']:7.2f}%{closed:>33}")
    print(f"rows where it beats every baseline, of {len(rows)}: {DEFAULT_POLICY} {wins[DEFAULT_POLICY]}, "
          f"{CANDIDATE} out of sample {wins['out']}, in sample {wins['in']}")
    print("replay seconds per layer call: " + ", ".join(f"{p} {1e6 * s:.0f} us" for p, s in seconds.items()))
    return {"rows": rows, "seconds_per_call": seconds, "in_sample": inside, "wins": wins}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16, help="Layers of the synthetic traces (of 48).")
    ap.add_argument("--tokens", type=int, default=800, help="Tokens per synthetic trace.")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--traces", nargs="*", default=[], help="Recorded mlxmoe.trace/1 files to include.")
    ap.add_argument("--demo", action="store_true", help="Record (once) and include the demo model's traces.")
    ap.add_argument("--shares", type=lambda s: tuple(float(x) for x in s.split(",")), default=SHARES,
                    help="Cache sizes of the recorded traces, as shares of all experts (default 0.25,0.5,0.75; "
                         "a trace of a few hundred tokens of a 128-expert model reaches Belady's ceiling "
                         "by 0.5: use smaller shares there).")
    ap.add_argument("--no-synthetic", dest="synthetic", action="store_false", help="Only the recorded traces.")
    ap.add_argument("--lofo", action="store_true",
                    help=f"Leave-one-family-out evaluation of {CANDIDATE} (see above) instead of the tables.")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    if args.lofo:
        (OUT / "policies-lofo.json").write_text(json.dumps(lofo(args), indent=1))
        return
    if args.demo:
        args.traces += record_demo_traces()
    out = {"synthetic": synthetic(args) if args.synthetic else [], "recorded": recorded(args) if args.traces else {}}
    (OUT / "policies.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
