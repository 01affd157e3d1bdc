"""Synthetic checkpoints of real mlx-lm MoE architectures.

Builds tiny (and optionally large) random checkpoints with mlx-lm's own model
classes, quantization and save functions, plus a byte-level BPE tokenizer
trained locally, so tests and benchmarks never need the Hugging Face hub.

Shared by tests/ (conftest.py's fixtures; pytest puts the repository root on sys.path)
and bench/ (each script puts the repository root on sys.path); not part of the package.

    python synthetic.py --arch qwen3_moe --out /tmp/tiny --quant 4bit
    python synthetic.py --large --out /tmp/large --num-layers 4
"""

import argparse
import contextlib
import io
import json
import math
import shutil
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")

QUANT = {
    "4bit": {"group_size": 32, "bits": 4, "mode": "affine"},
    "mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
}

DTYPES = ("float32", "bfloat16", "float16")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)  # specials get the first ids

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{{ message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The mixture of experts model sends every token to a few small networks, "
    "called experts, chosen by a router. Only the chosen experts are read from "
    "memory, so a large model can run on a small machine if the weights stream "
    "from disk quickly enough.",
    "Hello world! This is a tiny corpus used to train a byte level tokenizer. "
    "It has numbers like 1, 2, 3, 42 and 2048, punctuation; quotes \"like this\" "
    "and some code: def forward(x): return x * 2.",
    "Once upon a time there was a little fox who lived in the forest. Every "
    "morning the fox walked to the river, drank some water and watched the "
    "birds flying over the trees.",
    "Il modello a miscela di esperti invia ogni token a poche piccole reti, "
    "chiamate esperti, scelte da un router. Solo gli esperti scelti vengono "
    "letti dalla memoria, quindi un modello grande può funzionare su una "
    "macchina piccola.",
    "C'era una volta una piccola volpe che viveva nel bosco. Ogni mattina la "
    "volpe camminava fino al fiume, beveva un po' d'acqua e guardava gli "
    "uccelli volare sopra gli alberi. Perché la città è così bella di sera?",
    "Buongiorno! Come stai? Oggi è una bella giornata: il sole splende, il "
    "caffè è caldo e la pizza è già nel forno. Grazie mille e arrivederci.",
]

# Dense (non-expert) MLPs, expert MLPs and MLA ranks are all multiples of 32 so
# that 4-bit affine (group 32) and mxfp4 (group 32) quantize every matrix.
_COMMON = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

_ARCH_CONFIGS = {
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "qwen2_moe": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "num_hidden_layers": 3,
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "olmoe": {
        "architectures": ["OlmoeForCausalLM"],
        "num_hidden_layers": 3,
        "intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
    },
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
    },
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": 32,
        "rope_theta": 150000.0,
        # gpt-oss's own YaRN settings (transformers warns without them).
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    },
}

# lm_head = LM_SCALE * random - ANTI_REPEAT * embeddings (see _init_model).
LM_SCALE = 4.0
ANTI_REPEAT = 0.5


def train_tokenizer(out_dir, texts=None, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE tokenizer with ChatML specials and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    texts = list(texts) if texts is not None else CORPUS * 8
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    assert tok.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


def _tokenizer_info(tok_dir: Path):
    """(vocab size, eos id) of a saved tokenizer."""
    with open(tok_dir / "tokenizer.json") as f:
        tok = json.load(f)
    vocab = dict(tok["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    eos = EOS_TOKEN
    config_file = tok_dir / "tokenizer_config.json"
    if config_file.exists():
        with open(config_file) as f:
            eos = json.load(f).get("eos_token", eos)
        if isinstance(eos, dict):
            eos = eos["content"]
    return max(vocab.values()) + 1, vocab[eos]


def tiny_config(arch: str, vocab_size: int, **overrides) -> dict:
    """A config.json dict with tiny dims for the mlx-lm ``model_type`` arch."""
    if arch not in ARCHS:
        raise ValueError(f"Unknown arch {arch!r}, expected one of {ARCHS}")
    config = {"model_type": arch, "vocab_size": vocab_size}
    config.update(_COMMON)
    config.update(_ARCH_CONFIGS[arch])
    config["eos_token_id"] = EOS_TOKEN_ID
    config.update(overrides)
    if arch == "gpt_oss" and "layer_types" not in overrides:
        config["layer_types"] = [
            ("sliding_attention", "full_attention")[i % 2]
            for i in range(config["num_hidden_layers"])
        ]
    return config


def _is_router(name: str) -> bool:
    return name.endswith(
        (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.router.weight")
    )


def _init_model(config: dict, seed: int, residual_scale: float = 1.0):
    """Random model whose routing and next-token choices depend on the input.

    mlx-lm's default init gives near uniform routers (zeros for deepseek_v3)
    and flat logits, so: routers get logits of std ~2, the lm_head is scaled
    up, and the rows of the special tokens are zeroed so that greedy decoding
    never emits them (e.g. eos) by accident. Zero-initialized biases, score
    corrections and attention sinks get small random values so that the code
    using them is exercised. ``residual_scale`` multiplies what each block adds to the
    residual stream (attention's and the experts' output projections).
    """
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    hidden = config["hidden_size"]

    def init(name, v):
        if residual_scale != 1.0 and name.endswith((".self_attn.o_proj.weight", ".switch_mlp.down_proj.weight")):
            return v * residual_scale
        if _is_router(name):
            return mx.random.normal(v.shape) * (2.0 / math.sqrt(hidden))
        if name.endswith(".mlp.router.bias"):
            return mx.random.normal(v.shape) * 0.5
        if name.endswith(("e_score_correction_bias", ".sinks")):
            return mx.random.normal(v.shape) * 0.1
        if name.endswith((".experts.gate_proj.bias", ".experts.up_proj.bias")):
            return mx.random.normal(v.shape) * 0.1
        if name.endswith(".experts.down_proj.bias"):
            return mx.random.normal(v.shape) * 0.02
        if name == "lm_head.weight":
            # Penalize repeating the current token: its embedding is in the
            # residual stream, so subtract the embeddings from the head.
            embed = model.model.embed_tokens.weight
            w = v * LM_SCALE - ANTI_REPEAT * embed * math.sqrt(hidden)
            keep = (mx.arange(v.shape[0]) >= len(SPECIAL_TOKENS))[:, None]
            return mx.where(keep, w, 0.0)
        return v

    model.update(tree_map_with_path(init, model.parameters()))
    return model


def _cast(model, dtype: str):
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    dtype = getattr(mx, dtype)
    cast_predicate = getattr(model, "cast_predicate", lambda _: True)

    def set_dtype(k, v):
        if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    model.update(tree_map_with_path(set_dtype, model.parameters()))


def _quantize(model, config: dict, quant: str):
    if quant not in QUANT:
        raise ValueError(f"quant must be None or one of {list(QUANT)}: {quant!r}")
    q = QUANT[quant]
    with contextlib.redirect_stdout(io.StringIO()):  # silence the bpw print
        return quantize_model(
            model, config, q["group_size"], q["bits"], mode=q["mode"]
        )


def _clear_weights(path: Path):
    for f in list(path.glob("model*.safetensors")) + [
        path / "model.safetensors.index.json"
    ]:
        f.unlink(missing_ok=True)


def save_weights(path, weights: dict, max_shard_bytes=None, fmt="mlx"):
    """Save ``weights`` as safetensors shards plus ``model.safetensors.index.json``.

    With ``max_shard_bytes`` the weights are split (in order) into shards of at
    most that size (a bigger tensor gets a shard of its own).
    """
    path = Path(path)
    shards, size = [], 0
    for k, v in weights.items():
        if not shards or (max_shard_bytes and size + v.nbytes > max_shard_bytes):
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    n = len(shards)
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": {},
    }
    for i, shard in enumerate(shards):
        name = "model.safetensors"
        if n > 1:
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(path / name), shard, metadata={"format": fmt})
        index["weight_map"].update({k: name for k in shard})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)


def _copy_tokenizer(src: Path, dst: Path):
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(("model", "config.json")):
            shutil.copy(f, dst / f.name)


def build_checkpoint(
    path,
    arch: str,
    *,
    quant: Optional[str] = None,
    layout: str = "stacked",
    dtype: str = "float32",
    seed: int = 0,
    tokenizer_dir=None,
    config_overrides: Optional[dict] = None,
    max_shard_bytes: Optional[int] = None,
) -> Path:
    """Build a tiny random checkpoint of ``arch`` at ``path`` (loads with mlx_lm.load).

    ``layout="stacked"`` is the mlx-lm layout (``...switch_mlp.gate_proj.weight``
    of shape [E, out, in]); ``layout="per_expert"`` is the Hugging Face layout
    (``...experts.{e}.gate_proj.weight``, ``w1/w2/w3`` for mixtral: architectures.hf_weights), float only.
    """
    if layout not in ("stacked", "per_expert"):
        raise ValueError(f"layout must be 'stacked' or 'per_expert', got {layout!r}")
    if layout == "per_expert" and (quant is not None or arch == "gpt_oss"):
        raise ValueError("per_expert layout needs a float, non gpt_oss checkpoint")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _clear_weights(path)

    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != path.resolve():
        _copy_tokenizer(Path(tokenizer_dir), path)
    elif tokenizer_dir is None:
        train_tokenizer(path)
    vocab_size, eos_id = _tokenizer_info(path)

    config = tiny_config(
        arch, vocab_size, eos_token_id=eos_id, **(config_overrides or {})
    )
    config["torch_dtype"] = dtype
    model = _init_model(config, seed)
    _cast(model, dtype)
    if quant is not None:
        model, config = _quantize(model, config, quant)
    mx.eval(model.parameters())

    if layout == "per_expert":
        from architectures import hf_weights  # (it imports this module)

        save_weights(path, hf_weights(model, config), max_shard_bytes, fmt="pt")
    elif max_shard_bytes:
        save_weights(path, dict(tree_flatten(model.parameters())), max_shard_bytes)
    else:
        save_model(path, model)
    save_config(config, config_path=path / "config.json")
    return path


def _random_quantized_experts(weights: dict, mode: str, residual_scale: float = 1.0):
    """Replace the (lazy) quantized experts by random 4-bit codes and scales.

    Roughly the distribution of quantizing mlx-lm's uniform init, but the
    float tensors are never made, which is much faster (mxfp4 quantization is
    especially slow on the CPU).
    """
    for k in [k for k in weights if ".switch_mlp." in k and k.endswith(".weight")]:
        base = k[: -len(".weight")]
        w, s = weights[k], weights[f"{base}.scales"]
        bound = 1 / math.sqrt(w.shape[-1] * 8)  # 8 4-bit codes per uint32
        if base.endswith(".down_proj"):
            bound *= residual_scale
        lo = mx.random.randint(0, 1 << 16, w.shape, dtype=mx.uint32)
        hi = mx.random.randint(0, 1 << 16, w.shape, dtype=mx.uint32)
        weights[k] = (hi << 16) | lo
        if mode == "affine":
            scales = mx.random.uniform(0.5, 1.5, s.shape) * (2 * bound / 15)
            weights[f"{base}.scales"] = scales.astype(s.dtype)
            weights[f"{base}.biases"] = (-7.5 * scales).astype(s.dtype)
        else:  # mxfp4: e8m0 scales; mean |fp4 code| is 2.25, of U(-b, b) b/2
            e = 127 + round(math.log2(bound / 4.5))
            scales = mx.random.randint(e - 1, e + 1, s.shape, dtype=mx.uint8)
            weights[f"{base}.scales"] = scales


def build_large_checkpoint(
    path,
    *,
    num_layers: int = 4,
    num_experts: int = 128,
    top_k: int = 8,
    hidden_size: int = 2048,
    moe_intermediate_size: int = 768,
    quant: Optional[str] = "4bit",
    seed: int = 0,
    dtype: str = "bfloat16",
    residual_scale: float = 1.0,
) -> Path:
    """A qwen3_moe checkpoint with Qwen3-30B-A3B's shapes but fewer layers.

    The model is built lazily and each tensor is evaluated (random init, cast
    to ``dtype``, quantized) and written one layer at a time, so at most one
    float expert projection is ever in memory. One shard per layer. When
    quantized, the expert codes and scales are drawn directly (no float
    experts are made at all).
    ``dtype`` is that of the scales and non-quantized weights: bfloat16 like
    mlx-community checkpoints; float32 runs ~10x faster on mlx's CPU backend.
    ``residual_scale`` scales attention's and the experts' output projections: at 1 the
    random blocks rewrite the residual stream so much that the next layer's router,
    applied to this layer's input, guesses the layer-ahead experts poorly in the first
    layers and deep layers route alike for every token; trained models keep the stream
    (the premise of lookahead prefetch). It is written to config.json
    (``mlxmoe_synthetic``) so that a checkpoint can be told from one built otherwise.
    """
    t0 = time.time()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _clear_weights(path)
    train_tokenizer(path)
    vocab_size, eos_id = _tokenizer_info(path)
    config = tiny_config(
        "qwen3_moe",
        vocab_size,
        eos_token_id=eos_id,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_intermediate_size,
        intermediate_size=6144,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        torch_dtype=dtype,
    )
    config["mlxmoe_synthetic"] = {"residual_scale": residual_scale, "seed": seed}
    model = _init_model(config, seed, residual_scale)  # lazy: nothing is computed yet
    _cast(model, dtype)
    if quant is not None:
        model, config = _quantize(model, config, quant)
    weights = dict(tree_flatten(model.parameters()))
    del model
    if quant is not None:
        _random_quantized_experts(weights, QUANT[quant]["mode"], residual_scale)

    groups = [{} for _ in range(num_layers + 1)]  # one per layer, then the rest
    for k, v in weights.items():
        i = int(k.split(".")[2]) if k.startswith("model.layers.") else num_layers
        groups[i][k] = v
    weights.clear()
    expert_bytes = sum(v.nbytes for k, v in groups[0].items() if ".switch_mlp." in k)
    layer_bytes = sum(v.nbytes for v in groups[0].values())
    total = sum(v.nbytes for g in groups for v in g.values())
    print(
        f"[synthetic] qwen3_moe {num_layers} layers x {num_experts} experts "
        f"(top {top_k}), quant={quant}: {expert_bytes / 2**20:.0f} MiB of experts "
        f"({expert_bytes / num_experts / 2**20:.2f} MiB per expert), "
        f"{layer_bytes / 2**20:.0f} MiB per layer, {total / 2**30:.2f} GiB total",
        flush=True,
    )

    n = len(groups)
    index = {"metadata": {"total_size": total}, "weight_map": {}}
    for i, group in enumerate(groups):
        for v in group.values():
            mx.eval(v)  # one tensor at a time bounds the float peak
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(path / name), group, metadata={"format": "mlx"})
        index["weight_map"].update({k: name for k in group})
        groups[i] = None
        del group
        print(f"[synthetic] wrote {name} ({time.time() - t0:.1f}s)", flush=True)
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)
    save_config(config, config_path=path / "config.json")
    print(f"[synthetic] done in {time.time() - t0:.1f}s: {path}", flush=True)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Build a synthetic MoE checkpoint of a real mlx-lm architecture."
    )
    parser.add_argument("--out", required=True, help="Output folder.")
    parser.add_argument("--arch", default="qwen3_moe", choices=ARCHS)
    parser.add_argument("--quant", default=None, choices=list(QUANT))
    parser.add_argument(
        "--layout", default="stacked", choices=["stacked", "per_expert"]
    )
    parser.add_argument(
        "--dtype", default=None, choices=DTYPES,
        help="float32 by default, bfloat16 with --large.",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-bytes", type=int, default=None)
    parser.add_argument(
        "--config", type=json.loads, default=None,
        help='JSON config overrides, e.g. \'{"num_experts": 64}\'.',
    )
    parser.add_argument(
        "--large", action="store_true",
        help="Qwen3-30B-A3B expert shapes with few layers (qwen3_moe, 4bit default).",
    )
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--moe-intermediate-size", type=int, default=768)
    args = parser.parse_args(argv)

    t0 = time.time()
    if args.large:
        build_large_checkpoint(
            args.out,
            num_layers=args.num_layers,
            num_experts=args.num_experts,
            top_k=args.top_k,
            hidden_size=args.hidden_size,
            moe_intermediate_size=args.moe_intermediate_size,
            quant=args.quant or "4bit",
            seed=args.seed,
            dtype=args.dtype or "bfloat16",
        )
    else:
        build_checkpoint(
            args.out,
            args.arch,
            quant=args.quant,
            layout=args.layout,
            dtype=args.dtype or "float32",
            seed=args.seed,
            max_shard_bytes=args.max_shard_bytes,
            config_overrides=args.config,
        )
        dt = time.time() - t0
        print(f"[synthetic] {args.arch} checkpoint in {args.out} ({dt:.2f}s)")


if __name__ == "__main__":
    main()
