"""Make this folder's sample routing logs: the demo model's routing of two short chats,
recorded by `mlxmoe trace record` and written in each format `mlxmoe trace import` reads
(as vLLM, SGLang, speculative-moe, BigMoeOnEdge and moe_ocs_learning log routing), so
that the README's routing commands run as written.

    python examples/routing/make.py     # a few seconds; rewrites the files here
"""

import base64
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CHATS = ["Ciao! Come stai oggi?", "Hello, how are you today?"]
NAMES = ["it", "en"]


def record():
    """The demo's trace of CHATS (mlxmoe.trace/1), without the optional full router
    distributions ("r"), which would make it five times the size."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts, out = Path(tmp) / "chats.txt", Path(tmp) / "demo.trace.jsonl"
        prompts.write_text("\n".join(CHATS) + "\n")
        subprocess.run([sys.executable, "-m", "mlxmoe", "trace", "record", "--prompts", str(prompts),
                        "--chat-template", "--max-tokens", "8", "-o", str(out)], check=True)
        lines = [json.loads(l) for l in out.read_text().splitlines()]
    for r in lines[1:]:
        r.pop("r", None)
    (HERE / "demo.trace.jsonl").write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in lines))
    return lines[0], lines[1:]


def sequences(records):
    """{sequence: (prompt tokens, [(token, layer, experts, probs)])}: a prompt is the tokens
    of multi-token layer calls ("n") and the last one, which runs alone."""
    out = {}
    for r in records:
        out.setdefault(r["s"], []).append((r["t"], r["l"], r["e"], [round(p, 4) for p in r["p"]]))
    prompt = {s: max((r["t"] for r in records if r["s"] == s and "n" in r), default=-1) + 2 for s in out}
    return {s: (prompt[s], sorted(rows)) for s, rows in out.items()}


def main():
    header, records = record()
    seqs = sequences(records)
    L, E, K, model = header["num_layers"], header["num_experts"], header["top_k"], header["model"]
    lines = [{"type": "meta", "model_id": model, "num_experts": E, "top_k": K}]
    for s, (prompt, rows) in seqs.items():
        lines += [{"type": "route", "req_id": NAMES[s], "token_idx": t, "layer": l, "topk_ids": e, "topk_weights": p,
                   "phase": "prefill" if t < prompt else "decode"} for t, l, e, p in rows]
    write("vllm.jsonl", lines)
    write("specmoe.jsonl", [{"dataset": "demo", "problem_id": s, "layer": l, "token_idx": t, "experts": e,
                             "gating_probs": p} for s, (_, rows) in seqs.items() for t, l, e, p in rows])
    responses = []
    for s, (prompt, rows) in seqs.items():  # [tokens, layers, top_k] int32 over positions [0, prompt + completion - 1)
        ids = np.array([e for _, _, e, _ in rows], dtype=np.int32).reshape(-1, L, K)
        responses.append({"meta_info": {"id": NAMES[s], "prompt_tokens": prompt, "completion_tokens": len(ids) - prompt + 1,
                                        "routed_experts": base64.b64encode(ids.tobytes()).decode()}})
    write("sglang.jsonl", responses)
    csv = [f"# model={model} n_layer={L} n_expert={E} n_expert_used={K}", "turn,phase,step,layer,slot,expert,weight"]
    for s, (prompt, rows) in seqs.items():
        for t, l, e, p in rows:
            ranked = sorted(zip(p, e), reverse=True)
            csv += [f"{s},{int(t >= prompt)},{t},{l},{slot},{x},{w}" for slot, (w, x) in enumerate(ranked)]
    (HERE / "bigmoeonedge.csv").write_text("\n".join(csv) + "\n")
    prompt, rows = seqs[0]  # one sequence per file
    routes = {}
    for t, l, e, p in rows:
        routes.setdefault(t, {"token_pos": t, "phase": "prefill" if t < prompt else "decode", "layers": {}})
        routes[t]["layers"][str(l)] = {"experts": e, "weights": p}
    doc = {"meta": {"model_id": model, "num_moe_layers": L, "num_experts": E, "top_k": K}, "routes": list(routes.values())}
    (HERE / "moe-ocs.json").write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    for f in sorted(HERE.iterdir()):
        print(f"{f.name}: {f.stat().st_size} bytes")


def write(name, objects):
    (HERE / name).write_text("".join(json.dumps(o, separators=(",", ":")) + "\n" for o in objects))


if __name__ == "__main__":
    main()
