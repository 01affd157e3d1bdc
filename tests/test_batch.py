"""`serve --max-batch N`: concurrent requests decoded in batches through the expert cache
(mlxmoe/batching.py). Each request's greedy output equals its solo answer at every cache
size (every expert resident, a partial cache, a cache smaller than the union of a batch's
experts, fetched in groups); per-request stats are each request's own and add up to the
cache's; with --profiles each request's profile learns its own routing; requests wait for the
KV reserve; a client leaving frees its slot; the budget holds with 16 clients. Servers bind
127.0.0.1 on a free port; every wait is bounded."""

import gc
import http.client
import json
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import server as mlx_server
from mlx_lm.models import cache as mlx_lm_cache

import mlxmoe
from mlxmoe import batching, server as mlxmoe_server
from mlxmoe.batching import CallRows, Share
from mlxmoe.caching import verify
from mlxmoe.caching.experts import LayerCall, StreamingExperts, row_counts
from mlxmoe.drafting import NGram
from mlxmoe.workload.profile import ActivationProfile
from test_server import PROMPTS, Server, copy_profiles, heldout_prompts
from test_threads import in_threads

openai = pytest.importorskip("openai")

# (prompt, max_tokens): different lengths, so that requests join and leave a running batch
ASKED = [(p, 6 + 5 * i) for i, p in enumerate(PROMPTS[:6])]
CACHES = {"resident": {"cache_experts": 128}, "partial": {"memory_budget": "46MB"},
          "below-union": {"cache_experts": 4}}  # 4 slots: a batch's experts at a layer are more


@pytest.fixture(scope="module")
def solo():
    """Each request's answer alone: mlxmoe.generate (greedy, one sequence)."""
    model, tokenizer = mlxmoe.load(mlxmoe.DEMO_MODEL)
    try:
        return [mlxmoe.generate(model, tokenizer, p, max_tokens=n) for p, n in ASKED]
    finally:
        model.expert_cache.close()


def start(max_batch, profiles=None, prompt_cache_size=0, **load):
    """An in-process server of the demo model loaded with `load` (no prefetcher: every read
    is one a request's step made), batching up to `max_batch` requests; with the stored
    `profiles` (a folder) matched per request; keeping `prompt_cache_size` prompt caches."""
    model, tokenizer = mlxmoe.load(mlxmoe.DEMO_MODEL, prefetch=0, **load)
    assert model.expert_cache.prewarm_done(60)  # (its reads are no request's)
    stock = mlx_server.stream_generate, mlx_server.BatchGenerator
    if profiles is not None:
        profiles = mlxmoe_server.Profiles(Path(profiles).glob("*.json"), model.expert_runtime.checkpoint)
    generator = mlxmoe_server.response_generator(model, tokenizer, "demo", max_batch=max_batch, profiles=profiles,
                                                 prompt_cache_size=prompt_cache_size)
    httpd = mlxmoe_server.http_server(generator, "127.0.0.1", 0)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{httpd.server_port}/v1", api_key="none", timeout=60,
                           max_retries=0)

    def stop():
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
        mlx_server.stream_generate, mlx_server.BatchGenerator = stock
        model.expert_cache.close()
    return SimpleNamespace(model=model, generator=generator, httpd=httpd, port=httpd.server_port, client=client,
                           stop=stop)


def complete(served, prompt, max_tokens):
    """(text, usage.mlxmoe with the request's total_tokens) of a greedy completion."""
    r = served.client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text, dict(r.usage.model_extra["mlxmoe"], total_tokens=r.usage.total_tokens)


def together(served, asked, ask=None):
    """Complete `asked` [(prompt, max_tokens)] at once (or `ask` each), sent while the model's
    generation lock is held (a second): the first waits for it, and the others are in by the
    time it starts."""
    lock = mlxmoe.api.generation_lock(served.model)
    lock.acquire()
    threading.Timer(1.0, lock.release).start()
    return in_threads(ask or (lambda p, n: complete(served, p, n)), asked)


def idle(served, seconds=30):
    """Wait until the batch has emptied (the model's generation lock is free again)."""
    lock, tic = mlxmoe.api.generation_lock(served.model), time.monotonic()
    while not lock.acquire(timeout=0.05):
        assert time.monotonic() - tic < seconds
    lock.release()


@pytest.mark.parametrize("cache", list(CACHES))
def test_batched_output_equals_solo_and_stats_are_each_requests_own(solo, cache, monkeypatch):
    """Each request's hits + misses are those of its own routing: what it counts served alone
    (the same greedy tokens, so the same experts per token; only which were resident differs);
    the requests' hits, misses, bytes and tokens add up to the cache's."""
    alone = start(1, **CACHES[cache])
    try:
        each = [complete(alone, p, n)[1] for p, n in ASKED]
    finally:
        alone.stop()
    served = start(8, **CACHES[cache])
    grouped = []  # batched decode steps whose experts did not fit the cache at once
    real = StreamingExperts._grouped

    def spy(self, x, *args):
        if x.ndim == 3 and x.shape[0] > 1 and x.shape[1] == 1:
            grouped.append(x.shape[0])
        return real(self, x, *args)
    monkeypatch.setattr(StreamingExperts, "_grouped", spy)
    shapes = []  # the batch's model calls' inputs
    call = batching.Rows.__call__
    monkeypatch.setattr(batching.Rows, "__call__", lambda self, inputs, **kw: shapes.append(inputs.shape) or
                        call(self, inputs, **kw))
    try:
        before = served.model.expert_cache.stats()
        got = in_threads(lambda p, n: complete(served, p, n), ASKED)
        idle(served)
        after = served.model.expert_cache.stats()
    finally:
        served.stop()
    assert [text for text, _ in got] == solo
    usages = [u for _, u in got]
    assert sum(u["batch_largest"] > 1 for u in usages) > 1  # they were batched
    assert [u["expert_hits"] + u["expert_misses"] for u in usages] == \
        [u["expert_hits"] + u["expert_misses"] for u in each]
    # prompts prefilled together, each step within the planned prefill step's tokens
    step = served.generator.model_provider.cli_args.prefill_step_size
    assert any(rows > 1 and tokens > 1 for rows, tokens in shapes), shapes
    assert all(rows * tokens <= step for rows, tokens in shapes if tokens > 1), (step, shapes)
    for key, total in (("expert_hits", "hits"), ("expert_misses", "misses"), ("total_tokens", "tokens")):
        assert sum(u[key] for u in usages) == after[total] - before[total], key  # (tokens: no prompt's padding)
    assert after["hits"] > before["hits"]
    assert sum(u["mb_read"] for u in usages) * (1 << 20) == pytest.approx(after["bytes_read"] - before["bytes_read"])
    if cache == "resident":
        assert after["misses"] == before["misses"]
    else:
        assert after["bytes_read"] > before["bytes_read"]
    if cache == "below-union":
        assert grouped, "no batched decode step was fetched in groups"


def test_a_request_alone_in_the_batch_takes_verified_steps(solo):
    """One client of a batching server at a partial cache: its decode steps (a batch of one
    row, on a BatchKVCache) are verified as a request's alone are, misses replayed (the
    switch that weighs replays against waits kept on), with its solo answer."""
    served = start(8, memory_budget="46MB")
    served.model.expert_cache.verifier.switch.weigh = lambda *a: False
    try:
        text, usage, took = one_request(served)
    finally:
        served.stop()
    assert text == solo[5] and usage["batch_largest"] == 1
    assert took["misses"] > 0  # (a partial cache: the per-layer path would wait)
    # every decode step (the model calls but the prompt's one) verified
    assert took["verified_tokens"] == usage["batch_steps"] - 1 >= 4
    assert took["replays"] > 0


def one_request(served):
    """ASKED[5] alone on `served`: its answer, its usage and the cache's stats it changed."""
    cache = served.model.expert_cache
    before = cache.stats()
    text, usage = complete(served, *ASKED[5])
    idle(served)
    after = cache.stats()
    return text, usage, {key: after[key] - before[key] for key in ("misses", "verified_tokens", "replays")}


def test_a_batch_takes_verified_steps(solo):
    """Requests decoded together at a partial cache: a batch's decode steps (inputs [B, 1] on
    BatchKVCaches) are verified as one step of B tokens, misses replayed (each row's token
    trimmed), with each request's solo answer (the placeholder slot, NaN here, never reaching
    it) and its own counts (those it makes alone), and the requests' counts add up to the
    cache's."""
    alone = start(1, memory_budget="46MB")
    try:
        each = [complete(alone, p, n)[1] for p, n in ASKED]
    finally:
        alone.stop()
    served = start(8, memory_budget="46MB")
    cache = served.model.expert_cache
    for view in cache.pools.views:  # the placeholder (the spare slot): NaN would reach the answers
        view[cache.capacity] = np.nan if view.dtype.kind == "f" else view[cache.capacity]
    verifier = cache.verifier
    verifier.batch_switch.weigh = lambda *a: False  # (kept on: the replays' cost is not weighed)
    steps = []  # the rows of each verified model call
    ready = verifier._ready

    def counted(args, kwargs):
        kv = ready(args, kwargs)
        if kv is not None:
            steps.append(args[0].shape[0])
        return kv
    verifier._ready = counted
    try:
        before = served.model.expert_cache.stats()
        got = together(served, ASKED)
        idle(served)
        after = served.model.expert_cache.stats()
    finally:
        served.stop()
    assert [text for text, _ in got] == solo
    assert max(steps) > 1 and sum(r > 1 for r in steps) >= 5, steps
    assert after["verified_tokens"] - before["verified_tokens"] == sum(steps)
    assert after["replays"] > before["replays"]
    usages = [u for _, u in got]
    assert [u["expert_hits"] + u["expert_misses"] for u in usages] == \
        [u["expert_hits"] + u["expert_misses"] for u in each]
    for key, total in (("expert_hits", "hits"), ("expert_misses", "misses")):
        assert sum(u[key] for u in usages) == after[total] - before[total]
    assert sum(u["mb_read"] for u in usages) * (1 << 20) == pytest.approx(after["bytes_read"] - before["bytes_read"])


def test_a_batch_turning_its_mode_off_leaves_a_request_alone_verified(solo, monkeypatch):
    """A batch's steps have a switch of their own: where its replays cost more than the waits
    they save (here waits that cost nothing), the mode turns off for batches, and a request
    alone afterwards is still verified. (The batch's steps then taken on the per-layer path are
    never timed against the verified ones here: on a loaded machine either may be faster.)"""
    monkeypatch.setattr(verify, "MEASURED_OFF", 10 ** 6)
    served = start(8, memory_budget="46MB")
    verifier = served.model.expert_cache.verifier
    verifier.batch_switch.layer_wait = lambda: 1e-9  # waits that cost nothing: no replay pays
    verifier.switch.weigh = lambda *a: False
    try:
        got = together(served, ASKED)
        idle(served)
        stats = served.model.expert_cache.stats()["verify"]
        text, usage, took = one_request(served)
    finally:
        served.stop()
    assert [t for t, _ in got] == solo and text == solo[5]
    assert stats["batch"]["on"] is False and "more than" in stats["batch"]["reason"], stats
    assert stats["on"] is True
    assert took["verified_tokens"] == usage["batch_steps"] - 1 >= 4


def test_row_counts_split_a_layer_call_by_sequence():
    """Two sequences of two tokens, top-2: each sequence's distinct experts counted once; the
    600 bytes of the 2 experts read (300 each) shared by the sequences that routed to each."""
    rows = [[0, 1], [1, 2],  # sequence 0: experts 0, 1, 2
            [2, 3], [2, 3]]  # sequence 1: experts 2, 3
    got = row_counts(np.array(rows), 2, missed=[2, 3], nbytes=600)
    # expert 2 (300 bytes) read for both: 150 each; expert 3 (300) for sequence 1 alone
    assert got.tolist() == [[2, 1, 150], [0, 2, 450]]
    odd = row_counts(np.array(rows), 2, missed=[2], nbytes=301)  # the remainder to the first
    assert odd[:, 2].tolist() == [151, 150] and odd[:, :2].tolist() == [[2, 1], [1, 1]]
    # sequence 0's second token is right padding (a prompt batch's): expert 2 is sequence 1's alone
    padded = row_counts(np.array(rows), 2, missed=[2], nbytes=300, real=[1, 2])
    assert padded.tolist() == [[2, 0, 0], [1, 1, 300]]


def test_prompts_prefilled_together_count_their_own_tokens(monkeypatch):
    """Two prompts of different lengths prefilled in one call (a prompt batch of 2, the shorter
    right-padded): each request's hits + misses are still what it counts alone (its padding
    counts to no one), and the requests' add up to the cache's."""
    asked = [("The cat sat on", 6), ("Il gatto è sul tavolo e la lingua italiana è una storia di Roma", 6)]
    alone = start(1, memory_budget="46MB")
    try:
        each = [complete(alone, p, n) for p, n in asked]
    finally:
        alone.stop()
    prompt_calls, real = [], batching.Batches.rows_of

    def spy(self, kv, size, tokens):
        rows = real(self, kv, size, tokens)
        if rows.real is not None:
            prompt_calls.append(rows.real.tolist())
        return rows
    monkeypatch.setattr(batching.Batches, "rows_of", spy)
    served = start(8, memory_budget="46MB")
    served.generator.model_provider.cli_args.prompt_concurrency = 2  # (read when the batch is made)
    cache = served.model.expert_cache
    try:
        first = open_request(served, {"prompt": PROMPTS[6], "max_tokens": 400, "temperature": 0, "stream": True})
        before = cache.stats()
        hold = threading.Thread(target=lambda: cache.lock.acquire() and time.sleep(1.0) or cache.lock.release())
        hold.start()  # the running batch waits a second at its next layer call: both requests come meanwhile
        time.sleep(0.1)
        got = in_threads(lambda p, n: complete(served, p, n), asked)
        hold.join(30)
        first.close()
        idle(served)
        after = cache.stats()
    finally:
        served.stop()
    assert [text for text, _ in got] == [text for text, _ in each]
    assert any(len(r) == 2 and r[0] != r[1] for r in prompt_calls), prompt_calls  # prefilled together, one padded
    assert [u["expert_hits"] + u["expert_misses"] for _, u in got] == \
        [u["expert_hits"] + u["expert_misses"] for _, u in each]
    assert after["hits"] + after["misses"] - before["hits"] - before["misses"] > \
        sum(u["expert_hits"] + u["expert_misses"] for _, u in got)  # (the first request's too)


def test_prompts_prefilled_together_take_as_many_tokens_as_the_working_memory_holds(monkeypatch):
    """Eight held-out prompts of up to 75 tokens admitted together near the model's minimum budget:
    the step of several prompts is sized by their own keys (the longest's), not by the whole
    context's, so the working memory holds them all in one prefill call (the whole context's
    step would have cut them into four), the answers are their solo ones and MLX's peak stays
    within the budget."""
    asked = [(p, 4) for lang in ("en", "it", "de", "fr", "es") for p in heldout_prompts(lang, 8, 200)][:8]
    model, tokenizer = mlxmoe.load(mlxmoe.DEMO_MODEL)
    try:
        each = [mlxmoe.generate(model, tokenizer, p, max_tokens=n) for p, n in asked]
    finally:
        model.expert_cache.close()
    longest = max(len(tokenizer.encode(p)) for p, _ in asked)
    shapes, call = [], batching.Rows.__call__
    monkeypatch.setattr(batching.Rows, "__call__", lambda self, inputs, **kw: shapes.append(inputs.shape) or
                        call(self, inputs, **kw))
    before = mx.get_active_memory()  # (what earlier tests left: not this server's)
    admit_together(monkeypatch, 8)
    mx.reset_peak_memory()
    served = start(8, memory_budget="43MB")
    try:
        got = in_threads(lambda p, n: complete(served, p, n), asked)
        budget = served.model.expert_runtime.plan.budget
        context_step = served.generator.model_provider.cli_args.prefill_step_size
    finally:
        served.stop()
    assert [text for text, _ in got] == each
    prompt_calls = [(rows, tokens) for rows, tokens in shapes if tokens > 1]
    assert prompt_calls == [(8, longest - 1)], shapes  # (a prompt's last token: its first decode step's)
    assert 8 * (longest - 1) > 2 * context_step, (longest, context_step)
    assert mx.get_peak_memory() - before <= budget, (mx.get_peak_memory() - before) / budget


def test_call_rows_wait_for_their_requests():
    """A model call whose rows' requests are known only after the step (those joining the
    generation): what its layer calls counted and learnt waits, then goes to each row's request."""
    batches = SimpleNamespace(cache=SimpleNamespace(lock=threading.RLock()), counted=np.zeros(3, dtype=np.int64))
    rows = CallRows(batches, 2)
    rows.count(np.array([[3, 1, 100], [2, 2, 200]]))
    call = LayerCall(0, 0, np.array([[0, 1], [2, 3]]), None, 2, [0, 1, 2, 3], None, None, 2)
    rows.learn(call)
    first, second = (SimpleNamespace(share=Share(8, ActivationProfile(1, 4, 2, half_life=0))) for _ in range(2))
    assert batches.counted.tolist() == [5, 3, 300]  # (counted as the cache's counters changed)
    rows.bind([first, second])
    assert first.share.counts[:3] == [3, 1, 100] and second.share.counts[:3] == [2, 2, 200]
    assert first.share.observed.counts.tolist() == [[1, 1, 0, 0]] and first.share.observed.tokens == 1
    assert second.share.observed.counts.tolist() == [[0, 0, 1, 1]] and second.share.observed.tokens == 1
    rows.count(np.array([[1, 0, 0], [0, 1, 0]]))  # bound: at once
    assert first.share.counts[:3] == [4, 1, 100] and second.share.counts[:3] == [2, 3, 200]
    # a prompt batch's call of 2 tokens a row, the first row's second token right padding
    CallRows(batches, 2, [first, second], real=np.array([1, 2])).learn(
        LayerCall(0, 0, np.array([[0, 1], [2, 3], [1, 2], [1, 3]]), None, 4, [0, 1, 2, 3], None, None, 4))
    assert first.share.observed.counts.tolist() == [[2, 2, 0, 0]] and first.share.observed.tokens == 2
    assert second.share.observed.counts.tolist() == [[0, 1, 2, 2]] and second.share.observed.tokens == 3


@pytest.mark.parametrize("cache", ["partial", "resident"])
def test_profiles_per_request_in_a_batch(tmp_path, cache, monkeypatch):
    """With --profiles requests are batched, and each one's profile learns exactly what it
    learns from that request served alone: its own routing, not the batch's (a batch's decode
    steps learnt at once: verified, or every expert resident)."""
    asked = [("Il gatto è sul tavolo e la lingua italiana", 24), ("The cat sat on the kernel option", 24)]
    def fresh(name):  # a fresh copy of the stored profiles
        (tmp_path / name).mkdir()
        return copy_profiles(tmp_path / name)

    alone = []
    for prompt, n in asked:
        served = start(1, fresh(f"alone{len(alone)}"), **CACHES[cache])
        try:
            text, usage = complete(served, prompt, n)
            alone.append((text, usage, served.generator.profiles.by_name))
        finally:
            served.stop()
    names = [usage["profile"] for _, usage, _ in alone]
    assert sorted(names) == ["english", "italian"]  # they take different profiles
    stepped, real = [], CallRows.learn_step
    monkeypatch.setattr(CallRows, "learn_step", lambda self, *a: stepped.append(self.size) or real(self, *a))
    served = start(8, fresh("batch"), **CACHES[cache])
    try:
        got = together(served, asked)
        idle(served)
        learnt = served.generator.profiles.by_name
    finally:
        served.stop()
    assert all(usage["batch_largest"] == 2 for _, usage in got), got  # batched together
    assert [text for text, _ in got] == [text for text, _, _ in alone]
    assert [usage["profile"] for _, usage in got] == names
    assert 2 in stepped  # (a batch's decode steps learnt at once)
    for name, (_, usage, profiles) in zip(names, alone):
        assert learnt[name].tokens_total == profiles[name].tokens_total
        assert np.array_equal(learnt[name].counts, profiles[name].counts)
        assert np.allclose(learnt[name].mass, profiles[name].mass, rtol=1e-4, atol=1e-6)


def test_requests_wait_for_the_kv_reserve(solo):
    """A 600-token context holds two of these requests' KV, not three (rows x their longest
    need, in BatchKVCache's steps of 256 tokens)."""
    asked = [(p, 100) for p, _ in ASKED[:4]]
    served = start(8, memory_budget="46MB", max_context=600)
    try:
        got = in_threads(lambda p, n: complete(served, p, n), asked)
    finally:
        served.stop()
    alone = mlxmoe.load(mlxmoe.DEMO_MODEL)
    try:
        assert [text for text, _ in got] == [mlxmoe.generate(*alone, p, max_tokens=n) for p, n in asked]
    finally:
        alone[0].expert_cache.close()
    assert max(u["batch_largest"] for _, u in got) == 2


def open_request(served, body):
    """A raw client's request, once it is in the batch (a stream: its first token came)."""
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    got, tic = b"", time.monotonic()
    while b"data: " not in got if body["stream"] else not mlxmoe.api.generation_lock(served.model).locked():
        assert time.monotonic() - tic < 30
        got += sock.recv(4096) if body["stream"] else b""
        time.sleep(0 if body["stream"] else 0.05)
    time.sleep(0 if body["stream"] else 0.5)  # (a non-streaming client sees nothing: its prefill done by now)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_frees_its_batch_slot(stream):
    """Two long requests fill a batch of 2; the first's client leaves; a third request then
    completes while the second still runs: it took the slot the first left."""
    served = start(2, memory_budget="46MB")
    try:
        long = {"prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0, "stream": stream}
        first, second = open_request(served, long), open_request(served, long)
        first.close()
        tic = time.monotonic()
        text, usage = complete(served, PROMPTS[2], 4)
        assert time.monotonic() - tic < 15
        assert served.generator.served == 2  # the first (stopped) and this one; the second still runs
        assert usage["batch_largest"] == 2
        second.close()
        tic = time.monotonic()
        while served.generator.served < 3:
            assert time.monotonic() - tic < 15, "the second request still runs after its client left"
            time.sleep(0.05)
    finally:
        served.stop()


def test_the_budget_holds_with_16_clients():
    s = Server("--memory-budget", "46MB", "--max-batch", "16")
    try:
        got = in_threads(lambda i: s.client.completions.create(
            model="demo", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8 + i % 5, temperature=0),
            [(i,) for i in range(16)])
        assert all(not isinstance(r, str) for r in got), got
        assert max(r.usage.model_extra["mlxmoe"]["batch_largest"] for r in got) > 4
        stats = s.json("GET", "/v1/mlxmoe/stats")[2]
    finally:
        s.stop()
    assert stats["peak_memory"] <= 1.05 * stats["server"]["memory_budget"]


def admit_together(monkeypatch, n):
    """The batch admits no request until `n` wait, then admits them (by the KV reserve)."""
    admit, waiting = batching.Batches._admit, [True]

    def all_at_once(self):
        waiting[0] = waiting[0] and len(self._unprocessed_sequences) < n
        if waiting[0]:
            self.completion_batch_size = 0  # (mlx-lm's step does nothing: they wait)
        else:
            admit(self)
    monkeypatch.setattr(batching.Batches, "_admit", all_at_once)


def test_the_budget_holds_as_rows_leave_a_batch_of_16(monkeypatch):
    """16 requests admitted together (held back until all are in: the KV reserve's 16 rows of
    256 tokens), leaving at 5 different steps: a finished row's cache (for mlx-lm's prompt
    cache) is a slice of the batch's KV before the rows left, and the next step copies the rows
    kept; the old KV must go as the copy is made, not live beside it (1.08x the budget when it
    did)."""
    admit_together(monkeypatch, 16)
    asked = [(PROMPTS[i % len(PROMPTS)], 8 + i % 5) for i in range(16)]
    before = mx.get_active_memory()  # (what earlier tests left: not this server's)
    mx.reset_peak_memory()
    served = start(16, memory_budget="46MB")
    try:
        got = in_threads(lambda p, n: complete(served, p, n), asked)
        budget = served.model.expert_runtime.plan.budget
    finally:
        served.stop()
    assert sorted({u["batch_steps"] for _, u in got}) == [10, 11, 12, 13, 14]  # (and their prompts' two)
    assert [u["batch_largest"] for _, u in got] == [16] * 16
    assert mx.get_peak_memory() - before <= 1.05 * budget, (mx.get_peak_memory() - before) / budget


def test_the_budget_holds_with_16_prompts_of_every_length():
    """16 clients, twice, with held-out prompts of up to 200 characters, a budget near the model's
    minimum (the KV reserve a large share of it): rows join the prompt batch and leave it for
    the generation batch at different steps, and mlx-lm makes each move's KV as lazy copies of
    the batch's (a row's extracted cache too), held until a later step evaluates them. The old
    KV must go as the copies are made, and admission must count the padding that rows joining
    at other steps get: the peak stays under the budget with room (0.78x here; 1.00-1.11x
    when the copies were left lazy)."""
    asked = [(p, 16) for lang in ("en", "it", "de", "fr", "es") for p in heldout_prompts(lang, 8, 200)][:16]
    s = Server("--memory-budget", "43MB", "--max-batch", "16")
    try:
        for _ in range(2):
            got = in_threads(lambda p, n: s.client.completions.create(model="demo", prompt=p, max_tokens=n,
                                                                      temperature=0), asked)
            assert all(not isinstance(r, str) for r in got), got
        stats = s.json("GET", "/v1/mlxmoe/stats")[2]
    finally:
        s.stop()
    assert max(r.usage.model_extra["mlxmoe"]["batch_largest"] for r in got) > 4
    assert stats["peak_memory"] <= 0.95 * stats["server"]["memory_budget"], \
        stats["peak_memory"] / stats["server"]["memory_budget"]


def test_a_kept_prompt_cache_holds_each_rows_own_kv():
    """With a prompt cache (--prompt-cache-size), a batch's finished rows leave their caches
    in it: each row's own KV, made (one row, not slices of the batch's whole KV), and a
    request sent again is answered the same from it. Without one, the batches keep (extract) none."""
    asked = [(PROMPTS[i], 6 + i) for i in range(4)]
    served = start(4, prompt_cache_size=8)
    try:
        first = together(served, asked)
        kept = served.generator.prompt_cache
        assert len(kept) >= 4
        entries = list(_entries(kept._trie._trie))
        assert entries and all(c.keys.shape[0] == 1 and c.keys.shape[2] == c.offset
                               for e in entries for c in e.prompt_cache)
        again = together(served, asked)
    finally:
        served.stop()
    assert [t for t, _ in again] == [t for t, _ in first]
    served = start(4)
    try:
        together(served, asked)
        assert not served.generator.batches._generation_batch.keep
    finally:
        served.stop()


def _entries(node):
    """Every cache entry in a PromptTrie's nested dicts."""
    for key, child in node.items():
        if key == "__value__" or not isinstance(child, dict):
            yield child
        else:
            yield from _entries(child)


def test_batching_off_with_drafts_or_max_batch_1():
    model, tokenizer = mlxmoe.load(mlxmoe.DEMO_MODEL, memory_budget="46MB")
    try:
        def line(max_batch, draft=None, profiles=None):
            args = mlxmoe_server.cli_args("demo", 8, 0.0, 1.0, 0, max_batch=max_batch)
            provider = mlxmoe_server.Provider(args, model, tokenizer, draft)
            generator = SimpleNamespace(model_provider=provider, profiles=profiles, group=None)
            return provider.is_batchable, mlxmoe_server.batch_line(generator, max_batch)
        assert line(8) == (True, "; batches of up to 8 requests (within the KV reserve)")
        assert line(1) == (False, "; one request at a time (--max-batch 1)")
        assert line(8, NGram()) == (False, "; one request at a time (speculative decoding does not batch)")
        assert line(8, profiles=object()) == (True, "; batches of up to 8 requests (within the KV reserve, each "
                                                    "with its own profile)")
    finally:
        model.expert_cache.close()


@pytest.mark.parametrize("slots", [128, 64], ids=["resident", "half"])
def test_a_batchs_logprobs_are_each_requests_own(slots):
    """Requests batched together asking for logprobs (the legacy completions' top 3) are
    answered the values each gets alone (--max-batch 1: mlx-lm's one-sequence path), with every
    expert resident or half of them (the demo's 128) streamed."""
    asked = [(p, 5) for p in PROMPTS[:3]]
    answers = {}
    for max_batch in (8, 1):
        served = start(max_batch, cache_experts=slots)
        try:
            answers[max_batch] = together(served, asked, lambda p, n: served.client.completions.create(
                model="demo", prompt=p, max_tokens=n, temperature=0, logprobs=3))
            assert (served.model.expert_cache.stats()["misses"] > 0) == (slots < 128)
        finally:
            served.stop()
    assert max(r.usage.model_extra["mlxmoe"]["batch_largest"] for r in answers[8]) > 1  # (batched)
    for batched, alone in zip(*[[r.choices[0].logprobs for r in answers[b]] for b in (8, 1)]):
        assert batched.tokens == alone.tokens and len(batched.tokens) == 5
        assert batched.token_logprobs == pytest.approx(alone.token_logprobs, abs=1e-4)
        for ours, theirs in zip(batched.top_logprobs, alone.top_logprobs):
            assert ours.keys() == theirs.keys() and list(ours.values()) == pytest.approx(list(theirs.values()), abs=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_rows_logprobs_are_read_on_the_host(dtype):
    """mlx-lm's server loop reads each row's `logprobs[token].item()` at every token: from a
    batch's row it is read from the evaluated array's memory (not an op queued behind the
    next step), the same value in every dtype; its top tokens (top_logprobs) as the array's."""
    row = (mx.random.normal((1000,), key=mx.random.key(0)) * 4).astype(getattr(mx, dtype))
    mx.eval(row)
    host = batching.HostRow(row)
    for token in (0, 17, 999):
        read = host[token]
        assert not isinstance(read, mx.array) and read.item() == row[token].item()
    tokenizer = SimpleNamespace(convert_ids_to_tokens=lambda ids: [str(i) for i in ids])
    assert mlx_server._format_top_logprobs(host, 3, tokenizer) == mlx_server._format_top_logprobs(row, 3, tokenizer)


@pytest.mark.parametrize("room", [0, 1 << 40])
@pytest.mark.parametrize("kind", ["Prompts", "Decoding"])
def test_rows_leaving_a_batch_free_their_kv_at_once(kind, room):
    """A row removed from a batch (a client gone mid-prefill or mid-decode): mlx-lm's filter
    makes each layer's KV a lazy gather of the old, which would keep the whole batch's KV alive
    beside it until a later step; ours evaluates it there, so the removed row's share is freed
    (a layer at a time where the budget has no room, at once where it has)."""
    layers, rows, shape = 4, 4, (8, 256, 64)  # 4 rows of 8 heads x 256 tokens x 64, float32: 2 MB a layer
    batch = getattr(batching, kind).empty(None, None)
    batch.room = lambda: room
    cache = [mlx_lm_cache.BatchKVCache([0] * rows) for _ in range(layers)]
    for c in cache:
        c.update_and_fetch(mx.ones((rows, *shape)), mx.ones((rows, *shape)))
        mx.eval(c.keys, c.values)
    batch.prompt_cache, batch.uids = cache, list(range(rows))
    for name in ("tokens", "samplers", "logits_processors", "max_tokens", "stop_sequences", "_next_logprobs",
                 "_token_context", "_num_tokens", "_matchers"):
        setattr(batch, name, [None] * rows)
    batch._next_tokens = mx.zeros(rows, dtype=mx.int32)
    before = mx.get_active_memory()
    batch.filter([0])
    gc.collect()
    freed = before - mx.get_active_memory()
    whole = layers * 2 * rows * np.prod(shape) * 4
    assert freed >= 0.7 * whole, (freed, whole)


def test_kv_changes_are_evaluated_as_many_layers_at_once_as_the_budget_has_room_for(monkeypatch):
    """settle_kv (rows joining or leaving a batch): one wait on the device for as many layers'
    new KV as `room` bytes hold, at least one layer a wait; in a server whose budget has room
    for all of it, a batch's joins and leaves take one wait each."""
    class KV:
        def __init__(self):
            self.keys, self.values = mx.ones((2, 4, 16, 8)), mx.zeros((2, 4, 16, 8))

        @property
        def state(self):
            return self.keys, self.values
    evals, real = [], mx.eval
    monkeypatch.setattr(batching.mx, "eval", lambda *a: evals.append(len(a[0])) or real(*a))
    layer = 2 * 2 * 4 * 16 * 8 * 4  # one layer's keys and values, float32
    for room, expected in ((0, [1] * 6), (layer + 1, [1] * 6), (3 * layer, [3, 3]), (4 * layer, [4, 2]),
                           (1 << 30, [6])):
        evals.clear()
        batching.settle_kv([KV() for _ in range(6)], room=room)
        assert evals == expected, (room, evals)
    monkeypatch.undo()
    groups, layer_groups = [], batching.layer_groups  # evaluations per KV change
    # (arrays other tests left alive in this process are not this server's: its room is its own)
    held, active = mx.get_active_memory(), mx.get_active_memory
    monkeypatch.setattr(batching.mx, "get_active_memory", lambda: active() - held)

    def spy(layers, room):
        out = layer_groups(layers, room)
        groups.append(len(out))
        return out
    monkeypatch.setattr(batching, "layer_groups", spy)
    served = start(8, cache_experts=128)
    try:
        together(served, ASKED[:3])
        idle(served)
    finally:
        served.stop()
    assert groups.count(1) >= 3 and set(groups) <= {0, 1}, groups  # (0: a change of no layers' KV)


@pytest.mark.parametrize("max_batch", [8, 1])
def test_a_stop_answers_503_to_requests_it_cuts_short_or_never_began(max_batch):
    """The server stops (SIGTERM's path) while one long request generates and three wait (one
    streaming): none gets a 200 that looks whole (mlx-lm's handler ends any answer so, finish
    "stop"); each gets a 503 with Retry-After, batched or one at a time. (The stats route
    during the server's first generation: the idle cache's, said to be busy.)"""
    served = start(max_batch, memory_budget="46MB")
    no_eos = {"0": -100, "2": -100}  # (the demo's end tokens: the long one runs till stopped)
    got = {}

    def ask(i):
        try:
            kw = dict(model="demo", prompt=PROMPTS[i], temperature=0, max_tokens=3000 if i == 0 else 8,
                      logit_bias=no_eos)
            if i == 3:
                got[i] = "".join(c.choices[0].text for c in served.client.completions.create(stream=True, **kw))
            else:
                got[i] = served.client.completions.create(**kw).choices[0].finish_reason
        except openai.APIStatusError as e:
            got[i] = (e.status_code, e.response.headers.get("retry-after"), e.message)

    def stats():
        connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
        connection.request("GET", "/v1/mlxmoe/stats")
        return json.loads(connection.getresponse().read())

    idle = stats()
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    threads[0].start()
    lock, tic = mlxmoe.api.generation_lock(served.model), time.monotonic()
    while not lock.locked():  # the long one generates
        assert time.monotonic() - tic < 30
        time.sleep(0.02)
    busy = stats()  # (the server's first generation: the stats of the idle cache, said to be busy)
    assert idle["busy"] is False and busy["busy"] is True
    assert busy["tokens"] == idle["tokens"] and busy["server"]["requests"] == 0
    for t in threads[1:]:
        t.start()
    def queued():  # the three behind it: in the batch (waiting for admission), or in mlx-lm's queue
        batches = served.generator.batches
        return len(batches.requests) == 4 if max_batch > 1 and batches is not None else \
            served.generator.requests.qsize() == 3
    while not queued():
        assert time.monotonic() - tic < 30
        time.sleep(0.02)
    served.stop()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert sorted(got) == [0, 1, 2, 3]
    for i, answer in got.items():
        assert answer[:2] == (503, "1") and "shutting down" in answer[2], (i, answer)


def test_a_request_after_the_generation_stopped_gets_503():
    """A kept-alive connection's request after the server's generation stopped (its HTTP side
    still up, as it is while serve waits for the answers in flight): 503, not mlx-lm's 404
    'generation thread died'."""
    served = start(1, memory_budget="46MB")
    try:
        served.generator.stop_and_join()
        with pytest.raises(openai.APIStatusError) as e:
            complete(served, PROMPTS[0], 4)
    finally:
        served.stop()
    assert e.value.status_code == 503 and "shutting down" in e.value.message, e.value


def test_bench_decode_rate_counts_the_time_some_request_decodes():
    """bench_batch's generated tok/s while decoding: tokens after each request's first over the
    union of their first-to-last spans (overlapping spans count once, gaps of prefill not at all)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from bench_batch import decode_rate
    # two overlapping requests (0-1, 0.5-2: 2 s together), then one alone after a gap (3-4)
    assert decode_rate([(3, 4, 6), (0, 1, 11), (0.5, 2, 11)]) == pytest.approx(25 / 3)
    assert decode_rate([(0, 2, 11), (0.5, 1, 11)]) == pytest.approx(20 / 2)  # one inside the other
    assert decode_rate([(1, 1, 1)]) is None  # one token: nothing decoded after it
