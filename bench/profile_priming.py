"""Profiles on real routing: does a profile built from some prompts of a model prime the
replay of another prompt of the same model, and what does a profile of another workload cost?

For each pair (profile source -> target) of imported real traces (bench/real_traces.py),
the hit rate over the target's first `--tokens` tokens
(prompt tokens included where the trace has them) at `--share` of all experts, replayed
with no profile and with the source's profile (`trace replay --profile`: the policy's prior
and pins, the cache pre-warmed in the profile's order), for every online policy; and the
same over the whole target trace. Pairs:
  - Mixtral-8x7B (speculative-moe dev problems only): GSM8K problem 0 -> HumanEval problem 1
    and back (math vs code: another workload of the same model);
  - Qwen3.6-35B-A3B (moe_ocs_learning): the vLLM recording -> the MLX recording of the same
    prompt and back (same workload; the decodes diverge after a few tokens).
The models' other real traces (bigmoeonedge) hold one prompt each: no pair to make.

    python bench/profile_priming.py --traces TRACES [--share 0.5] [--tokens 64]

TRACES (or $MLXMOE_TRACES): the folder of the traces; a pair whose traces it lacks is left out.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxmoe.caching.policies import ONLINE
from mlxmoe.caching.policies import HALF_LIFE_PROFILE
from mlxmoe.workload.trace import build_profile, read_trace, replay

PAIRS = [
    ("Mixtral-8x7B", "mixtral-gsm8k-p0", "mixtral-humaneval-p1"),
    ("Mixtral-8x7B", "mixtral-humaneval-p1", "mixtral-gsm8k-p0"),
    ("Qwen3.6-35B-A3B", "moe-ocs-qwen3.6-35b-a3b.vllm", "moe-ocs-qwen3.6-35b-a3b.mlx"),
    ("Qwen3.6-35B-A3B", "moe-ocs-qwen3.6-35b-a3b.mlx", "moe-ocs-qwen3.6-35b-a3b.vllm"),
]


def first_tokens(records, tokens):
    """The records of each sequence's first `tokens` positions (online policies decide
    causally, so their hits there are those of the whole replay's start)."""
    return [r for r in records if r[1] < tokens]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default=os.environ.get("MLXMOE_TRACES"),
                    help="folder of the imported traces (bench/real_traces.py); default $MLXMOE_TRACES")
    ap.add_argument("--share", type=float, default=0.5, help="cache size as a share of all experts")
    ap.add_argument("--tokens", type=int, default=64, help="the first tokens scored")
    ap.add_argument("--policies", default=",".join(ONLINE))
    args = ap.parse_args()
    if not args.traces:
        sys.exit("give --traces TRACES or set MLXMOE_TRACES: the folder of the imported real routing "
                 "(python bench/real_traces.py REAL_ROUTING TRACES)")
    policies = args.policies.split(",")
    pairs = [p for p in PAIRS if all((Path(args.traces) / f"{name}.trace.jsonl").exists() for name in p[1:])]
    if not pairs:
        sys.exit(f"{args.traces} holds the traces of no pair ({', '.join(f'{s} -> {t}' for _, s, t in PAIRS)})")
    traces = {}

    def load(name):
        if name not in traces:
            traces[name] = read_trace(Path(args.traces) / f"{name}.trace.jsonl")
        return traces[name]

    tic = time.time()
    print(f"hit rate at {100 * args.share:.0f} % cache: first {args.tokens} tokens (whole trace), "
          f"profile half-life {HALF_LIFE_PROFILE} tokens")
    print("| model | profile of -> replay of | policy | no profile | with profile | change (points) | "
          "whole trace: no profile | with | change |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = {}
    for model, source, target in pairs:
        sh, sr = load(source)
        profile = build_profile([(source, sh, sr)], source)
        header, records = load(target)
        cache = round(header["num_layers"] * header["num_experts"] * args.share)
        head = first_tokens(records, args.tokens)
        for policy in policies:
            cold, warm = (replay(header, head, policy, cache, p)["hit_rate"] for p in (None, profile))
            whole_cold, whole_warm = (replay(header, records, policy, cache, p)["hit_rate"] for p in (None, profile))
            d = 100 * (warm - cold)
            worst[policy] = min(worst.get(policy, d), d)
            print(f"| {model} | {source} -> {target} | {policy} | {100 * cold:.1f} | {100 * warm:.1f} | {d:+.1f} | "
                  f"{100 * whole_cold:.1f} | {100 * whole_warm:.1f} | {100 * (whole_warm - whole_cold):+.1f} |")
    print("worst change over the first tokens, per policy: " +
          ", ".join(f"{p} {d:+.1f}" for p, d in worst.items()))
    print(f"({time.time() - tic:.0f} s)")


if __name__ == "__main__":
    main()
