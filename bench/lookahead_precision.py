"""How well the next MoE layer's router, applied to this layer's input, guesses the next
layer's experts (the lookahead prefetch relies on it), on a qwen3_moe checkpoint, for
residual branches scaled by each factor given (attention's and the experts' output
projections, scaled in memory): precision per layer pair, the mean cosine of consecutive
MoE inputs, the distinct experts each layer uses over the prompt and the share of a
token's experts the previous token also used.

    python bench/lookahead_precision.py /tmp/mlxmoe-bench/qwen3-30b-shapes-8L --scales 1,0.1
    python bench/lookahead_precision.py mlxmoe/demo
"""

import argparse

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.base import create_attention_mask

TEXT = ("Once upon a time there was a little fox who lived in the forest. The fox liked to run and play in the "
        "sun all day long with friends.")


def measure(model, ids):
    inner, k = model.model, model.args.num_experts_per_tok
    h = inner.embed_tokens(ids)
    mask = create_attention_mask(h, None)
    xs = []
    for layer in inner.layers:  # qwen3_moe's decoder layer, keeping each MoE input
        h = h + layer.self_attn(layer.input_layernorm(h), mask, None)
        xs.append(layer.post_attention_layernorm(h))
        h = h + layer.mlp(xs[-1])
    mx.eval(xs)
    top = lambda l, x: np.argsort(-np.array(inner.layers[l].mlp.gate(x))[0], axis=-1)[:, :k]
    precision, cosine = [], []
    for l in range(len(xs) - 1):
        true, guess = top(l + 1, xs[l + 1]), top(l + 1, xs[l])
        precision.append(np.mean([len(set(a) & set(b)) / k for a, b in zip(true, guess)]))
        a, b = np.array(xs[l])[0], np.array(xs[l + 1])[0]
        cosine.append(np.mean((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)))
    used = [top(l, x) for l, x in enumerate(xs)]
    reuse = np.mean([len(set(u[t]) & set(u[t - 1])) / k for u in used for t in range(1, len(u))])
    return precision, float(np.mean(cosine)), [len(np.unique(u)) for u in used], float(reuse)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--scales", default="1", help="Comma-separated factors for the residual branches.")
    args = ap.parse_args()
    model, tokenizer = load(args.model)
    model.set_dtype(mx.float32)
    ids = mx.array(tokenizer.encode(TEXT))[None]
    projections = [m for layer in model.model.layers for m in (layer.self_attn.o_proj, layer.mlp.switch_mlp.down_proj)]
    original = [(m.scales, m.biases) for m in projections]  # affine 4-bit: output scales with both
    print(f"{len(ids[0])} tokens")
    for scale in (float(s) for s in args.scales.split(",")):
        for m, (s, b) in zip(projections, original):
            m.scales, m.biases = s * scale, b * scale
        precision, cosine, distinct, reuse = measure(model, ids)
        print(f"scale {scale}: lookahead precision {np.mean(precision):.2f} (per layer {np.round(precision, 2).tolist()}), "
              f"cosine of consecutive MoE inputs {cosine:.3f}, distinct experts per layer {distinct}, "
              f"previous-token reuse {reuse:.2f}")


if __name__ == "__main__":
    main()
