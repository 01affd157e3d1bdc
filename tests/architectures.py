"""Tiny checkpoints of every MoE architecture of the installed mlx-lm.

`moe_architectures()` finds them at run time: the model files of mlx_lm.models that use
SwitchGLU/SwitchMLP, and those that build a model of one of those (gemma4, mistral3,
kimi_k25, ...), so a new mlx-lm brings its new ones in. `tiny_config()` builds a config of
each from one table of small sizes keyed by mlx-lm's own field names (ModelArgs.from_dict
takes the fields a model knows and leaves the rest), plus the few settings an
architecture needs beyond sizes (ARCH_SETTINGS). `build()` makes the model with mlx-lm's
own classes, gives its routers input-dependent weights and saves it (float32 or 4-bit)
with mlx-lm's save functions and the tokenizer of synthetic.train_tokenizer.

A test fixture (tests/test_architectures.py), not part of the package.
"""

import contextlib
import copy
import io
import math
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

import synthetic

EXPERTS = 8
TOP_K = 2
LAYERS = 2

# Small sizes under every name mlx-lm's MoE models give them (a model reads the ones it knows).
SIZES = {
    "hidden_size": 64, "model_dim": 64, "d_model": 64,
    "num_hidden_layers": LAYERS, "num_layers": LAYERS, "n_layers": LAYERS,
    "intermediate_size": 128, "ffn_hidden_size": 128, "dense_intermediate_size": 128,
    "moe_intermediate_size": 64, "expert_ffn_hidden_size": 64, "expert_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "shared_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64, "share_expert_dim": 64,
    "num_attention_heads": 4, "num_heads": 4, "num_key_value_heads": 2, "num_attention_groups": 2,
    "head_dim": 16, "global_head_dim": 16, "rotary_dim": 16,
    "num_experts": EXPERTS, "n_routed_experts": EXPERTS, "num_local_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K, "num_experts_per_token": TOP_K, "moe_topk": TOP_K, "moe_top_k": TOP_K,
    "moe_k": TOP_K, "top_k_experts": TOP_K,
    "n_shared_experts": 1, "num_shared_experts": 1, "num_shared_expert": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "first_k_dense_replace": 0, "num_dense_layers": 0, "moe_layer_freq": 1, "decoder_sparse_step": 1,
    "moe_layer_start_index": 0, "moe_layer_interval": 1, "mlp_only_layers": [],
    "routed_scaling_factor": 1.0, "norm_topk_prob": True,
    "max_position_embeddings": 512, "model_max_length": 512, "original_max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "norm_eps": 1e-6, "layer_norm_epsilon": 1e-6, "layernorm_epsilon": 1e-6,
    "rope_theta": 10000.0, "swa_rope_theta": 10000.0, "partial_rotary_factor": 1.0,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "o_lora_rank": 32, "o_groups": 2,
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 64,
    "sliding_window": 64, "sliding_window_size": 64,
    "attention_bias": False, "use_bias": False, "mlp_bias": False, "use_qk_norm": False,
    "tie_word_embeddings": False,
}


def _layer_types(full="full_attention", sliding="sliding_attention"):
    return [(sliding, full)[i % 2] for i in range(LAYERS)]


# What an architecture needs beyond SIZES: its layer patterns, the switches that make its
# layers MoE, settings a model indexes without a default.
ARCH_SETTINGS = {
    "afmoe": {"layer_types": _layer_types()},
    "bailing_hybrid": {"layer_group_size": 2, "group_norm_size": 1},
    "bailing_moe_linear": {"layer_group_size": 2, "group_norm_size": 1},
    "bailing_moe_v3": {"layer_group_size": 2},
    "deepseek_v2": {"rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 512,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0}},
    "exaone_moe": {"layer_types": _layer_types(), "is_moe_layer": [True] * LAYERS},
    "gemma4_text": {"enable_moe_block": True, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
                    "layer_types": _layer_types()},
    "granitemoe": {"logits_scaling": 1.0, "attention_multiplier": 0.25, "embedding_multiplier": 1.0,
                   "residual_multiplier": 1.0},
    "granitemoehybrid": {"logits_scaling": 1.0, "attention_multiplier": 0.25, "embedding_multiplier": 1.0,
                         "residual_multiplier": 1.0, "layer_types": ["mamba", "attention"],
                         "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 16,
                         "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False},
    "hunyuan": {"use_mixed_mlp_moe": True, "use_cla": False, "cla_share_factor": 1,
                "rope_scaling": {"type": "dynamic", "factor": 1.0, "alpha": 1.0}},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 0, "expert_layer_period": 1,
              "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2},
    "kimi_linear": {"linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4,
                                           "head_dim": 16, "short_conv_kernel_size": 4}},
    "lfm2_moe": {"use_expert_bias": True, "conv_bias": False, "conv_L_cache": 3,
                 "layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "longcat_flash": {"attention_method": "MLA", "zero_expert_type": "identity", "zero_expert_num": 2,
                      "mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "longcat_flash_ngram": {"attention_method": "MLA", "zero_expert_type": "identity", "zero_expert_num": 2,
                            "mla_scale_q_lora": True, "mla_scale_kv_lora": True, "ngram_vocab_size_ratio": 2},
    "mellum": {"layer_types": _layer_types(), "rope_parameters": {"full_attention": {"rope_theta": 10000.0},
                                                                  "sliding_attention": {"rope_theta": 10000.0}}},
    "mimo_v2_flash": {"hybrid_layer_pattern": [0, 1], "moe_layer_freq": [1, 1],
                      "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                      "topk_method": "noaux_tc", "scoring_func": "sigmoid", "swa_num_attention_heads": 4,
                      "swa_num_key_value_heads": 2, "swa_head_dim": 16, "swa_v_head_dim": 16},
    "mistral4": {"rope_parameters": {"rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                     "original_max_position_embeddings": 512}},
    "nemotron_h": {"hybrid_override_pattern": ["M", "E", "*", "E"], "mamba_num_heads": 4, "mamba_head_dim": 16,
                   "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1,
                   "use_conv_bias": True, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2"},
    "qwen3_next": {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2},
    "step3p5": {"moe_layers_enum": "0,1"},
    "glm4_moe": {"rope_scaling": None},
    "glm_moe_dsa": {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "rope_parameters": {"rope_theta": 10000.0}},
}

# The text_config of a model that nests its language model's settings there, beyond SIZES.
TEXT_SETTINGS = {
    "gemma4": ARCH_SETTINGS["gemma4_text"],
    "kimi_k3": {"linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4,
                                       "head_dim": 16, "short_conv_kernel_size": 4}},
    "llama4": {"num_hidden_layers": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 128, "interleave_moe_layer_step": 1,
               "attention_chunk_size": 64, "use_qk_norm": False, "rope_scaling": None},
    "minimax_m3_vl": {"moe_layer_freq": [1] * LAYERS},
    "mistral3": {"model_type": "mistral4", **ARCH_SETTINGS["mistral4"]},
    "muse_spark": {"post_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0},
                   "layer_rope_theta": [10000.0] * LAYERS, "layer_types": _layer_types(),
                   "final_logit_softcapping": 30.0, "output_multiplier": 1.0, "moe_hidden_size": 64,
                   "num_shared_experts": 0},
    "qwen3_5": {**ARCH_SETTINGS["qwen3_next"]},
    "qwen3_5_moe": {**ARCH_SETTINGS["qwen3_next"]},
}

# config.json keys beyond the model's args that transformers checks when mlx-lm loads the
# tokenizer (it reads config.json for a model type it knows too).
CONFIG_EXTRA = {"muse_spark": {"audio_config": {"out_hidden_size": SIZES["hidden_size"]}}}

# Architectures no tiny checkpoint can be built for from ModelArgs alone, and why.
NOT_BUILDABLE = {
    "prism_hadamard_qwen35": "a Hadamard-rotated 2-bit pack of qwen3_5 (tested as qwen3_5): mlx-lm builds it only "
                             "from the pack's manifest of rotated modules, 2-bit with group size 128",
}


def _module_sources():
    import mlx_lm.models as models

    return {p.stem: p.read_text() for p in Path(models.__file__).parent.glob("*.py")}


def _imports(source):
    out = set(re.findall(r"^\s*from \.(\w+) import", source, re.M))
    for names in re.findall(r"^\s*from \. import ([\w, ]+)", source, re.M):
        out.update(n.strip() for n in names.split(","))
    return out


def moe_architectures():
    """The model files of the installed mlx-lm whose experts are SwitchGLU/SwitchMLP, and
    those that import one of them (wrappers), sorted."""
    sources = _module_sources()
    sources.pop("switch_layers", None)
    moe = {m for m, s in sources.items() if re.search(r"\bSwitch(GLU|MLP)\b", s)}
    while True:
        more = {m for m, s in sources.items() if m not in moe and _imports(s) & moe}
        if not more:
            return sorted(moe)
        moe |= more


def _arg_fields(arch):
    """The field names of every args dataclass of `arch`'s module and the modules it
    imports (a wrapper's text_config goes to one of them)."""
    import dataclasses
    import importlib

    from mlx_lm.models.base import BaseModelArgs

    sources, names, seen, todo = _module_sources(), set(), set(), [arch]
    while todo:
        module = todo.pop()
        if module in seen or module not in sources:
            continue
        seen.add(module)
        for obj in vars(importlib.import_module(f"mlx_lm.models.{module}")).values():
            if isinstance(obj, type) and issubclass(obj, BaseModelArgs) and dataclasses.is_dataclass(obj):
                names |= {f.name for f in dataclasses.fields(obj)}
        todo += sorted(_imports(sources[module]))
    return names


def tiny_config(arch, vocab_size, eos_token_id, overrides=None):
    """A config.json of `arch` with SIZES, its ARCH_SETTINGS (and for a model that nests
    its language model's settings, SIZES and TEXT_SETTINGS in text_config), then `overrides`."""
    config = {**SIZES, **copy.deepcopy(ARCH_SETTINGS.get(arch, {})), "model_type": arch, "vocab_size": vocab_size,
              "vocab_size_per_layer_input": vocab_size, "eos_token_id": eos_token_id}
    if arch == "phixtral":
        config["num_vocab"] = vocab_size
    _, args_class = _get_classes(config)
    fields = set(getattr(args_class, "__dataclass_fields__", {}))
    if "text_config" in fields:
        text = {**SIZES, **copy.deepcopy(TEXT_SETTINGS.get(arch, {})), "vocab_size": vocab_size,
                "vocab_size_per_layer_input": vocab_size}
        known = _arg_fields(arch)
        config["text_config"] = {"model_type": arch, **{k: v for k, v in text.items() if k in known}}
    config.update(overrides or {})
    # only the fields the model declares: a config.json as the model's authors write it
    # (a key of another model's name, e.g. num_experts_per_tok, would hide a reader of that key)
    config = {k: v for k, v in config.items() if k in fields or k in ("model_type", "eos_token_id", "text_config")}
    return {**config, **copy.deepcopy(CONFIG_EXTRA.get(arch, {}))}


def expected_top_k(config):
    """The top-k the tiny config gives its MoE layers."""
    return config.get("text_config", {}).get("num_experts_per_tok", TOP_K) if "text_config" in config else TOP_K


def switch_modules(model):
    return [(p, m) for p, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]


def _init(model):
    """Routers whose choice depends on the input (mlx-lm's init makes some all zeros or
    near uniform): a [experts, hidden] weight of a module named gate/router gets std ~2
    logits, a per-expert bias (score correction, expert bias) small random values."""
    def init(name, v):
        if not mx.issubdtype(v.dtype, mx.floating):
            return v
        parts = name.split(".")
        if v.ndim == 2 and v.shape[0] == EXPERTS and any(p in ("gate", "router", "classifier") for p in parts[-3:-1]):
            return mx.random.normal(v.shape) * (2.0 / math.sqrt(v.shape[1]))
        if v.ndim == 1 and v.shape[0] == EXPERTS and "switch" not in name:
            return mx.random.normal(v.shape) * 0.1
        return v

    model.update(tree_map_with_path(init, model.parameters()))


def make_model(config, seed=0):
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    _init(model)
    return model


# The families tested in bf16, mxfp4 and the Hugging Face layout besides float32 and 4-bit
# (tests/test_architectures.py): the most used MoE models.
FAMILIES = ("qwen3_moe", "qwen3_5_moe", "qwen3_next", "gemma4", "gpt_oss", "glm4_moe", "deepseek_v3", "minimax",
            "kimi_k25", "mixtral")

# Hugging Face names of a family's per-expert projections where they are not mlx-lm's
HF_PROJ = {arch: {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"} for arch in ("mixtral", "minimax")}
# Families whose Hugging Face checkpoints hold each layer's experts stacked, gate and up
# fused in one tensor [E, 2 * I, H]: halves (qwen3_5_moe, gemma4) or interleaved rows (gpt_oss)
FUSED = {"qwen3_5_moe": "halves", "gemma4": "halves", "gpt_oss": "interleaved"}
# The MXFP4 checkpoints of gpt-oss as mlx-community ships them: experts mxfp4, the rest 8-bit
MXFP4_REST = {"group_size": 64, "bits": 8, "mode": "affine"}


def _fuse(gate, up, how, axis):
    """gate and up in one tensor along `axis`: gate then up, or their rows interleaved."""
    if how == "halves":
        return mx.concatenate([gate, up], axis=axis)
    shape = list(gate.shape)
    shape[axis] *= 2
    return mx.stack([gate, up], axis=axis + 1 if axis >= 0 else axis).reshape(shape)


def hf_weights(model, config):
    """The weights of `model` (a model of FAMILIES, float, or gpt_oss with mxfp4 experts)
    named and laid out as its Hugging Face checkpoint, i.e. what mlx-lm's sanitize turns
    into `model`'s weights: per-expert tensors (`...experts.E.gate_proj.weight`), or
    FUSED stacked ones; deepseek's kv_b_proj before mlx-lm splits it; qwen3_next's and
    qwen3_5's norms as offsets from 1 and conv1d weights [C, 1, K]."""
    arch = config["model_type"]
    weights = dict(tree_flatten(model.parameters()))
    out = {}
    for path, _ in switch_modules(model):
        parent = path.rsplit(".", 1)[0]
        params = {(lin, p): weights.pop(f"{path}.{lin}.{p}") for lin in ("gate_proj", "up_proj", "down_proj")
                  for p in ("weight", "scales", "biases", "bias") if f"{path}.{lin}.{p}" in weights}
        if arch in FUSED:
            base = path if path.endswith(".experts") else parent if parent.endswith(".experts") else f"{parent}.experts"
            for (lin, p), v in params.items():
                if lin == "up_proj":
                    continue
                name = "gate_up_proj" if lin == "gate_proj" else lin
                if lin == "gate_proj":
                    v = _fuse(v, params["up_proj", p], FUSED[arch], -1 if p == "bias" else -2)
                if p == "weight" and v.dtype == mx.uint32:  # mxfp4 codes: bytes, 16 per block of 32
                    v = v.view(mx.uint8).reshape(*v.shape[:-1], -1, 16)
                suffix = {"weight": "_blocks", "scales": "_scales", "bias": "_bias"}[p] if arch == "gpt_oss" else ""
                out[f"{base}.{name}{suffix}"] = v
        else:
            for (lin, p), v in params.items():
                name = HF_PROJ.get(arch, {}).get(lin, lin)
                for e in range(v.shape[0]):
                    out[f"{parent}.experts.{e}.{name}.{p}"] = mx.contiguous(v[e])
    norms = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
             ".k_norm.weight")
    for k, v in weights.items():
        if k.endswith(".self_attn.embed_q.weight"):  # deepseek: kv_b_proj, [heads * (nope + v), kv_lora]
            prefix = k[: -len(".embed_q.weight")]
            kv_b = mx.concatenate([v.swapaxes(-1, -2), weights[f"{prefix}.unembed_out.weight"]], axis=1)
            out[f"{prefix}.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
        elif k.endswith(".self_attn.unembed_out.weight"):
            continue
        elif arch in ("qwen3_next", "qwen3_5_moe") and "conv1d.weight" in k:
            out[k] = v.moveaxis(2, 1)
        elif arch in ("qwen3_next", "qwen3_5_moe") and k.endswith(norms) and v.ndim == 1:
            out[k] = v - 1.0
        else:
            out[k] = v
    if arch in ("qwen3_5_moe", "gemma4"):
        out = {k.replace("language_model.model.", "model.language_model.", 1): v for k, v in out.items()}
    return out


FP8_BLOCK = 128  # DeepSeek's and MiniMax's fp8 checkpoints: one scale per 128 x 128 block
PER_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.\w+\.weight$")


def _fp8_experts(hf):
    """The per-expert weights of `hf` in fp8 with a scale per block (weight_scale_inv), as
    DeepSeek-V3 and MiniMax ship them; mlx-lm's sanitize dequantizes them to bf16."""
    out = {}
    for k, v in hf.items():
        if PER_EXPERT_WEIGHT.search(k):
            out[k] = mx.to_fp8(v)
            out[f"{k}_scale_inv"] = mx.ones([-(-n // FP8_BLOCK) for n in v.shape])
        else:
            out[k] = v
    return out


def _check_hf_weights(model, hf, path):
    """mlx-lm's sanitize of `hf` gives back `model`'s weights exactly (the fixture is right)."""
    want = dict(tree_flatten(model.parameters()))
    got = model.sanitize(dict(hf))
    if set(got) != set(want):
        raise AssertionError(f"{path}: sanitize of the HF layout gives other names: "
                             f"{sorted(set(got) ^ set(want))[:6]}")
    for k, v in want.items():
        if got[k].shape != v.shape or got[k].dtype != v.dtype or not mx.array_equal(got[k], v).item():
            raise AssertionError(f"{path}: sanitize of the HF layout changes {k}")


def _is_expert(model):
    """path -> whether it is a projection of the model's experts (SwitchGLU/SwitchMLP)."""
    experts = {p for p, _ in switch_modules(model)}
    return lambda path: path.rsplit(".", 1)[0] in experts


def _quantize(model, config, quant):
    """quantize_model with synthetic.QUANT[quant]; "mxfp4": the experts only, the rest
    8-bit affine (MXFP4_REST), as mlx-community's gpt-oss checkpoints."""
    q, predicate = synthetic.QUANT[quant], None
    if quant == "mxfp4":
        is_expert = _is_expert(model)
        q, predicate = MXFP4_REST, lambda path, _: synthetic.QUANT["mxfp4"] if is_expert(path) else MXFP4_REST
    with contextlib.redirect_stdout(io.StringIO()):
        return quantize_model(model, config, q["group_size"], q["bits"], mode=q["mode"], quant_predicate=predicate)


def build(path, arch, tokenizer_dir, quant=None, seed=0, overrides=None, dtype="float32", layout="stacked"):
    """A tiny checkpoint of `arch` at `path`, its config changed by `overrides`; returns
    (path, config). `dtype`: of its floats (synthetic.DTYPES); `quant`: None, "4bit"
    (affine, group 32) or "mxfp4" (experts mxfp4, the rest 8-bit, as gpt-oss ships on
    mlx-community); `layout`: "stacked" (mlx-lm's, saved with its save functions) or
    "hf" (as the model's Hugging Face checkpoint: hf_weights; gpt_oss's with mxfp4 experts,
    its original format; "fp8": per-expert fp8 weights with block scales, as DeepSeek's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    synthetic._copy_tokenizer(Path(tokenizer_dir), path)
    vocab_size, eos = synthetic._tokenizer_info(path)
    config = tiny_config(arch, vocab_size, eos, overrides)
    model = make_model(config, seed)
    if not switch_modules(model):
        raise ValueError(f"{arch}: the tiny config builds no SwitchGLU/SwitchMLP")
    if dtype != "float32":
        synthetic._cast(model, dtype)
        config["torch_dtype"] = dtype
    if layout == "hf":
        if (quant == "mxfp4") != (arch == "gpt_oss") or quant not in (None, "mxfp4", "fp8"):
            raise ValueError(f"the hf layout of {arch} is float{', mxfp4 experts' if arch == 'gpt_oss' else ''} "
                             "(or fp8 experts)")
        if quant == "mxfp4":  # the experts only, as gpt-oss's own checkpoints
            is_expert = _is_expert(model)
            nn.quantize(model, **synthetic.QUANT[quant], class_predicate=lambda p, m: hasattr(m, "to_quantized")
                        and is_expert(p))
            config["quantization_config"] = {"quant_method": "mxfp4"}
        mx.eval(model.parameters())
        hf = hf_weights(model, config)
        _check_hf_weights(model, hf, path)
        if quant == "fp8":
            hf = _fp8_experts(hf)
            config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
        synthetic.save_weights(path, hf, fmt="pt")
    else:
        if quant is not None:
            model, config = _quantize(model, config, quant)
        mx.eval(model.parameters())
        save_model(path, model)
    save_config(config, config_path=path / "config.json")
    return path, config
