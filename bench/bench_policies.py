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

from mlxmoe.policies import ONLINE  # noqa: E402
from mlxmoe.trace import read_trace, replay  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
SHARES = (0.25, 0.5, 0.75)


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
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    if args.demo:
        args.traces += record_demo_traces()
    out = {"synthetic": synthetic(args) if args.synthetic else [], "recorded": recorded(args) if args.traces else {}}
    (OUT / "policies.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
