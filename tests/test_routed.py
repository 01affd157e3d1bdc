"""bench/routed.py, recorded routing for the benches (bench_host.py and bench_disk.py --routing): a
model that follows a recording routes, at each context position and MoE layer, to the recording's
experts (a missing cell: the position before it; a model with fewer layers: the recording's
first ones), stock mlx-lm and mlxmoe (loaded after routed.install) alike, and mlxmoe's
output at a partial cache (verified steps that replay included) equals stock's under it. Run in
a child process: following a recording patches mlx's Linear classes for good."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS, EXPERTS, K, PREFILL, DECODE = 3, 8, 2, 4, 40
RECORDED_LAYERS = LAYERS + 1  # the model routes as the recording's first layers

SCRIPT = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import mlx_lm, mlxmoe, routed
model_path, recording, prompt = sys.argv[2], sys.argv[3], "hello there"
meta, logits, first_decode = routed.read(recording)
seen = []
def watch(model):
    for i, layer in enumerate(model.layers):
        sw = layer.mlp.switch_mlp
        cls = type(sw)
        def call(self, x, idx, cls=cls, i=i):
            seen.append((i, np.array(idx).reshape(-1, idx.shape[-1]).tolist()))
            return cls.__call__(self, x, idx)
        sw.__class__ = type("Watched" + cls.__name__, (cls,), {"__call__": call})
model, tok = mlx_lm.load(model_path)
routed.follow(model, logits, first_decode, len(tok.encode(prompt)))
watch(model)
stock = [int(r.token) for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=24)]
stock_seen = list(seen)
routed.install(recording, prompt)  # (every model loaded from here on)
streamed, tok = mlxmoe.load(model_path, cache_experts=int(sys.argv[4]))
ours = [int(r.token) for r in mlxmoe.stream_generate(streamed, tok, prompt, max_tokens=24)]
stats = streamed.expert_cache.stats()
print(json.dumps({"meta": meta, "first_decode": first_decode, "prompt": len(tok.encode(prompt)),
                  "seen": stock_seen, "stock": stock, "ours": ours, "misses": stats["misses"],
                  "replays": stats.get("replays", 0)}))
"""


def _recording(path, rng, drop=None, bad_row=False):
    """A BigMoeOnEdge route_trace of PREFILL + DECODE positions; `drop`: a (step, layer) cell left out."""
    lines = ["# route_trace v1", f"# model=/x/tiny.gguf arch=qwen3moe n_layer={RECORDED_LAYERS} n_expert={EXPERTS} "
             f"n_expert_used={K}", "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes"]
    chosen = {}
    for step in range(PREFILL + DECODE):
        for layer in range(RECORDED_LAYERS):
            experts = rng.choice(EXPERTS, size=K, replace=False).tolist()
            weights = sorted(rng.random(K), reverse=True)
            chosen[step, layer] = experts
            if (step, layer) == drop:
                continue
            if bad_row and (step, layer) == (5, 1):  # one expert more than the top-k
                experts = experts + [next(e for e in range(EXPERTS) if e not in experts)]
                weights = weights + [weights[-1]]
            for slot, (e, w) in enumerate(zip(experts, weights)):
                lines.append(f"0,{int(step >= PREFILL)},{step},{layer},{slot},{e},{w / sum(weights):.6f},0,100")
    path.write_text("\n".join(lines) + "\n")
    return chosen


def test_a_model_routes_as_the_recording_did_and_mlxmoe_answers_as_stock(tmp_path, checkpoint):
    model = checkpoint("qwen3_moe", config_overrides={"num_hidden_layers": LAYERS, "num_experts": EXPERTS,
                                                      "num_experts_per_tok": K})
    recording = tmp_path / "route.csv"
    chosen = _recording(recording, np.random.default_rng(0), drop=(PREFILL + 3, 2))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "bench"), str(model), str(recording),
                          str(LAYERS * EXPERTS // 2)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["meta"]["num_layers"] == RECORDED_LAYERS and r["meta"]["top_k"] == K and r["first_decode"] == PREFILL
    positions = PREFILL + DECODE
    chosen[PREFILL + 3, 2] = chosen[PREFILL + 2, 2]  # the missing cell: the position before it
    shift, position, checked = r["first_decode"] - r["prompt"], 0, 0
    calls = r["seen"]
    for start in range(0, len(calls), LAYERS):  # each model call: one layer call a MoE layer
        rows = len(calls[start][1])
        for layer, indices in calls[start:start + LAYERS]:
            for j, row in enumerate(indices):
                assert sorted(row) == sorted(chosen[(position + j + shift) % positions, layer]), (position + j, layer)
                checked += 1
        position += rows
    assert checked >= (r["prompt"] + 20) * LAYERS
    assert r["ours"] == r["stock"] and r["misses"] > 0


def test_a_recording_whose_cell_has_another_top_k_is_refused_naming_its_line(tmp_path):
    recording = tmp_path / "route.csv"
    _recording(recording, np.random.default_rng(1), bad_row=True)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import routed
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from mlxmoe.errors import MlxmoeError

    with pytest.raises(MlxmoeError, match=rf"{recording}:\d+: 3 distinct experts, the recording's top-k is 2"):
        routed.read(str(recording))


BATCH_SCRIPT = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import mlx.core as mx, mlx_lm, routed
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
routed.install(sys.argv[3], "", by_token=True)
model, tok, config = mlx_lm.utils.load(sys.argv[2], return_config=True)  # (as mlx_lm.server loads)
seen = []
for i, layer in enumerate(model.layers):
    sw = layer.mlp.switch_mlp
    cls = type(sw)
    def call(self, x, idx, cls=cls, i=i):
        seen.append((i, np.array(idx).tolist()))
        return cls.__call__(self, x, idx)
    sw.__class__ = type("Watched" + cls.__name__, (cls,), {"__call__": call})
def run(cache, *steps):
    out = []
    for tokens in steps:
        seen.clear()
        model(mx.array(tokens), cache=cache)
        out.append(list(seen))
    return out
prompts, nxt = [[0, 5, 9], [7, 3, 11]], [[4], [8]]
batched = run([BatchKVCache([1, 0]) for _ in model.layers], prompts, nxt)  # row 0 left-padded by one
alone = run(make_prompt_cache(model), [prompts[1]], [nxt[1]])
print(json.dumps({"batched": batched, "alone": alone, "prompts": prompts, "next": nxt}))
"""


def test_a_batch_routes_each_row_at_its_position_moved_by_its_token(tmp_path, checkpoint):
    """by_token (bench_batch.py's servers): each row of a batch (mlx-lm's BatchKVCache, a row
    left-padded) routes as the recording's step (position + 7919 x input token) at each layer,
    and a row alone routes as it does in the batch."""
    model = checkpoint("qwen3_moe", config_overrides={"num_hidden_layers": LAYERS, "num_experts": EXPERTS,
                                                      "num_experts_per_tok": K})
    recording = tmp_path / "route.csv"
    chosen = _recording(recording, np.random.default_rng(2))
    out = subprocess.run([sys.executable, "-c", BATCH_SCRIPT, str(ROOT / "bench"), str(model), str(recording)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    positions = PREFILL + DECODE
    shift = PREFILL  # (the recording's first decode step, for an empty prompt)

    def want(position, token, layer):
        return sorted(chosen[(position + shift + 7919 * token) % positions, layer])

    tokens = [r["prompts"][0][1:], r["prompts"][1]]  # each row's real tokens, at positions 0, 1, ...
    for step, calls in enumerate(r["batched"]):
        assert [layer for layer, _ in calls] == list(range(LAYERS))
        for layer, rows in calls:
            for b, row in enumerate(rows):
                real = tokens[b] if step == 0 else [r["next"][b][0]]
                first = 0 if step == 0 else len(tokens[b])
                for j, experts in enumerate(row[len(row) - len(real):]):  # (row 0's padding: not a token of it)
                    assert sorted(experts) == want(first + j, real[j], layer), (step, layer, b, j)
    assert [[[layer, rows[0]] for layer, rows in calls] for calls in r["alone"]] == \
           [[[layer, rows[1]] for layer, rows in calls] for calls in r["batched"]]
    # two requests at the same position (0) with distinct tokens route as distinct steps
    assert any(sorted(rows[0][1]) != sorted(rows[1][0]) for _, rows in r["batched"][0])
