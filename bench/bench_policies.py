"""Policy benchmark: hit rates of every policy against Belady at 25/50/75 % of all
experts, on two families of routing, in one run:

- synthetic traces whose per-layer popularity follows Qwen3-30B-A3B's real expert heat
  (bench/data/qwen3-30b-a3b-expert-heat.json) with temporal locality (bench/traces.py),
- the same generator with even popularity in Mixtral-8x7B's shape (32 layers x 8 experts,
  top-2): routing far less skewed, where pinning and frequency help little,
- traces recorded from the bundled demo model on held-out text in five languages
  (--demo: `mlxmoe trace record` on 16 held-out prompts per language, 64 generated tokens
  each, into bench/out/demo-LANG.trace.jsonl, kept for later runs; or --traces FILES).

Replay fetches one layer call at a time as the runtime does, and gives the policies the
router's whole distribution where the trace has it (the runtime's traces and the
synthetic ones do).

For each size it prints the hit rates, Belady's, and the share of the LRU->Belady gap the
default policy closes. Results go to bench/out/policies.json.

    python bench/bench_policies.py                 # synthetic only (about a minute)
    python bench/bench_policies.py --demo          # plus the demo model's traces (a few minutes)

--lofo judges the default honestly: its parameter (GRID) is chosen leave-one-family-out,
by the best mean lead over the best baseline on every row of every family but the one
scored, and printed beside the value chosen on all families (in sample), today's
`activation` before real routing chose the default, Belady, and the share of the
LRU->Belady gap each closes, with that of the oracle told each layer's experts at its next
visit (policy_ceiling.py). Families: the recorded traces grouped by the source they were
imported from (the header's "source" up to ':', else the model), plus the synthetic
Qwen3-heat and even traces. Models of 64+ experts are scored at 5/10/25 % (a few hundred
tokens of them meet Belady's ceiling by 50 %).

    python bench/bench_policies.py --lofo --demo --traces TRACES/*.trace.jsonl   # TRACES: bench/real_traces.py's
"""

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from heldout import LANGUAGES, write_prompts  # noqa: E402
from system import check_outputs, write_json  # noqa: E402
from policy_ceiling import next_visit_hit_rate  # noqa: E402
from traces import describe, load_heat, synthetic_records  # noqa: E402

from mlxmoe.caching.policies import DEFAULT_POLICY, FLOOR_SLACK, ONLINE  # noqa: E402
from mlxmoe.workload.trace import read_trace, replay  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
SHARES = (0.25, 0.5, 0.75)
SMALL_SHARES = (0.05, 0.1, 0.25)  # --lofo, models of 64+ experts: a short trace hits Belady's ceiling by 50 %
# the default's parameter: values, shipped (its half-life, 0.5, was chosen the same way from 0.25/0.5/1/2/4/24)
GRID = ("floor_slack", (0, 0.5, 1), FLOOR_SLACK)
BEFORE = "activation"  # the default before real routing chose it
BASELINES = ("lru", "lfu", "slru", "s3fifo", "layer-lru", "layer-lfu", "lfuda")


def table(name, header, records, shares=SHARES):
    """Replay every policy and Belady at each share of all experts; print and return rows."""
    L, E = header["num_layers"], header["num_experts"]
    rows = []
    print(f"\n{name}: {L} layers x {E} experts, {len(records)} layer calls "
          f"({describe(records, L, E)['reuse_prev_token']:.0%} of a token's experts reused from the previous token, "
          f"hottest 25% carry {describe(records, L, E)['top25_share']:.0%})")
    widths = {p: max(12, len(p) + 2) for p in ONLINE + ["belady"]}  # columns at least one space apart
    print(f"{'cache':>8}" + "".join(f"{p:>{w}}" for p, w in widths.items()) + f"{'gap closed':>12}")
    for share in shares:
        size = int(L * E * share)
        rates = {}
        for policy in ONLINE + ["belady"]:
            tic = time.perf_counter()
            rates[policy] = replay(header, records, policy, size)["hit_rate"]
            rates[policy + "_seconds"] = time.perf_counter() - tic
        gap = rates["belady"] - rates["lru"]
        closed = (rates[DEFAULT_POLICY] - rates["lru"]) / gap if gap > 0 else float("nan")
        print(f"{share:>7.0%} " + "".join(f"{100 * rates[p]:{w - 1}.2f}%" for p, w in widths.items()) + f"{closed:12.2f}")
        rows.append({"share": share, "cache_experts": size, "rates": rates, "gap_closed": closed,
                     "default_beats_all": all(rates[DEFAULT_POLICY] > rates[p] for p in ONLINE if p != DEFAULT_POLICY)})
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


def families(args):
    """(family, trace name, header, records, shares) of every trace --lofo scores."""
    traces = []
    for path in args.traces:
        header, records = read_trace(path)
        source = header.get("source", "").split(":")[0]
        family = f"{source} ({header.get('model', '?')})" if source == "specmoe" else source or header.get("model", "?")
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
    return traces


def lofo_rows(args):
    """Every (family, trace, share) row with the hit rates of the baselines, BEFORE, Belady,
    the next-visit oracle and the default at each GRID value, and the replay's host time per
    layer call of BEFORE and of the default as shipped (the best of two runs each, alternated)."""
    key, values, _ = GRID
    rows = []
    for family, name, header, records, shares in families(args):
        size = header["num_layers"] * header["num_experts"]
        for share in shares:
            cap = max(int(size * share), header["top_k"])
            rates = {"oracle": next_visit_hit_rate(header, records, cap)}
            for policy in BASELINES + (BEFORE, "belady"):
                rates[policy] = replay(header, records, policy, cap)["hit_rate"]
            for value in values:
                rates[value] = replay(header, records, DEFAULT_POLICY, cap, **{key: value})["hit_rate"]
            seconds = {BEFORE: math.inf, DEFAULT_POLICY: math.inf}
            for _ in range(2):
                for policy in seconds:
                    tic = time.perf_counter()
                    replay(header, records, policy, cap)
                    seconds[policy] = min(seconds[policy], (time.perf_counter() - tic) / len(records))
            rows.append({"family": family, "trace": name, "share": share, "rates": rates, "seconds_per_call": seconds})
            print(f"  {family} {name} {share:.0%} done", file=sys.stderr, flush=True)
    return rows


def lofo(args):
    rows = lofo_rows(args)
    key, values, shipped = GRID

    def lead(row, rate):
        return rate - max(row["rates"][p] for p in BASELINES)

    def best(on):
        return max(values, key=lambda v: sum(lead(r, r["rates"][v]) for r in on))

    inside = best(rows)
    print(f"\nleave-one-family-out: {DEFAULT_POLICY}'s {key} chosen from {values} by the mean lead over the best "
          f"baseline ({', '.join(BASELINES)}) on the other families; on all (in sample): {inside}; shipped: {shipped}")
    print(f"{'family':<30}{'trace':<26}{'cache':>6}{'best baseline':>20}{BEFORE:>11}{'out of sample':>20}"
          f"{'in sample':>10}{'belady':>8}   gap closed: {BEFORE} / out / in / next-visit oracle")
    wins = {BEFORE: 0, "out": 0, "in": 0}
    for family in dict.fromkeys(r["family"] for r in rows):
        outside = best([r for r in rows if r["family"] != family])
        for r in (r for r in rows if r["family"] == family):
            rates = r["rates"]
            base = max(BASELINES, key=rates.get)
            figures = {BEFORE: rates[BEFORE], "out": rates[outside], "in": rates[inside]}
            gap = rates["belady"] - rates["lru"]
            closed = " / ".join(f"{(v - rates['lru']) / gap:.2f}" if gap > 0 else "nan"
                                for v in [*figures.values(), rates["oracle"]])
            for name, v in figures.items():
                wins[name] += v > rates[base]
            r.update(outside=outside, best_baseline=base)
            print(f"{family[:29]:<30}{r['trace'][:25]:<26}{r['share']:>6.0%}{base:>11}{100 * rates[base]:8.2f}%"
                  f"{100 * figures[BEFORE]:10.2f}%{100 * figures['out']:10.2f}% ({outside:>5})"
                  f"{100 * figures['in']:9.2f}%{100 * rates['belady']:7.2f}%   {closed}")
    print(f"rows where it beats every baseline, of {len(rows)}: {BEFORE} {wins[BEFORE]}, "
          f"{DEFAULT_POLICY} out of sample {wins['out']}, in sample {wins['in']}")
    times = {p: np.median([r["seconds_per_call"][p] for r in rows]) for p in (BEFORE, DEFAULT_POLICY)}
    ratio = np.median([r["seconds_per_call"][DEFAULT_POLICY] / r["seconds_per_call"][BEFORE] for r in rows])
    print("replay host time per layer call, median over the rows: "
          + ", ".join(f"{p} {1e6 * s:.1f} us" for p, s in times.items()) + f"; {DEFAULT_POLICY} / {BEFORE} {ratio:.2f}")
    return {"rows": rows, "in_sample": inside, "wins": wins}


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
                    help="Leave-one-family-out evaluation of the default (see above) instead of the tables.")
    args = ap.parse_args()
    result = OUT / ("policies-lofo.json" if args.lofo else "policies.json")
    check_outputs({"the results": result}, {"--traces": args.traces})  # (the demo traces: mlxmoe trace record's)
    if args.demo:
        args.traces += record_demo_traces()
    if args.lofo:
        write_json(result, lofo(args))
        return
    write_json(result, {"synthetic": synthetic(args) if args.synthetic else [],
                        "recorded": recorded(args) if args.traces else {}})


if __name__ == "__main__":
    main()
