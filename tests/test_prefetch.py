"""Prefetch never changes output, never reads an expert twice, survives IO errors in
its workers, and its predictors are scored."""

import dataclasses
import itertools
import threading

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

import mlxmoe
from mlxmoe.backend import detect
from mlxmoe.caching.prefetch import ReadBar
from mlxmoe.errors import MlxmoeError
from mlxmoe.workload.trace import predictor_scores

PROMPT = "The quick brown fox jumps over the lazy dog. Il gatto"


def reference(path, tokens=32):
    model, tokenizer = mlx_lm.load(str(path))
    detect().apply_dtype_policy(model)
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=tokens)]


def tokens(model, tokenizer, n=32):
    return [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=n)]


@pytest.fixture
def always_predicting(monkeypatch):
    """Decode steps predict whatever it costs (prefetch.Worth never pauses them): for tests
    of what the predictions count, which a pause timed on this machine would cut short."""
    from mlxmoe.caching.prefetch import Worth

    monkeypatch.setattr(Worth, "WARMUP", 10**9)


class OpenBar(ReadBar):
    """A bar every guess clears (the bar itself: test_guesses_are_read_only_where_they_can_pay)."""

    def __call__(self, steps):
        return 0.0


def read_every_guess(prefetcher):
    """Every router guess loaded (random weights guess badly), however the machine's load
    times reads and layers (the bar's pacing is still measured, not obeyed)."""
    prefetcher.confidence = 0.0
    prefetcher.bar.__class__ = OpenBar


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_prefetch_keeps_output_and_loads_ahead(checkpoint, arch):
    # (here and in the tests of the per-layer path's prefetcher and running ahead: verify=False,
    # as a verified decode step calls no predictor; tests/test_verify.py tests that path)
    path = checkpoint(arch, quant="4bit")
    want = reference(path)
    for depth in (1, 2):
        model, tokenizer = mlxmoe.load(str(path), cache_experts=8, prefetch=depth, verify=False)
        pf = model.expert_cache.prefetcher
        read_every_guess(pf)
        assert tokens(model, tokenizer) == want
        pf.drain()
        s = model.expert_cache.stats()
        assert s["loads_prefetched"] > 0
        assert "router" in s["predictors"] and 0 <= s["predictors"]["router"]["precision"] <= 1
        assert s["bytes_read"] == (s["loads_demand"] + s["loads_prefetched"]) * model.expert_cache.store.expert_file_bytes()


def test_no_expert_is_read_twice(checkpoint):
    """Between two reads of the same expert it must have been evicted: a demand read never
    repeats a background read in flight, and the other way round."""
    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = mlxmoe.load(str(path), cache_experts=10, prefetch=2)
    cache = model.expert_cache
    log, lock = [], threading.Lock()
    read = cache.store.read_expert

    def logged_read(layer, expert, outs, **kw):
        with lock:
            log.append(("read", (layer, expert)))
        return read(layer, expert, outs, **kw)

    evicted = cache.evicted

    def logged_evict(key):
        log.append(("evict", key))  # called under the cache's lock
        evicted(key)

    cache.store.read_expert, cache.evicted = logged_read, logged_evict
    tokens(model, tokenizer, 48)
    cache.prefetcher.drain()
    resident = set()
    for what, key in log:
        if what == "read":
            assert key not in resident, f"{key} read again while resident"
            resident.add(key)
        else:
            resident.discard(key)
    s = cache.stats()  # a background read cancelled part way (its layer call came without it) is no load
    assert sum(w == "read" for w, _ in log) == s["loads_demand"] + s["loads_prefetched"] + s["prefetch_cancelled"]


def test_a_guess_whose_layer_call_arrives_mid_check_is_kept(checkpoint):
    """A background read asks whether it is still wanted before each piece, reading the
    decode thread's state without its lock. Its layer call arriving in the middle of that
    check (at either of its reads) leaves the read going, not cancelled into a demand read
    that no miss counted."""
    path = checkpoint("qwen3_moe", quant="4bit")
    model, _ = mlxmoe.load(str(path), cache_experts=8, prefetch=1, verify=False)
    cache, loader = model.expert_cache, model.expert_cache.loader
    cache.prewarm_done()
    layer = 1
    key = next((layer, e) for e in range(cache.store.num_experts) if (layer, e) not in cache.slot_of)
    cache.current_layer, until = layer - 1, (cache.counters.tokens, layer)
    arrived = []

    def arrive():  # what the decode thread's fetch does under its lock: active keys, then the layer
        if not arrived:
            arrived.append(True)
            cache.active = {key}
            cache.current_layer = layer

    class ArrivingAfterThisRead(set):
        def __contains__(self, k):
            found = set.__contains__(self, k)
            arrive()
            return found

    reached = loader.reached
    loader.reached = lambda at: (arrive(), reached(at))[1]
    cache.active = ArrivingAfterThisRead()
    with cache.lock:
        (_, slot), = loader.claim([key], evict=True)
    before = cache.stats()
    loader.load(key, slot, until)
    after = cache.stats()
    assert arrived and key not in loader.failed and cache.slot_of[key] == slot
    assert after["loads_prefetched"] == before["loads_prefetched"] + 1 and after["loads_demand"] == before["loads_demand"]


def test_failed_background_read_falls_back_to_a_demand_read(checkpoint):
    path = checkpoint("qwen3_moe", quant="4bit")
    want = reference(path)
    # (verify=False: every decode step through the prefetcher, none reading its guesses itself)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, verify=False)
    store = model.expert_cache.store
    read = store.read_expert

    def failing_in_workers(layer, expert, outs, **kw):
        if threading.current_thread().name.startswith("mlxmoe-prefetch"):
            raise MlxmoeError(f"reading {store.files[0]} at offset 123: injected")
        return read(layer, expert, outs, **kw)

    store.read_expert = failing_in_workers
    assert tokens(model, tokenizer) == want
    assert model.expert_cache.stats()["loads_prefetched"] == 0


def test_unreadable_shard_gives_a_clear_error_not_a_hang(checkpoint, tmp_path):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(checkpoint("qwen3_moe", quant="4bit"), path)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8)
    store = model.expert_cache.store
    shard = store.files[0]
    with open(shard, "r+b") as f:  # the file shrinks under the running model
        f.truncate(shard.stat().st_size // 2)
    result = {}

    def run():
        try:
            tokens(model, tokenizer)
        except MlxmoeError as e:
            result["error"] = str(e)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "decoding hung after a failed read"
    assert str(shard) in result["error"] and "offset" in result["error"]


def test_predictor_precision_on_a_recorded_trace(tmp_path):
    # layer 0 repeats its experts every token; layer 1 alternates between two sets
    records = []
    for t in range(10):
        records.append((0, t, 0, [1, 2], None))
        records.append((0, t, 1, [3, 4] if t % 2 else [5, 6], None))
    prior = [[0, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0]]
    scores = predictor_scores(records, prior)
    # previous token: layer 0 always right (9 of 9), layer 1 always wrong (0 of 9)
    assert scores["previous_token"]["precision"] == pytest.approx(0.5)
    # profile: layer 0 always right (10), layer 1 right on odd tokens (5 of 10)
    assert scores["profile"]["precision"] == pytest.approx(15 / 20)


def test_cross_token_prefetch_loads_the_first_layer(checkpoint):
    """The last layer predicts the next token's layer 0, which is loaded in the background."""
    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, verify=False)
    cache = model.expert_cache
    read_every_guess(cache.prefetcher)
    read, layers, lock = cache.store.read_expert, [], threading.Lock()

    def logged_read(layer, expert, outs, **kw):
        if threading.current_thread().name.startswith("mlxmoe-prefetch"):
            with lock:
                layers.append(layer)
        return read(layer, expert, outs, **kw)

    cache.store.read_expert = logged_read
    tokens(model, tokenizer)
    cache.prefetcher.drain()
    assert 0 in layers
    assert 0 <= cache.stats()["predictors"]["router_next_token"]["precision"] <= 1


def test_rank_chances_count_what_the_router_predictor_counts(checkpoint):
    """The chance of each router guess rank is measured on the same predictions that
    score the `router` predictor, counting only the guesses that were not resident (the
    ones a read would be for): its top-k ranks one layer ahead add up to at most its
    counts, and to fewer guesses where some were resident (counted from the decode steps
    on: the prompt's tokens counted before are no decode step's predictions)."""
    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, verify=False)
    pf = model.expert_cache.prefetcher
    pf.off_thread = False
    after_prompt, observe = [], pf.observe

    def observed(layer, experts, decode=True, rows=None, **kw):
        observe(layer, experts, decode, rows, **kw)
        if not decode:
            after_prompt[:] = [pf.rank_counts.copy()]

    pf.observe = observed
    tokens(model, tokenizer)
    pf.drain()
    k = pf.top_k
    assert (after_prompt[0][0, 1:, :, 1] > 16).all()  # the prompt's tokens scored every rank of layers 1..
    same_token = (pf.rank_counts - after_prompt[0])[0, 1:, :k]  # layers 1.. are predicted within the token
    correct, guessed = same_token[..., 0].sum(), same_token[..., 1].sum()
    assert 0 <= correct <= pf.counts["router"][0]
    assert 0 < guessed < pf.counts["router"][1]  # 8 slots for 3 layers x 8 experts: some guesses were resident
    assert correct <= guessed
    assert pf.rank_counts[0, 0, :, 1].sum() > 16 * pf.rank_counts.shape[2]  # layer 0: from the last layer


def test_claim_asks_worth_and_never_evicts_protected():
    from mlxmoe.caching.cache import Residency
    from mlxmoe.caching.policies import make_policy
    from mlxmoe.caching.prefetch import outranks

    r = Residency(4, make_policy("activation", 4, 2, 8))
    for t in range(6):  # layer 0 uses 0 and 1 every token, layer 1 uses 0 and 1 once
        r.tick(1)
        r.access(0, [0, 1])
        r.access(1, [0, 1] if t == 0 else [2, 3])
    protected = {(1, 2), (1, 3)}
    likely = {(0, 5): 1e-3, (0, 6): 0.99}
    beats_victim = outranks(r.policy, likely)
    assert r.claim([(0, 5)], protected, evict=True, beats_victim=beats_victim) == []  # worth less than any victim
    assert len(r.slot_of) == 4
    taken = r.claim([(0, 6)], protected, evict=True, beats_victim=beats_victim)
    assert [k for k, _ in taken] == [(0, 6)]
    assert protected <= r.slot_of.keys()
    assert r.claim([(0, 7)], set(r.slot_of), evict=True) == []  # everything protected: nothing evicted
    assert outranks(make_policy("lru", 4, 2, 8), likely) is None


def test_prefetch_with_a_policy_without_estimates_keeps_output(checkpoint):
    path = checkpoint("qwen3_moe", quant="4bit")
    want = reference(path)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, policy="lru")
    read_every_guess(model.expert_cache.prefetcher)
    assert tokens(model, tokenizer) == want
    model.expert_cache.prefetcher.drain()
    assert model.expert_cache.stats()["loads_prefetched"] > 0


def test_min_chance_follows_the_disks_occupancy():
    """An idle disk lets guesses down to the floor be read; a disk busy over 80 % of each
    decode step raises the bar (to at most max_chance, 0.25); a stats reset is no load."""
    from mlxmoe.caching.prefetch import Prefetcher

    pf = Prefetcher(None, [None, None], 2, workers=2, min_chance=0.1, chance_floor=0.05)
    try:
        pf.bar.pace(0.0, 0.0)
        pf.bar.pace(1.0, 0.1)  # the disk busy 0.1 s of a 1 s step: 10 %
        assert pf.bar.min_chance == pytest.approx(0.1 / 1.5)
        pf.bar.pace(2.0, 0.2)
        assert pf.bar.min_chance == 0.05  # not below the floor
        pf.bar.pace(3.0, 0.2 + 0.9)  # 90 % busy
        assert pf.bar.min_chance == pytest.approx(0.075)
        pf.bar.pace(4.0, 1.1 + 0.6)  # 60 %: between the targets, unchanged
        assert pf.bar.min_chance == pytest.approx(0.075)
        for t in range(5, 15):
            pf.bar.pace(float(t), 1.7 + 1.0 * (t - 4))  # always busy
        assert pf.bar.min_chance == 0.25
        pf.bar.pace(15.0, 0.0)  # the cache's stats were reset: no step measured
        assert pf.bar.min_chance == 0.25
    finally:
        pf.close()


def test_background_reads_are_timed_for_pacing(checkpoint):
    """The disk's busy time, which paces the guesses, counts the background reads too."""
    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, prefetch=0)
    cache = model.expert_cache
    tokens(model, tokenizer, 8)
    demand_only = cache.stats()["disk_busy_seconds"]
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, verify=False)
    cache = model.expert_cache
    read_every_guess(cache.prefetcher)
    read = cache.store.read_expert
    busy = []

    def logged_read(layer, expert, outs, pace=None, **kw):
        if pace is not None:  # a background read: the gate counts the disk busy while it runs
            before = cache.loader.gate.busy_seconds()
            n = read(layer, expert, outs, pace=pace, **kw)
            busy.append(cache.loader.gate.busy_seconds() > before)
            return n
        return read(layer, expert, outs, **kw)

    cache.store.read_expert = logged_read
    tokens(model, tokenizer, 8)
    cache.prefetcher.drain()
    assert demand_only > 0 and cache.counters.loads_prefetched > 0
    assert busy and all(busy)
    bar = cache.prefetcher.bar
    assert bar.chance_floor <= bar.min_chance <= bar.max_chance


def test_coactivation_counts_what_consecutive_layer_calls_used(checkpoint, tmp_path, always_predicting):
    """The co-activation matrix holds, for every decode step, the experts of each layer
    call against those of the next one (past the last layer: the next token's first),
    as the trace of the same run shows them; and the predictor is scored."""
    import numpy as np

    from mlxmoe.workload.trace import layer_calls, read_trace

    path = checkpoint("qwen3_moe", quant="4bit")
    trace = tmp_path / "run.trace.jsonl"
    # (verify=False: every decode step through the prefetcher, which verified steps never call)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, trace_out=str(trace), verify=False)
    cache = model.expert_cache
    tokens(model, tokenizer, 12)
    cache.prefetcher.drain()
    pf = cache.prefetcher
    cache.close()
    header, records = read_trace(trace)
    L, E = header["num_layers"], header["num_experts"]
    experts = {(t, l): e for _, t, l, e, *_ in records}
    # single-token layer calls are the decode steps (mlx-lm runs the prompt's last token alone too)
    decode = [call[0][1:4] for call in layer_calls(records, L) if len(call) == 1]
    want = np.zeros((L, E, E))
    for t, l, used in decode:
        source = experts[(t, l - 1)] if l else experts[(t - 1, L - 1)]
        want[(l - 1) % L][np.ix_(sorted(set(source)), sorted(set(used)))] += 1
    assert len(decode) >= 11 * L and want.sum() > 0
    np.testing.assert_array_equal(pf.coactive, want)
    assert 0 <= cache.stats()["predictors"]["coactivation"]["precision"] <= 1


def test_a_layer_whose_misses_prefetch_hides_gives_up_slots_first():
    """The victim is the expert with the largest expected time to next use over its
    layer's miss cost: lowering one layer's cost moves the victim there."""
    from mlxmoe.caching.cache import Residency
    from mlxmoe.caching.policies import make_policy

    r = Residency(6, make_policy("activation", 6, 2, 8))
    for t in range(4):
        r.tick(1)
        r.access(0, [0, 1, 2] if t % 2 else [0, 3, 4])
        r.access(1, [0, 1, 2])
    layer, _ = r.policy.victim(set())
    other = 1 - layer
    r.policy.estimate.miss_cost[other] = 1e-3
    assert r.policy.victim(set())[0] == other
    r.policy.estimate.miss_cost[:] = 1.0
    assert r.policy.victim(set())[0] == layer


def test_miss_costs_follow_the_share_of_loads_prefetch_hides(checkpoint, always_predicting):
    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, verify=False)
    cache = model.expert_cache
    # guesses made and loaded before the next call, however the machine's load times them
    cache.prefetcher.off_thread = False
    read_every_guess(cache.prefetcher)
    estimate = cache.policy.estimate
    cost = estimate.miss_cost
    estimate.layer_loads[0] = 0.0
    estimate.count_loads(0, 3, 1)
    assert cost[0] == pytest.approx(1 - 0.75 * 3 / 5)
    estimate.count_loads(0, 0, 2)
    hidden, demand = 3 * 0.98, 0.98 + 2
    assert cost[0] == pytest.approx(1 - 0.75 * hidden / (hidden + demand + 1))
    # a run: every layer's cost is what its counts say, and prefetch hid some loads
    estimate.layer_loads[:] = 0.0
    cost[:] = 1.0
    tokens(model, tokenizer, 16)
    cache.prefetcher.drain()
    counts = estimate.layer_loads
    assert counts[:, 0].sum() > 0
    assert cost == pytest.approx(1 - 0.75 * counts[:, 0] / counts.sum(axis=1).__add__(1.0))
    assert cost.min() < 1.0


def test_failed_prewarm_read_is_read_again_before_the_resident_path(checkpoint):
    """Room for every expert: the pre-warm reads them all; those whose read failed are read
    again on the decode thread before layers compute from the resident slot table."""
    path = checkpoint("qwen3_moe", quant="4bit")
    want = reference(path)
    from mlxmoe.storage.store import ExpertStore

    read = ExpertStore.read_expert

    def failing_layer_0(self, layer, expert, outs, **kw):
        if threading.current_thread().name == "mlxmoe-prewarm" and layer == 0:
            raise MlxmoeError(f"reading {self.files[0]} at offset 123: injected")
        return read(self, layer, expert, outs, **kw)

    ExpertStore.read_expert = failing_layer_0
    try:
        model, tokenizer = mlxmoe.load(str(path), cache_experts=10 ** 6)
        cache = model.expert_cache
        assert cache.prewarm_done(timeout=30)
        failed = len(cache.loader.failed)
        assert failed == cache.store.num_experts
    finally:
        ExpertStore.read_expert = read
    assert tokens(model, tokenizer) == want
    assert not cache.loader.failed and cache.slot_table is not None
    assert cache.stats()["loads_demand"] == failed


def test_interrupted_demand_read_leaves_no_key_with_wrong_bytes(checkpoint):
    """Ctrl-C during a read on the decode thread (chat carries on after it): the keys being
    read leave the cache, and the next generation gives the same tokens as mlx-lm."""
    import numpy as np

    path = checkpoint("qwen3_moe", quant="4bit")
    want = reference(path)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=6, prefetch=0)
    cache = model.expert_cache
    store = cache.store
    read = store.read_expert
    hit, lock = {}, threading.Lock()

    def interrupted(layer, expert, outs, **kw):
        with lock:
            first = cache.counters.tokens > 3 and not hit
            if first:
                hit["key"] = (layer, expert)
        if first:
            outs[0][...] = 0  # half-written
            raise KeyboardInterrupt
        return read(layer, expert, outs, **kw)

    store.read_expert = interrupted
    with pytest.raises(KeyboardInterrupt):
        tokens(model, tokenizer)
    store.read_expert = read
    key = hit["key"]
    if key in cache.slot_of:  # read again since: its slot must hold its bytes
        outs = [np.empty_like(v[0]) for v in cache.pools.views]
        read(*key, outs)
        assert all(np.array_equal(o, v[cache.slot_of[key]]) for o, v in zip(outs, cache.pools.views))
    assert len(cache.slot_of) + len(cache.free) == cache.capacity
    assert tokens(model, tokenizer) == want


def test_predictions_off_the_decode_thread_score_the_same(always_predicting):
    """The prefetcher's scoring and predicting in their own thread (the default) see the
    same layer calls in the same order as on the decode thread: the same tokens and the
    same predictor counts (which depend on the routing alone, not on the timing); the live
    profile's updates, made there too, the same numbers."""
    results = []
    for off_thread in (False, True):
        # (verify=False: how many steps take the per-layer path, where predictions are
        # made, would otherwise follow the verified path's switch, which times them)
        model, tokenizer = mlxmoe.load(str(mlxmoe.DEMO_MODEL), cache_experts=16, verify=False)
        cache = model.expert_cache
        assert cache.capacity < cache.store.num_layers * cache.store.num_experts / 2
        cache.prefetcher.off_thread = off_thread
        out = tokens(model, tokenizer, 24)
        cache.stats()  # waits for the queued predictions
        assert not cache.deferred
        p = cache.profile
        # (running ahead's guesses depend on how long reads take: not compared)
        counts = {name: list(c) for name, c in cache.prefetcher.counts.items() if name != "speculative"}
        results.append((out, counts,
                        p.counts.tolist(), p.mass.tolist(), p.tokens, p.tokens_total))
        cache.close()
    assert results[0] == results[1]
    assert results[0][5] > 24 and sum(map(sum, results[0][2])) > 0
    assert results[0][1]["router"][1] > 0 and results[0][1]["coactivation"][1] > 0


def test_prefill_reads_the_next_layers_experts_ahead():
    """A prompt's layer calls read, while they compute, the experts the next layer's router
    picks for the prompt's tokens: at a cold half-size cache the layers after the first
    find some of their experts prefetched (as many as the background read while the layer
    computed; the layer reads the rest itself, all at once), each expert is loaded once,
    and the prompt's tokens teach the rank chances."""
    model, tokenizer = mlxmoe.load(str(mlxmoe.DEMO_MODEL), cache_experts=64)
    cache = model.expert_cache
    cache.prefetcher.off_thread = False
    calls, fetch = [], cache.fetch

    def logged(layer, experts, *a, **kw):
        before = cache.counters.loads_demand, cache.counters.prefetch_useful
        slots = fetch(layer, experts, *a, **kw)
        calls.append((layer, len(experts), cache.counters.loads_demand - before[0], cache.counters.prefetch_useful - before[1]))
        return slots

    cache.fetch = logged
    guessed = cache.prefetcher.rank_counts[..., 1].sum()
    list(mlxmoe.stream_generate(model, tokenizer, "Once upon a time there was a little girl", max_tokens=1))
    prompt = calls[:4]  # 14 of the prompt's 15 tokens in one step (its last is a step of its own)
    assert [layer for layer, *_ in prompt] == [0, 1, 2, 3] and all(n > 2 for _, n, _, _ in prompt)
    assert prompt[0][2] == prompt[0][1]  # nothing predicts the first layer: all read on demand
    demand, useful = sum(c[2] for c in prompt[1:]), sum(c[3] for c in prompt[1:])
    assert demand + useful == sum(c[1] for c in prompt[1:])  # a cold cache: every expert was loaded
    assert useful > 0
    assert cache.prefetcher.rank_counts[..., 1].sum() >= guessed + 3 * 14
    cache.close()


@pytest.mark.parametrize("cache_experts", [64, 6])
def test_trace_written_off_the_decode_thread_is_the_same_file(tmp_path, cache_experts):
    """The trace is an observer of the cache's layer calls: written by the prefetcher's host
    thread (the default) or on the decode thread, the same bytes, and the host thread
    writes lines. At 6 slots the prompt's layer calls are fetched in runs of tokens: their
    lines are still one per token, in order, each with its whole call's token count."""
    from mlxmoe.workload.trace import TraceWriter, layer_calls, read_trace

    line, writers = TraceWriter.line, set()

    def counted(self, *a, **kw):
        writers.add(threading.current_thread().name)
        return line(self, *a, **kw)

    TraceWriter.line = counted
    files = []
    try:
        for off_thread in (True, False):
            files.append(tmp_path / f"off-{off_thread}.trace.jsonl")
            model, tokenizer = mlxmoe.load(str(mlxmoe.DEMO_MODEL), cache_experts=cache_experts,
                                           trace_out=str(files[-1]))
            cache = model.expert_cache
            cache.prefetcher.off_thread = off_thread
            tokens(model, tokenizer, 16)
            cache.close()
            if off_thread:
                assert "mlxmoe-predict" in writers
    finally:
        TraceWriter.line = line
    assert files[0].read_bytes() == files[1].read_bytes()
    header, records = read_trace(files[0])
    calls = list(layer_calls(records, header["num_layers"]))
    assert [len(call) for call in calls][:4] == [len(calls[0])] * 4 and len(calls[0]) > 3  # the prompt's step
    assert all(r[6] == len(call) for call in calls for r in call if len(call) > 1)
    for layer in range(header["num_layers"]):  # every token's line, once, in order
        positions = [r[1] for r in records if r[2] == layer]
        assert positions == list(range(len(positions))) and len(positions) > len(calls[0]) + 14


def test_read_gate_puts_demand_reads_first():
    """A background read asks for its turn before each piece: none starts while a demand
    read is under way (the piece already asked for is the most a demand read waits
    behind), unless the decode thread waits for that very key; a read whose layer call
    came without it stops at its next piece."""
    import time

    from mlxmoe.caching.cache import Cancelled, ReadGate

    gate, starts = ReadGate(), []

    def background(key, wanted, pieces=12):
        try:
            with gate.reading(key, wanted, [0]) as pace:
                for _ in range(pieces):
                    pace(1)
                    starts.append((key, time.perf_counter()))
                    time.sleep(0.01)
        except Cancelled:
            starts.append((key, "cancelled"))

    worker = threading.Thread(target=background, args=("guess", lambda: True))
    worker.start()
    time.sleep(0.025)
    with gate.demand():
        begun = time.perf_counter()
        time.sleep(0.1)
        ended = time.perf_counter()
    worker.join()
    during = [t for _, t in starts if begun + 0.002 < t < ended]
    assert not during and len(starts) == 12
    assert gate.busy_seconds() > 0.1 + 12 * 0.01 * 0.9
    # the demand read came during a 10 ms piece: it waited for the rest of it, no more
    assert 0 < gate.delayed_seconds() <= 0.012
    assert gate.rate is None  # a read that shared the disk with a demand read does not time it

    starts.clear()  # the decode thread waits for the key: it goes on at demand priority
    worker = threading.Thread(target=background, args=("needed", lambda: True, 6))
    with gate.demand():
        gate.hurry(["needed"])
        worker.start()
        worker.join()
    assert len(starts) == 6
    gate.hurry(["needed"], on=False)

    starts.clear()  # no longer wanted: it stops before its next piece
    wanted = threading.Event()
    wanted.set()
    worker = threading.Thread(target=background, args=("stale", wanted.is_set))
    worker.start()
    time.sleep(0.025)
    wanted.clear()
    worker.join()
    assert starts[-1] == ("stale", "cancelled") and len(starts) < 12

    rate = gate.rate  # a read with the disk to itself: pieces of 1 byte in 10 ms, the slowest disk, the smallest pieces
    worker = threading.Thread(target=background, args=("alone", lambda: True, 3))
    worker.start()
    worker.join()
    assert gate.rate is not None and gate.rate != rate and gate.rate < 1000 and gate.chunk() == 64 << 10
    asked, go = threading.Event(), threading.Event()

    def held(key):
        with gate.reading(key, lambda: True, [0]) as pace:
            pace(1)
            asked.set()
            go.wait(5)
            pace(1)

    rate, worker = gate.rate, threading.Thread(target=held, args=("shared",))
    worker.start()
    assert asked.wait(5)
    with gate.demand():  # begun and ended between its pieces: it shared the disk, it times nothing
        pass
    go.set()
    worker.join()
    assert gate.rate == rate


def slow_reads(store, seconds):
    """Each piece a store reads takes `seconds` more (a slow disk)."""
    import time

    run = store._read_run

    def slow(piece):
        time.sleep(seconds)
        return run(piece)

    store._read_run = slow


def test_tokens_identical_where_reads_are_slow(checkpoint):
    """Reads slower than compute (the disk-bound regime, emulated by sleeping in each read):
    guesses are read piece by piece, cancelled when their layer call came without them, and
    the output is still stock mlx-lm's; every read is accounted for."""
    path = checkpoint("qwen3_moe", quant="4bit")
    want = reference(path, 12)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8)
    cache = model.expert_cache
    read_every_guess(cache.prefetcher)
    store = cache.store
    slow_reads(store, 0.003)
    assert tokens(model, tokenizer, 12) == want
    cache.prefetcher.drain()
    s = cache.stats()
    assert s["loads_prefetched"] + s["prefetch_cancelled"] > 0
    assert s["bytes_read"] == (s["loads_demand"] + s["loads_prefetched"]) * store.expert_file_bytes()
    assert 0 < s["disk_busy_seconds"]
    # a demand read waits for the 3 ms pieces a guess asked (two) at most, not a queue of guesses
    assert s["demand_delay_seconds"] <= s["loads_demand"] * 0.01


@pytest.mark.parametrize("cache_experts,prefetch", [(4, 0), (4, 1), (16, 1)])
def test_a_prompt_step_reads_each_expert_at_most_once(checkpoint, cache_experts, prefetch):
    """A prompt's layer calls read each (layer, expert) they use at most once, also where a
    call uses more experts than the cache holds (computed in groups of experts) and while
    the prefetcher reads guesses for the next layers."""
    path = checkpoint("qwen3_moe", quant="4bit")
    prompt = " ".join(["the cat sat on the mat and then the dog came"] * 4)
    model, tokenizer = mlx_lm.load(str(path))
    detect().apply_dtype_policy(model)
    want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=2)]
    model, tokenizer = mlxmoe.load(str(path), cache_experts=cache_experts, prefetch=prefetch)
    cache = model.expert_cache
    if cache.prefetcher is not None:
        cache.prefetcher.cross_token = False  # its guesses for the next step's first layer are that step's reads
    read, reads, lock = cache.store.read_expert, [], threading.Lock()

    def logged_read(layer, expert, outs, **kw):
        with lock:
            if cache.step_tokens > 1:  # the prompt's step (its last token is a step of its own)
                reads.append((layer, expert))
        return read(layer, expert, outs, **kw)

    cache.store.read_expert = logged_read
    got = [r.token for r in mlxmoe.stream_generate(model, tokenizer, prompt, max_tokens=2)]
    assert got == want
    assert reads and len(reads) == len(set(reads))
    if cache_experts == 4:  # the prompt's calls used more experts than the cache holds
        assert len({e for l, e in reads if l == 0}) > cache_experts


def test_resident_experts_compute_while_the_missing_are_read(checkpoint):
    """A decode step that must read some of its experts starts computing with those already
    resident before the reads (their rows are their own: the same numbers), so the
    output is stock mlx-lm's; a step with nothing to read or nothing resident starts nothing."""
    path = checkpoint("qwen3_moe", quant="4bit")
    want = reference(path, 16)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=6, prefetch=0, verify=False)
    cache = model.expert_cache
    fetch, calls = cache.fetch, []

    def logged(layer, experts, *a, early=None, **kw):
        started = []
        wrapped = None if early is None else (lambda ready: (started.append(dict(ready)), early(ready)))
        slots = fetch(layer, experts, *a, early=wrapped, **kw)
        calls.append((layer, experts, started))
        return slots

    cache.fetch = logged
    assert tokens(model, tokenizer, 16) == want
    early = [(experts, started[0]) for _, experts, started in calls if started]
    assert early  # some decode steps read a part of their experts
    assert all(0 < len(ready) < len(experts) and set(ready) <= set(experts) for experts, ready in early)


@pytest.fixture
def kernels_by_rows(monkeypatch):
    """mx.gather_qmm as MLX's CUDA build picks its kernel: another below GATHER_GEMM_ROWS rows
    (emulated: such calls' outputs x 1.25, far beyond its other roundings); the backend's
    split_exact set by the test (True: the CPU's, False: CUDA's)."""
    from mlxmoe import backend as backends

    gather = mx.gather_qmm

    def by_rows(*args, rhs_indices=None, **kwargs):
        y = gather(*args, rhs_indices=rhs_indices, **kwargs)
        return y * 1.25 if rhs_indices is not None and rhs_indices.size < backends.GATHER_GEMM_ROWS else y

    monkeypatch.setattr(mx, "gather_qmm", by_rows)
    detect = backends.detect

    def split(exact):
        monkeypatch.setattr(backends, "detect", lambda name=None: dataclasses.replace(detect(name), split_exact=exact))
    return split


@pytest.mark.parametrize("split_exact", [True, False])
def test_a_layer_call_is_one_call_where_the_kernel_follows_the_row_count(checkpoint, kernels_by_rows, split_exact):
    """Top 8 of 16 experts: a decode step computes its 8 rows in one call (the resident ones
    are not computed early, apart from those read), and a prompt's group of experts that the
    cache holds at once (more experts than slots) computes no fewer rows than the whole call,
    where the backend's kernel follows the row count: the tokens, and the prompt's logits,
    are stock mlx-lm's under the same kernels. Computed in parts (the CPU's way) they are not."""
    kernels_by_rows(split_exact)
    path = checkpoint("qwen3_moe", quant="4bit", config_overrides={"num_experts": 16, "num_experts_per_tok": 8})
    model, tokenizer = mlx_lm.load(str(path))
    detect().apply_dtype_policy(model)
    want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=12)]
    prompt = mx.array([tokenizer.encode("the cat")])  # its groups at 9 slots: 19 + 5, 18 + 6, 20 + 4 rows
    want_logits = model(prompt)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=24, prefetch=0, verify=False)
    got = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=12)]
    assert model.expert_cache.stats()["loads_demand"] > 0
    assert (got == want) != split_exact
    model, tokenizer = mlxmoe.load(str(path), cache_experts=9, prefetch=0, verify=False)
    assert mx.array_equal(model(prompt), want_logits).item() != split_exact


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_running_ahead_while_reads_are_slow_keeps_tokens(checkpoint, arch):
    """Reads slower than a layer's compute: the decode thread runs the next layers ahead
    while it waits (speculate.py), on a copy of the hidden state and a read-only view of the
    KV cache, and the prefetcher reads what they route to. The output is still stock
    mlx-lm's, every read is accounted for, and those guesses are scored."""
    path = checkpoint(arch, quant="4bit")
    want = reference(path, 12)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, verify=False)
    cache = model.expert_cache
    speculator = cache.speculator
    assert speculator is not None
    store = cache.store
    slow_reads(store, 0.02)
    assert tokens(model, tokenizer, 12) == want
    cache.prefetcher.drain()
    s = cache.stats()
    assert speculator.error is None and speculator.layers_run > 0
    assert s["predictors"]["speculative"]["recall"] > 0
    assert s["bytes_read"] == (s["loads_demand"] + s["loads_prefetched"]) * store.expert_file_bytes()
    assert tokens(model, tokenizer, 12) == want  # a second generation: new KV caches, the same tokens


def test_running_ahead_on_bfloat16_activations_keeps_tokens(checkpoint, monkeypatch):
    """As on a GPU, where activations keep a bfloat16 checkpoint's dtype (numpy has no
    bfloat16: the router's logits are read through their bits): running ahead runs, without
    an error, and the tokens are stock mlx-lm's."""
    from mlxmoe import backend as backends

    detect = backends.detect
    monkeypatch.setattr(backends, "detect", lambda name=None: dataclasses.replace(detect(name), compute_dtype=None))
    # top 4: a layer run ahead computes the AHEAD_EXPERTS its router weighs most of those resident
    path = checkpoint("qwen3_moe", quant="4bit", dtype="bfloat16", config_overrides={"num_experts_per_tok": 4})
    model, tokenizer = mlx_lm.load(str(path))
    want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=12)]
    model, tokenizer = mlxmoe.load(str(path), cache_experts=16, verify=False)
    speculator = model.expert_cache.speculator
    assert model.model.norm.weight.dtype == mx.bfloat16  # (the dtype policy left it as it is)
    slow_reads(model.expert_cache.store, 0.02)
    assert tokens(model, tokenizer, 12) == want
    assert speculator.error is None and speculator.layers_run > 0


def test_no_running_ahead_where_the_backend_says_it_does_not_pay(checkpoint, monkeypatch):
    """On a GPU backend (runs_ahead False) the decode thread never runs ahead: the prefetcher
    still reads its guesses, and the tokens are stock mlx-lm's."""
    from mlxmoe import backend as backends

    detect = backends.detect
    if not detect().runs_ahead:
        pytest.skip("the backend runs no layer ahead anyway")
    monkeypatch.setattr(backends, "detect", lambda name=None: dataclasses.replace(detect(name), runs_ahead=False))
    path = checkpoint("qwen3_moe", quant="4bit")
    want = reference(path, 12)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, verify=False)
    cache = model.expert_cache
    assert cache.speculator is None and cache.prefetcher is not None
    slow_reads(cache.store, 0.02)
    assert tokens(model, tokenizer, 12) == want
    cache.prefetcher.drain()
    assert cache.stats()["predictors"]  # (the prefetcher's other predictors guessed)


def ban_recent(window):
    """A logits processor banning the last `window` tokens (greedy decoding then differs
    from the plain argmax at most steps), marked stateless."""
    import mlx.core as mx

    def process(tokens, logits):
        banned = mx.zeros(logits.shape[-1], dtype=mx.bool_)
        banned[tokens[-window:]] = True
        return mx.where(banned, -mx.inf, logits)

    process.stateless = True
    return process


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_running_ahead_crosses_into_the_next_token(checkpoint, arch):
    """Where the last layers wait for reads, running ahead guesses the next token as the
    generation would choose it (its stateless logits processors applied to the approximate
    logits) and runs that token's first layers, whose routing is read ahead and scored at
    that token's calls. Tokens are stock mlx-lm's with the same processors, and a processor
    that keeps state is called exactly as stock mlx-lm calls it."""
    path = checkpoint(arch, quant="4bit")

    def counting():
        calls = []

        def process(tokens, logits):  # keeps state: never called for a guess
            calls.append(tokens.tolist())
            return logits
        return process, calls

    stock_counter, stock_calls = counting()
    model, tokenizer = mlx_lm.load(str(path))
    detect().apply_dtype_policy(model)
    want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=12,
                                                    logits_processors=[ban_recent(4), stock_counter])]
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, verify=False)
    cache = model.expert_cache
    speculator = cache.speculator
    assert speculator.head is not None
    slow_reads(cache.store, 0.02)
    routed, scored = cache.loader.routed_ahead, []

    class Scored(dict):  # the running ahead's findings the layer calls took (observe pops them)
        def pop(self, key, *default):
            found = super().pop(key, *default)
            if found is not None and key[0] == cache.counters.tokens:
                scored.append(key)
            return found

    cache.loader.routed_ahead = Scored(routed)
    counter, calls = counting()
    got = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=12,
                                                   logits_processors=[ban_recent(4), counter])]
    cache.prefetcher.settle()
    assert got == want
    assert calls == stock_calls
    assert speculator.error is None and speculator.next_token is None  # let go at the end
    right, guessed = speculator.tokens_guessed
    assert guessed > 0 and right > 0
    assert any(layer == 0 for _, layer in scored)  # a next token's first layer, found the step before


def test_next_token_guess_follows_the_processors():
    """NextToken keeps what mlx-lm's generation loop gives its processors and sampler, and
    guesses the next token as the processors would leave the logits (their argmax)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import greedy_sampler

    from mlxmoe.caching.speculate import NextToken

    plain = NextToken()
    kwargs = {}
    plain.wrap(kwargs, greedy_sampler)
    assert "logits_processors" not in kwargs  # mlx-lm keeps no token list for nothing
    assert kwargs["sampler"](mx.array([[0.0, 1.0, 5.0]])).item() == 2 and plain.last.item() == 2
    assert plain.guess(mx.array([[0.0, 5.0, 4.0]])).item() == 1

    banning = NextToken([ban_recent(2)])
    kwargs = {}
    banning.wrap(kwargs, greedy_sampler)
    assert banning.guess(mx.array([[0.0, 5.0, 4.0]])) is None  # no token sampled yet
    first, *rest = kwargs["logits_processors"]
    logits = mx.array([[0.0, 1.0, 5.0]])
    tokens = mx.array([1])
    for processor in (first, *rest):
        logits = processor(tokens, logits)
    kwargs["sampler"](logits)  # token 2; tokens 1 and 2 are now the last two
    assert banning.guess(mx.array([[0.0, 5.0, 4.0]])).item() == 0


def test_guesses_are_read_only_where_they_can_pay():
    """The bar a guess's chance must clear: none is read before a read and a layer's
    compute are timed; where a layer computes in far less than a read of one piece and the
    disk is busy, nearly nothing clears it (a right guess hides at most that compute, a
    wrong one costs its read); where a wrong read is cancelled after a short piece, or the
    disk idles, it is min_chance."""
    from types import SimpleNamespace

    from mlxmoe.caching.prefetch import Prefetcher

    pf = Prefetcher(None, [None, None], 2, workers=1, min_chance=0.1)
    try:
        gate = SimpleNamespace(rate=None, chunk=lambda: 1 << 20)
        pf.cache = pf.bar.cache = SimpleNamespace(loader=SimpleNamespace(gate=gate), layer_seconds=None,
                                   store=SimpleNamespace(expert_file_bytes=lambda: 1 << 20))
        assert pf.bar(1) == float("inf")
        gate.rate, pf.cache.layer_seconds = 2 << 20, 0.001  # a read of one piece 0.5 s, a layer 1 ms
        assert pf.bar(1) > 0.99  # the disk taken as busy until measured
        pf.bar.pace(0.0, 0.0)
        pf.bar.pace(1.0, 0.9)  # busy 90 % of a step
        assert 0.99 < pf.bar(1) < 1.0 and pf.bar(3) < pf.bar(1)
        gate.chunk = lambda: 1 << 14  # pieces of 7.8 ms: a wrong guess stops after those asked
        cost = 0.9 * (1 << 14) / (2 << 20)
        assert pf.bar(1) == pytest.approx(cost / (0.001 + cost))
        assert pf.bar(8) == pytest.approx(max(pf.bar.min_chance, cost / (0.008 + cost)))
        for t in range(2, 30):
            pf.bar.pace(float(t), 0.9)  # the disk idle since
        assert pf.bar(1) == pf.bar.min_chance
    finally:
        pf.close()


def test_running_ahead_reads_the_kv_cache_without_writing_it():
    """A layer run ahead attends to the real cache's keys up to its offset and this token's,
    and leaves the real cache as it was (its arrays, offset and values)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxmoe.caching.speculate import AheadKV

    real = KVCache()
    k0 = mx.random.normal((1, 2, 5, 4))
    real.update_and_fetch(k0, k0 + 1)
    before = (real.keys, real.offset, np.array(real.keys[..., :5, :]))
    new = mx.random.normal((1, 2, 1, 4))
    for offset in (5, 4):  # a layer not yet called at this token; one that was (its slot 4 is this token's)
        ahead = AheadKV(real, offset)
        keys, values = ahead.update_and_fetch(new, new + 1)
        assert keys.shape[2] == offset + 1 and ahead.offset == offset + 1
        assert np.array_equal(np.array(keys[..., :offset, :]), np.array(k0[..., :offset, :]))
        assert np.array_equal(np.array(keys[..., offset:, :]), np.array(new))
        assert np.array_equal(np.array(values[..., offset:, :]), np.array(new + 1))
    assert real.keys is before[0] and real.offset == before[1]
    assert np.array_equal(np.array(real.keys[..., :5, :]), before[2])


def test_running_ahead_keeps_no_prompt_activations(checkpoint):
    """What running ahead keeps of the last layer calls (their arguments, the norms' inputs
    and outputs, the MoE blocks' inputs) is a decode step's one token at most: a prompt's
    activations would stay alive until each layer's next call, outside the memory budget."""
    import mlx.core as mx

    path = checkpoint("qwen3_moe", quant="4bit")
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, verify=False)
    speculator = model.expert_cache.speculator
    from mlx_lm.models.cache import make_prompt_cache

    prompt = " ".join(["the cat sat on the mat and then the dog came"] * 4)
    mx.eval(model(mx.array([tokenizer.encode(prompt)]), cache=make_prompt_cache(model)))  # a prompt step
    kept = [a for args, kwargs, _, _ in speculator.calls.values() if args is not None
            for a in (*args, *kwargs.values())]
    kept += [a for pairs in speculator.norms.values() for pair in pairs.values() for a in pair]
    kept += list(speculator.block_inputs.values())
    arrays = [a for a in kept if isinstance(a, mx.array)]
    assert len(speculator.calls) == len(model.layers)
    assert all(a.ndim < 2 or a.shape[-2] == 1 for a in arrays), [a.shape for a in arrays if a.shape[-2] != 1]


class Counts:
    """The counters Worth reads, set by hand."""

    prefetch_useful, demand_seconds, loads_demand, tokens = 0, 0.0, 0, 0


def test_predicting_pauses_where_it_costs_more_than_it_spares_and_resumes_where_reads_grow():
    from mlxmoe.caching.prefetch import Worth

    worth, c = Worth(), Counts()
    worth.step(c)
    settled = []  # (verify.Switch times the per-layer path once it is)
    for _ in range(Worth.WARMUP + 2):  # 3 ms of host work a step; 2 useful guesses of 0.1 ms reads
        settled.append(worth.settled())
        worth.work += 0.003
        c.prefetch_useful += 2
        c.loads_demand += 4
        c.demand_seconds += 4 * 1e-4
        c.tokens += 1
        assert not worth.step(c)
    assert worth.paused and not worth.stats()["on"] and worth.settled()
    assert settled == [False] * Worth.WARMUP + [True] * 2, settled
    assert "less than 1.5 x" in worth.stats()["reason"]
    # steps between that never come here (verified steps, a prompt) read much: no paused
    # step's reads, it stays paused
    for between in (5, 12):
        c.loads_demand += 40
        c.demand_seconds += 40 * 0.003
        c.tokens += between + 1
        assert not worth.step(c) and worth.paused
        c.loads_demand += 4
        c.demand_seconds += 4 * 1e-4
        c.tokens += 1
        assert not worth.step(c) and worth.paused
    # paused: the demand reads grow (a slower disk) until the share the try spared (0.2 of
    # 0.6 ms: a third) of them exceeds MARGIN x the 3 ms it cost
    assert abs(worth.share - 1 / 3) < 0.01, worth.share
    on_again = []
    for _ in range(40):
        c.loads_demand += 4
        c.demand_seconds += 4 * 0.005
        c.tokens += 1
        on_again.append(worth.step(c))
        if on_again[-1]:
            break
    assert on_again[-1] and not worth.paused and worth.stats()["on"] and not worth.settled()
    # where each useful guess spares a read longer than the host work, it stays on
    worth, c = Worth(), Counts()
    worth.step(c)
    for _ in range(5 * Worth.WARMUP):
        worth.work += 0.003
        c.prefetch_useful += 2
        c.loads_demand += 1
        c.demand_seconds += 0.004
        c.tokens += 1
        worth.step(c)
    assert not worth.paused and "spares" in worth.stats()["reason"]
    # guesses that hide every miss leave no demand read to time: the disk's rate prices them
    worth, c = Worth(), Counts()
    worth.step(c, read_guess=0.004)
    for _ in range(5 * Worth.WARMUP):
        worth.work += 0.003
        c.prefetch_useful += 2
        c.tokens += 1
        worth.step(c, read_guess=0.004)
    assert not worth.paused


def test_a_try_of_predicting_that_never_pays_is_made_ever_more_rarely():
    """Where each paused step's reads are large (a slow disk) and guesses spare nothing,
    predicting is tried again after HOLD paused steps, then twice as many after each try that
    paused at its first weighing (before, one paused step in WARMUP + 1); a try that paid for
    a while before pausing is followed by HOLD again."""
    from mlxmoe.caching.prefetch import Worth

    worth, c = Worth(), Counts()
    worth.step(c)

    def steps(n, useful):  # n steps of 3 ms of host work and 20 ms of demand reads; whether predicting was on
        on = []
        for _ in range(n):
            on.append(not worth.paused)
            worth.work += 0.003
            c.prefetch_useful += useful
            c.loads_demand += 5
            c.demand_seconds += 0.020
            c.tokens += 1
            worth.step(c)
        return on

    on = steps(Worth.WARMUP + Worth.HOLD + 2 * Worth.WARMUP + 2 * Worth.HOLD + Worth.WARMUP, useful=0)
    runs = [len(list(g)) for _, g in itertools.groupby(on)]
    # on for the first weighing, then paused HOLD, on WARMUP, paused 2 x HOLD, on again
    assert runs[:4] == [Worth.WARMUP, Worth.HOLD, Worth.WARMUP, 2 * Worth.HOLD], runs
    # a try whose guesses pay stays on past its first weighing; once they stop paying, the next pause is HOLD
    worth, c = Worth(), Counts()
    worth.step(c)
    steps(Worth.WARMUP + Worth.HOLD, useful=0)
    assert not worth.paused and "spares" in worth.stats()["reason"]
    steps(2 * Worth.WARMUP, useful=10)  # (10 useful guesses of 4 ms reads a step against 3 ms of work)
    assert not worth.paused
    on = steps(4 * Worth.WARMUP + Worth.HOLD, useful=0)
    runs = [len(list(g)) for _, g in itertools.groupby(on)]
    assert on[0] and runs[0] > Worth.WARMUP and runs[1] == Worth.HOLD, runs
    assert worth.paused and "paused for 16 steps" in worth.stats()["reason"]  # (its next try, WARMUP steps, never paid)


def test_a_try_that_spared_nothing_is_made_again_only_where_reads_grow_past_its_cost():
    """A try whose guesses spared nothing is counted as sparing SHARE_FLOOR of the reads: with
    10 ms of demand reads a step against 3 ms of predicting (2.5 < 1.5 x 3) predicting stays
    paused through every hold; at 40 ms a step (10 > 4.5) it is tried again once held."""
    from mlxmoe.caching.prefetch import Worth

    worth, c = Worth(), Counts()
    worth.step(c)

    def step(read):
        worth.work += 0.003 * (not worth.paused)
        c.loads_demand += 5
        c.demand_seconds += read
        c.tokens += 1
        return worth.step(c)

    assert not any(step(0.010) for _ in range(Worth.WARMUP))
    assert worth.paused and worth.share == Worth.SHARE_FLOOR
    assert not any(step(0.010) for _ in range(Worth.MOST_HOLD + Worth.HOLD)) and worth.paused
    assert any(step(0.040) for _ in range(4 * Worth.HOLD)) and not worth.paused


def test_paused_predicting_computes_no_lookahead_and_keeps_tokens(checkpoint, monkeypatch):
    """Predicting that costs more host time than it spares (made so: each prediction
    spins 3 ms of CPU while reads are quick) pauses: stats say why, no lookahead is
    computed, no guess asked and no prediction given to the host thread for a decode step
    after that (only the cache's deferred host work, experts.wait_for), nothing kept for running ahead, and tokens stay stock mlx-lm's. Reads made slow
    (20 ms a piece) put it on again."""
    import time

    from mlxmoe.caching.prefetch import Prefetcher

    path = checkpoint("qwen3_moe", quant="4bit")
    want = reference(path, 24)
    after_layer = Prefetcher.after_layer

    def costly(self, *args):
        end = time.thread_time() + 0.003
        while time.thread_time() < end:
            pass
        return after_layer(self, *args)

    monkeypatch.setattr(Prefetcher, "after_layer", costly)
    # (io="pread": reads from the page cache, quick on any machine's disk)
    model, tokenizer = mlxmoe.load(str(path), cache_experts=8, verify=False, io="pread")
    cache = model.expert_cache
    pf = cache.prefetcher
    assert tokens(model, tokenizer, 24) == want
    pf.drain()
    s = cache.stats()
    assert s["prefetch"]["on"] is False and "less than 1.5 x" in s["prefetch"]["reason"], s["prefetch"]
    lookaheads = []
    lookahead = pf.lookahead
    monkeypatch.setattr(pf, "lookahead", lambda *a, **k: lookaheads.append(lookahead(*a, **k)) or lookaheads[-1])
    queued = []  # (keys, from a decode step)
    queue = pf.queue
    monkeypatch.setattr(pf, "queue", lambda keys, *a, decode=True, **k: queued.append((keys, decode)) or queue(
        keys, *a, decode=decode, **k))
    jobs = []
    put = pf.host.put
    monkeypatch.setattr(pf.host, "put", lambda job: jobs.append(job) or put(job))
    cache.speculator.calls.clear()
    assert s["loads_prefetched"] > 0
    assert tokens(model, tokenizer, 24) == want
    pf.drain()
    assert cache.stats()["misses"] > 0 and not [keys for keys, decode in queued if decode]
    assert jobs and not [job for job in jobs if job != () and job[-1]]  # the prompt's predictions alone
    assert not cache.speculator.calls and not cache.deferred
    decode = [a for a in lookaheads if a is not None]
    assert decode and not any(decode[len(decode) // 2:])  # the prompt's layer calls look ahead, decode's not
    slow_reads(cache.store, 0.02)
    tokens(model, tokenizer, 24)
    assert cache.stats()["prefetch"]["on"] is True, cache.stats()["prefetch"]
    assert cache.speculator.calls and [job for job in jobs if job and job[-1]]
    cache.close()
