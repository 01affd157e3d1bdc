"""Memory sizes: parse them, read the machine's, and split a budget into resident
weights, KV cache reserve, working memory and the expert cache."""

import math
import os
import re
import resource
import sys
from dataclasses import dataclass

from .errors import MlxmoeError

# Binary units; each also all in lower case (12gb). Mixed cases (Mb: megabits) are refused.
UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KiB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
         "MiB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GiB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TiB": 1 << 40}
UNITS.update({unit.lower(): n for unit, n in UNITS.items()})
MAX_SIZE = 1 << 60  # an exabyte: anything larger is a typo

# Share of the machine's memory used when no budget is given.
DEFAULT_SHARE = 0.6
# Tokens of context the KV reserve is sized for by default.
DEFAULT_CONTEXT = 4096


def parse_size(value, what="size"):
    """'12GB', '512MB', '1.5G', 1000 -> bytes (binary units: 1 GB = 2**30)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise MlxmoeError(f"cannot read {what} {value!r}: give bytes or a size such as 12GB")
    if isinstance(value, (int, float)):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2) not in UNITS:
            raise MlxmoeError(f"cannot read {what} {str(value)[:40]!r}: use a number with an optional unit, e.g. "
                              "12GB or 512MB (units: B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB, all binary)")
        n = float(m.group(1)) * UNITS[m.group(2)]
    if not 0 <= n <= MAX_SIZE:  # also NaN
        raise MlxmoeError(f"{what} {str(value)[:40]!r} is not a size between 0 and {MAX_SIZE >> 60} EB")
    return int(n)


def format_size(n, rounding=round):
    """Bytes in the units parse_size reads (1 MB = 2**20 bytes), to 0.1 of the unit. A
    minimum is shown with rounding=math.ceil, so that the size shown, typed back, is enough."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{rounding(n):.0f} {unit}" if unit == "B" else f"{rounding(n * 10) / 10:.1f} {unit}"
        n /= 1024


def machine_memory():
    """Physical memory of this machine in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def text_config(config):
    """The language model's settings: a multimodal config.json (llama4, qwen3-vl-moe)
    nests them under "text_config"."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def kv_bytes_per_token(config, dtype_bytes):
    """KV cache bytes one token of context costs, from config.json (an upper bound for
    models with sliding-window layers)."""
    config = text_config(config)
    layers = config.get("num_hidden_layers", 0)
    heads = config.get("num_attention_heads", 1)
    if "kv_lora_rank" in config:  # MLA (deepseek): mlx-lm caches the compressed latent and rope key
        per_layer = config["kv_lora_rank"] + config.get("qk_rope_head_dim", 0)
    else:
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
        per_layer = 2 * kv_heads * head_dim
    return layers * per_layer * dtype_bytes


def kv_reserve_bytes(config, dtype_bytes, context, share=1.0):
    """The KV cache of `context` tokens (`share`: of the layers this process runs), and one
    layer's keys and values again: mlx-lm grows a layer's cache by concatenation, so while
    it grows the old and the new arrays both exist."""
    per_token = kv_bytes_per_token(config, dtype_bytes)
    layers = max(1, text_config(config).get("num_hidden_layers", 1))
    return int(per_token * context * share + per_token * context / layers)


def working_bytes(config, dtype_bytes, prefill_tokens, top_k):
    """Activations of one prefill step: hidden states, the experts' intermediates (of the
    `top_k` experts each token is routed to, as the model routes) and logits."""
    config = text_config(config)
    hidden = config.get("hidden_size", 0)
    inter = config.get("moe_intermediate_size") or config.get("intermediate_size", 0)
    k = top_k
    vocab = config.get("vocab_size", 0)
    return prefill_tokens * (8 * hidden + 3 * k * inter + vocab) * dtype_bytes


def attention_bytes(config, dtype_bytes, queries, keys):
    """Attention scores and probabilities of `queries` tokens against `keys` where the
    backend materialises them (CPU; no fused attention kernel there)."""
    return 2 * queries * keys * text_config(config).get("num_attention_heads", 1) * dtype_bytes


@dataclass
class Plan:
    budget: int
    resident: int  # non-expert weights
    kv_reserve: int
    working: int  # activations and MLX scratch
    expert_cache: int  # bytes for slot pools
    cache_experts: int  # slots
    minimum: int  # smallest budget that works
    slot_bytes: int
    attention: int = 0  # of `working`: a prefill step's attention scores, where the backend materialises them
    attention_per_key: int = 0  # those bytes per query token and key
    step_bytes: int = 0  # a prefill step's activations per token, logits left out (api.prefill_step)
    context: int = DEFAULT_CONTEXT  # tokens (prompt + generated) the KV reserve is sized for


def plan(budget, resident, slot_bytes, min_experts, kv_reserve, working, cache_size=None, cache_experts=None,
         memory=None, all_experts=None):
    """Split `budget` bytes. `cache_size`/`cache_experts` set the expert cache directly
    (then the budget, when given, must still hold it). With neither, the budget is a
    safe share of `memory` (default: this machine's). The cache never exceeds
    `all_experts` (every expert of the model), when given."""
    fixed = resident + kv_reserve + working
    minimum = fixed + min_experts * slot_bytes
    if cache_experts is not None:
        slots = int(cache_experts)
    elif cache_size is not None:
        slots = cache_size // slot_bytes
    else:
        slots = None
    if budget is None and slots is None:
        budget = int((memory or machine_memory()) * DEFAULT_SHARE)
        if budget < minimum:
            raise MlxmoeError(f"this model needs at least {format_size(minimum, math.ceil)}; {format_size(budget)} is "
                              f"{DEFAULT_SHARE:.0%} of this machine's memory. Pass --memory-budget to use more.")
    if budget is not None and budget < minimum:
        raise MlxmoeError(
            f"memory budget {format_size(budget)} is below the minimum of {format_size(minimum, math.ceil)}"
            f"{f' ({minimum - budget} B short)' if format_size(budget) == format_size(minimum, math.ceil) else ''} "
            "for this model "
            f"({format_size(resident)} resident weights + {format_size(kv_reserve)} KV cache + "
            f"{format_size(working)} working memory + {min_experts} experts of {format_size(slot_bytes)})")
    if slots is None:
        slots = (budget - fixed) // slot_bytes
    if all_experts is not None and slots > all_experts:  # more than every expert: hold them all, no more
        slots = all_experts
    if budget is not None and fixed + slots * slot_bytes > budget:
        raise MlxmoeError(
            f"an expert cache of {slots} experts ({format_size(slots * slot_bytes)}) does not fit in the memory "
            f"budget {format_size(budget)} beside {format_size(fixed)} of weights, KV cache and working memory")
    if slots < min_experts:
        raise MlxmoeError(f"the expert cache must hold at least {min_experts} experts (top-k), got {slots}")
    return Plan(budget or fixed + slots * slot_bytes, resident, kv_reserve, working, slots * slot_bytes, slots,
                minimum, slot_bytes)


def peak_rss() -> int:
    """The process's peak resident memory in bytes (VmHWM on Linux: ru_maxrss there
    includes the parent's peak when this process was started by fork + exec)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(l for l in f if l.startswith("VmHWM")).split()[1]) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
