"""Verified decode steps (caching/verify.py): no wait at a layer call, one at the token's end,
a layer that missed read and the token computed again from it; tokens and KV caches as
stock mlx-lm's, the placeholder slot never in the output, waits per token counted."""

import collections
import dataclasses
import itertools
import sys
import threading
import time
from types import SimpleNamespace

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlxmoe
import synthetic
from mlxmoe import backend as backends
from mlxmoe.backend import detect
from mlxmoe.caching import experts, verify
from mlxmoe.storage import reader

PROMPT = "The quick brown fox"  # short: gpt_oss's 32-token windows do not wrap
TOKENS = 20


def reference(path, prompt_cache=None):
    model, tokenizer = mlx_lm.load(str(path))
    detect().apply_dtype_policy(model)
    kw = {} if prompt_cache is None else {"prompt_cache": prompt_cache(model)}
    tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS, **kw)]
    return tokens, kw.get("prompt_cache")


def generate(model, tokenizer, evict=None, weigh=False, direct=False, **kw):
    """Greedy tokens; before each decode step i, `evict(i)` gives keys to take out of the cache
    (so that the step misses there). The verified path stays on whatever its replays cost
    (its switch is not consulted), every miss replayed (no layer read at once, unless
    `direct`), unless `weigh`."""
    cache, tokens = model.expert_cache, []
    if cache.verifier is not None and not weigh:
        cache.verifier.switch.weigh = lambda *a: False
        if not direct:  # (no layer ever chosen: Direct.now stays empty)
            cache.verifier.switch.direct.stepped = lambda: 0
    for i, r in enumerate(mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS, **kw)):
        tokens.append(r.token)
        if evict is not None:
            cache.forget(evict(i))
    return tokens


def all_but(path, n, **kw):
    """The model loaded with a cache of all its experts but `n`."""
    model, _ = mlxmoe.load(str(path), cache_experts=None)
    total = model.expert_cache.capacity
    model.expert_runtime.close()
    return mlxmoe.load(str(path), cache_experts=total - n, **kw)


def reads_cost(monkeypatch, costly):
    """Where `costly`, the first host read of a small array is priced as on CUDA (a managed
    allocation and a synchronous copy): checks read flags (verify.FLAG_READS)."""
    if costly:
        monkeypatch.setattr(verify, "first_read_seconds", lambda: 1.0)


COSTLY = pytest.mark.parametrize("costly", [False, True], ids=["reads free", "reads costly"])


def every_expert(cache, *layers):
    E = cache.store.num_experts
    return lambda i: [(layer, e) for layer in layers for e in range(E)]


def late_reads(events: list, start):
    """store.start_expert whose reads fill their slots with NaN as they are asked and end 20 ms
    late, each asked and ended in `events`."""
    def late(store, layer, expert, outs, *args):
        for out in outs:
            out[...] = np.nan
        finish = start(store, layer, expert, outs, *args)
        events.append(("asked", (layer, expert), finish is not None))
        return finish and (lambda: (time.sleep(0.02), finish(), events.append(("ended", (layer, expert))))[1])
    return late


@pytest.mark.parametrize("arch,quant", [("qwen3_moe", "4bit"), ("mixtral", None), ("gpt_oss", None),
                                        ("deepseek_v3", None), ("qwen2_moe", None), ("olmoe", None)])
def test_tokens_equal_stock_at_every_cache_size(checkpoint, arch, quant):
    path = checkpoint(arch, quant=quant)
    want, _ = reference(path)
    probe, _ = mlxmoe.load(str(path))
    L, E, k = probe.expert_cache.store.num_layers, probe.expert_cache.store.num_experts, probe.expert_runtime.checkpoint.top_k
    probe.expert_runtime.close()
    for size in (L * E - 1, L * E * 3 // 4, L * E // 2, k * L, k):
        model, tokenizer = mlxmoe.load(str(path), cache_experts=size)
        assert generate(model, tokenizer) == want, f"{arch}: {size} experts"
        stats = model.expert_cache.stats()
        assert stats["verified_tokens"] > TOKENS // 2, f"{arch}: {size} experts"
        assert stats["loads_demand"] == stats["misses"]
        model.expert_runtime.close()


@COSTLY
@pytest.mark.parametrize("where", ["first", "last", "consecutive", "first and last"])
def test_a_miss_anywhere_is_read_and_recomputed(checkpoint, monkeypatch, where, costly):
    reads_cost(monkeypatch, costly)
    path = checkpoint("qwen3_moe", quant="4bit")
    want, _ = reference(path)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=None)
    L = model.expert_cache.store.num_layers
    total = model.expert_cache.capacity
    model.expert_runtime.close()
    layers = {"first": [0], "last": [L - 1], "consecutive": [1, 2], "first and last": [0, L - 1]}[where]
    model, tokenizer = mlxmoe.load(str(path), cache_experts=total - 1)
    cache = model.expert_cache
    assert generate(model, tokenizer, evict=every_expert(cache, *layers)) == want
    stats = cache.stats()
    # every decode step after the first missed at each of those layers, once verified
    assert stats["replays"] >= len(layers) * 2, stats
    assert stats["verified_tokens"] >= 2 and stats["verify"]["flags"] == costly


def test_slot_tables_follow_the_reads_of_a_miss(checkpoint, monkeypatch):
    """After each miss's reads (the policy's victims and the guesses), the tables updated in
    place show what a fresh build from the cache's residency shows."""
    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = all_but(path, 6)
    cache = model.expert_cache
    checked = []
    read = verify.SlotTables.read

    def read_and_compare(self, *args):
        taken = read(self, *args)
        fresh = verify.SlotTables(cache)
        fresh.build()
        assert np.array_equal(self.host, fresh.host)
        assert self.lists == fresh.lists and self.key_of == fresh.key_of
        assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(self.rows, fresh.rows))
        checked.append(1)
        return taken

    monkeypatch.setattr(verify.SlotTables, "read", read_and_compare)
    generate(model, tokenizer, evict=every_expert(cache, 1))
    assert len(checked) >= 5


def test_slot_tables_keep_the_token_before_its_slots(checkpoint):
    """A forward that finds the residency changed builds its tables into the other set: a
    lookup the token before built (not yet computed) still finds the slot it was built with.
    A check's read writes the set in use in place: a lookup built in this forward and not yet
    computed finds the slot the read gave."""
    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = all_but(path, 6)
    cache = model.expert_cache
    generate(model, tokenizer)  # (experts resident)
    tables = verify.SlotTables(cache)
    tables.build()
    key, slot = next(iter(cache.slot_of.items()))
    layer, expert = key
    before = tables.rows[layer][mx.array([expert])]  # (the token before's lookup, lazy)
    cache.forget([key])
    tables.build()
    assert tables.lists[layer][expert] == tables.placeholder
    assert before.item() == slot  # (its set untouched)
    assert tables.rows[layer][mx.array([expert])].item() == tables.placeholder
    now = tables.rows[layer][mx.array([expert])]  # (this forward's lookup, lazy)
    tables.read(layer, [expert], None, None, [], [expert], 1)
    assert now.item() == tables.lists[layer][expert] == cache.slot_of[key] != tables.placeholder


@COSTLY
def test_placeholder_never_reaches_the_output(checkpoint, monkeypatch, costly):
    reads_cost(monkeypatch, costly)
    path = checkpoint("qwen3_moe")  # float weights: NaN in the placeholder would spread
    want, _ = reference(path)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=None)
    total = model.expert_cache.capacity
    model.expert_runtime.close()
    model, tokenizer = mlxmoe.load(str(path), cache_experts=total // 2)
    cache = model.expert_cache
    spare = cache.capacity
    for view in cache.pools.views:
        assert view.shape[0] == spare + 1
        view[spare] = np.nan if view.dtype.kind == "f" else view[spare]
    nan_seen = []

    def watch(tokens, logits):
        nan_seen.append(bool(mx.isnan(logits).any().item()))
        return logits

    L = cache.store.num_layers
    assert generate(model, tokenizer, evict=every_expert(cache, 0, L - 1), logits_processors=[watch]) == want
    assert cache.stats()["replays"] > 0 and not any(nan_seen)


@pytest.mark.skipif(reader.AIO is None, reason="no POSIX AIO here (glibc on 64-bit Linux)")
@pytest.mark.parametrize("where", ["replayed", "held"])
def test_a_checks_reads_run_while_the_host_builds_and_end_before_anything_computes(checkpoint, tmp_path,
                                                                                  monkeypatch, where):
    """A check's misses are asked of the kernel at once (AIO, a bundled checkpoint: one run an
    expert) and the decode thread builds on, a replay up to the missed layer's experts, a held
    layer's next decoder layer up to its experts; nothing computes with their slots before
    they end. Reads that fill their slots with NaN as they are asked and end 20 ms late
    still give stock's tokens, no NaN in the logits."""
    from mlxmoe.caching import cache as cache_module
    from mlxmoe.storage.convert import bundle

    src = checkpoint("qwen3_moe")  # float weights: NaN left in a slot would spread
    want, _ = reference(src)
    path = bundle(src, tmp_path / "bundled", progress=lambda _: None)
    if where == "held":  # (held where predicting is off)
        model, tokenizer = mlxmoe.load(str(path), cache_experts=None)
        total = model.expert_cache.capacity
        model.expert_runtime.close()
        model, tokenizer = mlxmoe.load(str(path), cache_experts=total // 2, prefetch=0)
        monkeypatch.setattr(verify.Direct, "at", lambda self, layer: True)
    else:
        model, tokenizer = all_but(path, 1)
    cache = model.expert_cache
    L = cache.store.num_layers
    if where == "held":
        cache.verifier.switch.direct.now = set(range(L))
    events = []
    monkeypatch.setattr(cache_module, "start_expert", late_reads(events, cache_module.start_expert))
    experts_of = cache.verifier.experts
    cache.verifier.experts = lambda s, x, i: events.append(("experts", s._layer)) or experts_of(s, x, i)
    nan_seen = []

    def watch(tokens, logits):
        nan_seen.append(bool(mx.isnan(logits).any().item()))
        return logits

    evicted = [0, L - 1] if where == "held" else [1]
    assert generate(model, tokenizer, evict=every_expert(cache, *evicted), direct=where == "held",
                    logits_processors=[watch]) == want
    stats = cache.stats()
    assert not any(nan_seen) and stats["verified_tokens"] >= TOKENS - 2
    assert (stats["replays"] > 0) == (where == "replayed"), stats
    first = next(i for i, e in enumerate(events) if e[0] == "experts")  # (the prompt's reads before: the per-layer path's)
    asked = [i for i, e in enumerate(events) if e[0] == "asked" and i > first]
    assert len(asked) >= TOKENS - 2 and all(events[i][2] for i in asked)  # (all of them by AIO)
    built = [any(e[0] == "experts" for e in events[i:events.index(("ended", events[i][1]), i)]) for i in asked]
    # built meanwhile: each replay's; a held layer's where no check comes first (a check waits for them)
    assert all(built) if where == "replayed" else sum(built) >= TOKENS // 2, built
    cache.close()


@pytest.mark.skipif(reader.AIO is None, reason="no POSIX AIO here (glibc on 64-bit Linux)")
def test_a_per_layer_calls_misses_are_read_while_its_resident_experts_are_built(checkpoint, tmp_path, monkeypatch):
    """On the per-layer path, a layer call's misses are asked of the kernel at once, before the
    experts it holds are built (early), and end before anything computes with their slots: reads
    that fill their slots with NaN as they are asked and end 20 ms late still give stock's
    tokens, no NaN in the logits; the first demand read, which measures the disk's rate, is
    read at once; every miss is counted as a demand load and its bytes as read."""
    from mlxmoe.caching import cache as cache_module
    from mlxmoe.storage.convert import bundle

    src = checkpoint("qwen3_moe")  # float weights: NaN left in a slot would spread
    want, _ = reference(src)
    model, tokenizer = all_but(bundle(src, tmp_path / "bundled", progress=lambda _: None), 0)
    cache = model.expert_cache
    total = cache.capacity
    model.expert_runtime.close()
    model, tokenizer = mlxmoe.load(str(tmp_path / "bundled"), cache_experts=total // 2, prefetch=0)
    cache = model.expert_cache
    cache.verifier.switch.step = lambda: False  # the per-layer path throughout
    events, fetch, demand = [], cache.fetch, cache.read_demand

    def spying_fetch(layer, experts, *args, early=None, **kw):
        if early is not None:
            built = early
            early = lambda ready: (events.append(("early", layer)), built(ready))[1]  # noqa: E731
        return fetch(layer, experts, *args, early=early, **kw)

    monkeypatch.setattr(cache_module, "start_expert", late_reads(events, cache_module.start_expert))
    cache.fetch = spying_fetch
    cache.read_demand = lambda layer, missed: (events.append(("at once", layer)), demand(layer, missed))[1]
    nan_seen = []

    def watch(tokens, logits):
        nan_seen.append(bool(mx.isnan(logits).any().item()))
        return logits

    assert generate(model, tokenizer, logits_processors=[watch]) == want
    stats = cache.stats()
    assert not any(nan_seen) and stats["verified_tokens"] == 0 and stats["misses"] > TOKENS
    asked = [i for i, e in enumerate(events) if e[0] == "asked"]
    assert asked and all(events[i][2] for i in asked)  # (all of them by AIO)
    assert any(e[0] == "at once" for e in events[:asked[0]])  # (the first: timed at once)
    built = [any(e[0] == "early" for e in events[i:events.index(("ended", events[i][1]), i)]) for i in asked]
    assert sum(built) >= len(built) // 2, built  # (where the call held some of its experts)
    assert stats["loads_demand"] == stats["misses"]
    assert stats["bytes_read"] == stats["loads_demand"] * cache.store.expert_file_bytes()
    cache.close()


@pytest.mark.skipif(reader.AIO is None, reason="no POSIX AIO here (glibc on 64-bit Linux)")
@pytest.mark.parametrize("where", ["verified", "per-layer"])
def test_a_read_that_fails_after_it_was_asked_raises_and_leaves_the_model_whole(checkpoint, tmp_path, monkeypatch,
                                                                               where):
    """A read asked at a check (or by a per-layer call, before its resident experts are built)
    that fails when it is waited for: every other read of the step is waited for, the error
    names the file and offset, its keys leave the cache, and the next generation gives stock's
    tokens."""
    from mlxmoe import MlxmoeError
    from mlxmoe.caching import cache as cache_module
    from mlxmoe.storage.convert import bundle

    src = checkpoint("qwen3_moe")
    want, _ = reference(src)
    model, tokenizer = all_but(bundle(src, tmp_path / "bundled", progress=lambda _: None), 1)
    cache, start, failed = model.expert_cache, cache_module.start_expert, []
    if where == "per-layer":
        cache.verifier.switch.step = lambda: False

    def failing(store, layer, expert, outs, *args):
        finish = start(store, layer, expert, outs, *args)
        if finish is None or failed:
            return finish
        failed.append((layer, expert))

        def fail():
            finish()
            raise MlxmoeError(f"reading {store.files[0]} at offset 123: injected")
        return fail

    monkeypatch.setattr(cache_module, "start_expert", failing)
    with pytest.raises(MlxmoeError, match="offset 123: injected"):
        generate(model, tokenizer, evict=every_expert(cache, 1))
    assert failed and failed[0] not in cache.slot_of and not cache.verifier.tables.pending
    assert not cache.verifier.forward and cache.pools.store.reader.later.busy == 0
    if where == "per-layer":  # (no verified step ran: the per-layer call's read failed)
        assert cache.counters.verified_tokens == 0 and cache.counters.loads_demand > 0
    monkeypatch.undo()
    assert generate(model, tokenizer, evict=every_expert(cache, 1)) == want
    cache.close()


@pytest.mark.skipif(reader.AIO is None, reason="no POSIX AIO here (glibc on 64-bit Linux)")
def test_an_interrupt_while_a_per_layer_call_builds_waits_for_its_reads(checkpoint, tmp_path, monkeypatch):
    """Ctrl-C (chat carries on) while a per-layer call builds the experts it holds, its misses'
    reads asked: they are waited for before the interrupt leaves (no read still writes into a
    slot), the call's keys leave the cache, and the next generation gives stock's tokens."""
    from mlxmoe.storage.convert import bundle

    src = checkpoint("qwen3_moe")
    want, _ = reference(src)
    path = bundle(src, tmp_path / "bundled", progress=lambda _: None)
    model, tokenizer = all_but(path, 1, prefetch=0)  # (no running ahead: read on the decode thread)
    cache, fetch, interrupted = model.expert_cache, model.expert_cache.fetch, []
    cache.verifier.switch.step = lambda: False  # the per-layer path throughout
    later = cache.pools.store.reader.later

    def interrupting_fetch(layer, experts, *args, early=None, **kw):
        if early is not None and not interrupted and cache.loader.gate.rate:
            def early(ready):
                interrupted.append((layer, list(experts), later.busy))
                raise KeyboardInterrupt
        return fetch(layer, experts, *args, early=early, **kw)

    cache.fetch = interrupting_fetch
    with pytest.raises(KeyboardInterrupt):
        generate(model, tokenizer, evict=every_expert(cache, 1))
    (layer, experts, busy), = interrupted
    assert busy > 0 and later.busy == 0 and not later.unfinished  # (asked before, ended after)
    assert not any((layer, e) in cache.slot_of for e in experts)
    cache.fetch = fetch
    assert generate(model, tokenizer, evict=every_expert(cache, 1)) == want
    cache.close()


def test_kv_caches_after_a_recompute_equal_stock(checkpoint):
    path = checkpoint("qwen3_moe", quant="4bit")
    want, stock_kv = reference(path, prompt_cache=make_prompt_cache)
    model, tokenizer = all_but(path, 1)
    cache = model.expert_cache
    L = cache.store.num_layers
    kv = make_prompt_cache(model)
    assert generate(model, tokenizer, evict=every_expert(cache, 1), prompt_cache=kv) == want
    assert cache.stats()["replays"] > 0
    for ours, theirs in zip(kv, stock_kv):
        assert ours.offset == theirs.offset
        for a, b in zip(ours.state[:2], theirs.state[:2]):
            n = ours.offset
            assert mx.array_equal(a[..., :n, :], b[..., :n, :]).item()


class WaitCounter:
    """mlxmoe's waits on the device per decode step, on the decode thread, that leave it with
    nothing queued: mx.eval, .item(), .tolist(), and np.array of an array no earlier mlxmoe
    mx.eval of the step covered; not an mx.eval within a check of a forward's earlier layers
    made once later decoder layers were queued (`queued_after`: how many, per such check; a
    half where an mlxmoe mx.async_eval since the last decoder layer was built queued part of
    the next, its attention).
    `reads`: count every host read of an array of more than 8 bytes instead (on CUDA each is a
    managed allocation and a synchronous copy; CUDA keeps smaller ones in host memory), and no
    mx.eval."""

    def __init__(self, monkeypatch, model, reads=False):
        self.thread = threading.get_ident()
        self.reads = reads
        self.steps = []  # per model call of one token: waits
        self.windowed = []  # ... and whether its checks were within the forward when it started
        self.missed = []  # ... and its layer calls that missed (one replay each)
        self.covered = set()
        self.queued_after = []
        self.within = False  # in a check within a forward with decoder layers queued after it
        self.partial = False  # an mlxmoe mx.async_eval since the last decoder layer was built
        self.built = -1  # the last decoder layer this pass built (a replay's earlier ones given back)
        eval_, array, async_eval = mx.eval, np.array, mx.async_eval
        counter, cls = self, type(model)
        call = cls.__call__
        check, decoder_call = verify.Verifier._check, verify.Verifier._decoder_call

        def within_check(v, until=None, **kw):
            queued = counter.built + 1 - until if until is not None else 0
            queued += 0.5 * (until is not None and counter.partial)
            counter.within = queued > 0
            if queued > 0:
                counter.queued_after.append(queued)
            try:
                return check(v, until, **kw)
            finally:
                counter.within = False

        def model_call(m, inputs, *a, **kw):
            if inputs.size != 1:
                return call(m, inputs, *a, **kw)
            counter.steps.append(0)
            counter.windowed.append(m.expert_cache.verifier.switch.windowed)
            counter.covered, counter.built = set(), -1
            c = m.expert_cache.counters
            replays, verified = c.replays, c.verified_tokens
            out = call(m, inputs, *a, **kw)
            counter.missed.append(c.replays - replays if c.verified_tokens > verified else None)
            return out

        def mine():
            import sys
            return threading.get_ident() == counter.thread and \
                sys._getframe(2).f_globals.get("__name__", "").startswith("mlxmoe")

        def built(v, d, *args, **kw):
            try:
                out = decoder_call(v, d, *args, **kw)
            except verify.Replay:
                counter.built = -1  # (the next pass builds from its first decoder layer)
                raise
            finally:
                counter.partial = False
            counter.built = d
            return out

        def counted_async(*args):
            counter.partial = counter.partial or mine()
            return async_eval(*args)

        def counted_eval(*args, **kw):
            if mine() and counter.steps and not counter.reads:
                counter.steps[-1] += not counter.within
                counter.covered.update(id(x) for x in args if isinstance(x, mx.array))
            return eval_(*args, **kw)

        def counted_array(obj, *args, **kw):
            if isinstance(obj, mx.array) and mine() and counter.steps and counter.counts(obj):
                counter.steps[-1] += 1
            return array(obj, *args, **kw)

        def reader(fn):
            def read(obj, *args, **kw):
                if mine() and counter.steps and counter.counts(obj):
                    counter.steps[-1] += 1
                return fn(obj, *args, **kw)
            return read

        monkeypatch.setattr(cls, "__call__", model_call)
        monkeypatch.setattr(verify.Verifier, "_check", within_check)
        monkeypatch.setattr(verify.Verifier, "_decoder_call", built)
        monkeypatch.setattr(mx, "eval", counted_eval)
        monkeypatch.setattr(mx, "async_eval", counted_async)
        monkeypatch.setattr(np, "array", counted_array)
        for name in ("item", "tolist"):
            monkeypatch.setattr(mx.array, name, reader(getattr(mx.array, name)))
        # (bfloat16 arrays are read through their bits: backend.host_floats)
        monkeypatch.setattr(backends, "memoryview", reader(memoryview), raising=False)

    def counts(self, a) -> bool:
        """Whether a host read of mx array `a` counts."""
        return a.nbytes > 8 if self.reads else id(a) not in self.covered


@pytest.mark.parametrize("name", ["demo", "qwen3_moe", "deepseek_v3"])
def test_waits_per_step_at_most_one_plus_missed_layer_calls(checkpoint, monkeypatch, name):
    path = mlxmoe.DEMO_MODEL if name == "demo" else checkpoint(name)
    model, tokenizer = all_but(path, 2)
    cache = model.expert_cache
    generate(model, tokenizer)  # warm: the same workload before
    before = cache.stats()
    counter = WaitCounter(monkeypatch, model)
    L = cache.store.num_layers
    evict = every_expert(cache, L - 1)
    tokens = generate(model, tokenizer, evict=lambda i: evict(i) if i % 3 == 0 else [])
    after = cache.stats()
    # mlx-lm computes one step past the last token it yields
    assert after["verified_tokens"] - before["verified_tokens"] >= len(tokens) - 1 >= 8
    assert after["replays"] > before["replays"]
    verified = [(w, m) for w, m in zip(counter.steps, counter.missed) if m is not None]
    assert len(verified) >= len(tokens) - 1
    for waits, missed in verified:
        assert waits <= 1 + missed, verified
    assert [w for w, m in verified if m == 0] and all(w == 1 for w, m in verified if m == 0)


@pytest.mark.parametrize("name,costly", [("demo", False), ("qwen3_moe", False), ("qwen3_moe bfloat16", False),
                                         ("qwen3_moe", True), ("qwen3_moe bfloat16", True)])
def test_a_step_that_missed_nowhere_reads_its_routing_in_two_host_copies(checkpoint, monkeypatch, name, costly):
    """The layer calls' indices and routers packed on the device at the last MoE layer call:
    two host reads a step, not two a layer call (on CUDA each is a managed allocation and a
    synchronous copy). While checks run within the forward, each reads its layer calls'
    indices where reads are free, their flags (4 bytes) where a first read costs: two reads a
    step then too. With bfloat16 activations, as on a GPU, the tokens are stock's too."""
    reads_cost(monkeypatch, costly)
    if name == "demo":
        path = mlxmoe.DEMO_MODEL
    elif name.endswith("bfloat16"):
        base = backends.detect  # (activations keep the checkpoint's dtype, as on a GPU)
        monkeypatch.setattr(backends, "detect", lambda n=None: dataclasses.replace(base(n), compute_dtype=None))
        path = checkpoint("qwen3_moe", quant="4bit", dtype="bfloat16")
    else:
        path = checkpoint(name)
    model, tokenizer = all_but(path, 2)
    cache = model.expert_cache
    tokens = generate(model, tokenizer)  # warm: the same workload before
    if name.endswith("bfloat16"):
        assert model.model.norm.weight.dtype == mx.bfloat16
        assert tokens == [r.token for r in mlx_lm.stream_generate(*mlx_lm.load(str(path)), PROMPT, max_tokens=TOKENS)]
    counter, lasts = WaitCounter(monkeypatch, model, reads=True), set()
    for _ in range(3):  # (checks within the forward stop some clean steps after a miss)
        # (the prompt's layer calls count into the step before them, the last one's)
        lasts.add(len(counter.steps) - 1)
        generate(model, tokenizer)
    cache.close()
    steps = [(n, w) for i, (n, m, w) in enumerate(zip(counter.steps, counter.missed, counter.windowed))
             if m == 0 and i not in lasts]
    assert len([n for n, w in steps if not w]) >= 5 and {n for n, w in steps if not w} == {2}, steps
    # while checks run within the forward: one read each (none where they read flags), then the pack
    # (the hits' routers in it)
    most = 2 if costly else cache.store.num_layers + 1
    assert [n for n, w in steps if w] and max(n for n, w in steps if w) <= most, steps


def test_a_clean_steps_accounting_is_left_to_the_host_thread(checkpoint, monkeypatch, tmp_path):
    """A verified step that missed nowhere reads its indices at its end and leaves the rest
    (its routers' softmax, the policy's updates, the live profile's) to the prefetcher's host
    thread: no routing softmax on the decode thread in such steps, some on the host thread;
    the live profile learns the same counts and mass as call by call (a trace recorded)."""
    path = checkpoint("qwen3_moe", quant="4bit")
    decode_thread, steps, softmaxes = threading.get_ident(), [], []
    host_dists, host_probs = verify.host_dists, verify.host_probs

    def counted(fn):
        def call(*a, **kw):
            softmaxes.append((threading.get_ident(), len(steps)))  # (the step under way)
            return fn(*a, **kw)
        return call

    profiles = []
    for trace in (None, tmp_path / "run.trace.jsonl"):
        model, tokenizer = all_but(path, 2, trace_out=trace)
        cache = model.expert_cache
        generate(model, tokenizer)  # warm: the same workload before
        if trace is None:
            monkeypatch.setattr(verify, "host_dists", counted(host_dists))
            monkeypatch.setattr(verify, "host_probs", counted(host_probs))
            model_call = type(model).__call__

            def stepped(m, inputs, *a, **kw):
                c = m.expert_cache.counters
                replays, verified = c.replays, c.verified_tokens
                out = model_call(m, inputs, *a, **kw)
                steps.append(inputs.size == 1 and c.verified_tokens > verified and c.replays == replays)
                return out
            monkeypatch.setattr(type(model), "__call__", stepped)
        generate(model, tokenizer)
        cache.flush()
        profiles.append(model.expert_runtime.profile)
        if trace is None:
            monkeypatch.undo()
            assert cache.prefetcher is not None and sum(steps) >= TOKENS // 2, steps
            clean = [i for i, ok in enumerate(steps) if ok]
            assert not [i for t, i in softmaxes if t == decode_thread and i in clean], softmaxes
            assert [t for t, _ in softmaxes if t != decode_thread]
        model.expert_runtime.close()
    a, b = profiles
    assert a.tokens == b.tokens and np.array_equal(a.counts, b.counts) and np.array_equal(a.mass, b.mass)


def test_off_where_replays_cost_more_than_waits(checkpoint, monkeypatch):
    """Waits that cost nothing: the replays' estimate turns the mode off. (The steps then
    taken on the per-layer path are never set against the verified ones here: which is
    faster is a timing on a loaded machine; the next test makes it certain.)"""
    path = checkpoint("qwen3_moe", quant="4bit")
    want, _ = reference(path)
    model, tokenizer = all_but(path, 1)
    cache = model.expert_cache
    cache.verifier.switch.wait = 1e-9
    monkeypatch.setattr(verify, "MEASURED_OFF", TOKENS + 1)
    L = cache.store.num_layers
    assert generate(model, tokenizer, evict=every_expert(cache, 0, L - 1), weigh=True) == want
    stats = cache.stats()
    assert stats["verify"]["reason"].startswith("replays cost"), stats["verify"]
    assert stats["verify"]["on"] is False and "more than" in stats["verify"]["reason"], stats["verify"]
    assert stats["verified_tokens"] < TOKENS - 2


def test_on_again_where_the_per_layer_path_is_measured_slower(checkpoint, monkeypatch):
    """A first weighing that prices the per-layer path by an empty round trip turns the mode
    off; the steps then taken on that path, each of its layer calls' waits 5 ms longer (an
    emulated round trip), are timed: slower than the verified steps, the mode is on again after
    MEASURED_OFF of them, and stays on, its replays weighed against the measured time.
    (Predicting taken as settled: the wait for it is the subject of
    test_the_per_layer_path_is_timed_once_predicting_settled, and here a pause of predicting
    then its resumption, as the machine's load times them, could hold the timing past the
    generation's 19 steps.)"""
    path = checkpoint("qwen3_moe", quant="4bit")
    want, _ = reference(path)
    model, tokenizer = all_but(path, 1)
    cache = model.expert_cache
    cache.verifier.switch.wait = 1e-9
    cache.verifier.switch.settled = lambda: True

    class RoundTrip:  # the per-layer path's mx: each wait on the device 5 ms longer
        def __getattr__(self, name):
            return getattr(mx, name)

        @staticmethod
        def eval(*arrays):
            mx.eval(*arrays)
            time.sleep(0.005)
    monkeypatch.setattr(experts, "mx", RoundTrip())
    L = cache.store.num_layers
    assert generate(model, tokenizer, evict=every_expert(cache, 0, L - 1), weigh=True) == want
    stats = cache.stats()
    assert stats["verify"]["on"] is True and stats["verify"]["reason"].startswith("on again"), stats["verify"]
    assert stats["verified_tokens"] >= TOKENS - 1 - verify.FIRST_WEIGH - verify.MEASURED_OFF, stats["verified_tokens"]


def test_the_lag_rises_where_checks_wait_for_the_device(checkpoint, monkeypatch):
    """Checks one decoder layer behind that wait for the device (each eval within the forward
    5 ms longer here, as where the device is the slower side) raise the lag to LAG: the checks
    after it leave LAG layers queued; tokens as stock's."""
    path = checkpoint("qwen3_moe", quant="4bit", config_overrides={"num_hidden_layers": 12})
    want, _ = reference(path)
    model, tokenizer = all_but(path, 1)
    cache = model.expert_cache
    verifier = cache.verifier
    assert verifier.lag.layers == verify.MIN_LAG
    queued = []  # per check within the forward: the decoder layers queued past it
    check = verify.Verifier._check

    def counted(self, until=None, **kw):
        if until is not None:
            queued.append(max(self.outputs) + 1 - until)
        return check(self, until, **kw)

    class Slow:  # the verifier's mx: a wait within the forward 5 ms longer
        def __getattr__(self, name):
            return getattr(mx, name)

        @staticmethod
        def eval(*arrays):
            mx.eval(*arrays)
            if verifier.forward:
                time.sleep(0.005)
    monkeypatch.setattr(verify.Verifier, "_check", counted)
    monkeypatch.setattr(verify, "mx", Slow())
    assert generate(model, tokenizer, evict=every_expert(cache, 0)) == want
    assert verifier.lag.layers == verify.LAG
    assert queued[0] == verify.MIN_LAG and queued[-1] == verify.LAG, queued


@pytest.mark.parametrize("lag", [0, 1])
def test_at_lag_0_a_miss_is_found_before_the_next_decoder_layer_is_queued(checkpoint, monkeypatch, lag):
    """At lag 0 a decoder layer's routing is checked where the next one's experts are called:
    a miss found there replays before that next layer is built whole and queued (at lag 1, once
    it is). Tokens and KV caches as stock's."""
    path = checkpoint("qwen3_moe", quant="4bit", config_overrides={"num_hidden_layers": 12})
    want, stock_kv = reference(path, prompt_cache=make_prompt_cache)
    model, tokenizer = all_but(path, 1)
    cache = model.expert_cache
    verifier = cache.verifier
    verifier.lag.layers, verifier.lag.wait = lag, float("inf")  # (no check counts as a wait: the lag stays)
    found = []  # per miss found within a forward: decoder layers built whole past the missed one, and
    # whether the next one's attention was
    check = verify.Verifier._check

    def counted(self, until=None, **kw):
        missed = check(self, until, **kw)
        if until is not None and missed is not None and not kw.get("direct"):
            d = self.decoder_of[missed]
            found.append((max(self.outputs) - d, d + 1 in self.attention.outputs))
        return missed
    monkeypatch.setattr(verify.Verifier, "_check", counted)
    kv = make_prompt_cache(model)
    assert generate(model, tokenizer, evict=every_expert(cache, 5), prompt_cache=kv) == want
    stats = cache.stats()
    assert stats["verified_tokens"] >= TOKENS - 2 and stats["replays"] >= TOKENS - 2, stats
    assert len(found) >= TOKENS - 2 and set(found) == {(lag, True)}, found
    for ours, theirs in zip(kv, stock_kv):
        n = ours.offset
        assert n == theirs.offset
        for a, b in zip(ours.state[:2], theirs.state[:2]):
            assert mx.array_equal(a[..., :n, :], b[..., :n, :]).item()


@pytest.mark.parametrize("windowed", [False, True], ids=["clean", "checks within"])
def test_a_forward_is_queued_every_few_decoder_layers_without_checks_within(checkpoint, monkeypatch, windowed):
    """A verified forward queues its decoder layers (mx.async_eval) every QUEUE_EVERY of them
    where no check runs within it (each queue costs the host a graph walk), each one where
    checks run a layer or two behind (the device computes those while the host reads one);
    the tokens are stock's either way."""
    path = checkpoint("qwen3_moe", quant="4bit", config_overrides={"num_hidden_layers": 10})
    want, _ = reference(path)
    model, tokenizer = all_but(path, 2)
    cache = model.expert_cache
    assert generate(model, tokenizer) == want  # warm: the same workload before
    switch = cache.verifier.switch
    monkeypatch.setattr(verify.Switch, "windowed", property(lambda self: windowed, lambda self, v: None), raising=False)
    queued, real = [], mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (queued.append(sys._getframe(1).f_code.co_name), real(*a))[1])
    steps = []
    model_call = type(model).__call__

    def counted(m, inputs, *a, **kw):
        queued.clear()
        replays = cache.counters.replays
        out = model_call(m, inputs, *a, **kw)
        if inputs.size == 1 and cache.counters.replays == replays:
            steps.append(queued.count("_queue"))
        return out

    monkeypatch.setattr(type(model), "__call__", counted)
    assert generate(model, tokenizer) == want
    layers = len(model.layers)
    assert switch.windowed is windowed and len(steps) >= TOKENS // 2 and layers // verify.QUEUE_EVERY >= 2
    assert set(steps) == {layers if windowed else layers // verify.QUEUE_EVERY}, steps
    cache.close()


def test_verify_off_waits_per_layer(checkpoint):
    path = checkpoint("qwen3_moe", quant="4bit")
    want, _ = reference(path)
    probe, _ = mlxmoe.load(str(path))
    total = probe.expert_cache.capacity
    assert probe.expert_cache.stats()["verify"]["reason"].startswith("every expert resident")
    probe.expert_runtime.close()
    model, tokenizer = mlxmoe.load(str(path), cache_experts=total // 2, verify=False)  # (not all: streamed)
    assert generate(model, tokenizer) == want
    stats = model.expert_cache.stats()
    assert stats["misses"] > 0, stats
    assert stats["verified_tokens"] == 0 and stats["verify"]["on"] is False
    assert "--wait-per-layer" in stats["verify"]["reason"], stats["verify"]  # (said in chat's /stats: cli.decode_path)


@pytest.mark.parametrize("verify_on", [True, False], ids=["verified", "per-layer"])
def test_keep_busy_queues_ops_during_demand_reads_only(checkpoint, monkeypatch, verify_on):
    """What keeps an Apple GPU's clock up while the decode thread reads (backend.KeepBusy),
    run here on the CPU: tokens as stock's, ops queued while demand reads run and none
    between them, its thread ended by close(); a CPU or CUDA model gets none."""
    from mlxmoe.caching import cache as cache_module

    path = checkpoint("qwen3_moe", quant="4bit")
    want, _ = reference(path)
    model, tokenizer = all_but(path, 1, verify=verify_on)
    cache = model.expert_cache
    assert not isinstance(cache.keep_busy, backends.KeepBusy)  # (this backend is the CPU)
    busy = backends.KeepBusy(mx.cpu, interval=1e-4)
    cache.closers.append(busy.close)
    blocks, read_experts, read, start, later = [], [], cache.pools.read, cache.pools.start, verify.read_later

    class Recorded:  # the kernels queued before each block and when it has ended
        def __enter__(self):
            blocks.append([busy.kernels, None])
            busy.__enter__()

        def __exit__(self, *exc):
            busy.__exit__(*exc)
            blocks[-1][1] = busy.kernels

    def slow_read(layer, missed):  # the per-layer path's
        time.sleep(0.003)  # a read long enough for the thread to queue ops meanwhile
        read_experts.append(len(missed))
        return read(layer, missed)

    def slow_start(keyed):  # a verified step's: asked at once, waited for later
        finish = start(keyed)
        return lambda: (time.sleep(0.003), finish())[1]

    def read_later(cache, layer, missed, taken):
        read_experts.append(len(missed))
        return later(cache, layer, missed, taken)

    cache.keep_busy = Recorded()
    monkeypatch.setattr(cache.pools, "read", slow_read)
    monkeypatch.setattr(cache.pools, "start", slow_start)
    monkeypatch.setattr(verify, "read_later", read_later)
    monkeypatch.setattr(cache_module, "read_later", read_later)  # (the per-layer path's, once the disk's rate is known)
    assert generate(model, tokenizer, evict=every_expert(cache, 0)) == want
    stats = cache.stats()
    assert (stats["verified_tokens"] > 0) == verify_on, stats["verify"]
    assert len(blocks) == len(read_experts) > 0 and sum(read_experts) == stats["loads_demand"]
    assert sum(end - start for start, end in blocks) >= len(blocks), blocks  # (3 ms a read: ~30 ops)
    time.sleep(0.05)
    assert [b[0] - a[1] for a, b in zip(blocks, blocks[1:] + [[busy.kernels]])] == [0] * len(blocks)
    model.expert_runtime.close()
    assert not busy._thread.is_alive()


def test_keep_busy_that_fails_never_holds_a_read_up(monkeypatch):
    """Keeping the GPU busy is optional: a thread whose MLX calls fail ends, says why, and
    the blocks around reads go on at once, then and after."""
    def refuse(*args, **kwargs):
        raise RuntimeError("no queue here")

    monkeypatch.setattr(backends.mx, "async_eval", refuse)  # (the first op, with the block begun)
    busy = backends.KeepBusy(mx.cpu)
    with busy:
        time.sleep(0.01)
    busy._thread.join(timeout=10)
    tic = time.perf_counter()
    for _ in range(3):
        with busy:
            pass
    assert time.perf_counter() - tic < 1 and busy.kernels == 0 and "no queue here" in busy.error
    busy.close()


@pytest.mark.parametrize("less", [0, 1], ids=["resident", "verified"])
def test_live_profile_learnt_at_once_equals_call_by_call(checkpoint, tmp_path, less):
    """A decode step's hits teach the live profile in one go where it is the only observer
    (verify.observe_calls: the verified path's and the resident path's); with a trace
    recorded too, call by call: the same counts and mass."""
    path = checkpoint("qwen3_moe", quant="4bit")
    profiles = []
    for trace in (None, tmp_path / "run.trace.jsonl"):
        model, tokenizer = all_but(path, less, trace_out=trace)
        generate(model, tokenizer)
        generate(model, tokenizer)
        stats = model.expert_cache.stats()
        if less:
            assert stats["verified_tokens"] >= TOKENS
        else:  # the resident path
            assert stats["verified_tokens"] == 0 and model.expert_cache.slot_table is not None
        profiles.append(model.expert_runtime.profile)
        model.expert_runtime.close()
    a, b = profiles
    assert a.tokens == b.tokens and np.array_equal(a.counts, b.counts)
    if less:
        assert np.array_equal(a.mass, b.mass)
    else:  # (the resident path's mass summed on the device, softmax included: float32's rounding apart)
        np.testing.assert_allclose(a.mass, b.mass, rtol=1e-5, atol=1e-6)
        assert not np.array_equal(a.mass, np.zeros_like(a.mass))


def test_per_layer_path_teaches_the_live_profile_once_a_token(checkpoint, tmp_path, monkeypatch):
    """On the per-layer path, a miss brings the policy up to date with the token's hits so far,
    while the live profile learns the token's calls in one go at the next token's tick, not
    once a miss (Residency.catch_up's policy_only): the same counts and mass as learnt call by call
    (a trace recorded too), the same tokens."""
    from mlxmoe.caching import cache as cache_module
    from mlxmoe.caching.cache import ExpertCache
    from mlxmoe.workload.profile import ActivationProfile

    path = checkpoint("qwen3_moe", quant="4bit")
    batches, missed = [], []
    learn_calls, read_demand, read_later = ActivationProfile.learn_calls, ExpertCache.read_demand, cache_module.read_later
    monkeypatch.setattr(ActivationProfile, "learn_calls",
                        lambda self, calls: (batches.append(len(calls)), learn_calls(self, calls))[1])
    monkeypatch.setattr(ExpertCache, "read_demand",
                        lambda self, layer, m: (missed.append(layer), read_demand(self, layer, m))[1])
    monkeypatch.setattr(cache_module, "read_later",  # (the per-layer path's misses once the disk's rate is known)
                        lambda cache, layer, m, taken: (missed.append(layer), read_later(cache, layer, m, taken))[1])
    runs = []
    for trace in (None, tmp_path / "run.trace.jsonl"):
        model, tokenizer = mlxmoe.load(str(path), cache_experts=12, prefetch=0, trace_out=trace)
        model.expert_cache.verifier.switch.step = lambda: False  # the per-layer path throughout
        batches.clear(), missed.clear()
        tokens = generate(model, tokenizer)
        model.expert_cache.flush()
        runs.append((tokens, model.expert_runtime.profile, len(batches), len(missed)))
        model.expert_runtime.close()
    (tokens, a, learnt, misses), (tokens_b, b, _, _) = runs
    assert misses > 2 * TOKENS  # several layer calls of a token missed
    assert learnt <= TOKENS + 2  # once a token (the prompt's and the end's flush besides)
    assert tokens == tokens_b and a.tokens == b.tokens
    assert np.array_equal(a.counts, b.counts) and np.array_equal(a.mass, b.mass)


def test_a_verified_steps_tick_does_not_wait_for_the_host_threads_catch_up(checkpoint):
    """A verified step's tick leaves the policy's clock in `deferred` without the cache's lock,
    which the host thread holds while it catches up on the step before: the step starts
    building at once (a tick of the per-layer path still waits for the lock). The clock then
    moves in order, after the work deferred before it, and the tokens stay stock's."""
    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = all_but(path, 2)
    cache = model.expert_cache
    assert generate(model, tokenizer) == reference(path)[0]
    held, release = threading.Event(), threading.Event()

    def catching_up():  # (as the host thread's catch-up: the lock held)
        with cache.lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=catching_up)
    holder.start()
    held.wait(30)
    try:
        ticks = [threading.Thread(target=cache.tick, args=(1,), kwargs={"later": later}) for later in (True, False)]
        ticks[0].start()
        ticks[0].join(10)
        assert not ticks[0].is_alive()  # (done while the lock is held)
        assert cache.deferred[-1] == (cache.policy.tick, (1,))
        ticks[1].start()
        ticks[1].join(0.2)
        assert ticks[1].is_alive()  # (the per-layer path's tick reads the policy: it waits)
    finally:
        release.set()
        holder.join()
    ticks[1].join(10)
    assert not ticks[1].is_alive() and not cache.deferred  # (its catch-up did the clock left before)
    assert generate(model, tokenizer) == reference(path)[0]
    model.expert_runtime.close()


def test_a_step_ending_unpacked_leaves_its_softmax_for_later(checkpoint, tmp_path, monkeypatch):
    """Where a verified step ends with nothing packed (every layer Direct, held), its hits'
    router logits are copied to the host on the decode thread and their softmax is left with
    the rest of the step's host work: the live profile learns the same counts and mass as where
    an observer (a trace) takes the calls one by one, the same tokens."""
    path = checkpoint("qwen3_moe", quant="4bit")
    copied, copy = [], verify.PassRouting.copy_routers
    monkeypatch.setattr(verify.PassRouting, "copy_routers",
                        lambda self, layers: (copy(self, layers), copied.append(len(self.unread)))[0])
    monkeypatch.setattr(verify.Direct, "at", lambda self, layer: True)
    runs = []
    for trace in (None, tmp_path / "run.trace.jsonl"):
        model, tokenizer = mlxmoe.load(str(path), cache_experts=12, prefetch=0, trace_out=trace)
        cache = model.expert_cache
        cache.verifier.switch.step = lambda: True  # the verified path throughout
        cache.verifier.switch.direct.now = set(range(cache.store.num_layers))
        copied.clear()
        tokens = generate(model, tokenizer, direct=True)
        cache.flush()
        runs.append((tokens, model.expert_runtime.profile, cache.stats()["verified_tokens"], list(copied)))
        model.expert_runtime.close()
    (tokens, a, verified, left), (tokens_b, b, _, by_trace) = runs
    assert verified >= TOKENS - 1 and len(left) >= TOKENS // 2 and sum(left) >= 3 and not by_trace, left
    assert tokens == tokens_b and a.tokens == b.tokens
    assert np.array_equal(a.counts, b.counts) and np.array_equal(a.mass, b.mass)


@pytest.mark.parametrize("calls", [3, experts.FEW_CALLS + 8])
def test_step_calls_in_one_go_equal_call_by_call(calls):
    """A decode step's layer calls summarised together (plain Python from their lists up to
    FEW_CALLS, numpy above and from an array, as the resident path's; a row with a repeated
    expert too) equal summary() of each call's row as an array: the same experts, router
    scores and distributions."""
    rng = np.random.default_rng(calls)
    rows = [[int(e) for e in rng.choice(32, 4, replace=False)] for _ in range(calls)]
    probs = [rng.random(32).astype(np.float32) for _ in range(calls)]
    layers = list(range(calls))
    for rows_ in (rows, rows[:1] + [rows[1][:3] + rows[1][:1]] + rows[2:], np.array(rows, dtype=np.uint32)):
        got = experts.step_calls(layers, rows_, probs)
        want = [experts.step_call(m, np.array(r), p) for m, r, p in zip(layers, rows_, probs)]
        assert len(got) == calls
        for (m, e, scores, dist), (m_, e_, scores_, dist_) in zip(got, want):
            assert m == m_ and e == e_ and scores == scores_ and np.array_equal(dist, dist_)
            assert all(type(x) is int for x in e) and all(type(x) is float for x in scores)


def test_verified_steps_teach_the_live_profile_once_a_step(checkpoint, tmp_path, monkeypatch):
    """A verified step's layer calls (the hits before a miss, the missed call, the rest after
    its replay) teach the live profile in one go at the step's end, not once a check: once a
    step where most steps miss, the same counts and mass as learnt call by call (a trace
    recorded too), the same tokens."""
    from mlxmoe.workload.profile import ActivationProfile

    path = checkpoint("qwen3_moe", quant="4bit")
    learnt = []
    observe_step = ActivationProfile.observe_step
    monkeypatch.setattr(ActivationProfile, "observe_step",
                        lambda self, *a: (learnt.append(a[0]), observe_step(self, *a))[1])
    runs = []
    for trace in (None, tmp_path / "run.trace.jsonl"):
        model, tokenizer = mlxmoe.load(str(path), cache_experts=12, prefetch=0, trace_out=trace)
        model.expert_cache.verifier.switch.step = lambda: True  # the verified path throughout
        learnt.clear()
        tokens = generate(model, tokenizer)
        model.expert_cache.flush()
        stats = model.expert_cache.stats()
        runs.append((tokens, model.expert_runtime.profile, list(learnt), stats))
        model.expert_runtime.close()
    (tokens, a, steps, stats), (tokens_b, b, _, _) = runs
    assert stats["verified_tokens"] >= TOKENS - 1 and stats["replays"] >= TOKENS // 2
    assert len(steps) == stats["verified_tokens"]  # once a step, each with all its layer calls
    assert all(list(layers) == sorted(layers) for layers in steps) and max(len(x) for x in steps) == a.counts.shape[0]
    assert tokens == tokens_b and a.tokens == b.tokens
    assert np.array_equal(a.counts, b.counts) and np.array_equal(a.mass, b.mass)


@COSTLY
@pytest.mark.parametrize("layers", [[3], [9], [0, 17], [8, 15, 16], [23]])
def test_checks_within_a_forward(checkpoint, monkeypatch, layers, costly):
    """On a 24-decoder-layer model, checks within the forward read the layers `lag` behind
    the one just queued; a miss found there or
    at the end is read and the forward run again from it: tokens and KV caches as stock's.
    Waits with nothing queued after them (the check at the forward's end): at most 1 + the
    layer calls that missed. Where a first read costs, the checks within read flags."""
    reads_cost(monkeypatch, costly)
    path = checkpoint("qwen3_moe", quant="4bit", config_overrides={"num_hidden_layers": 24})
    want, stock_kv = reference(path, prompt_cache=make_prompt_cache)
    model, tokenizer = all_but(path, 1)
    cache = model.expert_cache
    checks = []  # per check: (until: None at the forward's end, the layer that missed or None)
    check = verify.Verifier._check

    def counted(self, until=None, **kw):
        missed = check(self, until, **kw)
        checks.append((until, missed))
        return missed

    monkeypatch.setattr(verify.Verifier, "_check", counted)
    kv = make_prompt_cache(model)
    assert generate(model, tokenizer, evict=every_expert(cache, *layers), prompt_cache=kv) == want
    stats = cache.stats()
    assert stats["verified_tokens"] >= TOKENS - 2 and stats["replays"] >= 2 * len(layers)
    assert any(u is not None and m is not None for u, m in checks) or layers == [23]
    assert stats["verify"]["flags"] == costly
    ends = [m for u, m in checks if u is None]
    assert sum(m is None for m in ends) == stats["verified_tokens"]  # one clean check at the end of each step
    assert len(ends) <= stats["verified_tokens"] + stats["replays"]
    for ours, theirs in zip(kv, stock_kv):
        n = ours.offset
        assert n == theirs.offset
        for a, b in zip(ours.state[:2], theirs.state[:2]):
            assert mx.array_equal(a[..., :n, :], b[..., :n, :]).item()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_replay_starts_at_the_missed_layers_experts(checkpoint, monkeypatch, arch):
    """A replay takes the missed decoder layer's attention as its pass gave it (its KV cache
    not trimmed): in a step whose one replay is from that layer, its attention runs once, the
    next layer's twice; tokens and KV caches as stock's."""
    path = checkpoint(arch, config_overrides={"num_hidden_layers": 6})
    want, stock_kv = reference(path, prompt_cache=make_prompt_cache)
    model, tokenizer = all_but(path, 1)
    cache = model.expert_cache
    missed = cache.store.num_layers // 2  # (a MoE layer; deepseek_v3's first decoder layer is dense)
    d = cache.verifier.decoder_of[missed]
    calls = {m: [] for m in (d, d + 1)}  # per call of these decoder layers' attention: the tokens verified before
    base = type(model.layers[d].self_attn).__mro__[1]  # (mlx-lm's class, under the verifier's subclass)
    call = base.__call__

    def counted(self, *a, **kw):
        for m, log in calls.items():
            if self is model.layers[m].self_attn:
                log.append(cache.counters.verified_tokens)
        return call(self, *a, **kw)

    monkeypatch.setattr(base, "__call__", counted)
    replays, clear = [], verify.PassRouting.clear  # (tokens verified before, the decoder layer replayed from)

    def recorded(self, since=None, **kw):
        if since is not None:
            replays.append((cache.counters.verified_tokens, cache.verifier.decoder_of[since]))
        return clear(self, **({} if since is None else {"since": since}))

    monkeypatch.setattr(verify.PassRouting, "clear", recorded)
    kv = make_prompt_cache(model)
    assert generate(model, tokenizer, evict=every_expert(cache, missed), prompt_cache=kv) == want
    stats = cache.stats()
    # (every step replays from it but the prompt's last token's and the next, both built before
    # mlx-lm yields the first token, the first eviction)
    assert stats["verified_tokens"] >= TOKENS
    tokens = range(2, stats["verified_tokens"])
    assert all((t, d) in replays for t in tokens), replays
    alone = [t for t in tokens if [r for u, r in replays if u == t] == [d]]  # (other layers miss too: victims)
    assert len(alone) >= len(tokens) // 2, replays
    assert [calls[d].count(t) for t in alone] == [1] * len(alone), calls[d]
    assert [calls[d + 1].count(t) for t in alone] == [2] * len(alone), calls[d + 1]
    for ours, theirs in zip(kv, stock_kv):
        n = ours.offset
        assert n == theirs.offset
        for a, b in zip(ours.state[:2], theirs.state[:2]):
            assert mx.array_equal(a[..., :n, :], b[..., :n, :]).item()


def replays_from(monkeypatch):
    """The MoE layers replays start from, as they happen."""
    layers, clear = [], verify.PassRouting.clear

    def recorded(self, since=None, **kw):
        if since is not None:  # (a replay's: the forward's own clear() gives none)
            layers.append(since)
        return clear(self, **({} if since is None else {"since": since}))

    monkeypatch.setattr(verify.PassRouting, "clear", recorded)
    return layers


@COSTLY
@pytest.mark.parametrize("direct,evicted", [([0], [0]), ([5, 11], [3, 11]), ([23], [0, 23])])
def test_direct_layers_read_at_once(checkpoint, monkeypatch, direct, evicted, costly):
    """A Direct layer's routing is read as soon as it is built and its misses before its
    experts are: no replay from it; a miss at an earlier layer found there is replayed from
    that layer. Tokens and KV caches as stock's (24 decoder layers, `evicted` missing at
    every step)."""
    reads_cost(monkeypatch, costly)
    path = checkpoint("qwen3_moe", quant="4bit", config_overrides={"num_hidden_layers": 24})
    want, stock_kv = reference(path, prompt_cache=make_prompt_cache)
    model, tokenizer = all_but(path, 1)
    cache = model.expert_cache
    monkeypatch.setattr(verify.Direct, "at", lambda self, layer: layer in direct)
    cache.verifier.switch.direct.now = set(direct)
    replayed = replays_from(monkeypatch)
    kv = make_prompt_cache(model)
    assert generate(model, tokenizer, evict=every_expert(cache, *evicted), prompt_cache=kv, direct=True) == want
    stats = cache.stats()
    assert stats["verified_tokens"] >= TOKENS - 2 and stats["verify"]["direct"] == direct
    assert not set(replayed) & set(direct) and set(evicted) - set(direct) <= set(replayed), replayed
    assert stats["replays"] == len(replayed) and stats["misses"] >= stats["verified_tokens"] * len(evicted)
    for ours, theirs in zip(kv, stock_kv):
        n = ours.offset
        assert n == theirs.offset
        for a, b in zip(ours.state[:2], theirs.state[:2]):
            assert mx.array_equal(a[..., :n, :], b[..., :n, :]).item()


@COSTLY
@pytest.mark.parametrize("arch,predicting", [("qwen3_moe", "off"), ("deepseek_v3", "off"), ("qwen3_moe", "on")])
def test_held_direct_layers_are_read_in_place(checkpoint, monkeypatch, arch, predicting, costly):
    """A Direct layer, the last MoE layer of its decoder layer, is held where predicting is off
    or paused: its experts built from the tables, its routing read once the next decoder layer
    is built (at the forward's end for the last), before its experts are queued; a miss there
    is read into the slots the lookup then finds, with no replay. Where predicting is on, it is
    read as soon as it is built. Every layer Direct, a half cache whose placeholder holds NaN,
    layers missing at every step: stock's tokens and KV caches, no NaN in the logits."""
    from mlxmoe.caching import prefetch

    reads_cost(monkeypatch, costly)
    path = checkpoint(arch, config_overrides={"num_hidden_layers": 6})  # float weights: NaN would spread
    want, stock_kv = reference(path, prompt_cache=make_prompt_cache)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=None)
    total = model.expert_cache.capacity
    model.expert_runtime.close()
    kw = {"prefetch": 0} if predicting == "off" else {}
    model, tokenizer = mlxmoe.load(str(path), cache_experts=total // 2, **kw)
    cache, verifier = model.expert_cache, model.expert_cache.verifier
    if predicting == "on":
        assert cache.prefetcher is not None
        monkeypatch.setattr(prefetch.Worth, "step", lambda self, *a, **k: False)  # (never paused)
    else:
        assert cache.prefetcher is None
    for view in cache.pools.views:
        view[cache.capacity] = np.nan
    L = cache.store.num_layers
    monkeypatch.setattr(verify.Direct, "at", lambda self, layer: True)
    verifier.switch.direct.now = set(range(L))
    checks, check = [], verify.Verifier._check  # (the held layer, decoder layers built by then, misses read)

    def counted(self, until=None, held=None, **kw):
        misses = cache.counters.misses
        missed = check(self, until, held=held, **kw)
        if held is not None:
            checks.append((held, max(self.outputs, default=-1) + 1, cache.counters.misses - misses))
        return missed

    monkeypatch.setattr(verify.Verifier, "_check", counted)
    replayed, nan_seen = replays_from(monkeypatch), []

    def watch(tokens, logits):
        nan_seen.append(bool(mx.isnan(logits).any().item()))
        return logits

    kv = make_prompt_cache(model)
    evict = every_expert(cache, 0, L // 2, L - 1)
    assert generate(model, tokenizer, evict=evict, direct=True, prompt_cache=kv, logits_processors=[watch]) == want
    assert not any(nan_seen) and not replayed and cache.stats()["verified_tokens"] >= TOKENS - 2
    decoder_of = verifier.decoder_of
    if predicting == "off":  # (read once the next decoder layer is built)
        held = [decoder_of[m] + 2 if m < L - 1 else len(model.layers) for m, _, _ in checks]
    else:  # (read as soon as built: its decoder layer's output not yet there)
        held = [decoder_of[m] for m, _, _ in checks]
    assert [built for _, built, _ in checks] == held, [(c, h) for c, h in zip(checks, held) if c[1] != h][:5]
    assert sum(n for m, _, n in checks if m in (0, L // 2, L - 1)) >= 3 * (TOKENS - 2)
    for ours, theirs in zip(kv, stock_kv):
        n = ours.offset
        assert n == theirs.offset
        for a, b in zip(ours.state[:2], theirs.state[:2]):
            assert mx.array_equal(a[..., :n, :], b[..., :n, :]).item()


def test_a_layer_that_misses_at_every_step_turns_direct(checkpoint, monkeypatch):
    """A layer whose calls all miss (its experts taken out before each step) is replayed from
    until Direct has measured a replay and its share of misses outweighs a wait: from then
    on its routing is read at once, and no step replays from it; tokens as stock's. Layers
    that never miss are never direct (one missing at one step in five may be, where a replay
    costs five waits: on this small model it does)."""
    path = checkpoint("qwen3_moe", quant="4bit", config_overrides={"num_hidden_layers": 12})
    want, _ = reference(path)
    model, tokenizer = all_but(path, 1)
    cache = model.expert_cache
    replayed, steps = replays_from(monkeypatch), []
    first, rare = every_expert(cache, 0), every_expert(cache, 7)
    evict = lambda i: (steps.append(len(replayed)), first(i) + (rare(i) if i % 5 == 2 else []))[1]
    at = verify.Direct.at

    def five_waits(direct, layer):  # once a replay is measured, it costs five waits (timings on busy cores vary)
        direct.first_wait, direct.first_replay, direct.wait = (lambda: 1e-3), (lambda: None), 1e-3
        direct.replay = direct.replay and 5e-3
        return at(direct, layer)

    monkeypatch.setattr(verify.Direct, "at", five_waits)
    assert generate(model, tokenizer, evict=evict, direct=True) == want
    stats = cache.stats()
    assert stats["verified_tokens"] >= TOKENS - 2 and stats["verify"]["direct"][0] == 0, stats["verify"]
    assert set(stats["verify"]["direct"]) <= {0, 7} | set(replayed), stats["verify"]
    assert 1 <= replayed.count(0) <= 3 and 7 in replayed, replayed
    assert 0 not in replayed[steps[4]:], (replayed, steps)


def test_a_direct_check_guessed_dear_is_measured_by_a_probe():
    """Where a direct check is guessed dearer than any layer's misses cost in replays (the guess
    an empty round trip; a held check, overlapped with the host's building, cost ~0.3 ms on the
    host-bound bench at 1000 us, a replay ~2 ms), no layer is read directly until one is
    measured: after PROBE_STEPS verified steps without a direct check, the layer that misses
    most is read directly once; measured cheap, the layers whose misses outweigh it turn
    direct. Where no layer misses, nothing is probed."""
    direct = verify.Direct(4, lambda: 2e-3, lambda: 2e-3)
    direct.missing, direct.replay = [0.5, 0.2, 0.0, 0.3], 2e-3
    chosen = []
    for _ in range(verify.PROBE_STEPS):
        assert direct.stepped() == 0
        chosen.append(set(direct.now))
    assert chosen == [set()] * (verify.PROBE_STEPS - 1) + [{0}], chosen
    direct.waited(0.3e-3)  # (the probe's check, during the next step)
    assert direct.stepped() == 1
    assert direct.now == {0, 1, 3}
    clean = verify.Direct(4, lambda: 2e-3, lambda: 2e-3)
    for _ in range(4 * verify.PROBE_STEPS):
        clean.stepped()
        assert clean.now == set()


def test_verified_steps_go_on_after_a_rotating_cache_wraps(checkpoint, monkeypatch):
    """gpt_oss's sliding-window layers keep a RotatingKVCache that, once full, overwrites its
    oldest entry in place (is_trimmable() says no): one-token verified steps go on past
    that, a replay writing the same slot again. Every step misses (a layer's experts taken
    out before it): stock's tokens, every step verified and replayed."""
    from mlx_lm.models.cache import RotatingKVCache

    path = checkpoint("gpt_oss", config_overrides={"sliding_window": 4})
    want, _ = reference(path)
    model, tokenizer = all_but(path, 1)
    cache = model.expert_cache
    wrapped = []  # per verified step: whether a rotating cache had wrapped before it
    ready = verify.Verifier._ready

    def seen(self, args, kwargs):
        kv = ready(self, args, kwargs)
        if kv is not None:
            wrapped.append(any(isinstance(c, RotatingKVCache) and not c.is_trimmable() for c in kv))
        return kv

    monkeypatch.setattr(verify.Verifier, "_ready", seen)
    assert generate(model, tokenizer, evict=every_expert(cache, 1)) == want
    stats = cache.stats()
    assert sum(wrapped) >= TOKENS - 2, wrapped  # (the prompt is longer than the window)
    assert stats["verified_tokens"] >= TOKENS - 2 and stats["replays"] >= TOKENS - 2
    model.expert_runtime.close()


def test_steps_without_a_replay_never_turn_the_mode_off(monkeypatch):
    """Once the per-layer path is timed, a verified step weighs against it only where it
    replayed: steps without a replay, slower by the clock (0.05 s against 0.03 s on the
    per-layer path: a longer context, a busier machine), keep the mode on; two steps that
    replayed, as slow, turn it off."""
    monkeypatch.setattr(verify, "time", SimpleNamespace(perf_counter=lambda: 0.0))
    switch = verify.Switch(4, lambda: None)
    switch.layerwise = 0.03
    for _ in range(3 * verify.WEIGH_TOKENS):
        assert switch.step()
        assert not switch.verified(0.05, 0, 0, 4), switch.reason
    turned_off = [switch.verified(0.05, 1, 2, 4) for _ in range(verify.FIRST_WEIGH) if switch.step()]
    assert turned_off[-1] and "more than the 30.00 ms" in switch.reason, (turned_off, switch.reason)


def timed_after(monkeypatch, steps, per_layer):
    """A Switch after verified `steps` [(seconds, replays, missed)], then, off to time the per-layer
    path (as a re-timing turns it off), MEASURED_OFF steps on it that miss, `per_layer` s each."""
    clock = [0.0]
    monkeypatch.setattr(verify, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    cache = SimpleNamespace(counters=SimpleNamespace(read_seconds=0.0, misses=0, prefetch_useful=0))
    switch = verify.Switch(4, lambda: None)
    switch.wait = 1.0  # (waits priced dear: the replays keep the mode on till the timing)
    for seconds, replays, missed in steps:
        assert switch.step()
        assert not switch.verified(seconds, replays, 2 * replays, 4, missed), switch.reason
    switch.off_until = switch.steps + verify.MEASURED_OFF

    def step_that_misses():
        clock[0] += per_layer
        cache.counters.misses += 1
    for _ in range(verify.MEASURED_OFF):
        assert not switch.step()
        switch.timed(cache, step_that_misses, (), {})
    return switch


@pytest.mark.parametrize("replayed, per_layer", [(False, 0.03), (True, 0.03), (True, 0.038)])
def test_a_timing_that_the_verified_steps_lose_by_far_keeps_the_mode_off(monkeypatch, replayed, per_layer):
    """Off only to time the per-layer path, the mode stays off for the stretch (OFF_STEPS) where
    the verified steps (0.05 s each, each with a replay) cost STAY_OFF times that path's steps
    (0.03 s); it is on again after those MEASURED_OFF steps, to be weighed, where they cost less
    than that (0.038 s: 1.3x), or where they replayed nothing (weighed as a tie, as weigh() does)."""
    switch = timed_after(monkeypatch, [(0.05, int(replayed), None)] * verify.WEIGH_TOKENS, per_layer)
    stays_off = replayed and 0.05 > verify.STAY_OFF * per_layer
    assert switch.step() is not stays_off, switch.reason
    if stays_off:
        assert switch.off_until == verify.WEIGH_TOKENS + verify.MEASURED_OFF + verify.OFF_STEPS, switch.off_until
        assert "a verified step took 50.00 ms, more than the 30.00 ms" in switch.reason, switch.reason


@pytest.mark.parametrize("told", [True, False])
def test_steps_that_read_at_direct_layers_weigh_as_steps_that_missed(monkeypatch, told):
    """Where Direct layers read a step's misses, few verified steps replay: off to time the
    per-layer path (its steps all miss, 0.05 s each), a verified step that missed weighs as those
    that missed took (0.04 s, read at a Direct layer), not as the one replay (0.09 s, STAY_OFF
    times that path's): on again after MEASURED_OFF steps. Told only of the replays (`missed`
    not given), the one replay stands for every step that misses: off for the stretch."""
    missed = True if told else None
    steps = [(0.09, 1, missed)] + [(0.04, 0, missed)] * (verify.WEIGH_TOKENS - 1)
    switch = timed_after(monkeypatch, steps, 0.05)
    assert switch.step() is told, switch.reason
    assert ("on again: a step would take 50.00 ms on the per-layer path" if told else
            "a verified step took 90.00 ms, more than the 50.00 ms") in switch.reason, switch.reason


@pytest.mark.parametrize("told", [True, False])
def test_steps_that_read_at_direct_layers_weigh_against_the_steps_that_missed(monkeypatch, told):
    """Once the per-layer path is timed (its steps all miss, 0.054 s each), a verified step that
    missed and read at a Direct layer (0.046 s, no replay) weighs against that path's steps that
    missed, and what it saves outweighs a replay's cost beyond them (0.10 s, one step in eight):
    the mode stays on. Weighed as ties (`missed` not given), the replays alone turn it off."""
    monkeypatch.setattr(verify, "time", SimpleNamespace(perf_counter=lambda: 0.0))
    switch = verify.Switch(4, lambda: None)
    switch.layerwise = switch.layerwise_missed = 0.054
    turned_off = False
    for i in range(3 * verify.WEIGH_TOKENS):
        assert switch.step()
        replays = int(i % 8 == 7)
        turned_off = switch.verified(0.10 if replays else 0.046, replays, 2 * replays, 4, True if told else None)
        if turned_off:
            break
    assert turned_off is not told, switch.reason


@pytest.mark.parametrize("per_layer", [0.03, 0.045])
def test_steps_a_little_costlier_are_weighed_longer(monkeypatch, per_layer):
    """Verified steps that replayed, against the per-layer path's: CLEARLY_WORSE times costlier
    (0.05 s against 0.03 s: a disk's reads behind the replays) turn the mode off after
    FIRST_WEIGH steps; a little costlier (against 0.045 s: a step's replays vary) after
    WEIGH_TOKENS steps, not on a few steps' noise."""
    runs = switch_runs(monkeypatch, 2 * verify.WEIGH_TOKENS, per_layer, itertools.repeat(1), layerwise=per_layer)
    assert 0.05 > per_layer * verify.CLEARLY_WORSE if per_layer < 0.04 else 0.05 < per_layer * verify.CLEARLY_WORSE
    assert runs[0] == (True, verify.FIRST_WEIGH if per_layer < 0.04 else verify.WEIGH_TOKENS), runs
    assert runs[1][0] is False


def test_steps_off_that_miss_less_often_turn_the_mode_on_again(monkeypatch):
    """Off after verified steps that all replayed (a prompt's first, at a cold cache), the mode
    is on again where the share of steps on the per-layer path that miss falls MISSING_FELL
    times below theirs (the cache warmed: their cost dates from then): here at the second of two
    clean steps after one that used an expert a prefetch read."""
    misses = iter([1] * (verify.MEASURED_OFF + 3) + [0, 2, 0, 0] + [1] * 100)
    runs = switch_runs(monkeypatch, verify.FIRST_WEIGH + verify.MEASURED_OFF + 7 + verify.FIRST_WEIGH, 0.03, misses,
                       layerwise=0.03)
    assert runs[:3] == [(True, verify.FIRST_WEIGH), (False, verify.MEASURED_OFF + 3 + 4),
                        (True, verify.FIRST_WEIGH)], runs


def test_a_near_tie_keeps_the_mode_on(monkeypatch):
    """Verified steps that replayed, a little costlier than the per-layer path's (0.05 s against
    0.047 s: less than CLOSE times), keep the mode on: a near tie is the clock's noise, and a
    turn off costs that path's timing and host work."""
    assert 0.05 < 0.047 * verify.CLOSE
    runs = switch_runs(monkeypatch, 3 * verify.WEIGH_TOKENS, 0.047, itertools.repeat(1), layerwise=0.047)
    assert runs == [(True, 3 * verify.WEIGH_TOKENS)], runs


def switch_runs(monkeypatch, steps, per_layer, misses, layerwise=None, wait=1e-9, settled=lambda: True):
    """A Switch over `steps` decode steps, each verified at 0.05 s with a replay where the
    mode is on, else on the per-layer path at `per_layer` s (or what it returns each step),
    next(misses) telling what it met (0 nothing, 1 a miss, 2 an expert a prefetch read; a
    clock of their own), a wait of that path priced at `wait` s before it is timed, predicting
    settled where `settled()`: [(on, steps in a row)]."""
    clock = [0.0]
    monkeypatch.setattr(verify, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    cache = SimpleNamespace(counters=SimpleNamespace(read_seconds=0.0, misses=0, prefetch_useful=0))
    switch = verify.Switch(4, lambda: None, settled=settled)
    switch.wait, switch.layerwise = wait, layerwise

    def step_on_the_per_layer_path():
        clock[0] += per_layer() if callable(per_layer) else per_layer
        counted = next(misses)  # a miss, or (2) an expert a prefetch read
        cache.counters.misses += counted == 1
        cache.counters.prefetch_useful += counted == 2
    ons = []
    for _ in range(steps):
        on = switch.step()
        if on:
            switch.verified(0.05, 1, 2, 4)
        else:
            switch.timed(cache, step_on_the_per_layer_path, (), {})
        ons.append(on)
    return [(on, len(list(run))) for on, run in itertools.groupby(ons)]


def test_steps_off_that_miss_nothing_turn_the_mode_on_again(monkeypatch):
    """Off after replays that cost more than the per-layer path (0.05 s a verified step with a
    replay against 0.03 s), the mode is on again once MEASURED_OFF steps in a row on the
    per-layer path miss nothing (verified, they would have replayed nothing), not after the
    doubled OFF_STEPS; a step that misses, or uses an expert a prefetch read, starts the count again
    (the share of steps that miss, compared with the verified steps', left out: MISSING_FELL)."""
    monkeypatch.setattr(verify, "MISSING_FELL", 1e9)
    misses = iter([1] * (verify.MEASURED_OFF + 3) + [0] * (verify.MEASURED_OFF - 1) + [2] + [0] * 100)
    runs = switch_runs(monkeypatch, 4 * verify.MEASURED_OFF + verify.FIRST_WEIGH + 6, 0.03, misses, layerwise=0.03)
    # off at the first weighing; MEASURED_OFF + 3 steps that miss, MEASURED_OFF - 1 that do
    # not, one that uses a prefetched expert, then MEASURED_OFF that miss nothing: on again (32 off before)
    off = verify.MEASURED_OFF + 3 + verify.MEASURED_OFF - 1 + 1 + verify.MEASURED_OFF
    assert runs[:3] == [(True, verify.FIRST_WEIGH), (False, off), (True, verify.FIRST_WEIGH)], runs
    assert off < verify.OFF_STEPS


@pytest.mark.parametrize("per_layer", [0.03, 0.08])
def test_a_first_guess_that_keeps_the_mode_on_times_the_per_layer_path_all_the_same(per_layer, monkeypatch):
    """Waits priced dear (0.1 s each: a wait of the per-layer path holds the device's work too)
    keep the mode on at the first weighing, but steps replayed: the per-layer path is timed
    for MEASURED_OFF steps all the same once WARM_STEPS steps went by, then weighed against
    them: off for twice OFF_STEPS more where its steps were STAY_OFF times faster (0.03 s
    against verified steps of 0.05 s), on for good where slower (0.08 s)."""
    steps = verify.WARM_STEPS + verify.MEASURED_OFF + verify.FIRST_WEIGH + 2 * verify.OFF_STEPS + 4
    runs = switch_runs(monkeypatch, steps, per_layer, itertools.repeat(1), wait=0.1)
    first = [(True, verify.WARM_STEPS), (False, verify.MEASURED_OFF)]  # (a cold cache's first steps left out)
    if per_layer > 0.05:
        assert runs == first + [(True, steps - verify.WARM_STEPS - verify.MEASURED_OFF)], runs
    else:
        assert runs[:3] == [(True, verify.WARM_STEPS), (False, verify.MEASURED_OFF + 2 * verify.OFF_STEPS),
                            (True, verify.FIRST_WEIGH)], runs


@pytest.mark.parametrize("settling", [3, 1000])
def test_the_per_layer_path_is_timed_once_predicting_settled(settling, monkeypatch):
    """While predicting has not settled whether it pays (prefetch.Worth), the per-layer path's
    steps carry its host work (0.2 s a step here, against 0.03 s once it paused) and are not
    timed: the mode stays off through them, then MEASURED_OFF steps are timed, STAY_OFF
    times faster than the verified steps (0.05 s): off for twice OFF_STEPS more. Timed with
    them, the mode would be on again. Where predicting never settles, it is timed after
    MOST_SETTLING steps all the same."""
    per_layer_steps = [0]

    def per_layer():
        per_layer_steps[0] += 1
        return 0.2 if per_layer_steps[0] <= settling else 0.03
    settled = lambda: per_layer_steps[0] >= settling  # noqa: E731
    steps = verify.FIRST_WEIGH + verify.MOST_SETTLING + verify.MEASURED_OFF + 2 * verify.OFF_STEPS + 4
    runs = switch_runs(monkeypatch, steps, per_layer, itertools.repeat(1), settled=settled)
    if settling == 3:
        assert runs[:3] == [(True, verify.FIRST_WEIGH), (False, settling + verify.MEASURED_OFF + 2 * verify.OFF_STEPS),
                            (True, verify.FIRST_WEIGH)], runs
    else:  # (0.2 s a step timed: slower than verified steps, on for good)
        assert runs == [(True, verify.FIRST_WEIGH), (False, verify.MOST_SETTLING + verify.MEASURED_OFF),
                        (True, steps - verify.FIRST_WEIGH - verify.MOST_SETTLING - verify.MEASURED_OFF)], runs


def test_a_step_that_replayed_weighs_against_the_per_layer_steps_that_missed(monkeypatch):
    """The per-layer path's steps that read cost more than those that hit (0.07 s against 0.02 s
    here: a miss's host work after each wait). A verified step that replayed (0.05 s) weighs
    against the former: the mode stays on after that path is timed, until it is timed again
    (OFF_STEPS later: the two were close); against the mean of all its steps (0.048 s) it would
    be off at the first weighing."""
    timings, misses = itertools.cycle([0.07, 0.02]), itertools.cycle([1, 0])
    steps = verify.WARM_STEPS + 2 * verify.MEASURED_OFF + verify.OFF_STEPS
    runs = switch_runs(monkeypatch, steps, lambda: next(timings), misses, wait=0.1)
    assert runs == [(True, verify.WARM_STEPS), (False, verify.MEASURED_OFF), (True, verify.OFF_STEPS),
                    (False, verify.MEASURED_OFF)], runs


def test_a_step_without_a_replay_weighs_against_the_per_layer_steps_that_hit(monkeypatch):
    """Where the per-layer path's steps that hit cost more than a verified one (0.06 s against
    0.03 s: that path's waits), a verified step without a replay weighs as they do: replays
    that cost more than that path's misses (0.05 s against 0.03 s), one step in two, keep the
    mode on, the waits spared outweighing them; weighed as ties, they would turn it off."""
    clock = [0.0]
    monkeypatch.setattr(verify, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    cache = SimpleNamespace(counters=SimpleNamespace(read_seconds=0.0, misses=0, prefetch_useful=0))
    switch = verify.Switch(4, lambda: None)
    switch.wait = 0.1  # (waits priced dear: on until the per-layer path is timed, after WARM_STEPS)

    def step_on_the_per_layer_path(missing):
        clock[0] += 0.03 if missing else 0.06
        cache.counters.misses += missing
    ons = []
    for i in range(verify.WARM_STEPS + verify.MEASURED_OFF + 4 * verify.WEIGH_TOKENS):
        on = switch.step()
        if on:
            switch.verified(0.05 if i % 2 else 0.03, i % 2, 2 * (i % 2), 4)
        else:
            switch.timed(cache, step_on_the_per_layer_path, (i % 2,), {})
        ons.append(on)
    runs = [(on, len(list(run))) for on, run in itertools.groupby(ons)]
    assert runs == [(True, verify.WARM_STEPS), (False, verify.MEASURED_OFF),
                    (True, 4 * verify.WEIGH_TOKENS)], (runs, switch.reason)


@pytest.mark.parametrize("first", [0.052, 0.08])
def test_the_per_layer_path_is_timed_again_while_steps_replay(first, monkeypatch):
    """A first timing of the per-layer path slower than the verified steps (a cold cache's
    tokens) keeps the mode on, not for good while steps replay: that path is timed again
    OFF_STEPS steps later where the two were close (0.052 s against verified steps of 0.05 s),
    RETIME_STEPS later where not (0.08 s); timed again at 0.03 s, it wins STAY_OFF times
    over and the mode stays off for OFF_STEPS more, then turns off again at the first weighing."""
    timings = iter([first] * verify.MEASURED_OFF + [0.03] * 1000)
    steps = verify.WARM_STEPS + 2 * verify.MEASURED_OFF + verify.RETIME_STEPS + 3 * verify.WEIGH_TOKENS
    runs = switch_runs(monkeypatch, steps, lambda: next(timings), itertools.repeat(1), wait=0.1)
    on_for = verify.OFF_STEPS if first < 0.05 * verify.CLOSE else verify.RETIME_STEPS
    assert runs[:2] == [(True, verify.WARM_STEPS), (False, verify.MEASURED_OFF)], runs
    # on until the first weighing past the re-time's step, timed again, then weighed against it: off
    assert runs[2][0] and on_for <= runs[2][1] < on_for + verify.WEIGH_TOKENS, runs
    assert runs[3] == (False, verify.MEASURED_OFF + verify.OFF_STEPS) and runs[4] == (True, verify.FIRST_WEIGH), runs
    assert runs[5][0] is False, runs


@pytest.mark.parametrize("timed_again", [0.108, 0.04])
def test_a_stale_timing_is_taken_again_before_the_mode_turns_off(timed_again, monkeypatch):
    """The per-layer path timed at 0.06 s a step against verified steps of 0.05 s: on. More
    than FRESH_STEPS steps later the machine slows down (verified steps of 0.09 s, each with a
    replay): they are not weighed against that stale timing (off for OFF_STEPS) but the path
    is timed again, MEASURED_OFF steps. Slowed as much (0.108 s), the mode is on again after
    those; found faster all the same (0.04 s), it stays off for the stretch."""
    clock = [0.0]
    monkeypatch.setattr(verify, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    cache = SimpleNamespace(counters=SimpleNamespace(read_seconds=0.0, misses=0, prefetch_useful=0))
    switch = verify.Switch(4, lambda: None)
    switch.wait = 0.1  # (waits priced dear: on until the per-layer path is timed, after WARM_STEPS)
    slow_from = verify.WARM_STEPS + verify.MEASURED_OFF + verify.FRESH_STEPS + verify.WEIGH_TOKENS
    timings = iter([0.06] * verify.MEASURED_OFF + [timed_again] * 1000)

    def step_on_the_per_layer_path():
        clock[0] += next(timings)
        cache.counters.misses += 1
    ons = []
    for i in range(slow_from + verify.FIRST_WEIGH + verify.MEASURED_OFF + verify.OFF_STEPS + 2):
        on = switch.step()
        if on:
            switch.verified(0.05 if i < slow_from else 0.09, 1, 2, 4)
        else:
            switch.timed(cache, step_on_the_per_layer_path, (), {})
        ons.append(on)
        if i == slow_from + verify.FIRST_WEIGH - 1:
            assert "timed again: its timing" in switch.reason, switch.reason
    runs = [(on, len(list(run))) for on, run in itertools.groupby(ons)]
    assert runs[:2] == [(True, verify.WARM_STEPS), (False, verify.MEASURED_OFF)], runs
    assert runs[2] == (True, slow_from - verify.WARM_STEPS - verify.MEASURED_OFF + verify.FIRST_WEIGH), runs
    if timed_again > 0.09:
        assert runs[3] == (False, verify.MEASURED_OFF) and runs[4][0], (runs, switch.reason)
    else:
        assert runs[3] == (False, verify.MEASURED_OFF + verify.OFF_STEPS), (runs, switch.reason)


@pytest.mark.parametrize("per_layer", [0.03, 0.08])
def test_a_first_guess_turns_the_mode_off_only_to_time_the_per_layer_path(per_layer, monkeypatch):
    """The first weighing prices the per-layer path by an empty round trip (here free): off on
    it, the mode is off for the MEASURED_OFF steps that time that path, then weighed against
    them: on for good where the per-layer steps took longer (0.08 s against verified steps of
    0.05 s); where they were STAY_OFF times faster (0.03 s), off for twice OFF_STEPS more
    (not tried again at once: a disk's reads would wait behind the replays)."""
    steps = verify.FIRST_WEIGH + verify.MEASURED_OFF + 2 * verify.OFF_STEPS + 4
    # (a miss in each per-layer step: steps that miss nothing would turn it on again)
    runs = switch_runs(monkeypatch, steps, per_layer, itertools.repeat(1))
    first = [(True, verify.FIRST_WEIGH), (False, verify.MEASURED_OFF)]
    if per_layer > 0.05:
        assert runs == first + [(True, steps - verify.FIRST_WEIGH - verify.MEASURED_OFF)], runs
    else:
        assert runs[:3] == [(True, verify.FIRST_WEIGH), (False, verify.MEASURED_OFF + 2 * verify.OFF_STEPS),
                            (True, verify.FIRST_WEIGH)], runs


def test_the_lag_rises_again_after_each_retry():
    """Where every check waits, the lag rises to LAG, drops to MIN_LAG after LAG_RETRY checks
    above it, and rises to LAG again: each retry counts its own checks."""
    lag = verify.Lag(wait=0.0)
    seen = []
    for _ in range(3 * verify.LAG_RETRY):
        lag.checked(1.0)
        seen.append(lag.layers)
    drops = [i for i in range(1, len(seen)) if seen[i] < seen[i - 1]]
    assert len(drops) == 2, drops
    assert all(seen[i + len(verify.LAGS)] == verify.LAG for i in drops)
