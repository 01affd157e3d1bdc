"""Build the mlx-lm model with only its non-expert weights and swap every
SwitchGLU/SwitchMLP for StreamingExperts.

mlx-lm's own `load_model(lazy=True)` builds, sanitizes and quantizes the model; expert
tensors stay lazy and are dropped before anything evaluates them, so they are never read.
In a bundled checkpoint the model's sanitize is followed by lazy stand-ins of the expert
tensors (shapes and dtypes from the bundle metadata) in place of the bundle tensors.
"""

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import _get_classes, load_config, load_model, load_tokenizer

from .errors import MlxmoeError
from .storage.files import DEMO_MODEL, named_model, read_bytes, read_json
from .caching.experts import StreamingExperts, find_router
from .storage.shards import PER_EXPERT, tensor_bytes
from .storage.remote import is_repo_id, pulled
from .storage.store import ExpertStore

# safetensors dtype -> MLX dtype (of a slot pool before the backend's dtype policy, of a stand-in)
MX_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "U32": mx.uint32, "U8": mx.uint8,
             "I8": mx.int8, "U16": mx.uint16, "I32": mx.int32, "F8_E4M3": mx.uint8, "F8_E5M2": mx.uint8}

# The small MoE model trained by demo/train_demo.py that ships inside the package.
MAX_JSON_BYTES = 1 << 30  # config.json, tokenizer.json: the largest real ones are ~30 MB

SWITCH_TYPES = (SwitchGLU, SwitchMLP)
LINEARS = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2")
PARAMS = ("weight", "scales", "biases", "bias")


@dataclass
class Checkpoint:
    """A model whose experts are not loaded yet, and where they lie on disk."""
    path: Path
    config: dict
    model: nn.Module
    store: ExpertStore
    experts: list = field(default_factory=list)  # StreamingExperts, one per MoE layer
    module_paths: list = field(default_factory=list)
    routers: list = field(default_factory=list)  # per MoE layer: x -> router scores, or None
    blocks: list = field(default_factory=list)  # per MoE layer: the module holding its experts (the MoE block)
    top_ks: list = field(default_factory=list)  # per MoE layer: the experts each token is routed to
    layer_offset: int = 0  # under a pipeline split: the whole model's index of this stage's first MoE layer
    total_layers: int = 0  # the whole model's MoE layers (this stage's alone when 0)
    group: object = None  # the mx.distributed group of a pipeline split, else None
    stage_share: float = 1.0  # the share of the model's KV cache this rank keeps
    split: str = "pipeline"  # under a group: "pipeline" (a stage of layers) or "tensor" (a slice of each)

    @property
    def all_layers(self):
        return self.total_layers or self.num_layers

    @property
    def num_layers(self):
        return len(self.experts)

    @property
    def num_experts(self):
        return self.store.num_experts

    @property
    def top_k(self):
        """The most experts one token is routed to in a layer (the cache's minimum)."""
        return max(self.top_ks, default=0)


def resolve(path_or_repo, revision=None):
    """A local folder, or a Hugging Face repo id pulled into the hub's cache (`mlxmoe pull`;
    never the network: one not pulled, or pulled in part, says to run it);
    None and "demo" are the bundled demo model (a folder named demo in the current
    directory wins: files.named_model)."""
    path_or_repo = named_model(path_or_repo)
    if path_or_repo == DEMO_MODEL:
        if not (DEMO_MODEL / "config.json").exists():
            raise MlxmoeError(f"the bundled demo model is missing from {DEMO_MODEL}; pass --model")
        return DEMO_MODEL
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise MlxmoeError(f"{path}: no config.json; is this a model folder?")
        return path
    if is_repo_id(path_or_repo):
        return pulled(str(path_or_repo), revision)
    raise MlxmoeError(f"model folder not found: {path}")


# config.json's sizes and counts: a positive integer at most this where present (the
# largest real models use about a tenth; more is a typo, and building the model would hang)
INT_FIELDS = {"num_hidden_layers": 1 << 12, "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12,
              "head_dim": 1 << 14, "hidden_size": 1 << 18, "intermediate_size": 1 << 20,
              "moe_intermediate_size": 1 << 20, "num_experts": 1 << 16, "n_routed_experts": 1 << 16,
              "num_local_experts": 1 << 16, "num_experts_per_tok": 1 << 16, "moe_top_k": 1 << 16,
              "num_experts_per_token": 1 << 16, "top_k": 1 << 16, "vocab_size": 1 << 24, "kv_lora_rank": 1 << 16,
              "qk_rope_head_dim": 1 << 14}
TOP_K_FIELDS = ("num_experts_per_tok", "moe_top_k", "num_experts_per_token", "top_k")
EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")
# The tokenizer's JSON files: each, where present, a readable JSON object
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "generation_config.json", "vocab.json")
# One of these holds the vocabulary
TOKENIZER_VOCAB = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "vocab.txt")


def read_json_object(path, what):
    """The JSON object in the regular file `path`, or an MlxmoeError naming it."""
    value = read_json(path, what, MAX_JSON_BYTES)  # UTF-8 only: mlx-lm reads it as such
    if not isinstance(value, dict):
        raise MlxmoeError(f"{path}: not a JSON object")
    return value


def read_config(path):
    read_json_object(path / "config.json", "config")
    if (path / "generation_config.json").exists() or (path / "generation_config.json").is_symlink():
        read_json_object(path / "generation_config.json", "generation config")  # mlx-lm reads it next
    try:
        config = load_config(path)
    except (json.JSONDecodeError, OSError) as e:  # changed since the check above
        raise MlxmoeError(f"{path / 'config.json'}: cannot read it ({e})") from None
    if "model_type" not in config or not isinstance(config["model_type"], str):
        raise MlxmoeError(f"{path / 'config.json'}: no model_type")
    for cfg in (config, config.get("text_config")):
        for key, most in INT_FIELDS.items():
            v = cfg.get(key) if isinstance(cfg, dict) else None
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= most):
                raise MlxmoeError(f"{path / 'config.json'}: {key} must be an integer from 1 to {most}, "
                                  f"not {str(v)[:40]!r}")
    for cfg in (config, config.get("text_config")):  # routing picks top_k of the experts: no more than there are
        cfg = cfg if isinstance(cfg, dict) else {}
        k = next(((key, cfg[key]) for key in TOP_K_FIELDS if isinstance(cfg.get(key), int)), None)
        e = next(((key, cfg[key]) for key in EXPERT_FIELDS if isinstance(cfg.get(key), int)), None)
        if k and e and k[1] > e[1]:
            raise MlxmoeError(f"{path / 'config.json'}: {k[0]} {k[1]} is more than the {e[1]} experts "
                              f"({e[0]}) a layer has")
    for key in ("quantization", "quantization_config"):  # (MLX's; not another library's, with its quant_method)
        if not (isinstance(config.get(key), dict) and "quant_method" in config[key]):
            _check_quantization(path, key, config.get(key))
    q = config.get("quantization")
    group = q.get("group_size") if isinstance(q, dict) and isinstance(q.get("group_size"), int) else 0
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size"):  # a layer narrower than a group:
        if isinstance(config.get(key), int) and config[key] < group:  # built quantized, MLX dies (SIGFPE)
            raise MlxmoeError(f"{path / 'config.json'}: {key} {config[key]} is below the quantization group size "
                              f"{group}")
    try:
        _, args_class = _get_classes(config)
    except ValueError:
        raise MlxmoeError(
            f"{path / 'config.json'}: model_type {config['model_type']!r} is not an architecture mlx-lm knows") from None
    except Exception as e:  # a field mlx-lm reads to pick the class (architectures) of the wrong type
        raise MlxmoeError(f"{path / 'config.json'}: mlx-lm cannot read it ({type(e).__name__}: {e})") from None
    _check_field_types(path, config, args_class)
    return config


def _check_field_types(path, config, args_class):
    """config.json's fields that mlx-lm's ModelArgs declares int, float or bool, of that kind
    (mlx-lm takes them as they come: a string rope_theta fails inside the first token). Its
    annotations are loose (gpt-oss's int rope_theta is 150000.0 in real configs; hunyuan's
    int moe_topk is a list, one per layer, in some): a number is a number or a list of
    numbers, a flag true, false, 0 or 1."""
    fields = getattr(args_class, "__dataclass_fields__", {})
    for key, f in fields.items():
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", None)
        v = config.get(key)
        if v is None or kind not in ("int", "float", "bool"):
            continue
        if kind == "bool":
            ok = isinstance(v, bool) or (isinstance(v, int) and v in (0, 1))
        else:
            ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                     for x in (v if isinstance(v, list) and v else [v]))
        if not ok:
            what = "true or false" if kind == "bool" else "a finite number (or a list of them, one per layer)"
            raise MlxmoeError(f"{path / 'config.json'}: {key} must be {what}, not {json.dumps(v)[:40]}")


def _check_quantization(path, key, q):
    """A quantization block: its group_size and bits (and each per-layer override's)
    positive integers in range; MLX divides by them (a group size of 0 kills the process)."""
    if q is None:
        return
    if not isinstance(q, dict):
        raise MlxmoeError(f"{path / 'config.json'}: {key} must be an object, not {str(q)[:40]!r}")
    for where, block in [(key, q)] + [(f"{key}.{k}", v) for k, v in q.items() if isinstance(v, dict)]:
        for field, most in (("group_size", 4096), ("bits", 16)):
            v = block.get(field)
            if (v is not None or block is q) and (isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= most):
                raise MlxmoeError(f"{path / 'config.json'}: {where}.{field} must be an integer from 1 to {most}, "
                                  f"not {str(v)[:40]!r}")


def check_tokenizer_files(path):
    """Refuse a checkpoint whose tokenizer cannot load, naming the file: no vocabulary,
    or a tokenizer JSON file that is not a readable JSON object."""
    if not any((path / name).exists() for name in TOKENIZER_VOCAB):
        raise MlxmoeError(f"{path}: no tokenizer (none of {', '.join(TOKENIZER_VOCAB)})")
    for name in TOKENIZER_JSON:
        if (path / name).exists() or (path / name).is_symlink():
            read_json_object(path / name, "tokenizer file")


def read_tokenizer(path, tokenizer_config=None, eos_token_ids=None):
    """mlx-lm's tokenizer of checkpoint `path`, or an MlxmoeError naming what is wrong."""
    check_tokenizer_files(path)
    jinja = path / "chat_template.jinja"
    if jinja.exists() or jinja.is_symlink():  # transformers skips a folder, waits on a FIFO
        read_bytes(jinja, "chat template", MAX_JSON_BYTES)
    try:
        tokenizer = load_tokenizer(path, tokenizer_config or {}, eos_token_ids=eos_token_ids)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # transformers and tokenizers raise many types (a Rust panic is a BaseException)
        raise MlxmoeError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {str(e)[:200]})") from None
    template = getattr(tokenizer._tokenizer, "chat_template", None)
    if isinstance(template, str):  # a template that does not parse: refused now, not at the first chat
        try:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
        except jinja2.TemplateSyntaxError as e:
            where = jinja if jinja.exists() else path / "tokenizer_config.json"
            raise MlxmoeError(f"{where}: the chat template does not parse (line {e.lineno}: {e.message})") from None
    return tokenizer


def _layer_order(path):
    return [int(p) for p in re.findall(r"\d+", path)]


# A stand-in's rows (see _hf_sources): enough to tell halves (0 1 | 2 3) from interleaved rows (0 2 | 1 3)
ROWS = 4
# What a stacked parameter's rows are, from the stand-in rows sanitize gave it: all of the
# file tensor's, or gate's or up's part of a fused gate_up tensor
ROW_PARTS = {(0, 1, 2, 3): None, (0, 1): ("halves", 2, 0), (2, 3): ("halves", 2, 1),
             (0, 2): ("interleaved", 2, 0), (1, 3): ("interleaved", 2, 1)}


def _hf_sources(model, store):
    """Where each expert of each stacked parameter lies in a checkpoint in a Hugging Face
    layout (per-expert tensors `...experts.N.gate_proj.weight`, or stacked ones that
    sanitize splits: qwen3.5's and gemma4's gate_up_proj halves, gpt-oss's interleaved
    rows): {parameter: [(file tensor, expert row or None, rows part) per expert]}, a rows
    part as ROW_PARTS. The model's own `sanitize` runs on int32 stand-ins of the file's
    `.experts.` tensors, each value the number of one expert of one tensor and one of ROWS
    rows (a per-expert tensor's stand-in is [ROWS, 1, ...], a stacked one's [E, ROWS, 1,
    ...]: sanitize splits and slices that axis); we read back how it stacked and split them."""
    params = {k for k, _ in tree_flatten(model.parameters())}
    names = [n for n, info in store.index.items() if ".experts." in n and n not in params and not info.bundle
             and (PER_EXPERT.search(n) or len(info.shape) >= 2)]
    if not names or not hasattr(model, "sanitize"):
        return {}
    tracers, ids, base = {}, [], 0
    for n in names:
        shape = store.index[n].shape
        if PER_EXPERT.search(n):
            tracers[n] = (base + mx.arange(ROWS, dtype=mx.int32)).reshape(ROWS, *[1] * (len(shape) - 1))
            ids.append((n, None))
        else:
            e = mx.arange(shape[0], dtype=mx.int32)[:, None] * ROWS + mx.arange(ROWS, dtype=mx.int32)
            tracers[n] = (base + e).reshape(shape[0], ROWS, *[1] * (len(shape) - 2))
            ids += [(n, k) for k in range(shape[0])]
        base = len(ids) * ROWS
    try:
        out = model.sanitize(dict(tracers))
    except Exception as e:  # sanitize may compute with the values (dequantize) or index shapes stand-ins lack
        info = store.index[names[0]]
        raise MlxmoeError(f"{info.file}: mlxmoe cannot stream experts stored as {info.name} is ({info.dtype} "
                          f"{list(info.shape)}): mlx-lm's sanitize computes them ({type(e).__name__}: "
                          f"{str(e)[:120]}); {convert_hint(store.path)}") from None
    sources = {}
    for key, v in out.items():
        if key in tracers or not isinstance(v, mx.array) or v.dtype not in (mx.int32, mx.uint32) or v.ndim < 2:
            continue
        rows = v.reshape(v.shape[0], -1).tolist()
        found = []
        for r in rows:
            part = tuple(x % ROWS for x in r)
            if not 0 <= min(r) <= max(r) < base or len({x // ROWS for x in r}) != 1 or part not in ROW_PARTS:
                break
            found.append((*ids[r[0] // ROWS], ROW_PARTS[part]))
        else:
            sources[key] = found
    return sources


def convert_hint(path):
    """How to turn checkpoint `path`, which mlxmoe cannot stream from, into one it can."""
    return f"convert it once with `mlxmoe convert {path} DST` (mlx-lm's stacked layout, which streams as it is)"


def _bundled_classes(store):
    """mlx-lm's model classes, the model's `sanitize` followed by stand-ins for the
    tensors the bundles hold: lazy zeros of their shape that nothing evaluates."""
    bundles = {info.bundle for info in store.index.values() if info.bundle}

    def classes(config):
        model_class, args_class = _get_classes(config)

        def sanitize(self, weights):
            weights = {k: v for k, v in weights.items() if k not in bundles}
            if hasattr(model_class, "sanitize"):
                weights = model_class.sanitize(self, weights)
            for name, info in store.index.items():
                if info.bundle:
                    weights[name] = mx.zeros(info.shape, MX_DTYPES[info.dtype])
            return weights

        return type(model_class.__name__, (model_class,), {"sanitize": sanitize}), args_class

    return classes


def open_checkpoint(path_or_repo, model_config=None, revision=None, trust_remote_code=False, group=None,
                    split="pipeline"):
    """Read config, index the shards, build the model lazily and map every expert to its
    bytes. `model_config` overrides config.json's fields, as in mlx_lm.load. With a
    `group` of several ranks, mlx-lm splits the model into pipeline stages and only this
    rank's stage is built and mapped; with split="tensor", mlx-lm's `model.shard(group)`
    shards every layer in place and this rank maps its slice of every expert."""
    path = resolve(path_or_repo, revision)
    read_config(path)  # a clear error for a missing or unknown config.json
    store = ExpertStore(path)
    try:
        return _open(path, store, model_config, trust_remote_code, group, split)
    except BaseException:
        store.close()
        raise


def _stage_layer(module_path):
    """The decoder layer a module path lies in (mlx-lm's sharded_load matches layers so too)."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", module_path)
    return None if m is None else int(m.group(1))


def _pipeline(path, config, model, switches, group):
    """Split `model` with mlx-lm's own `model.model.pipeline(group)`; return this stage's
    switches, the whole model's index of its first MoE layer and the stage's share of the
    decoder layers (of the KV cache)."""
    if not hasattr(getattr(model, "model", None), "pipeline"):
        raise MlxmoeError(f"{path}: mlx-lm cannot split model_type {config['model_type']!r} into pipeline stages "
                          "(its model has no pipeline()); run it as one process")
    decoder_layers = len(model.model.layers)
    try:
        model.model.pipeline(group)
    except ValueError as e:  # e.g. more ranks than layers
        raise MlxmoeError(f"{path}: mlx-lm cannot split {decoder_layers} layers over {group.size()} ranks ({e})") from None
    start, end = model.model.start_idx, model.model.end_idx
    local = [i for i, (p, _) in enumerate(switches) if start <= (_stage_layer(p) or 0) < end]
    if not local:
        raise MlxmoeError(f"{path}: rank {group.rank()}'s pipeline stage (layers {start}-{end - 1}) holds no MoE "
                          f"layer to stream; use fewer ranks")
    return switches[local[0]:local[-1] + 1], local[0], (end - start) / decoder_layers


def _shard(path, config, model, store, group, hf_layout):
    """Shard `model` with mlx-lm's own `model.shard(group)` (attention heads, dense MLPs,
    experts in place); return the share of the KV cache a rank keeps."""
    if not hasattr(model, "shard"):
        raise MlxmoeError(f"{path}: mlx-lm cannot shard model_type {config['model_type']!r} over ranks (its model "
                          "has no shard()); use the pipeline split")
    if store.bundled or hf_layout:
        raise MlxmoeError(f"{path}: the tensor split reads slices of stacked experts; this checkpoint's layout "
                          f"is not stacked ({convert_hint(path)})")
    try:
        model.shard(group)
    except ValueError as e:  # heads or widths that do not divide by the ranks
        raise MlxmoeError(f"{path}: mlx-lm cannot shard this model over {group.size()} ranks ({e})") from None
    return 1.0 / group.size()


def _shard_axis(info, shape, group):
    """The axis of one expert's tensor that model.shard split (None: not split), checked."""
    if info.shape == tuple(shape):
        return None
    differ = [a for a, (full, part) in enumerate(zip(info.shape, shape)) if full != part]
    if group is None or len(info.shape) != len(shape) or len(differ) != 1 \
            or shape[differ[0]] * group.size() != info.shape[differ[0]] or differ[0] == 0:
        raise MlxmoeError(f"{info.file}: {info.name} has shape {list(info.shape)}, config.json implies {list(shape)}")
    return differ[0] - 1, group.size(), group.rank()


def _open(path, store, model_config=None, trust_remote_code=False, group=None, split="pipeline"):
    model, config = _build_model(path, store, model_config, trust_remote_code)
    switches = sorted(
        ((p, m) for p, m in model.named_modules() if isinstance(m, SWITCH_TYPES)), key=lambda pm: _layer_order(pm[0]))
    if not switches:
        raise MlxmoeError(f"{path}: model_type {config['model_type']!r} has no SwitchGLU/SwitchMLP experts to stream")
    # the model's own top-k and expert count, before a split changes the model
    top_ks = dict(zip((p for p, _ in switches), model_top_k(path, config, model, switches)))
    counts = {_num_experts(m) for _, m in switches}
    if len(counts) > 1:
        raise MlxmoeError(f"{path}: model_type {config['model_type']!r} has MoE layers of {sorted(counts)} experts; "
                          "mlxmoe streams layers of one expert count")
    sources = _hf_sources(model, store)
    total, offset, share = len(switches), 0, 1.0
    if group is not None and split == "tensor":
        share = _shard(path, config, model, store, group, bool(sources))
    elif group is not None:
        switches, offset, share = _pipeline(path, config, model, switches, group)
    shard_group = group if split == "tensor" else None
    layers = [_layer_tensors(path, config, store, sources, mpath, module, shard_group) for mpath, module in switches]
    if any(getattr(module[lin], "global_scale", None) is not None for _, module in switches for lin in LINEARS
           if lin in module):
        raise MlxmoeError(f"{path}: experts with a global scale (nvfp4) are not supported yet")
    store.map_layers(layers)
    if sources:
        _as_model_computes(store, layers[0], switches[0][1])

    ckpt = Checkpoint(path, config, model, store, module_paths=[p for p, _ in switches], layer_offset=offset,
                      top_ks=[top_ks[p] for p, _ in switches],
                      total_layers=total, group=group, stage_share=share, split=split)
    _swap_in(ckpt, switches)
    return ckpt


def _build_model(path, store, model_config, trust_remote_code):
    """mlx-lm's model of the checkpoint, lazy (nothing read), and its config."""
    classes = _bundled_classes(store) if store.bundled else _get_classes
    try:
        model, config = load_model(path, lazy=True, strict=True, model_config=model_config,
                                   get_model_classes=classes, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise MlxmoeError(weights_mismatch(path, e) or f"{path}: the weights do not match config.json: {e}") from None
    except Exception as e:  # mlx-lm's model classes take config.json's fields as they come: any error there
        raise MlxmoeError(f"{path}: mlx-lm cannot build this model from config.json and its weights "
                          f"({type(e).__name__}: {str(e)[:200]})") from None
    if store.bundled:
        model.__class__ = model.__class__.__mro__[1]  # mlx-lm's own class again
    return model, config


def weights_mismatch(path, error):
    """mlx's strict load_weights error, which names every extra or missing parameter a line
    each (dozens for a checkpoint of another architecture), in one line: how many, the first
    (sorted), and the model_type; None for another error."""
    m = re.fullmatch(r"(Received|Missing) (\d+) parameters[^:]*: \n(.*)\.", str(error), re.DOTALL)
    if m is None:
        return None
    first = m[3].split(",\n")[0]
    model_type, n = load_config(path).get("model_type"), int(m[2])
    return (f"{path}: {n} parameter{' does' if n == 1 else 's do'} not match the {model_type!r} model of "
            f"config.json (first: {first} {'not in the model' if m[1] == 'Received' else 'missing'}); is this "
            "checkpoint for this architecture?")


def _layer_tensors(path, config, store, sources, mpath, module, shard_group):
    """Where the bytes of each expert tensor of the switch module `module` (at `mpath`) are:
    {"gate_proj.weight": [(file tensor, expert, shard) or (file tensor, index, None, rows)
    per expert], ...}; `shard_group`, the group of a tensor split."""
    tensors = {}
    for lin in LINEARS:
        if lin not in module:
            continue
        for p in PARAMS:
            v = module[lin].get(p)
            if not isinstance(v, mx.array):
                continue
            full, E = f"{mpath}.{lin}.{p}", v.shape[0]
            if full in store.index:
                shard = _shard_axis(store.index[full], v.shape, shard_group)
                if p == "bias" and shard is None and tensors[f"{lin}.weight"][0][2] is not None:
                    # mlx-lm's shard divides such a bias by the ranks (their sum adds it back)
                    raise MlxmoeError(f"{path}: the tensor split cannot stream experts whose {lin} adds its "
                                      f"bias after the ranks' sum (model_type {config['model_type']!r}); "
                                      "run this model in one process")
                tensors[f"{lin}.{p}"] = [(full, e, shard) for e in range(E)]
            elif full in sources and len(sources[full]) == E:
                tensors[f"{lin}.{p}"] = [(n, k, None, rows) for n, k, rows in sources[full]]
            else:
                stored = next((f" (its experts are stored as {i.file.name}: {i.name}, {i.dtype} "
                               f"{list(i.shape)})" for n, i in store.index.items() if ".experts." in n), "")
                raise MlxmoeError(f"{path}: cannot find the bytes of {full} in this checkpoint's layout{stored}; "
                                  f"{convert_hint(path)}")
    return tensors


def _swap_in(ckpt, switches):
    """Put a StreamingExperts in place of each switch module of `switches` (its lazy expert
    arrays dropped), the routers and the streaming layers recorded in `ckpt`."""
    model, swaps = ckpt.model, []
    for layer, (mpath, module) in enumerate(switches):
        # Drop the lazy expert arrays: nothing will ever evaluate (read) them.
        for lin in LINEARS:
            if lin in module:
                for p in PARAMS:
                    if isinstance(module[lin].get(p), mx.array):
                        module[lin][p] = mx.zeros((0,))
        parent = model
        for part in mpath.split(".")[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        probs, scores = find_router(parent, ckpt.store.num_experts)
        streaming = StreamingExperts(module, layer, probs)
        ckpt.routers.append(scores)
        ckpt.blocks.append(parent)
        ckpt.experts.append(streaming)
        swaps.append((mpath, streaming))
    model.update_modules(tree_unflatten(swaps))


# The integer types a file's expert bytes may be read as (mlx-lm's sanitize views gpt-oss's
# uint8 mxfp4 blocks as uint32)
INT_TYPES = {mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.int8: "I8", mx.int32: "I32"}


def _as_model_computes(store, layer, module):
    """Check each expert tensor of a checkpoint in a Hugging Face layout against the one
    the model computes with (`module`, a switch module, as sanitize and mlx-lm built it):
    the same shape and dtype, or the same bytes of integers (the model's shape and type
    kept for the slots); else an error naming the file tensor."""
    for i, t in enumerate(store.tensors):
        lin, p = t.split(".")
        v = module[lin][p]
        want, dtype = tuple(v.shape[1:]), v.dtype
        have, fdtype = store.tensor_shapes[i], store.tensor_dtypes[i]
        if (have, MX_DTYPES.get(fdtype)) == (want, dtype):
            continue
        if fdtype in INT_TYPES.values() and dtype in INT_TYPES and \
                tensor_bytes(fdtype, have) == math.prod(want) * dtype.size:
            store.tensor_shapes[i] = store.model_shapes[i] = want  # (the fingerprint's too: as stacked)
            store.tensor_dtypes[i] = INT_TYPES[dtype]
            continue
        info = store.index[layer[t][0][0]]
        raise MlxmoeError(f"{info.file}: {info.name} gives {fdtype} {list(have)} per expert where the model computes "
                          f"with {str(dtype).split('.')[-1]} {list(want)}; mlxmoe cannot stream it as it is: "
                          f"{convert_hint(store.path)}")


# Where mlx-lm's MoE blocks, their routers and the args they were built from keep how many
# experts each token is routed to: read only where running the routers (routed_widths) failed
TOP_K_NAMES = ("num_experts_per_tok", "top_k", "num_experts_per_token", "moe_topk", "moe_top_k", "moe_k",
               "top_k_experts", "n_activated_experts", "experts_per_token")


class _WidthProbe(nn.Module):
    """Stands in for a SwitchGLU/SwitchMLP during routed_widths: keeps the width of the
    expert indices it is called with (the experts each token is routed to) and returns
    zeros of the shape the experts' output has."""

    def __init__(self):
        super().__init__()
        self._width = 0

    def __call__(self, x, indices, *args, **kwargs):
        self._width = max(self._width, int(indices.shape[-1]))
        return mx.zeros((*indices.shape, x.shape[-1]), x.dtype)


def routed_widths(model, switches):
    """{module path: experts per token} of each switch module (path, module) of `model`, as
    the model's own routing hands them over (the width of the expert indices it passes):
    the model is run on one token with probes in place of the switch modules. MLX knows
    an array's shape before computing it, so the graph this builds is never evaluated and
    no weight is read (unless the model's own code evaluates something mid-way); no
    expert is in it. The switches are put back. Returns (widths, the error the run raised
    or None); a switch the run did not reach has no width.

    Measured rather than read from config.json or the blocks' attributes: mlx-lm's models
    name top-k in a dozen ways (num_experts_per_tok, top_k, k, moe_topk, top_k_experts,
    a router's or the args' field, a list per layer), and the width of the indices is what
    the cache must hold one token's experts for."""
    from mlx_lm.models.cache import make_prompt_cache

    probes = [(p, _WidthProbe()) for p, _ in switches]
    error = None
    model.update_modules(tree_unflatten(probes))
    try:
        model(mx.array([[0]]), cache=make_prompt_cache(model))
    except Exception as e:  # any architecture's forward: the declared top-k is the fallback
        error = e
    finally:
        model.update_modules(tree_unflatten(list(switches)))
    return {p: probe._width for p, probe in probes if probe._width}, error


def _int_attr(obj, name):
    v = obj.get(name) if isinstance(obj, dict) and not isinstance(obj, nn.Module) else getattr(obj, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def declared_top_k(model, path, num_experts):
    """The top-k the MoE block holding switch `path` was built with, or None: an integer
    attribute of TOP_K_NAMES (or `k`) of the block, of its router (`gate`/`router`) or of
    the args they keep (`args`/`config`), the nearest enclosing module first, up to the
    decoder layer (where e.g. gemma4 keeps its router)."""
    node, chain = model, []
    for part in path.split(".")[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
        chain.append((part, node))
    for part, block in reversed(chain):
        if isinstance(block, nn.Module):
            holders = [block] + [block[n] for n in ("gate", "router") if isinstance(block.get(n), nn.Module)]
            for holder in holders:
                found = [(holder, TOP_K_NAMES + ("k",))] + [
                    (args, TOP_K_NAMES) for args in (getattr(holder, a, None) for a in ("args", "config"))
                    if args is not None and not isinstance(args, (nn.Module, mx.array))]
                for obj, names in found:
                    for name in names:
                        k = _int_attr(obj, name)
                        if k is not None and 1 <= k <= num_experts:
                            return k
        if part.isdigit():  # the decoder layer: no further
            break
    return None


def model_top_k(path, config, model, switches):
    """[experts per token] of each switch (path, module), from the instantiated model:
    measured by running its routing (routed_widths), else declared by its MoE block; an
    MlxmoeError naming the model type where neither tells."""
    widths, error = routed_widths(model, switches)
    top_k = []
    for mpath, module in switches:
        E = _num_experts(module)
        k = widths.get(mpath) or declared_top_k(model, mpath, E)
        if k is None:
            why = f"running it on one token failed: {type(error).__name__}: {str(error)[:200]}" if error else \
                "running it on one token did not reach these experts"
            raise MlxmoeError(f"{path}: cannot tell how many experts model_type {config['model_type']!r} routes each "
                              f"token to at {mpath} ({why}; its MoE block declares no top-k mlxmoe knows)")
        if not 1 <= k <= E:
            raise MlxmoeError(f"{path}: model_type {config['model_type']!r} routes each token to {k} experts at "
                              f"{mpath}, which has {E}")
        top_k.append(k)
    return top_k


def _num_experts(module):
    """The experts of a SwitchGLU/SwitchMLP as mlx-lm built it: the leading dimension of its weights."""
    return next(module[lin]["weight"].shape[0] for lin in LINEARS if lin in module)


def decoder_layers(ckpt):
    """Each MoE layer's decoder layer, an index into `model.layers` (as mlx-lm's prompt cache
    counts them); None where a MoE layer lies in none of them."""
    layers = getattr(ckpt.model, "layers", None)
    found = [_stage_layer(p) for p in ckpt.module_paths]
    if layers is None or any(d is None or d >= len(layers) for d in found):
        return None
    if not all(any(m is s for _, m in layers[d].named_modules()) for d, s in zip(found, ckpt.experts)):
        return None
    return found


def attach_cache(ckpt, runtime):
    """Point every StreamingExperts' weights at the runtime's cache's slot pools; the model
    holds both (model.expert_runtime, model.expert_cache)."""
    cache = runtime.cache
    for streaming in ckpt.experts:
        module = streaming._inner
        for name, pool in zip(cache.pools.names, cache.pools.compute):
            lin, p = name.split(".")
            module[lin][p] = pool
        streaming._cache, streaming._runtime = cache, runtime
    ckpt.model.expert_cache, ckpt.model.expert_runtime = cache, runtime
