"""Will it run, and how fast: memory, hit rate, bytes read and tok/s of a checkpoint at a
memory budget, forecast before loading it, from its config and safetensors headers, a
brief read of the disk (at the model's own expert read size, from its non-expert tensors:
never an expert's bytes) and a brief measure of this machine's matmuls at its shapes.

A decode token reads R seconds of experts (the misses the hit rate leaves, at the disk's
rate) and computes C seconds (every expert resident). Reads and compute overlap in part:
the forecast's range runs from none (R + C: low) to all (max(R, C): high), the likely
value in between (max + OVERLAP_LEFT x min), with the hit rate's own range on top."""

import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .api import checkpoint_plan, prefill_step
from .budget import attention_bytes, kv_reserve_bytes, parse_size, text_config, working_bytes
from .caching.policies import DEFAULT_POLICY
from .errors import MlxmoeError
from .workload.curves import curve_at

CURVES = Path(__file__).parent / "data" / "routing_curves.json"
# Of the shorter of reads and compute, the share a token still waits for: a layer's
# attention and router run before its misses are known, its missed experts after they
# land (bench/bench_forecast.py tunes it on the 50 % rows of the disk-bound runs).
OVERLAP_LEFT = 0.75
# How far a token's compute may be from the timed matmuls (the model's other kernels, the
# prefetcher's copies, the host's own work): tuned on bench_forecast's rows of a 16-core CPU.
COMPUTE_MARGIN = 0.15
DISK_SECONDS = 0.5  # how long the disk is read for, at most
SCRATCH_BYTES = 64 << 20  # the file written to time a disk that holds no shard of the model


def family_curves(path=CURVES):
    """[(family, [[share, decode hit rate], ...])] of the real-routing table we ship."""
    return [(c["family"], c["decode_hit_rate"]) for c in json.loads(Path(path).read_text())["curves"]]


def _at_share(points, share):
    """A curve of [share, hit rate] points read at `share` (from 0 hits at an empty cache)."""
    points = ([[0.0, 0.0]] if points[0][0] > 0 else []) + points
    return curve_at(points, min(max(share, 0.0), points[-1][0]))


def hit_rates(model_type, share, cache_experts, profile=None):
    """(low, likely, high) decode hit rate at a cache holding `share` of the experts, and
    where it comes from. A curve is replayed from a cold cache over a short run, so even
    a cache of every expert misses the experts' first uses: low is the curve as it is (a
    first run), likely and high the curve over its value at every expert (the misses a
    longer run keeps making, once each expert has been read). From the profile's own curve
    when it has one, else from the real routing we ship: likely the mean of this model
    family's traces (of all where we have none of it), low / high across every family."""
    if share >= 1.0:
        return (1.0, 1.0, 1.0), "every expert resident"
    if profile is not None and profile.curve:
        name = DEFAULT_POLICY if DEFAULT_POLICY in profile.curve else next(iter(profile.curve))
        points = [[c / (profile.num_layers * profile.num_experts), r] for c, r in profile.curve[name]]
        cold, full = _at_share(points, share), points[-1][1] or 1.0
        return (cold, cold / full, cold / full), f"profile {profile.name()} ({name}'s curve)"
    curves = family_curves()
    cold = [(family, _at_share(points, share)) for family, points in curves]
    warm = [(family, r / (points[-1][1] or 1.0)) for (family, r), (_, points) in zip(cold, curves)]
    own = [r for family, r in warm if family == model_type]
    likely = sum(own or [r for _, r in warm]) / len(own or warm)
    source = (f"real routing of {model_type} ({len(own)} trace{'s' * (len(own) > 1)})" if own else
              f"real routing of {len({f for f, _ in curves})} other families (none of {model_type})")
    return (min(r for _, r in cold), likely, max(r for _, r in warm)), source


def non_expert_spans(store):
    """(file, offset, nbytes) of the checkpoint's tensors that hold no expert, largest first."""
    spans = [(info.file, info.offset, info.nbytes) for name, info in store.index.items()
             if name not in store.expert_names and info.nbytes]
    return sorted(spans, key=lambda s: -s[2])


def measure_disk(store, seconds=DISK_SECONDS, spans=None):
    """Bytes per second of O_DIRECT reads (the store's own reads) at one expert's request
    sizes, its ranges read by the store's threads at once, as an expert read is; the
    requests land in the checkpoint's non-expert tensors (or in `spans`, [(file, offset,
    bytes)]), never in an expert's bytes. Returns (rate, bytes read, requests), or None
    where those tensors are too small."""
    from .storage.store import ALIGN, align_down, align_up

    sizes = [align_up(r.nbytes) for r in store.ranges[0][0]]
    spans = [s for s in (spans or non_expert_spans(store)) if s[2] >= max(sizes) + 2 * ALIGN]
    if not spans:
        return None
    rng = np.random.default_rng(0)
    scratch = [np.empty(max(sizes), np.uint8) for _ in sizes]

    def request(i, size):
        file, offset, nbytes = spans[i % len(spans)]
        lo = align_up(offset) + align_down(int(rng.integers(0, nbytes - size - ALIGN + 1)))
        return store._read_run((file, lo, lo + size, [(lo, scratch[i % len(scratch)][:size])]))

    done = requests = 0
    start = time.perf_counter()
    with ThreadPoolExecutor(store.workers) as pool:
        while time.perf_counter() - start < seconds and requests < 64 * len(sizes):
            done += sum(pool.map(request, range(requests, requests + len(sizes)), sizes))
            requests += len(sizes)
    return done / (time.perf_counter() - start), done, requests


def _expert_block(ckpt, backend, k):
    """Layer 0's expert block as mlx-lm built it (SwitchGLU or its kin, quantized as the
    checkpoint is) holding `k` experts of random weights in the slot pools' dtypes, and
    their bytes: what a layer computes a token with, never read from the checkpoint."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    from .loader import MX_DTYPES

    block = ckpt.experts[0]._inner
    small = []
    for name, shape, dtype in zip(ckpt.store.tensors, ckpt.store.tensor_shapes, ckpt.store.tensor_dtypes):
        dtype = backend.pool_dtype(MX_DTYPES[dtype])
        if mx.issubdtype(dtype, mx.floating):
            small.append((name, (0.02 * mx.random.normal((k, *shape))).astype(dtype)))
        else:  # packed weights, integer scales: any bits will do
            small.append((name, mx.random.randint(0, 1 << 30, (k, *shape)).astype(dtype)))
    block.update(tree_unflatten(small))
    mx.eval([a for _, a in small])
    return block, sum(a.nbytes for _, a in small)


def compute_shape(ckpt, backend):
    """(hidden size, activation dtype) a token is computed with: mlx-lm computes in the
    checkpoint's float dtype on GPUs, in float32 on CPU (backend.py)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    config = text_config(ckpt.config)
    hidden = config.get("hidden_size") or config.get("d_model") or config.get("n_embd")
    if not hidden:
        raise MlxmoeError(f"{ckpt.path}: config.json names no hidden size (hidden_size, d_model, n_embd)")
    floats = [v.dtype for _, v in tree_flatten(ckpt.model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    return hidden, backend.compute_dtype or max(floats, key=lambda d: d.size, default=mx.float16)


def measure_compute(ckpt, backend, dense_bytes, tokens=1, seconds=0.25):
    """Seconds of compute for a step of `tokens` tokens with every expert resident, beside
    the per-layer costs of fixed_seconds: each MoE layer's top-k experts, computed by the
    model's own expert block on random weights with one sync a layer as the runtime runs
    them, timed here; the other weights the tokens compute with (`dense_bytes`) at the rate
    that block reached (weight bytes x tokens a second, also returned)."""
    import mlx.core as mx

    hidden, dtype = compute_shape(ckpt, backend)
    ks = sorted(set(ckpt.top_ks))
    per_k = {}
    for k in ks:
        block, nbytes = _expert_block(ckpt, backend, k)
        x = mx.random.normal((1, tokens, hidden)).astype(dtype)
        idx = mx.random.randint(0, k, (1, tokens, k)) if tokens > 1 else mx.arange(k)[None, None]
        mx.eval(block(x, idx))  # warm-up: kernels built
        n, start = 0, time.perf_counter()
        while n < 3 or (time.perf_counter() - start < seconds / len(ks) and n < 200):
            mx.eval(block(x, idx))
            n += 1
        per_k[k] = ((time.perf_counter() - start) / n, nbytes)
    seconds_k, nbytes = per_k[max(per_k)]
    rate = nbytes * tokens / seconds_k
    return sum(per_k[k][0] for k in ckpt.top_ks) + dense_bytes * tokens / rate, rate


def fixed_seconds(ckpt, backend):
    """What every step costs beside its bytes: each decoder layer's small kernels and each
    MoE layer's host work (the policy's bookkeeping)."""
    hidden, dtype = compute_shape(ckpt, backend)
    layers = text_config(ckpt.config).get("num_hidden_layers") or ckpt.num_layers
    return layers * _launch_seconds(hidden, dtype) + ckpt.num_layers * _policy_seconds(ckpt)


OPS_PER_LAYER = 30  # kernels a decoder layer launches beside its expert block (norms, projections, rope, ...)


def _launch_seconds(hidden, dtype, seconds=0.05):
    """What a layer's small kernels cost beside their bytes: a chain of OPS_PER_LAYER ops on
    one token's hidden state, evaluated (on a GPU, launches and a sync dominate a token)."""
    import mlx.core as mx

    x = mx.ones((1, hidden), dtype)

    def chain():
        y = x
        for _ in range(OPS_PER_LAYER // 2):
            y = y * 0.5 + 1.0
        mx.eval(y)

    chain()
    n, start = 0, time.perf_counter()
    while n < 5 or (time.perf_counter() - start < seconds and n < 500):
        chain()
        n += 1
    return (time.perf_counter() - start) / n


def _policy_seconds(ckpt, calls=300):
    """The host work of one MoE layer call: the default policy's bookkeeping (cache.Residency
    with the default policy at half the experts) on random routing of top-k experts."""
    from .caching.cache import Residency
    from .caching.policies import make_policy

    L, E, k = ckpt.num_layers, ckpt.num_experts, max(ckpt.top_ks)
    slots = max(k, L * E // 2)
    residency = Residency(slots, make_policy(DEFAULT_POLICY, slots, L, E))
    rng = np.random.default_rng(0)
    routes = [sorted(rng.choice(E, k, replace=False).tolist()) for _ in range(calls)]
    start = time.perf_counter()
    for i, experts in enumerate(routes):
        if i % L == 0:
            residency.tick(1)
        residency.access(i % L, experts, [1.0 / k] * k)
    return (time.perf_counter() - start) / calls


def dense_active_bytes(ckpt):
    """Bytes of the non-expert weights a token computes with: all of them but an embedding
    table that is only looked up (one not tied to the output head)."""
    from mlx.utils import tree_flatten

    params = tree_flatten(ckpt.model.parameters())
    total = sum(v.nbytes for _, v in params)
    if text_config(ckpt.config).get("tie_word_embeddings", False):
        return total
    return total - sum(v.nbytes for name, v in params if "embed" in name)


def distinct_pairs(layers, experts, top_k, tokens):
    """Expected distinct (layer, expert) pairs a prompt of `tokens` tokens routes to, were
    its routing uniform (real routing repeats more: an upper end)."""
    return layers * experts * (1 - (1 - top_k / experts) ** tokens)


def _seconds(reads, compute):
    """Seconds of a step that reads for reads = (fewest, likely, most) seconds and computes
    for about `compute`: from all of the shorter hidden behind the longer (low) to none
    (high), the compute itself within COMPUTE_MARGIN."""
    fast, slow = compute * (1 - COMPUTE_MARGIN), compute * (1 + COMPUTE_MARGIN)
    return {"low": max(reads[0], fast),
            "likely": max(reads[1], compute) + OVERLAP_LEFT * min(reads[1], compute),
            "high": reads[2] + slow}


def _tps(seconds):
    return 1.0 / seconds if seconds > 0 else math.inf


def share_budgets(ckpt, backend, shares):
    """The memory budget that holds each share of the experts (at least a layer's top-k)."""
    total = ckpt.num_layers * ckpt.num_experts
    return [checkpoint_plan(ckpt, backend, cache_experts=min(total, max(ckpt.top_k, round(total * s)))).budget
            for s in shares]


def scratch_disk_rate(store, folder, nbytes=SCRATCH_BYTES):
    """measure_disk on a scratch file of `nbytes` (more where one expert's ranges need it)
    written (and synced) in `folder`, then closed and removed: the disk where a model would
    be downloaded to, for a checkpoint of headers only."""
    from .storage.files import temp_beside
    from .storage.store import ALIGN, align_up

    block = 4 << 20
    need = max(align_up(r.nbytes) for r in store.ranges[0][0]) + 2 * ALIGN
    nbytes = max(nbytes, align_up(need, block))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd, scratch = temp_beside(folder / "mlxmoe-disk-probe")  # (a killed run's is removed by the next)
    try:
        with open(fd, "wb") as f:
            data = np.random.default_rng(0).bytes(block)
            for _ in range(nbytes // block):
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return measure_disk(store, spans=[(Path(scratch), 0, nbytes)]), nbytes
    finally:
        store.reader.forget(Path(scratch))
        Path(scratch).unlink(missing_ok=True)


def _disk_rate(ckpt, disk_rate, measured, assumed, disk_folder=None):
    """The disk's read rate, bytes/s: `disk_rate` where given (said in `assumed`), else
    timed on the checkpoint's non-expert tensors, or with `disk_folder` (a checkpoint of
    headers only) on a scratch file there (said in `measured`)."""
    if disk_rate is not None:
        assumed.append(f"disk {disk_rate / 1e9:.3f} GB/s (given)")
        return disk_rate
    if disk_folder is not None:
        disk, nbytes = scratch_disk_rate(ckpt.store, disk_folder)
        measured.append(f"disk {disk[0] / 1e9:.3f} GB/s ({disk[2]} O_DIRECT reads of one expert's ranges from a "
                        f"{nbytes >> 20} MiB scratch file in {disk_folder})")
        return disk[0]
    disk = measure_disk(ckpt.store)
    if disk is None:
        raise MlxmoeError(f"{ckpt.path}: its non-expert tensors are too small to time the disk on; "
                          "give its read rate with --disk-gbps")
    measured.append(f"disk {disk[0] / 1e9:.3f} GB/s ({disk[2]} O_DIRECT reads of one expert's ranges, "
                    f"{disk[1] / 2**20:.0f} MiB of non-expert tensors)")
    return disk[0]


def _run_memory(ckpt, backend, step, context):
    """Beside the weights and the cache, what a run of `context` tokens (prompt and tokens
    after it) in prefill steps of `step` takes: the budget reserves KV cache and working
    memory for the longest context instead."""
    act = backend.activation_bytes(ckpt.model)
    return int(kv_reserve_bytes(ckpt.config, act, context, ckpt.stage_share)
               + working_bytes(ckpt.config, act, step, ckpt.top_k)
               + (attention_bytes(ckpt.config, act, step, context) if backend.materialises_attention else 0))


def forecast(ckpt, backend, budgets, profile=None, disk_rate=None, prompt_tokens=256, new_tokens=256,
             disk_folder=None):
    """The forecast for each memory budget in `budgets` (bytes or "12GB"), as dicts, for a
    prompt of `prompt_tokens` and `new_tokens` generated (the checkpoint opened, its dtype
    policy applied); memory_bytes is what the run takes (weights, cache, its KV cache and
    working memory), at most the budget. Measures the disk (unless
    `disk_rate`, bytes/s, is given; in `disk_folder` for a checkpoint of headers only) and
    the compute once for all budgets."""
    assumed, measured = [], []
    disk_rate = _disk_rate(ckpt, disk_rate, measured, assumed, disk_folder)
    dense = dense_active_bytes(ckpt)
    fixed = fixed_seconds(ckpt, backend)
    compute, rate = measure_compute(ckpt, backend, dense)
    compute += fixed
    # the prompt's step as the run takes it (the same at every budget: the working memory is)
    step = min(prompt_tokens, prefill_step(checkpoint_plan(ckpt, backend, cache_experts=ckpt.top_k), None,
                                           [0] * (prompt_tokens + new_tokens)))
    step_seconds = measure_compute(ckpt, backend, dense, tokens=step)[0] + fixed
    measured.append(f"compute {1000 * compute:.1f} ms a token every expert resident (matmuls of the model's shapes "
                    f"on {backend.name}, {rate / 1e9:.1f} GB/s of weights)")
    assumed.append(f"overlap of reads and compute: none (low) to full (high), likely {1 - OVERLAP_LEFT:.0%} of the "
                   f"shorter; compute within +-{COMPUTE_MARGIN:.0%} of the timed matmuls")
    in_use = _run_memory(ckpt, backend, step, prompt_tokens + new_tokens)
    total = ckpt.num_layers * ckpt.num_experts
    expert_disk = ckpt.store.expert_file_bytes()
    routed = sum(ckpt.top_ks)
    # the prompt's experts, read from a cold cache or from one its profile pre-warmed
    pairs = min(distinct_pairs(ckpt.num_layers, ckpt.num_experts, max(ckpt.top_ks), prompt_tokens), total)
    step_pairs = min(distinct_pairs(ckpt.num_layers, ckpt.num_experts, max(ckpt.top_ks), step), total)
    steps = math.ceil(prompt_tokens / step)
    prefill_compute = step_seconds * steps
    rows = []
    for budget in budgets:
        try:
            p = checkpoint_plan(ckpt, backend, budget)
        except MlxmoeError as e:  # below the minimum: say so in its row
            rows.append({"budget": parse_size(budget, "memory budget"), "error": str(e)})
            continue
        share = p.cache_experts / total
        (lo, likely, hi), source = hit_rates(ckpt.config.get("model_type", ""), share, p.cache_experts, profile)
        token_bytes = [(1 - h) * routed * expert_disk for h in (hi, likely, lo)]  # fewest, likely, most
        decode = _seconds([b / disk_rate for b in token_bytes], compute)
        warm = (hi, likely, lo) if profile is not None else (0, 0, 0)
        # each step reads its distinct experts once; after the first, those the cache lost
        reread = (steps - 1) * step_pairs * max(0.0, 1 - p.cache_experts / pairs)
        prefill = _seconds([(pairs * (1 - h) + reread) * expert_disk / disk_rate for h in warm], prefill_compute)
        rows.append({
            "budget": p.budget, "memory_bytes": p.resident + p.expert_cache + in_use,
            "cache_experts": p.cache_experts, "share_of_experts": share,
            "hit_rate": {"low": lo, "likely": likely, "high": hi}, "hit_rate_source": source,
            "read_bytes_per_token": dict(zip(("low", "likely", "high"), token_bytes)),
            "decode_tps": {"low": _tps(decode["high"]), "likely": _tps(decode["likely"]), "high": _tps(decode["low"])},
            "ttft_seconds": prefill,
        })
    return {"model": str(ckpt.path), "model_type": ckpt.config.get("model_type"), "backend": backend.name,
            "new_tokens": new_tokens, "disk_bytes_per_second": disk_rate, "compute_seconds_per_token": compute, "prompt_tokens": prompt_tokens,
            "expert_bytes_on_disk": expert_disk, "routed_experts_per_token": routed,
            "measured": measured, "assumed": assumed, "budgets": rows}
