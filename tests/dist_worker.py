"""One rank of tests/test_distributed.py, started by mlx.launch: writes OUT/rank{r}.json.

    dist_worker.py MODEL OUT parity       greedy tokens at full and half cache, bytes read
    dist_worker.py MODEL OUT budget SIZE  memory while streaming under a per-rank budget
    dist_worker.py MODEL OUT readfail     rank 1 reads from COPY (MODEL + "-rank1"), truncated after load
    dist_worker.py MODEL OUT tensor       the tensor split: stock mlx-lm's and mlxmoe's tokens, bytes read
    dist_worker.py MODEL OUT uneven       the tensor split with one rank's cache full and the other's empty
"""

import json
import os
import sys

import mlx.core as mx
import mlx_lm  # noqa: F401  imported before the baseline: not model memory

import mlxmoe
from mlxmoe import distributed
from mlxmoe.errors import MlxmoeError

PROMPT = "Once upon a time there was a fox"
MAX_TOKENS = 10


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tokens(model, tokenizer):
    return [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS)]


def parity(path, group):
    out = {}
    model, _ = mlxmoe.load(path, group=group, prefetch=0)
    local = model.expert_runtime.checkpoint.num_layers * model.expert_runtime.checkpoint.num_experts
    model.expert_cache.close()
    for name, experts in (("full", local), ("half", local // 2)):
        model, tokenizer = mlxmoe.load(path, group=group, cache_experts=experts)
        cache = model.expert_cache
        ckpt = model.expert_runtime.checkpoint
        got = tokens(model, tokenizer)
        cache.close()
        stats = distributed.cluster_stats(model)
        out[name] = {"tokens": got, "bytes_read": cache.stats()["bytes_read"],
                     "useful_bytes": cache.store.io_stats()["useful_bytes"],
                     "expert_file_bytes": cache.store.expert_file_bytes(), "layer_offset": ckpt.layer_offset,
                     "num_layers": ckpt.num_layers, "all_layers": ckpt.all_layers, "num_experts": ckpt.num_experts,
                     "total_bytes_read": stats["total"]["bytes_read"], "cache_experts": cache.capacity}
    return out


def budget(path, group, size):
    base = rss()
    mx.reset_peak_memory()
    model, tokenizer = mlxmoe.load(path, group=group, memory_budget=size)
    cache, runtime = model.expert_cache, model.expert_runtime
    tokens(model, tokenizer)
    cache.close()
    peak_rss = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
    return {"base_rss": base, "peak_rss": peak_rss, "mlx_peak": mx.get_peak_memory(), "budget": runtime.plan.budget,
            "cache_experts": cache.capacity, "misses": cache.stats()["misses"],
            "local_experts": runtime.checkpoint.num_layers * runtime.checkpoint.num_experts}


def readfail(path, group):
    if group.rank() == 1:
        path += "-rank1"
    model, tokenizer = mlxmoe.load(path, group=group, cache_experts=2, prefetch=0, prewarm=False)
    if group.rank() == 1:  # the disk loses the experts after load: reads fail while decoding
        for f in model.expert_cache.store.files:
            os.truncate(f, 1024)
    try:
        tokens(model, tokenizer)
    except MlxmoeError as e:
        return {"error": str(e)}
    return {"error": None}


def tensor(path, group):
    from mlx_lm.utils import sharded_load

    model, tokenizer = sharded_load(path, tensor_group=group)
    out = {"stock": [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS)]}
    distributed.barrier(group)
    model, _ = mlxmoe.load(path, group=group, split="tensor", prefetch=0)
    every = model.expert_runtime.checkpoint.num_layers * model.expert_runtime.checkpoint.num_experts
    model.expert_cache.close()
    for name, experts in (("full", every), ("half", every // 2)):
        model, tokenizer = mlxmoe.load(path, group=group, split="tensor", cache_experts=experts)
        cache = model.expert_cache
        got = tokens(model, tokenizer)
        cache.close()
        out[name] = {"tokens": got, "bytes_read": cache.stats()["bytes_read"], "io": cache.store.io_stats(),
                     "expert_file_bytes": cache.store.expert_file_bytes(), "experts": every}
    return out


def uneven(path, group):
    """The tensor split, each rank in turn the one whose cache holds every expert at the start
    (its pre-warm done) while the others' hold none (their pre-warm not begun): tokens and
    whether the resident path was taken, then again once every rank's cache is full."""
    out = []
    for ready in range(group.size()):
        model, tokenizer = mlxmoe.load(path, group=group, split="tensor", prewarm=group.rank() == ready)
        cache, ckpt = model.expert_cache, model.expert_runtime.checkpoint
        cache.prewarm_done()
        first = tokens(model, tokenizer)
        resident_first = cache.slot_table is not None
        cache.prewarm([(l, e) for l in range(ckpt.num_layers) for e in range(ckpt.num_experts)])
        cache.prewarm_done()
        second = tokens(model, tokenizer)
        out.append({"first": first, "resident_first": resident_first, "second": second,
                    "resident_second": cache.slot_table is not None})
        model.expert_runtime.close()
    return out


def main():
    path, out, mode = sys.argv[1:4]
    group = distributed.init()
    if mode == "parity":
        result = parity(path, group)
    elif mode == "tensor":
        result = tensor(path, group)
    elif mode == "uneven":
        result = uneven(path, group)
    elif mode == "budget":
        result = budget(path, group, sys.argv[4])
    else:
        result = readfail(path, group)
    with open(os.path.join(out, f"rank{group.rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
