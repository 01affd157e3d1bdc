"""Host synchronisations per MoE layer call in the decode loop.

A sync is the decode thread waiting for the device on mlxmoe's behalf: a blocking
`mx.eval` called from mlxmoe's code, or mlxmoe's code reading an array on the host
(`np.array`/`np.asarray`, `.item()`, `.tolist()`) that no earlier mlxmoe `mx.eval` covered
and that was made in the current token or the one before (mlx-lm's loop has waited for
the token before the one it is building: arrays of older tokens are on the host already;
this is the resident path's premise, see experts.ResidentCalls). `mx.async_eval` does not
block and is counted apart.

Targets: with every expert resident no sync per layer call; streaming at half the
experts exactly one per decode layer call (the routing, the lookahead and the router's
probabilities in one `mx.eval`). Running ahead (speculate.py) computes while the decode
thread waits for reads: its syncs and layer calls are counted apart (`ahead`)."""

import sys
import threading

import mlx.core as mx
import numpy as np
import pytest

import mlxmoe
import synthetic
from mlxmoe.caching.experts import ResidentCalls, StreamingExperts, host_work_meanwhile, resident_table, wait_for

PROMPT = "The quick brown fox jumps over the lazy dog. Il gatto"
TOKENS = 12


def _from_mlxmoe(depth=2):
    return sys._getframe(depth).f_globals.get("__name__", "").startswith("mlxmoe")


class SyncCounter:
    """Counts, per decode layer call (one token), the syncs mlxmoe's code makes on the
    decode thread; installed with pytest's monkeypatch."""

    def __init__(self, monkeypatch):
        self.thread = threading.get_ident()
        self.calls = []  # per decode layer call: [syncs, async evals, layer, streamed]
        self.current = None
        self.ahead = 0  # syncs while running ahead
        self.speculator = None
        self.token = 0
        self.made = {}  # id -> (array, token it was made in) for arrays layer calls made or got
        self.covered = {}  # id -> array evaluated by an mlxmoe mx.eval
        eval_, async_eval, array, asarray = mx.eval, mx.async_eval, np.array, np.asarray
        counter = self

        def counted_eval(*args, **kw):
            if counter._mine():
                counter._sync()
                for a in args:
                    for x in (a if isinstance(a, (list, tuple)) else [a]):
                        if isinstance(x, mx.array):
                            counter.covered[id(x)] = x
            return eval_(*args, **kw)

        def counted_async_eval(*args, **kw):
            if counter._mine() and counter.current is not None:
                counter.current[1] += 1
            return async_eval(*args, **kw)

        def reader(fn):
            def read(obj, *args, **kw):
                if isinstance(obj, mx.array) and counter._mine():
                    counter._read(obj)
                return fn(obj, *args, **kw)
            return read

        def call(module, x, indices):
            counter.speculator = module._cache.speculator
            if counter._running_ahead():
                return orig_call(module, x, indices)
            decode = x.size == x.shape[-1]
            if decode and module._layer == 0:
                counter.token += 1
            counter.made[id(indices)] = (indices, counter.token)
            outer = counter.current
            counter.current = [0, 0, module._layer, None] if decode else None
            try:
                streamed = resident_table(module._cache) is None
                y = orig_call(module, x, indices)
            finally:
                if counter.current is not None:
                    counter.current[3] = streamed
                    counter.calls.append(counter.current)
                counter.current = outer
            return y

        def made(fn):
            def make(module, *args):
                p = fn(module, *args)
                if p is not None:
                    counter.made[id(p)] = (p, counter.token)
                return p
            return make

        orig_call = StreamingExperts.__call__
        monkeypatch.setattr(mx, "eval", counted_eval)
        monkeypatch.setattr(mx, "async_eval", counted_async_eval)
        monkeypatch.setattr(np, "array", reader(array))
        monkeypatch.setattr(np, "asarray", reader(asarray))
        for name in ("item", "tolist"):
            monkeypatch.setattr(mx.array, name, reader(getattr(mx.array, name)))
        monkeypatch.setattr(StreamingExperts, "__call__", call)
        for name in ("_probs", "_logits"):  # the router's arrays the host work reads
            monkeypatch.setattr(StreamingExperts, name, made(getattr(StreamingExperts, name)))
        pack = ResidentCalls.pack

        def packed(work, table):  # decode steps' routing joined on the device, at the last one's last layer call
            arrays = pack(work, table)
            for a in arrays:
                counter.made[id(a)] = (a, counter.token)
            return arrays
        monkeypatch.setattr(ResidentCalls, "pack", packed)

    def _mine(self):
        return threading.get_ident() == self.thread and _from_mlxmoe(3)

    def _running_ahead(self):
        return self.speculator is not None and self.speculator.running is not None

    def _sync(self):
        if self._running_ahead():
            self.ahead += 1
        elif self.current is not None:
            self.current[0] += 1

    def _read(self, x):
        if id(x) in self.covered:
            return
        made = self.made.get(id(x))
        if made is not None and made[0] is x and made[1] <= self.token - 2:
            return
        self._sync()

    def run(self, model, tokenizer):
        return [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]


def counts(calls, streamed):
    return [c[0] for c in calls if c[3] is streamed]


@pytest.fixture(params=["demo", *synthetic.ARCHS])
def model_path(request, checkpoint):
    return mlxmoe.DEMO_MODEL if request.param == "demo" else checkpoint(request.param)


def test_resident_decode_makes_no_sync(model_path, monkeypatch):
    model, tokenizer = mlxmoe.load(str(model_path))
    cache = model.expert_cache
    assert cache.prewarm_done(timeout=120)
    counter = SyncCounter(monkeypatch)
    counter.run(model, tokenizer)
    cache.close()
    resident = counts(counter.calls, False)
    assert len(resident) >= (TOKENS - 1) * cache.store.num_layers and not counts(counter.calls, True)
    assert set(resident) == {0}, f"syncs per resident layer call: {sorted(set(resident))}"


def test_streamed_decode_makes_one_sync(model_path, monkeypatch):
    """With a wait per layer call (verify=False; verified decode steps: tests/test_verify.py)."""
    model, tokenizer = mlxmoe.load(str(model_path), cache_experts=None)
    total = model.expert_cache.capacity
    model.expert_cache.close()
    model, tokenizer = mlxmoe.load(str(model_path), cache_experts=total // 2, verify=False)
    cache = model.expert_cache
    counter = SyncCounter(monkeypatch)
    counter.run(model, tokenizer)
    cache.close()
    streamed = counts(counter.calls, True)
    assert len(streamed) >= (TOKENS - 1) * cache.store.num_layers
    assert set(streamed) == {1}, f"syncs per streamed layer call: {sorted(set(streamed))}"


def test_counter_sees_a_read_of_this_tokens_routing(monkeypatch):
    """The counter is not blind: a resident layer that reads its routing at once (as the
    streamed path does, without its mx.eval) or calls .item() on it shows one sync each."""
    model, tokenizer = mlxmoe.load(str(mlxmoe.DEMO_MODEL))
    assert model.expert_cache.prewarm_done(timeout=120)
    scope = {"__name__": "mlxmoe.canary", "np": np, "resident": StreamingExperts._resident}
    exec("def eager(self, x, indices, table):\n"
         "    np.array(indices)\n"
         "    indices.reshape(-1)[0].item()\n"
         "    return resident(self, x, indices, table)\n", scope)  # counted as mlxmoe's code
    eager = scope["eager"]
    monkeypatch.setattr(StreamingExperts, "_resident", eager)
    counter = SyncCounter(monkeypatch)
    counter.run(model, tokenizer)
    model.expert_cache.close()
    assert set(counts(counter.calls, False)) == {2}


def test_streamed_decode_updates_the_policy_before_its_wait(monkeypatch):
    """The earlier layers' deferred policy updates (the hits) are done while the device
    computes up to a layer's router, not after its wait: none is left in `deferred` when a
    decode layer call waits, while some were there when calls began."""
    import mlx_lm
    from mlxmoe.caching.cache import Residency

    model, tokenizer = mlxmoe.load(str(mlxmoe.DEMO_MODEL), cache_experts=64, verify=False, prefetch=0)
    cache = model.expert_cache
    pending = lambda: sum(getattr(w, "__func__", None) is Residency._hit for w, _ in cache.deferred)
    at_wait, at_call = [], []
    eval_, call = mx.eval, StreamingExperts._call

    def counted_eval(*args, **kw):
        if sys._getframe(1).f_code is wait_for.__code__:
            at_wait.append(pending())
        return eval_(*args, **kw)

    def counted_call(module, x, indices):
        at_call.append(pending())
        return call(module, x, indices)

    monkeypatch.setattr(mx, "eval", counted_eval)
    monkeypatch.setattr(StreamingExperts, "_call", counted_call)
    tokens = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]
    cache.close()
    monkeypatch.undo()
    stock, stock_tokenizer = mlx_lm.load(str(mlxmoe.DEMO_MODEL))
    assert tokens == [r.token for r in mlx_lm.stream_generate(stock, stock_tokenizer, PROMPT, max_tokens=TOKENS)]
    assert len(at_wait) >= (TOKENS - 1) * cache.store.num_layers
    assert sum(at_call) > 0, "no layer call found hits of earlier layers deferred: the test shows nothing"
    assert set(at_wait) == {0}, f"deferred hits at a layer's wait: {sorted(set(at_wait))}"


def test_streamed_decode_hands_the_policy_updates_to_the_host_thread(monkeypatch):
    """With the prefetcher's host thread running, a decode layer call's wait leaves the
    earlier layers' deferred policy updates to that thread (done while the device computes,
    off the decode thread): the decode thread does none before its waits, the host thread
    does them, and the tokens are stock's."""
    import mlx_lm
    from mlxmoe.caching.cache import Residency

    model, tokenizer = mlxmoe.load(str(mlxmoe.DEMO_MODEL), cache_experts=64, verify=False)
    cache = model.expert_cache
    assert cache.prefetcher is not None and cache.prefetcher.off_thread
    decode_thread = threading.get_ident()
    at_wait, updates = [], {"decode": 0, "host": 0}
    catch_up, together = Residency.catch_up, Residency._together

    def counted_catch_up(self, *args, **kw):
        if sys._getframe(1).f_code is host_work_meanwhile.__code__ and threading.get_ident() == decode_thread:
            at_wait.append(len(self.deferred))
        return catch_up(self, *args, **kw)

    def counted_together(self, *args, **kw):
        updates["decode" if threading.get_ident() == decode_thread else "host"] += 1
        return together(self, *args, **kw)

    monkeypatch.setattr(Residency, "catch_up", counted_catch_up)
    monkeypatch.setattr(Residency, "_together", counted_together)
    tokens = [r.token for r in mlxmoe.stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]
    cache.flush()
    left = len(cache.deferred)
    cache.close()
    monkeypatch.undo()
    stock, stock_tokenizer = mlx_lm.load(str(mlxmoe.DEMO_MODEL))
    assert tokens == [r.token for r in mlx_lm.stream_generate(stock, stock_tokenizer, PROMPT, max_tokens=TOKENS)]
    assert at_wait == [], f"the decode thread did deferred policy updates at {len(at_wait)} waits"
    assert updates["host"] > 0, f"the host thread did no deferred policy update: {updates}"
    assert left == 0


def test_resident_steps_are_queued_whole(monkeypatch):
    """Every expert resident, a step is queued whole as stock queues it, not layer call by
    layer call; the routing of JOIN_TOKENS decode steps is queued once, with the last one's
    last layer call, and read in one host copy two tokens on."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxmoe.caching import experts, verify

    model, _ = mlxmoe.load(str(mlxmoe.DEMO_MODEL))
    cache = model.expert_cache
    assert cache.prewarm_done(timeout=120)
    queued = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (queued.append(sys._getframe(1).f_code.co_name), real(*a))[1])
    kv = make_prompt_cache(model)
    for tokens in (verify.STEP_TOKENS + 4, 4):
        queued.clear()
        mx.eval(model(mx.array([list(range(5, 5 + tokens))]), cache=kv))
        assert "_resident" not in queued, tokens
    reads, joined_rows = [], experts.JOIN_TOKENS * cache.store.num_layers  # (the prompts' calls read theirs)
    monkeypatch.setattr(np, "asarray", lambda a, *args, real=np.asarray, **kw: (
        reads.extend([a] if isinstance(a, mx.array) and a.shape[0] == joined_rows else []), real(a, *args, **kw))[1])
    for step in range(2 * experts.JOIN_TOKENS + 2):
        queued.clear()
        mx.eval(model(mx.array([[7 + step]]), cache=kv))
        assert queued.count("_resident") == (1 if step % experts.JOIN_TOKENS == experts.JOIN_TOKENS - 1 else 0), step
        # (the first batch is read two tokens after its last step, then no more until the next's)
        assert len(reads) == (step >= experts.JOIN_TOKENS + 1) + (step >= 2 * experts.JOIN_TOKENS + 1), step
    cache.close()
