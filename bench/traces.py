"""Synthetic routing traces whose per-layer popularity follows real expert heat
(bench/data/qwen3-30b-a3b-expert-heat.json: mbolt's, MIT, bench/data/LICENSE-mbolt) with
temporal locality.

Each layer's router logits are log(popularity) plus two Gaussian AR(1) processes: a
slow one (topic drift over hundreds of tokens) and a fast one (token-to-token
locality); the top-k of the logits are the token's experts. Written as mlxmoe.trace/1.
"""

import argparse
import json
from pathlib import Path

import numpy as np

from system import check_outputs, write_atomic

HEAT = Path(__file__).resolve().parent / "data" / "qwen3-30b-a3b-expert-heat.json"


def load_heat(path=HEAT):
    data = json.loads(Path(path).read_text())
    heat = np.asarray(data["heat"], dtype=np.float64)
    return heat, data["top_k"]


def synthetic_records(heat, top_k, tokens, *, layers=None, slow=0.998, fast=0.4, sigma_slow=0.8, sigma_fast=1.0,
                      temperature=2.5, seed=0, sequences=1):
    """Records (s, t, l, experts, probs, router distribution) for `tokens` tokens per
    sequence (the distribution is the softmax of the logits, as a router's would be)."""
    rng = np.random.default_rng(seed)
    heat = heat[:layers] if layers else heat
    L, E = heat.shape
    logp = np.log((heat + 1.0) / (heat + 1.0).sum(axis=1, keepdims=True)) / temperature
    records = []
    for s in range(sequences):
        z_slow = rng.normal(size=(L, E)) * sigma_slow
        z_fast = rng.normal(size=(L, E)) * sigma_fast
        for t in range(tokens):
            z_slow = slow * z_slow + np.sqrt(1 - slow ** 2) * sigma_slow * rng.normal(size=(L, E))
            z_fast = fast * z_fast + np.sqrt(1 - fast ** 2) * sigma_fast * rng.normal(size=(L, E))
            logits = logp + z_slow + z_fast
            top = np.argpartition(-logits, top_k, axis=1)[:, :top_k]
            for l in range(L):
                e = top[l][np.argsort(-logits[l, top[l]])]
                w = np.exp(logits[l] - logits[l].max())
                dist = w / w.sum()
                records.append((s, t, l, e.tolist(), np.round(dist[e], 5).tolist(), dist))
    return records


def describe(records, L, E):
    """Top-25 % share of activations per layer, and the share of a token's experts that
    the previous token of the same layer also used."""
    counts = np.zeros((L, E))
    prev, reuse, total = {}, 0, 0
    for s, t, l, e, *_ in records:
        counts[l, e] += 1
        if (s, l) in prev:
            reuse += len(prev[(s, l)] & set(e))
            total += len(e)
        prev[(s, l)] = set(e)
    share = np.sort(counts, axis=1)[:, ::-1][:, : E // 4].sum(axis=1) / counts.sum(axis=1)
    return {"top25_share": float(share.mean()), "reuse_prev_token": reuse / max(total, 1)}


def write_trace(path, records, L, E, k, model="synthetic"):
    lines = [json.dumps({"format": "mlxmoe.trace/1", "num_layers": L, "num_experts": E, "top_k": k, "model": model})]
    for s, t, l, e, p, dist in records:
        line = {"s": s, "t": t, "l": l, "e": e, "p": p, "r": [float(f"{x:.3g}") for x in dist]}
        lines.append(json.dumps(line, separators=(",", ":")))
    write_atomic(path, "\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--even", action="store_true", help="Even popularity in Mixtral-8x7B's shape (32 x 8, top-2).")
    args = ap.parse_args()
    check_outputs({"--out": args.out}, {"the heat": None if args.even else HEAT})
    heat, k = (np.ones((32, 8)), 2) if args.even else load_heat()
    records = synthetic_records(heat, k, args.tokens, layers=args.layers, seed=args.seed)
    L = args.layers or heat.shape[0]
    write_trace(args.out, records, L, heat.shape[1], k)
    print(json.dumps(describe(records, L, heat.shape[1])))


if __name__ == "__main__":
    main()
