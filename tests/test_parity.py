"""Greedy tokens through mlxmoe equal stock mlx-lm's, for every architecture, layout and
cache size from everything resident down to the minimum."""

import mlx_lm
import pytest

import mlxmoe
import synthetic
from mlxmoe.backend import detect

PROMPT = "The quick brown fox jumps over the lazy dog. Il gatto"
TOKENS = 24

VARIANTS = [(arch, None, "stacked") for arch in synthetic.ARCHS]
VARIANTS += [(arch, "4bit", "stacked") for arch in synthetic.ARCHS]
VARIANTS += [(arch, None, "per_expert") for arch in synthetic.ARCHS if arch != "gpt_oss"]
VARIANTS += [("gpt_oss", "mxfp4", "stacked")]

_reference = {}


def reference_tokens(path):
    if path not in _reference:
        model, tokenizer = mlx_lm.load(str(path))
        detect().apply_dtype_policy(model)  # the same dtype policy as mlxmoe (float32 on CPU)
        _reference[path] = [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]
    return _reference[path]


def run(path, **kw):
    model, tokenizer = mlxmoe.load(str(path), **kw)
    tokens = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]
    return tokens, model.expert_runtime


@pytest.mark.parametrize("arch,quant,layout", VARIANTS, ids=lambda v: str(v))
def test_greedy_tokens_match_mlx_lm(checkpoint, arch, quant, layout):
    path = checkpoint(arch, quant=quant, layout=layout)
    want = reference_tokens(path)
    assert len(set(want)) >= 3, "the reference model repeats itself; the test would prove little"

    tokens, runtime = run(path)  # default budget: everything fits
    ckpt = runtime.checkpoint
    total = ckpt.num_layers * ckpt.num_experts
    k = ckpt.top_k
    assert runtime.cache.capacity == total
    assert tokens == want
    sizes = {"half": total // 2, "per-layer minimum": k * ckpt.num_layers, "minimum": k}
    for name, size in sizes.items():
        tokens, runtime = run(path, cache_experts=size)
        cache = runtime.cache
        assert tokens == want, f"cache of {size} experts ({name}) changed the output"
        stats = cache.stats()
        assert stats["misses"] > 0 and stats["cache_experts"] == size
        # every miss read exactly one expert's bytes, every prefetch too
        assert stats["loads_demand"] == stats["misses"]
        assert stats["bytes_read"] == (stats["misses"] + stats["loads_prefetched"]) * cache.store.expert_file_bytes()


def test_bfloat16_checkpoint(checkpoint):
    """bf16 weights are widened to float32 on CPU as they are read; output still matches."""
    path = checkpoint("qwen3_moe", dtype="bfloat16")
    want = reference_tokens(path)
    tokens, runtime = run(path, cache_experts=4)
    assert tokens == want
    assert runtime.cache.store.tensor_dtypes[0] == "BF16"


def test_long_prompt_is_chunked_at_minimum_cache(checkpoint):
    """A prefill touching more experts than the cache holds runs in chunks, same output."""
    path = checkpoint("qwen3_moe", quant="4bit")
    prompt = " ".join(["the cat sat on the mat and then the dog came"] * 12)
    model, tokenizer = mlx_lm.load(str(path))
    detect().apply_dtype_policy(model)
    want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=8)]
    model, tokenizer = mlxmoe.load(str(path), cache_experts=2)
    got = [r.token for r in mlxmoe.stream_generate(model, tokenizer, prompt, max_tokens=8)]
    assert got == want


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])  # a tapped router's logits; a scoring gate's probs
def test_resident_decode_steps_learn_at_once_what_they_learn_call_by_call(checkpoint, monkeypatch, arch):
    """The resident path's decode steps, accounted in one go from their routing read into two
    host arrays, count the same hits and teach the live profile the same counts and mass as
    the same run accounted layer call by layer call."""
    import numpy as np

    from mlxmoe.caching.experts import ResidentCalls

    path = checkpoint(arch, quant="4bit")

    def run():
        model, tokenizer = mlxmoe.load(str(path))
        cache = model.expert_cache
        assert cache.prewarm_done(timeout=60)
        tokens = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]
        assert cache.slot_table is not None and not cache.deferred
        out = tokens, cache.stats()["hits"], cache.profile.counts.copy(), cache.profile.mass.copy()
        cache.close()
        return out

    steps = []
    decode_step = ResidentCalls._decode_step
    monkeypatch.setattr(ResidentCalls, "_decode_step", lambda self, routers: (steps.append(1), decode_step(self, routers)))
    fast = run()
    assert len(steps) >= TOKENS - 2  # every decode step's accounting in one go
    monkeypatch.setattr(ResidentCalls, "_decode_step", lambda self, routers: self._call_by_call())
    slow = run()
    assert fast[0] == slow[0] == reference_tokens(path)
    assert fast[1] == slow[1] > 0
    np.testing.assert_array_equal(fast[2], slow[2])
    np.testing.assert_allclose(fast[3], slow[3], rtol=1e-5, atol=1e-6)


def test_streamed_decode_steps_teach_what_resident_ones_do(checkpoint, monkeypatch):
    """The per-layer path's decode steps (a small cache, no prefetcher, no verified steps) leave
    their routers' distributions unread until one is asked for (at the next layer call's wait,
    where the hits' policy updates are done), then read all those waiting in one softmax
    (experts.StepRouting): each call keeps its own, so the live profile learns the same counts
    and mass as with every expert resident."""
    import numpy as np

    from mlxmoe.caching import experts

    path = checkpoint("qwen3_moe", quant="4bit")
    batches = []
    host_probs = experts.host_probs
    monkeypatch.setattr(experts, "host_probs", lambda logits: (batches.append(len(logits)), host_probs(logits))[1])
    learnt = []
    for kw in ({}, {"cache_experts": 8, "prefetch": 0, "verify": False, "policy": "lru"}):
        batches.clear()
        tokens, runtime = run(path, **kw)
        assert tokens == reference_tokens(path)
        learnt.append((runtime.profile.counts.copy(), runtime.profile.mass.copy(), runtime.cache.stats()["misses"]))
        runtime.close()
    (resident_counts, resident_mass, _), (counts, mass, misses) = learnt
    assert misses > TOKENS and batches  # streamed, the distributions read on the host
    np.testing.assert_array_equal(counts, resident_counts)
    np.testing.assert_allclose(mass, resident_mass, rtol=1e-5, atol=1e-6)


def test_everything_resident_computes_from_the_pools_in_place(checkpoint):
    """With room for every expert, each is read into its home slot (layer x experts + expert)
    whatever the order of the reads, so that the resident path's layers compute from views of
    their rows of the slot pools with mlx-lm's own indices (no lookup op a layer call): the
    same tokens as stock, the views sharing the pools' memory."""
    import numpy as np

    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = mlxmoe.load(str(path))
    cache, ckpt = model.expert_cache, model.expert_runtime.checkpoint
    assert cache.prewarm_done(timeout=60)
    tokens = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]
    assert tokens == reference_tokens(path)
    E = ckpt.num_experts
    assert cache.slot_of == {(layer, e): layer * E + e for layer in range(ckpt.num_layers) for e in range(E)}
    table = cache.slot_table
    assert table.at_home and sorted(table.modules) == list(range(ckpt.num_layers))
    i = cache.pools.names.index("down_proj.weight")
    for layer, module in table.modules.items():
        view = np.array(module["down_proj"]["weight"], copy=False)
        assert view.shape[0] == E and np.shares_memory(view, cache.pools.views[i])
        np.testing.assert_array_equal(view, cache.pools.views[i][layer * E:(layer + 1) * E])
    cache.close()


def test_everything_resident_runs_without_host_work_per_layer(checkpoint, tmp_path):
    """With room for every expert, all are read once in the background; then layers remap
    on the device and their host work (hits, policy, live profile, trace) is done a token
    later: the same tokens, the same counts as the trace of the run shows."""
    from mlxmoe.workload.trace import read_trace, steps

    path = checkpoint("qwen3_moe", quant="4bit")
    want = reference_tokens(path)
    trace = tmp_path / "run.trace.jsonl"
    model, tokenizer = mlxmoe.load(str(path), trace_out=str(trace))
    cache, ckpt = model.expert_cache, model.expert_runtime.checkpoint
    assert cache.prewarm_done(timeout=60)
    tokens = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]
    assert tokens == want
    assert cache.slot_table is not None and not cache.deferred  # the resident path ran, its work is done
    stats = cache.stats()
    total = ckpt.num_layers * ckpt.num_experts
    assert stats["misses"] == 0 and stats["bytes_read"] == total * cache.store.expert_file_bytes()
    profile = cache.profile
    cache.close()
    header, records = read_trace(trace)
    fetched = sum(len(experts) for _, _, experts, *_ in steps(records, header["num_layers"]))
    assert stats["hits"] == fetched > TOKENS
    assert profile.tokens_total == len(records) // header["num_layers"]
