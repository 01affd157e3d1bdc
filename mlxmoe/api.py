"""load / generate / stream_generate with mlx-lm's names and arguments, the Runtime that
load builds around a model, and memory_plan (what a budget buys, nothing loaded)."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import GenerationResponse
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.generate import generation_stream as _mlx_generation_stream
from mlx_lm.generate import stream_generate as _mlx_stream_generate
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import backend as backends
from . import distributed
from .budget import (DEFAULT_CONTEXT, Plan, attention_bytes, format_size, kv_reserve_bytes, parse_size, plan,
                     text_config, working_bytes)
from .caching.cache import ExpertCache, lower_switch_interval
from .workload.curves import predicted_curve
from .errors import MlxmoeError
from .caching.experts import all_resident
from .storage.files import check_outputs, folder_bytes, read_lines
from .caching.fallback import attach_fallback
from .caching.fallback import build as write_fallback
from .caching.fallback import file_bytes as fallback_bytes
from .caching.fallback import read as read_fallback
from .caching.lossy import attach_lossy
from .caching.lossy import check_options as check_lossy
from .loader import DEMO_MODEL, MX_DTYPES, Checkpoint, attach_cache, decoder_layers, open_checkpoint, read_tokenizer
from .caching.policies import ONLINE, make_policy
from .caching.prefetch import Prefetcher
from .caching.speculate import NextToken, Speculator
from .caching.verify import Verifier
from .governor import Governor, Resizer, auto_budget
from .drafting import NGRAM_DRAFT_TOKENS, DraftCount, Lookup, NGram, after, load_draft, ngram_steps, respond, Switch
from .workload.profile import ActivationProfile, fingerprint, prewarm_order
from .workload.trace import TraceWriter, read_trace

# Prompt tokens per prefill step the budget's working memory is planned for (a small
# share of the budget); steps take as many tokens as that memory holds (prefill_step), up
# to mlx-lm's 2048: where the cache holds few experts, each step reads most of them again.
PREFILL_STEP = 512
MAX_PREFILL_STEP = 2048


def memory_plan(path_or_hf_repo: str | os.PathLike, memory_budget: str | int | None = None, *,
                cache_size: str | int | None = None, cache_experts: int | None = None,
                backend: str | None = None, max_context: int = DEFAULT_CONTEXT) -> Plan:
    """What `load` with these options would give, reading headers only: the budget's split
    (a budget.Plan: `cache_experts`, the expert cache's size in experts, and its bytes
    `expert_cache`; `resident`, `kv_reserve` and `working` bytes; `minimum`, the smallest
    budget that works). What `--memory-budget` resolves to. A budget below the minimum
    raises MlxmoeError naming it."""
    be = backends.detect(backend)
    ckpt = open_checkpoint(path_or_hf_repo)
    try:
        be.apply_dtype_policy(ckpt.model)
        return checkpoint_plan(ckpt, be, memory_budget, cache_size, cache_experts, context=max_context)
    finally:
        ckpt.store.close()


def build_fallback(path_or_hf_repo: str | os.PathLike, dst: str | os.PathLike, bits: int,
                   progress: Callable[[str], Any] | None = None) -> int:
    """Write low-bit copies of the checkpoint's experts to the file `dst` (fallback.py), for
    load(..., fallback=dst); return its bytes."""
    ckpt = open_checkpoint(path_or_hf_repo)
    try:
        check_outputs({"dst": dst}, {"the model": ckpt.path})  # before the work (files.py's rule)
        return write_fallback(ckpt, model_fingerprint(ckpt), dst, bits, progress=progress)
    finally:
        ckpt.store.close()


def checkpoint_plan(ckpt, backend, memory_budget=None, cache_size=None, cache_experts=None, context=DEFAULT_CONTEXT,
                    extra=0):
    """How `memory_budget` splits for an opened checkpoint on this backend (its dtype policy
    applied); `extra`: bytes resident beside the model's own weights (low-bit fallback copies)."""
    params = tree_flatten(ckpt.model.parameters())
    resident = sum(v.nbytes for _, v in params) + extra
    act_bytes = backend.activation_bytes(ckpt.model)
    slot_bytes = sum(int(np.prod(shape)) * backend.pool_dtype(MX_DTYPES[d]).size
                     for shape, d in zip(ckpt.store.tensor_shapes, ckpt.store.tensor_dtypes))
    total = ckpt.num_layers * ckpt.num_experts
    # where attention is materialised, the working memory holds a full prefill step's
    # against as many keys; longer prompts take shorter steps to stay within it (prefill_step)
    attention = attention_bytes(ckpt.config, act_bytes, PREFILL_STEP, PREFILL_STEP) if backend.materialises_attention else 0
    p = plan(parse_size(memory_budget, "memory budget"), resident, slot_bytes, ckpt.top_k,
             kv_reserve_bytes(ckpt.config, act_bytes, context, ckpt.stage_share),
             working_bytes(ckpt.config, act_bytes, PREFILL_STEP, ckpt.top_k) + attention,
             parse_size(cache_size, "cache size"), cache_experts, memory=backend.memory(), all_experts=total)
    p.attention = attention
    p.attention_per_key = attention_bytes(ckpt.config, act_bytes, 1, 1)  # per query token and key
    # a prefill step's activations per token: no logits (mlx-lm computes none for a prompt's steps)
    p.step_bytes = (working_bytes(ckpt.config, act_bytes, 1, ckpt.top_k)
                    - text_config(ckpt.config).get("vocab_size", 0) * act_bytes)
    p.context = context
    return p


def model_info(path_or_hf_repo: str | os.PathLike | None = None, memory_budget: str | int | None = None,
               backend: str | None = None, fallback: str | os.PathLike | None = None) -> dict:
    """What `mlxmoe info` shows, reading headers only: architecture, experts, bytes of the
    resident weights and of one expert, the smallest budget that works, the budget that
    holds every expert resident and, given `memory_budget`, what it buys (beside the
    `fallback` file's low-bit copies where given)."""
    be = backends.detect(backend)
    ckpt = open_checkpoint(path_or_hf_repo)
    try:
        be.apply_dtype_policy(ckpt.model)
        extra = 0
        if fallback:  # checked as load(fallback=) checks it: its format, the model's fingerprint and shape
            read_fallback(fallback, model_fingerprint(ckpt), ckpt.all_layers, ckpt.num_experts)
            extra = fallback_bytes(fallback)
        minimal = checkpoint_plan(ckpt, be, cache_experts=ckpt.top_k, extra=extra)
        total = ckpt.num_layers * ckpt.num_experts
        out = {
            "model": str(ckpt.path), "model_type": ckpt.config["model_type"], "backend": be.name,
            "moe_layers": ckpt.num_layers, "experts_per_layer": ckpt.num_experts, "top_k": ckpt.top_k,
            "top_k_per_layer": ckpt.top_ks,
            "expert_tensors": dict(zip(ckpt.store.tensors, ckpt.store.tensor_dtypes)),
            "expert_bytes": minimal.slot_bytes, "expert_bytes_on_disk": ckpt.store.expert_file_bytes(),
            "all_experts_bytes": total * minimal.slot_bytes, "resident_bytes": minimal.resident - extra,
            "kv_reserve_bytes": minimal.kv_reserve, "working_bytes": minimal.working,
            "minimum_budget": minimal.minimum,
            "all_resident_budget": minimal.minimum + (total - ckpt.top_k) * minimal.slot_bytes,
            # tokens a prefill step takes: a short prompt's, and a prompt as long as the context's
            "prefill_step": prefill_step(minimal, None, []),
            "prefill_step_at_context": prefill_step(minimal, None, [0] * minimal.context), "context": minimal.context,
        }
        if fallback:
            out["fallback_bytes"] = extra
        if memory_budget:
            p = checkpoint_plan(ckpt, be, memory_budget, extra=extra)
            out["budget"] = {"budget": p.budget, "cache_experts": p.cache_experts, "cache_bytes": p.expert_cache,
                             "share_of_experts": p.cache_experts / total}
        return out
    finally:
        ckpt.store.close()


def list_models(backend: str | None = None) -> list[dict]:
    """The models on this machine (`mlxmoe list`): pulled ones (the Hugging Face cache), the
    model folders in ./models, and the bundled demo. Each: `name`, `path`, `disk_bytes` and,
    from model_info (headers only), its MoE shape, `minimum_budget`, `all_resident_budget`,
    this machine's `memory` and `fits`: "all_resident" (that memory holds every expert),
    "streaming" (it holds the minimum; experts stream) or "no"; or `error` where it cannot
    be opened (an interrupted pull says to run `mlxmoe pull` again)."""
    from .storage.remote import cached_models, missing_files

    found = cached_models()
    if Path("models").is_dir():
        found += [(str(f), f, folder_bytes(f)) for f in sorted(Path("models").iterdir())
                  if (f / "config.json").is_file()]
    found.append(("demo", DEMO_MODEL, folder_bytes(DEMO_MODEL)))
    memory = backends.detect(backend).memory()
    rows = []
    for name, folder, size in found:
        row = {"name": name, "path": str(folder), "disk_bytes": size}
        rows.append(row)
        try:
            missing = missing_files(folder)
            if missing:
                raise MlxmoeError(f"incomplete: {len(missing)} weight file(s) missing; run `mlxmoe pull {name}` again")
            info = model_info(folder, backend=backend)
        except (MlxmoeError, OSError, ValueError) as e:  # one model that does not open does not end the list
            row["error"] = str(e)
            continue
        row.update({k: info[k] for k in ("model_type", "moe_layers", "experts_per_layer", "top_k", "minimum_budget",
                                         "all_resident_budget")})
        row["memory"] = memory
        row["fits"] = ("all_resident" if info["all_resident_budget"] <= memory else
                       "streaming" if info["minimum_budget"] <= memory else "no")
    return rows


@dataclass
class LoadOptions:
    """mlxmoe's own options of `load` (keywords there), defined once: the CLI and the server
    build one and pass it whole (`load(path, options=LoadOptions(...))`). Their meaning is
    load's docstring."""
    memory_budget: str | int | None = None  # or "auto" (governor.py)
    memory_margin: str | int | None = None
    cache_size: str | int | None = None
    cache_experts: int | None = None
    policy: str | None = None
    profile: str | os.PathLike | ActivationProfile | None = None
    backend: str | None = None
    io_threads: int = 4
    force_profile: bool = False
    prewarm: bool = True
    trace_out: str | os.PathLike | None = None
    prefetch: int = 1
    prefetch_confidence: float = 0.1
    io: str = "auto"
    group: Any = None
    split: str = "pipeline"
    max_context: int = DEFAULT_CONTEXT
    trim: float = 0.0
    cache_bias: float | str = 0.0  # or "profile"
    trim_mass: float = 0.0
    fallback: str | os.PathLike | None = None
    verify: bool = True
    draft_model: str | os.PathLike | None = None

    def check(self) -> None:
        """Refuse a value out of its range, naming it (the CLI's ranges: one rule for both entrances)."""
        if self.split not in ("pipeline", "tensor"):
            raise MlxmoeError(f"split {self.split!r}: choose pipeline or tensor")
        if not (isinstance(self.prefetch, bool) or _int_in(self.prefetch, 0, 64)):  # (True/False: depth 1, off)
            raise MlxmoeError(f"prefetch {self.prefetch!r}: layer calls ahead, an integer from 0 to 64")
        if not _int_in(self.io_threads, 1, 256):
            raise MlxmoeError(f"io_threads {self.io_threads!r}: an integer from 1 to 256")
        c = self.prefetch_confidence
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c <= 1:
            raise MlxmoeError(f"prefetch_confidence {c!r}: a probability, from 0 to 1")
        if self.cache_experts is not None and not _int_in(self.cache_experts, 1, 1 << 62):
            raise MlxmoeError(f"cache_experts {self.cache_experts!r}: a number of experts, an integer of at least 1")
        check_lossy(self.trim, self.cache_bias, self.trim_mass)
        if self.memory_margin is not None:
            if self.memory_budget != "auto":
                raise MlxmoeError("memory_margin: the memory left free by memory_budget \"auto\"; give both")
            parse_size(self.memory_margin, "memory margin")
        if self.draft_model is not None and self.group is not None and self.group.size() > 1:
            raise MlxmoeError("draft_model: speculative decoding runs in one process, not across ranks")
        if not _int_in(self.max_context, 16, 1 << 24):
            raise MlxmoeError(f"max_context {self.max_context!r}: tokens a sequence may hold, an integer from 16 "
                              f"to {1 << 24}")
        if self.trace_out is not None:  # refused now, not at close(): files.py's rule (the model's: record_trace)
            profile = None if isinstance(self.profile, ActivationProfile) else self.profile
            check_outputs({"trace_out": self.trace_out}, {"profile": profile, "fallback": self.fallback})


def load(path_or_hf_repo: str | os.PathLike, tokenizer_config: dict | None = None, model_config: dict | None = None,
         adapter_path: str | None = None, lazy: bool = False, return_config: bool = False, revision: str | None = None,
         trust_remote_code: bool = False, *, options: LoadOptions | None = None, **kwargs
         ) -> tuple[nn.Module, TokenizerWrapper] | tuple[nn.Module, TokenizerWrapper, dict]:
    """Load an mlx-lm MoE checkpoint with its experts streamed from disk.

    Takes mlx_lm.load's arguments (LoRA adapters excepted: fuse them first) and returns what it returns, (model,
    tokenizer) or with `return_config` (model, tokenizer, config); `model.expert_cache.stats()` gives the cache's
    stats and `model.expert_runtime` (a Runtime) records, swaps and saves profiles as the CLI does. mlxmoe's own
    options are keyword-only (the fields of LoadOptions; or `options=LoadOptions(...)`): `memory_budget` ("12GB",
    bytes) bounds resident weights + KV cache + working memory + expert cache; `cache_size` (bytes) or
    `cache_experts` (count) set the cache directly.
    `memory_budget="auto"` follows the memory available, keeping `memory_margin` free (default 15 % of memory or 2
    GB, the smaller): the expert cache shrinks and grows within a second (governor.py);
    `model.expert_runtime.resize("8GB")` resizes it at any time. Output is unchanged.
    `policy` names the eviction policy (default activation-floor); `backend` cpu, metal or cuda (default: the best
    available); `io` how experts are read (auto, mmap, pread, direct; store.py) by `io_threads` threads.
    `profile` (a path or an ActivationProfile) gives the policy its prior and pre-warms the cache with its hottest
    experts in the background (`prewarm`; where the cache holds every expert, all of them are read in the
    background, after the profile's hottest, and once they are in, layers run without per-layer host work or syncs);
    `force_profile` takes one recorded on another model whose layer and expert counts agree; the live profile
    (`model.expert_runtime.profile`) keeps learning either way. `trace_out` records a routing trace (mlxmoe.trace/1)
    there, completed by `model.expert_runtime.close()`.
    `prefetch` is how many MoE layer calls ahead (past the last layer: the next token's first layers) experts are
    predicted and read in the background during decoding (0: only on demand); a router guess is loaded when its
    probability reaches `prefetch_confidence` or the previous token used it too, and its next guesses (up to the top
    2k) where the cache policy ranks them above its victim (see prefetch.py).

    `max_context` is the tokens (prompt, earlier turns and generated) a sequence may hold: the budget reserves KV
    cache for that many; a longer prompt is refused (MlxmoeError naming both numbers) and generation stops there (as
    max_tokens does).

    Lossy modes, opt-in (exact, the default, gives mlx-lm's tokens): `trim` W skips, at a decode step, a routed
    expert that is not resident and carries less than W of the token's routing weight (the rest weighted as the
    model's top-k rule does), `trim_mass` M one beyond the top experts that carry M of it; `cache_bias` B adds B to
    resident experts' router logits before the top-k (see lossy.py; "profile": the `profile`'s recommended value,
    from `profile record --recommend-bias`). What they did is in stats() (skipped, biased). mlx-lm's softmax-routed
    families only (mixtral, qwen2_moe, qwen3_moe, olmoe, gpt_oss); others are refused naming their model type.
    `fallback`: a file of low-bit copies of every expert (`mlxmoe convert --fallback-bits`), resident within the
    budget: at a decode step an expert not in the cache computes with its copy at once and is read in the
    background, so no step waits on a read (stats(): substituted, fallback_bytes).
    `draft_model`: a small model sharing the tokenizer (a folder mlx_lm.load reads), loaded whole within the budget
    (its weights and a KV cache of `max_context` tokens beside the model's) as `model.expert_runtime.draft_model`,
    for speculative decoding: pass it to generate / stream_generate as `draft_model=` (see stream_generate).
    `verify` (on by default): where some experts are not resident, a decode step looks its slots up on the device
    and waits for the device once, at its end, instead of at every MoE layer; a layer that missed is read and the
    token computed again from it (see caching/verify.py; stats(): verified_tokens, replays, verify). False: a wait
    per layer.

    `group` (an mx.distributed group of several ranks, from `mx.distributed.init()` under `mlx.launch`) splits the
    model into mlx-lm's pipeline stages: this rank builds and streams only its stage's layers, within its own
    `memory_budget`; every rank must call load, generate and the stats/profile exchanges of mlxmoe.distributed
    alike. A rank that fails to load makes every rank raise, naming it. `split="tensor"` shards every layer with
    mlx-lm's `model.shard(group)` instead: each rank streams its slice of each expert.
    """
    opts = _options(options, kwargs)
    args = (path_or_hf_repo, tokenizer_config, model_config, adapter_path, lazy, return_config, revision,
            trust_remote_code, opts)
    return _load(*args) if opts.group is None else _load_on_ranks(opts.group, args)


def _options(options, kwargs):
    """`options` (a LoadOptions, or the defaults) with load's keywords `kwargs` over it,
    checked; `group` None unless it has several ranks."""
    unknown = sorted(set(kwargs) - {f.name for f in fields(LoadOptions)})
    if unknown:
        raise TypeError(f"load() got unknown option{'s' * (len(unknown) > 1)} {', '.join(unknown)} "
                        f"(mlxmoe's options: {', '.join(f.name for f in fields(LoadOptions))})")
    opts = replace(options or LoadOptions(), **kwargs)
    opts.check()
    opts.group = opts.group if opts.group is not None and opts.group.size() > 1 else None
    return opts


def _load_on_ranks(group, args):
    """_load(*args) on one rank of `group`: a rank that fails makes every rank raise, naming it."""
    try:
        loaded = _load(*args)
    except Exception as e:
        distributed.check(group, e)  # raises on every rank, naming this one
        raise
    try:
        distributed.check(group)  # every rank loaded
    except BaseException:
        loaded[0].expert_runtime.abort()
        raise
    return loaded


def _int_in(value, low, high):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and low <= value <= high


def _load(path_or_hf_repo, tokenizer_config, model_config, adapter_path, lazy, return_config, revision,
          trust_remote_code, opts):
    if tokenizer_config is not None and not isinstance(tokenizer_config, dict):
        raise MlxmoeError(f"tokenizer_config must be a dict, not {tokenizer_config!r} (mlx_lm.load's second "
                          "argument; mlxmoe's options are keywords: memory_budget=..., cache_experts=...)")
    if adapter_path is not None:
        raise MlxmoeError(f"adapter {adapter_path}: LoRA adapters are not supported; fuse them into the model "
                          "first (mlx_lm.fuse)")
    be = backends.detect(opts.backend)
    ckpt = open_checkpoint(path_or_hf_repo, model_config, revision, trust_remote_code, opts.group, opts.split)
    try:
        tokenizer = _build(ckpt, be, tokenizer_config, lazy, opts)
    except BaseException:  # nothing stays open: shards, IO threads, a trace's temp file
        runtime = getattr(ckpt.model, "expert_runtime", None)
        if runtime is not None:
            runtime.abort()
        ckpt.store.close()
        raise
    return (ckpt.model, tokenizer, ckpt.config) if return_config else (ckpt.model, tokenizer)


def _build(ckpt, be, tokenizer_config, lazy, opts):
    """Give an opened checkpoint its Runtime (model.expert_runtime, with model.expert_cache); return the tokenizer."""
    tokenizer = read_tokenizer(ckpt.path, tokenizer_config, ckpt.config.get("eos_token_id"))
    ckpt.store.set_io(opts.io)  # "auto", "mmap", "pread" or "direct" (see store.py)
    ckpt.store.reader.land = be.slot_copy()  # (None, the host's stores, but where backend.DEVICE_COPY is on)
    be.apply_dtype_policy(ckpt.model)
    fp = model_fingerprint(ckpt)
    draft, draft_bytes, extra = _beside_cache(ckpt, be, tokenizer, opts)
    budget, allowed, margin = _auto(ckpt, be, opts, extra) if opts.memory_budget == "auto" else \
        (opts.memory_budget, None, None)
    p = _plan_with_draft(ckpt, be, budget, opts, extra, draft_bytes)
    prior = None if opts.profile is None else stage_profile(ckpt, fp, opts.profile, opts.force_profile)
    if not lazy:
        mx.eval(ckpt.model.parameters())
    if draft is not None:
        mx.eval(draft.parameters())
    live = _live_profile(ckpt, fp, prior, p)
    runtime = _attach_runtime(ckpt, p, be, fp, live, prior, opts)
    runtime.draft_model = draft
    _start_runtime(runtime, p, prior, budget, allowed, margin, opts)
    return tokenizer


def _beside_cache(ckpt, be, tokenizer, opts):
    """(the draft model or None, its bytes, all the bytes resident beside the expert cache within the
    budget: the fallback copies and the draft model), the draft model loaded."""
    if opts.fallback is not None and Path(opts.fallback).is_dir():
        raise MlxmoeError(f"fallback copies {opts.fallback} is a folder, not a file")
    extra = 0 if opts.fallback is None else fallback_bytes(opts.fallback)  # resident beside the cache, within the budget
    draft, draft_bytes = None, 0
    if opts.draft_model is not None:
        check_rotating(make_prompt_cache(ckpt.model))
        draft, draft_bytes = load_draft(opts.draft_model, tokenizer, be, opts.max_context)
        extra += draft_bytes
    return draft, draft_bytes, extra


def _plan_with_draft(ckpt, be, budget, opts, extra, draft_bytes):
    """checkpoint_plan within `budget`; where it does not fit and there is a draft model
    (of `draft_bytes`), the error says what the draft model takes of it."""
    try:
        return checkpoint_plan(ckpt, be, budget, opts.cache_size, opts.cache_experts, opts.max_context, extra)
    except MlxmoeError as e:
        if opts.draft_model is None:
            raise
        raise MlxmoeError(f"{e}; the draft model {opts.draft_model} needs {format_size(draft_bytes, math.ceil)} of "
                          f"it (its weights and a KV cache of {opts.max_context} tokens)") from None


def _live_profile(ckpt, fp, prior, p):
    """The profile the cache keeps learning: the `prior` profile's counts carried on, or a new one."""
    if prior is not None:  # keep learning from where the profile left off
        live = ActivationProfile.merge([prior], workload=prior.workload)
        live.curve = prior.curve  # its recording's predicted hit rates, kept when the live profile is saved
    else:
        live = ActivationProfile(ckpt.num_layers, ckpt.num_experts, ckpt.top_k)
    live.model, live.fingerprint = model_name(ckpt.path), fp
    live.expert_bytes, live.resident_bytes = profile_sizes(p)
    return live


def _attach_runtime(ckpt, p, be, fp, live, prior, opts):
    """The Runtime of plan `p`: its expert cache, policy, prefetcher, lossy modes, fallback
    copies, speculator and verifier, attached to the model's MoE layers."""
    rates = None if prior is None else prior.rates()
    pool_dtypes = [be.pool_dtype(MX_DTYPES[d]) for d in ckpt.store.tensor_dtypes]
    policy = make_policy(opts.policy, p.cache_experts, ckpt.num_layers, ckpt.num_experts, prior=rates)
    decoders = decoder_layers(ckpt)
    streamed = p.cache_experts < ckpt.num_layers * ckpt.num_experts
    unverified = _unverified(opts, streamed, decoders, ckpt.group)
    verify = unverified is None
    # under the tensor split the ranks take the resident path together (Runtime.agree_resident)
    cache = ExpertCache(ckpt.store, p.cache_experts, policy, pool_dtypes, opts.io_threads, profile=live,
                        hold_resident=ckpt.group is not None and ckpt.split == "tensor", spare=verify)
    if streamed:  # (threads that read while the decode thread runs Python: see lower_switch_interval)
        cache.closers.append(lower_switch_interval())
    if be.name == "metal":  # (an idle Apple GPU lowers its clock: see KeepBusy)
        cache.keep_busy = backends.KeepBusy()
        cache.closers.append(cache.keep_busy.close)
    prefetcher = None
    if opts.prefetch and streamed:
        prefetcher = Prefetcher(cache, ckpt.routers, ckpt.top_ks, depth=opts.prefetch, prior=rates,
                                confidence=opts.prefetch_confidence)
    runtime = Runtime(ckpt, p, be, cache, fp, prefetcher)
    attach_cache(ckpt, runtime)
    runtime.lossy = attach_lossy(ckpt, cache, opts.trim, opts.cache_bias, opts.trim_mass, prior)
    if opts.fallback is not None:
        attach_fallback(ckpt, cache, opts.fallback, fp)
    if prefetcher is not None and ckpt.group is None and runtime.lossy is None and opts.fallback is None and decoders \
            and be.runs_ahead:
        cache.speculator = Speculator(ckpt.model, decoders, ckpt.blocks, cache, prefetcher)
    if verify:  # (never with a lossy mode: _unverified refuses its options)
        cache.verifier = Verifier(ckpt.model, decoders, cache, guess=prefetcher is not None, top_k=max(ckpt.top_ks))
    cache.unverified = unverified
    return runtime


def _unverified(opts, streamed: bool, decoders, group) -> str | None:
    """Why decode steps are not verified (caching/verify.py) in this runtime, or None where they are."""
    if not streamed:
        return "every expert resident at load: no wait at a layer call while they are"
    if not opts.verify:
        return "a wait at every MoE layer call (--wait-per-layer)"
    if not decoders:
        return "a wait at every MoE layer call (this model's decoder layers are not found)"
    if group is not None:
        return "a wait at every MoE layer call (several ranks)"
    if opts.fallback is not None or opts.trim or opts.cache_bias or opts.trim_mass:
        return "a wait at every MoE layer call (a lossy mode is on)"
    return None


def _start_runtime(runtime, p, prior, budget, allowed, margin, opts):
    """The backend's memory limits set; the trace, the prewarm and (memory_budget "auto") the governor started."""
    be, cache, ckpt = runtime.backend, runtime.cache, runtime.checkpoint
    be.activate(p.budget)
    if opts.trace_out is not None:
        runtime.record_trace(opts.trace_out)
    if opts.prewarm:
        order = prewarm_order(prior, ckpt.num_layers, ckpt.num_experts, p.cache_experts)
        if order:
            cache.prewarm(order)
    if margin is not None:
        if allowed < budget:  # (says so, once)
            runtime.resize(allowed, f"memory available at load less the margin {format_size(margin)}")
        runtime.govern(margin)


def _auto(ckpt, be, opts, extra):
    """memory_budget "auto": (the budget to start with, at least the minimum; the budget the
    memory available allows, less the margin; the margin in bytes)."""
    if opts.cache_size is not None or opts.cache_experts is not None or ckpt.group is not None:
        raise MlxmoeError("memory_budget \"auto\" sizes the expert cache itself, in one process: give no "
                          "cache_size or cache_experts, and no group")
    allowed, margin = auto_budget(opts.memory_margin)
    least = checkpoint_plan(ckpt, be, cache_experts=ckpt.top_k, context=opts.max_context, extra=extra).minimum
    return max(allowed, least), allowed, margin


def stage_profile(ckpt, fingerprint, profile, force=False):
    """`profile` (a path or an ActivationProfile) checked against the checkpoint; under
    pipeline stages, this stage's layers of it."""
    prior = profile if isinstance(profile, ActivationProfile) else ActivationProfile.load(profile)
    prior.check_model(fingerprint, ckpt.all_layers, ckpt.num_experts, force,
                      None if isinstance(profile, ActivationProfile) else str(profile))
    if ckpt.group is not None:  # a profile of the whole model: this stage's layers
        prior = distributed.stage_profile(prior, ckpt.layer_offset, ckpt.num_layers)
    return prior


class Runtime:
    """What `load` builds around a model, as `model.expert_runtime`: the opened checkpoint,
    its memory plan, the backend, the expert cache (also `model.expert_cache`), the
    prefetcher attached to it, the trace writer observing it and the live profile. Its
    methods are what the CLI does with them: record a workload's profile or a trace, swap a
    profile in as the policy's prior, save the live profile, close. Under several ranks
    every rank calls them alike (collectives)."""

    def __init__(self, checkpoint: Checkpoint, plan: Plan, backend: backends.Backend, cache: ExpertCache,
                 fingerprint: str, prefetcher: Prefetcher | None = None):
        self.checkpoint, self.plan, self.backend, self.cache = checkpoint, plan, backend, cache
        self.fingerprint = fingerprint  # the model's, as profiles and traces record it
        self.group = checkpoint.group  # an mx.distributed group of several ranks, or None
        self.error: BaseException | None = None  # a read that failed on this rank of a group (see experts.py)
        self.prefetcher = prefetcher  # built on `cache`, attached to it
        self.lossy = None  # lossy.Lossy where a lossy mode is on
        self.draft_model: nn.Module | None = None  # load's draft_model, within the budget
        self.ngram_switch = Switch()  # what n-gram drafting's switch learned (drafting.Lookup)
        self.trace: TraceWriter | None = None  # the trace being recorded (record_trace), one of the cache's observers
        # under pipeline stages: the file rank 0 merges the stages' traces into (close)
        self.trace_target: str | os.PathLike | None = None
        self.trace_file: str | os.PathLike | None = None  # where the whole trace is once closed (rank 0's)
        cache.prefetcher = prefetcher  # the cache closes it
        self.resizer = Resizer(self)
        self.governor: Governor | None = None  # following the memory available (govern)

    @property
    def profile(self) -> ActivationProfile:
        """The live profile: what the model has run so far (this stage's layers under pipeline stages)."""
        return self.cache.profile

    def check_open(self, method: str) -> None:
        """Refuse `method` once the runtime is closed (what saves or reads back what was
        recorded, save_profile and predict_curve, works after close)."""
        if self.cache.loader.stop.is_set():
            raise MlxmoeError(f"{method}: this model was closed (close()); load it again")

    def record_trace(self, path: str | os.PathLike) -> TraceWriter | None:
        """Record the routing of every layer call from now on to `path` (mlxmoe.trace/1),
        completed by close() (dropped by abort()). Under tensor splits only rank 0 records
        (every rank routes alike), under pipeline stages every rank its stage's part, merged
        by close(). Returns the writer (None on a rank that records nothing)."""
        self.check_open("record_trace")
        if self.trace is not None:
            raise MlxmoeError(f"a trace is being recorded already, to {self.trace.path}")
        ckpt = self.checkpoint
        check_outputs({"record_trace": path}, {"the model": ckpt.path})
        self.trace_file = path
        if ckpt.group is not None and ckpt.split == "tensor" and ckpt.group.rank():
            return None
        if ckpt.group is not None and ckpt.split == "pipeline":
            self.trace_target, path = path, f"{path}.rank{ckpt.group.rank()}"
        self.trace = TraceWriter(path, ckpt.num_layers, ckpt.num_experts, ckpt.top_k, model_name(ckpt.path),
                                 fingerprint=self.fingerprint)
        self.cache.watch(self.trace.observe, close=self.trace.close)
        return self.trace

    def new_sequence(self) -> None:
        """A new sequence starts (stream_generate calls it): positions restart at 0 in the
        cache, and the trace numbers its next sequence."""
        self.check_open("new_sequence")
        self.cache.new_sequence()
        if self.trace is not None:
            self.trace.new_sequence()
        self.agree_resident()

    def agree_resident(self) -> None:
        """Under the tensor split, at a sequence's start (a collective): the ranks' caches
        take the resident path from here on if every rank's holds every expert. Every rank
        must evaluate the same all_sums: mlx-lm evaluates only the KV caches of the prompt's
        chunks before its last token, so a chunk's last attention all_sum is evaluated by a
        streaming rank (with its router) and never by a rank on the resident path; every
        later all_sum would pair different arrays. Each rank's pre-warm ends when it ends."""
        cache = self.cache
        if cache.hold_resident:
            cache.hold_resident = distributed.any_rank(self.group, all_resident(cache) is None)

    def resize(self, memory_budget: str | int, reason: str | None = None) -> dict:
        """Give the expert cache what `memory_budget` ("8GB", bytes) holds beside the rest of
        the plan, never less than its minimum (said once, on stderr) nor more than every
        expert: at once where no generation holds the model, else between two of its tokens
        (governor.py). Output is unchanged. Returns {"from", "to" (experts), "memory_budget",
        "applied" (now), "message" (None, or why it kept the minimum)}; stats()["resizes"]
        lists those applied, with `reason`."""
        self.check_open("resize")
        done = self.resizer.request(memory_budget, reason)
        lock = generation_lock(self.checkpoint.model)
        done["applied"] = lock.acquire(blocking=False)
        if done["applied"]:
            try:
                self.resizer.apply_pending()
            finally:
                lock.release()
        return done

    def govern(self, margin: int, source: Callable[[], tuple[int, int]] | None = None) -> None:
        """Follow the memory available from now on, `margin` bytes kept free (memory_budget
        "auto"): `source()` gives (available, total) bytes (governor.available_memory)."""
        if self.governor is not None:
            self.governor.stop()
        self.governor = Governor(self, margin, **({} if source is None else {"source": source}))

    def main_rank(self) -> bool:
        """Whether this process speaks for the model: one process, or rank 0 of a group."""
        return self.group is None or self.group.rank() == 0

    def swap_live(self, profile: ActivationProfile) -> ActivationProfile:
        """Make `profile` the live profile (the one every layer call updates); returns the
        one it replaces. Between generations: updates already queued go to the old one."""
        with self.cache.lock:
            self.cache.catch_up()
            old, self.cache.profile = self.cache.profile, profile
        return old

    def record_profile(self, workload: str, half_life: float | None = None) -> ActivationProfile:
        """Start a fresh, empty live profile named `workload` (decay `half_life` tokens,
        default the current one's): what runs from now on is what it records, as in
        `mlxmoe profile record`. Returns it; save it with save_profile."""
        self.check_open("record_profile")
        old = self.profile
        fresh = ActivationProfile(old.num_layers, old.num_experts, old.top_k, half_life or old.half_life, old.model,
                                  old.fingerprint, workload, expert_bytes=old.expert_bytes,
                                  resident_bytes=old.resident_bytes)
        self.swap_live(fresh)
        return fresh

    def use_profile(self, profile: str | os.PathLike | ActivationProfile, force: bool = False,
                    prewarm: bool = True) -> ActivationProfile:
        """Make `profile` (a path or an ActivationProfile of this model; `force`: of another
        model whose layer and expert counts agree) the policy's prior and the prefetcher's
        profile guess, as a load with it would; with `prewarm`, its hottest experts fill the
        cache's free slots in the background. Policies built without a way to change their
        prior (lfu, slru...) keep theirs. The live profile is left as it is. Returns the
        profile as applied (this stage's part under pipeline stages)."""
        self.check_open("use_profile")
        prior = stage_profile(self.checkpoint, self.fingerprint, profile, force)
        rates = prior.rates()
        if prewarm and self.cache.prewarm_done(0):
            order = prewarm_order(prior, prior.num_layers, prior.num_experts, self.cache.capacity)
            if order:
                self.cache.prewarm(order)
        with self.cache.lock:
            self.cache.policy.set_prior(rates)
            if self.prefetcher is not None:
                self.prefetcher.set_prior(rates)
        return prior

    def whole_profile(self) -> ActivationProfile:
        """The live profile; under several ranks the whole model's, merged from every rank's
        stage (a collective, bounded in time)."""
        if self.group is None:
            return self.profile
        return distributed.bounded("merging the ranks' profiles", lambda: distributed.whole_profile(self), 60)

    def predict_curve(self, progress: Callable[[str], Any] | None = None) -> dict[str, list] | None:
        """Each online policy's predicted hit rate at each cache size (curves.predicted_curve),
        from replaying the trace this runtime recorded (record_trace, or load's trace_out),
        which close() completes: what `mlxmoe profile record` adds to its profile.
        `progress(policy)` after each policy. Under several ranks rank 0 replays the merged
        trace; the other ranks return None."""
        self._check_trace()
        if not self.main_rank():
            return None
        header, records = read_trace(self.trace_file)
        curve = {}
        for policy in ONLINE:
            curve.update(predicted_curve(header, records, [policy]))
            if progress is not None:
                progress(policy)
        return curve

    def _check_trace(self):
        if self.trace_file is None:
            raise MlxmoeError("a hit-rate curve replays a recorded trace: call record_trace(path) (or load with "
                              "trace_out=...) before generating")
        if self.trace is not None and not self.trace.file.closed:
            raise MlxmoeError(f"the trace {self.trace_file} is still being recorded: close() first")

    def save_profile(self, path: str | os.PathLike, workload: str | None = None, curve: bool = False,
                     progress: Callable[[str], Any] | None = None) -> ActivationProfile:
        """Write the live profile (the whole model's) to `path` atomically, between
        generations or after close; named `workload` where given, an unnamed one after the
        file. Under several ranks every rank calls it and rank 0 writes. Returns it.

        The file holds the live profile's `curve` (that of the profile `load` was given; none
        after record_profile). With `curve`, after close(), the curve is predicted anew from
        the trace recorded alongside (predict_curve, `progress` passed on), as `mlxmoe profile
        record` does: the profile is written first without it, so that an interrupt while
        the curve is computed leaves the profile. Record the trace from when the profile
        starts (record_profile right after load with trace_out, or record_trace with it)."""
        if curve:
            self._check_trace()
        live = self.whole_profile()
        if workload or not live.workload:
            live.workload = workload or os.path.splitext(os.path.basename(path))[0]
        if not self.main_rank():
            return live
        check_outputs({"save_profile": path}, {"the model": self.checkpoint.path, "the trace": self.trace_file})
        if curve:
            live.curve = {}
        live.save(path)
        if curve:
            self.save_curve(path, live, progress)
        return live

    def save_curve(self, path: str | os.PathLike, profile: ActivationProfile,
                   progress: Callable[[str], Any] | None = None) -> ActivationProfile:
        """save_profile(curve=True)'s second step, for a caller that lets an interrupt stop
        it (`mlxmoe profile record`): `profile`, saved at `path` already, gets its curve
        predicted from the recorded trace (predict_curve, `progress` passed on) and is
        written again. A profile of no tokens has nothing to predict: left as it is."""
        check_outputs({"save_curve": path}, {"the model": self.checkpoint.path, "the trace": self.trace_file})
        if profile.tokens_total:
            profile.curve = self.predict_curve(progress)
            profile.save(path)
        return profile

    def close_local(self) -> None:
        """This process's part of close(): the cache's close(), which closes the prefetcher and
        the trace (completed, renamed into place) in the one order that loses nothing."""
        if self.governor is not None:  # (first: it resizes the cache)
            self.governor.stop()
        self.cache.close()

    def abort(self) -> None:
        """close_local() after a failure: a trace being recorded is dropped, not completed."""
        if self.trace is not None:
            self.trace.abort()
        self.close_local()

    def close(self) -> None:
        """Close prefetcher, trace (completed) and cache (close_local). Under several ranks a
        collective: under pipeline stages rank 0 merges the stages' traces, and no rank
        returns before every rank has closed (one that exits early breaks its peers' last
        exchanges)."""
        self.close_local()
        if self.group is None:
            return

        def finish():
            distributed.finish_trace(self)
            distributed.barrier(self.group)

        distributed.bounded("closing with the other ranks", finish, 60)
        self.trace_target = None


def profile_sizes(plan):
    """What a profile records of a memory plan: (bytes of one expert, bytes beside the
    expert cache), so that `profile show --budget` can say what a budget buys."""
    return plan.slot_bytes, plan.resident + plan.kv_reserve + plan.working


def profile_identity(ckpt, backend):
    """(fingerprint, profile_sizes) of an opened checkpoint on `backend`, as a profile
    recorded on it would hold them."""
    backend.apply_dtype_policy(ckpt.model)
    return model_fingerprint(ckpt), profile_sizes(checkpoint_plan(ckpt, backend, cache_experts=ckpt.top_k))


def bind_profile(profile: ActivationProfile, path_or_hf_repo: str | os.PathLike, where: str | None = None
                 ) -> ActivationProfile:
    """Make a profile built from routing (workload.trace.build_profile) the profile of a
    checkpoint: its name, fingerprint and sizes (profile_budget then works). A profile known
    by its shape only (from an imported trace) takes the checkpoint's where the layer and
    expert counts agree; one recorded on another model is refused (`where` names it)."""
    ckpt = open_checkpoint(path_or_hf_repo)
    try:
        fp, sizes = profile_identity(ckpt, backends.detect(None))
    finally:
        ckpt.store.close()
    profile.check_model(fp, ckpt.num_layers, ckpt.num_experts, force=profile.fingerprint.startswith("shape-"),
                        where=where)
    profile.model, profile.fingerprint, (profile.expert_bytes, profile.resident_bytes) = model_name(ckpt.path), fp, sizes
    return profile


def model_name(path):
    """How profiles and traces name a checkpoint, never by where it lies on this machine:
    "mlxmoe-demo" for the bundled demo model, the repo id for a Hugging Face download
    (a snapshot folder models--OWNER--NAME/snapshots/REV), else the folder's name."""
    path = Path(path).resolve()
    if path == DEMO_MODEL:
        return "mlxmoe-demo"
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--") and repo.count("--") >= 2:
        return repo[len("models--"):].replace("--", "/", 1)
    return path.name


def model_fingerprint(ckpt):
    """The whole model's, under any split (its profiles load on any)."""
    return fingerprint(ckpt.config, ckpt.store.tensors, ckpt.store.model_shapes, ckpt.all_layers, ckpt.num_experts)


def prefill_step(plan, tokenizer, prompt, prompt_cache=None, rows=1):
    """Prompt tokens per prefill step: as many as the budget's working memory (planned for
    PREFILL_STEP tokens with their logits, and where attention is materialised their scores
    against as many keys) holds of a step's activations (no logits) and, where attention is
    materialised, its scores against every key of the prompt and the cache; at least 16,
    at most MAX_PREFILL_STEP. Fewer, longer steps read the experts of a small cache fewer
    times: each step reads each of its distinct experts once. `rows` > 1: the tokens in all
    of a step of that many prompts prefilled together (batching.Batches; `prompt` the
    longest), each key counted twice: a batch's mask is an array, and its masked scores one
    more array of scores beside them."""
    if plan is None or not getattr(plan, "step_bytes", 0):
        return PREFILL_STEP
    per_key = (plan.attention_per_key if plan.attention else 0) * (2 if rows > 1 else 1)
    keys = 0
    if per_key:
        keys = len(tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)
        keys += max((getattr(c, "offset", 0) for c in prompt_cache or []), default=0)
    return int(min(MAX_PREFILL_STEP, max(16, plan.working // (plan.step_bytes + keys * per_key))))


_lock_guard = threading.Lock()


def generation_lock(model):
    """The lock stream_generate holds on `model` for a whole generation: the expert cache
    holds one sequence's state (its position, the deferred host work of its last tokens,
    whose arrays live on the generating thread's stream), so a second thread's generation
    waits for the first to end or be closed."""
    with _lock_guard:
        if getattr(model, "_mlxmoe_generation_lock", None) is None:
            model._mlxmoe_generation_lock = threading.Lock()  # a plain attribute, not a parameter
        return model._mlxmoe_generation_lock


STREAM_TIMEOUT = 300.0  # seconds (MLXMOE_STREAM_TIMEOUT): see take_model


def stream_timeout():
    """MLXMOE_STREAM_TIMEOUT in seconds (default STREAM_TIMEOUT), read at each use."""
    text = os.environ.get("MLXMOE_STREAM_TIMEOUT", "")
    try:
        value = float(text) if text.strip() else STREAM_TIMEOUT
    except ValueError:
        value = -1.0
    if not (value > 0 and value < float("inf")):
        raise MlxmoeError(f"MLXMOE_STREAM_TIMEOUT={text!r}: give a number of seconds above 0")
    return value


class Holder:
    """A generation holding a model's generation lock: its thread, and since when its
    stream waits for its reader (`idle_since`: None while it computes). A stream left
    unread for MLXMOE_STREAM_TIMEOUT seconds while another thread waits is `revoked`: the
    lock passes to that thread, and the stream, if read again, raises."""

    def __init__(self, thread):
        self.thread, self.idle_since, self.revoked = thread, None, False


def take_model(model, lock):
    """Acquire `lock` (generation_lock(model)) for this thread's generation; returns its
    Holder. Waits at most MLXMOE_STREAM_TIMEOUT seconds: a holding stream left unread that
    long (abandoned by its thread) is revoked and the lock taken from it; one still being
    read when the time is up leaves this thread an MlxmoeError, not a wait without end."""
    timeout, start = stream_timeout(), time.monotonic()
    holder = Holder(threading.get_ident())
    while not lock.acquire(timeout=min(0.05, timeout)):
        now = time.monotonic()
        with _lock_guard:
            other = getattr(model, "_mlxmoe_generation", None)
            if other is not None and other.idle_since is not None and now - other.idle_since >= timeout:
                other.revoked = True  # the lock is ours now: it stays acquired
                model._mlxmoe_generation = holder
                return holder
        if now - start >= timeout:
            raise MlxmoeError(f"the model is generating for another thread and was not free within {timeout:g} s "
                              "(MLXMOE_STREAM_TIMEOUT): finish or close() that generation first, or set "
                              "MLXMOE_STREAM_TIMEOUT to wait longer")
    with _lock_guard:
        model._mlxmoe_generation = holder
    return holder


def vocab_size(model):
    """The rows of `model`'s token embedding (config.json's vocab_size), or None where unknown."""
    runtime = getattr(model, "expert_runtime", None)
    size = None
    if runtime is not None:
        size = text_config(runtime.checkpoint.config).get("vocab_size")
    if size is None:
        size = getattr(getattr(model, "args", None), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def check_token_ids(ids, size, field="prompt"):
    """Refuse (MlxmoeError naming `field`) token ids that are not integers in [0, size):
    MLX indexes the embedding with them unchecked (an id past it kills the process)."""
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise MlxmoeError(f"{field}[{i}]: a token id is an integer, not {str(t)[:40]!r}")
        if size is not None and not 0 <= t < size:
            raise MlxmoeError(f"{field}[{i}]: token id {t} is outside the vocabulary (0 to {size - 1})")


def prompt_tokens(model, tokenizer, prompt):
    """The prompt's token ids as mlx-lm's stream_generate would make them (a string
    tokenized, BOS added unless the text starts with it), checked: text that is not
    valid UTF-8 (undecodable bytes read as surrogates), no tokens, ids outside the
    vocabulary are refused with an MlxmoeError naming the prompt."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise MlxmoeError(f"prompt: not valid UTF-8 text (an undecodable byte at character {e.start})") from None
        bos = getattr(tokenizer, "bos_token", None)
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    elif isinstance(prompt, (mx.array, np.ndarray)):
        if prompt.ndim != 1:
            raise MlxmoeError(f"prompt: an array of token ids has one dimension, not shape {list(prompt.shape)}")
        ids = prompt.tolist()
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
    else:
        raise MlxmoeError(f"prompt: a string or a list of token ids, not {type(prompt).__name__}")
    if not ids:
        raise MlxmoeError("prompt: empty (no tokens to start from)")
    check_token_ids(ids, vocab_size(model))
    return ids


def _within_context(plan, prompt, prompt_cache, max_tokens):
    """max_tokens cut to the context the budget reserves KV cache for (plan.context), or an
    MlxmoeError where the prompt (after the tokens `prompt_cache` holds) leaves no room."""
    context = getattr(plan, "context", None)
    if not context:
        return max_tokens
    held = max((getattr(c, "offset", 0) for c in prompt_cache or []), default=0)
    if held + prompt >= context:
        before = f" after the {held} tokens of the conversation so far" if held else ""
        raise MlxmoeError(f"prompt: {prompt} tokens{before}, beyond the {context}-token context the memory budget "
                          "reserves (load with a larger max_context, --max-context, within the budget)")
    room = context - held - prompt
    return room if max_tokens < 0 else min(max_tokens, room)  # (-1: mlx-lm's "no limit")


_STREAMS = {}


def generation_stream(backend):
    """The stream generation runs on for this backend: mlx-lm's own, unless it was made for
    another device (mlx_lm.generate builds it on the default device at import: the GPU where
    there is one, also when this model runs on the CPU)."""
    device = mx.cpu if backend.name == "cpu" else mx.gpu
    if _mlx_generation_stream.device == device:
        return _mlx_generation_stream
    if device not in _STREAMS:  # made once: each is a stream (a queue) of its own
        _STREAMS[device] = mx.new_thread_local_stream(device)
    return _STREAMS[device]


def stream_generate(model: nn.Module, tokenizer: TokenizerWrapper, prompt: str | list[int], max_tokens: int = 256,
                    **kwargs) -> Iterator[GenerationResponse]:
    """mlx_lm.stream_generate, recording decode speed in the expert cache's stats. Holds
    the model's generation lock from the first response to the last (or close()); a thread
    whose previous generation on the model is still open (half consumed) gets an
    MlxmoeError, not a wait on itself. The prompt is checked first (prompt_tokens).

    Speculative decoding, as mlx-lm's: `draft_model` the draft model load gave
    (`model.expert_runtime.draft_model`: within the budget), drafting `num_draft_tokens` a
    step (default 2, mlx-lm's); or "ngram" (or a drafting.NGram): drafts of up to
    `num_draft_tokens` (default 5) looked up in the prompt and the text so far, no second
    model, off for a while where few are accepted (see drafting.py). Greedy output is that
    of decoding without drafts; stats() counts `drafted` and `accepted` tokens. A prompt
    cache (`prompt_cache`) holds the model's layers, then a draft model's
    (make_prompt_cache of each, as mlx-lm's)."""
    runtime = getattr(model, "expert_runtime", None)
    cache = None if runtime is None else runtime.cache
    prompt, max_tokens, draft, num_draft = _generation_args(model, tokenizer, prompt, max_tokens, runtime, kwargs)
    speculator = None if cache is None else cache.speculator
    next_token = None
    if speculator is not None and speculator.head is not None and draft is None:  # running ahead crosses tokens
        next_token = NextToken(kwargs.get("logits_processors"))
        next_token.wrap(kwargs, greedy_sampler)
    lock = generation_lock(model)
    me = threading.get_ident()
    if getattr(model, "_mlxmoe_generation_owner", None) == me:
        raise MlxmoeError("this thread's previous generation on this model is still open (a stream_generate "
                          "half consumed): read it to the end or close() it before generating again")
    holder = take_model(model, lock)
    model._mlxmoe_generation_owner = me
    try:
        if runtime is not None:
            runtime.new_sequence()
        if cache is not None and cache.verifier is not None:  # a speculative step's tokens verified at once
            cache.verifier.drafting = draft is not None
        if next_token is not None:
            speculator.next_token = next_token
        group = None if runtime is None else runtime.group
        steps, count = _steps(model, tokenizer, prompt, max_tokens, draft, num_draft, cache, kwargs)
        carried = kwargs.get("prompt_cache") if draft is not None else None
        held, response = None if not carried else getattr(carried[0], "offset", None), None
        while True:
            last, response = response, _next_response(steps, holder, runtime, cache, count)
            if response is None:
                break
            holder.idle_since = time.monotonic()
            yield response
        if held is not None and last is not None:
            _run_last(model, carried, held + len(prompt) + last.generation_tokens, last.token,
                      kwargs.get("stream", _mlx_generation_stream))
        _end_generation(cache, group)
    finally:
        _release_model(model, lock, holder, cache, speculator if next_token is not None else None)


def _generation_args(model, tokenizer, prompt, max_tokens, runtime, kwargs):
    """stream_generate's arguments checked and completed before it takes the model: (the
    prompt's tokens, max_tokens within the context, the draft model or NGram or None, the
    tokens drafted a step or None); `kwargs` given the stream and the prefill step."""
    if runtime is not None:
        runtime.check_open("stream_generate")
    draft = _draft(runtime, kwargs.pop("draft_model", None), kwargs.get("input_embeddings"))
    num_draft = kwargs.pop("num_draft_tokens", None)
    if draft is not None and not _int_in(num_draft if num_draft is not None else 1, 0, 1 << 10):
        raise MlxmoeError(f"num_draft_tokens {num_draft!r}: tokens drafted a step, an integer from 0 to 1024")
    if num_draft == 0:  # (no drafts: one token a step)
        draft = None
    if draft is not None:
        kwargs.pop("input_embeddings", None)  # (None: _draft refuses others)
    if kwargs.get("input_embeddings") is None:
        prompt = prompt_tokens(model, tokenizer, prompt)
        if runtime is not None:
            max_tokens = _within_context(runtime.plan, len(prompt), kwargs.get("prompt_cache"), max_tokens)
    if runtime is not None and "stream" not in kwargs:
        kwargs["stream"] = generation_stream(runtime.backend)
    if "prefill_step_size" not in kwargs:
        kwargs["prefill_step_size"] = prefill_step(None if runtime is None else runtime.plan, tokenizer, prompt,
                                                   kwargs.get("prompt_cache"))
    return prompt, max_tokens, draft, num_draft


def _next_response(steps, holder, runtime, cache, count):
    """The generation's next response from `steps`, None at its end: refused where the stream
    was revoked (left unread too long), counted, the cache resized between two tokens, a
    failure on another rank raised here."""
    with _lock_guard:
        if holder.revoked:
            raise MlxmoeError("this stream was left unread for MLXMOE_STREAM_TIMEOUT seconds while another "
                              "thread waited for the model, which went to it: start a new generation")
        holder.idle_since = None
    group = None if runtime is None else runtime.group
    with distributed.waiting(group, "generating a token"):  # a step waits on the other stages
        response = next(steps, None)
        if response is None:
            return None
        if cache is not None:
            cache.counters.decode_tps = response.generation_tps
            runtime.resizer.apply_pending()  # between two tokens (governor.py)
        if count is not None:
            count(response)
        if group is not None and distributed.failed_any(group, runtime.error):
            distributed.check(group, runtime.error, bound=False)
    return response


def _end_generation(cache, group):
    """A generation read to its end: the host work the resident path left for later done
    (see experts.ResidentCalls), the ranks met."""
    if cache is not None:
        cache.flush()
    if group is not None:
        with distributed.waiting(group, "ending a generation"):
            distributed.barrier(group)


def _release_model(model, lock, holder, cache, speculator):
    """stream_generate's end, on every way out: the model given back (its lock, its owner) unless
    the stream was revoked (the model is another generation's then); a generation closed early
    has the host work it left done first; `speculator` (where it ran ahead) loses its next token."""
    with _lock_guard:
        holder.idle_since = None  # (not revoked from here on)
    if not holder.revoked:  # (revoked: the model is another generation's now; nothing of it is ours)
        try:
            if cache is not None and (cache.deferred or cache.observed):  # closed early: its arrays are this thread's
                cache.flush()
        finally:
            if speculator is not None:
                speculator.next_token = None
            model._mlxmoe_generation_owner = None
            model._mlxmoe_generation = None
            lock.release()


def _draft(runtime, draft, embeddings):
    """stream_generate's `draft_model`: None, an NGram, or the runtime's draft model
    (any model where there is no runtime), else an MlxmoeError saying what it takes."""
    if draft is None:
        return None
    if embeddings is not None:
        raise MlxmoeError("draft_model: speculative decoding takes token ids, not input_embeddings (mlx-lm's rule)")
    if runtime is not None and runtime.group is not None:
        raise MlxmoeError("draft_model: speculative decoding runs in one process, not across ranks")
    if isinstance(draft, str) and draft == "ngram" or isinstance(draft, NGram):
        return NGram()
    if runtime is not None and draft is not runtime.draft_model:
        raise MlxmoeError("draft_model: \"ngram\", or the draft model loaded within the memory budget: load with "
                          "mlxmoe.load(..., draft_model=PATH) and pass model.expert_runtime.draft_model")
    if not isinstance(draft, nn.Module):
        raise MlxmoeError(f"draft_model: \"ngram\" or a model, not {type(draft).__name__}")
    return draft


def _run_last(model, prompt_cache, want, token, stream):
    """A speculative generation's last step leaves its own token out of the KV cache (not run
    yet); plain decoding has run it: run it, so that a carried `prompt_cache` (a chat's next
    turn) holds the `want` tokens it would hold without drafts."""
    kv = prompt_cache[:len(model.layers)]
    if all(getattr(c, "offset", None) == want - 1 for c in kv):
        with mx.stream(stream):
            model(mx.array([[token]], mx.uint32), cache=kv)
            mx.eval([c.state for c in kv])


def check_rotating(kv_caches):
    """Refuse a draft model where a KV cache rotates (a sliding window, or max_kv_size)."""
    if any(hasattr(c, "max_size") for c in kv_caches):
        raise MlxmoeError("draft_model: mlx-lm's speculative steps cannot take back rejected drafts from a rotating "
                          "(sliding-window) KV cache once it wraps; use draft_model=\"ngram\", which stops drafting "
                          "there")


def _steps(model, tokenizer, prompt, max_tokens, draft, num_draft, cache, kwargs):
    """(the responses of a generation, a function each response is given or None):
    mlx_lm.stream_generate's, speculative with a draft model; n-gram drafting's (drafting.py)."""
    if not isinstance(draft, NGram):
        if draft is None:
            return _mlx_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs), None
        num_draft = num_draft or 2  # (mlx-lm's default)
        check_rotating(kwargs.get("prompt_cache") or make_prompt_cache(model, kwargs.get("max_kv_size")))
        count = None if cache is None else DraftCount(cache.counters, num_draft, max_tokens)
        if kwargs.get("logits_processors") and len(prompt) > 1:  # mlx-lm's loop gives them the last prompt token on
            kwargs = dict(kwargs, logits_processors=after(kwargs["logits_processors"], mx.array(prompt[:-1])))
        return _mlx_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, draft_model=draft,
                                    num_draft_tokens=num_draft, **kwargs), count
    if cache is None:
        raise MlxmoeError("draft_model \"ngram\": a model loaded with mlxmoe.load (its stats count the drafts)")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    kwargs = dict(kwargs)
    stream = kwargs.pop("stream")
    lookup = Lookup(prompt, num_draft or NGRAM_DRAFT_TOKENS, model.expert_runtime.ngram_switch)
    steps = ngram_steps(mx.array(prompt, mx.uint32), model, stream, lookup, vocab_size(model) or tokenizer.vocab_size,
                        cache.counters, max_tokens, **kwargs)
    return respond(model, tokenizer, prompt, steps, max_tokens, stream), None


def generate(model: nn.Module, tokenizer: TokenizerWrapper, prompt: str | list[int], verbose: bool = False,
             **kwargs) -> str:
    """mlx_lm.generate through mlxmoe's stream_generate; returns the text."""
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text


def read_prompts(path, tokenizer=None, chats=False, chat_template=False):
    """Prompts from a file: one per non-empty line, or (`chats`) one JSON conversation per
    line ({"messages": [...]} or a list of {"role", "content"}) rendered with the chat
    template up to the assistant's turn."""
    lines = [(n, l) for n, l in enumerate(read_lines(path, "prompts file"), start=1) if l.strip()]
    if not lines:
        raise MlxmoeError(f"{path}: no prompts")
    if not chats:
        if chat_template:
            return [tokenizer.apply_chat_template([{"role": "user", "content": l}], add_generation_prompt=True)
                    for _, l in lines]
        return [l for _, l in lines]
    prompts = []
    for n, line in lines:  # n: the line's number in the file, blank lines counted
        try:
            chat = json.loads(line)
            messages = chat["messages"] if isinstance(chat, dict) else chat
            if not isinstance(messages, list) or not messages:
                raise ValueError("a chat is a non-empty list of messages")
            if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                raise ValueError("each message needs a role and a content")
            prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise MlxmoeError(f"{path}:{n}: not a chat ({e})") from None
        except Exception as e:  # the template's own checks (jinja2 errors: roles out of order...)
            raise MlxmoeError(f"{path}:{n}: the chat template refused this chat ({e})") from None
    return prompts


def run_prompts(model, tokenizer, prompts, max_tokens=128, on_prompt=None, **kwargs):
    """Generate for each prompt in turn (the way `profile record` and `trace record` feed a
    workload through the cache); `on_prompt(i, text)` after each. Returns tokens made."""
    made = 0
    for i, prompt in enumerate(prompts):
        text = ""
        for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs):
            text += response.text
            made = made + 1
        if on_prompt is not None:
            on_prompt(i, text)
    return made
