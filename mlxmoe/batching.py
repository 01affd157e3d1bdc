"""Batched serving (`serve --max-batch N`): mlx-lm's BatchGenerator on the mlxmoe model,
driven by mlx-lm's own server loop (mlx_lm/server.py ResponseGenerator._generate).

A decode step of B requests calls the model with inputs [B, 1]: where the verified mode is on
(caching/verify.py) it is verified as one step of B tokens (no wait at a layer whose rows'
experts are all resident; a replay trims each row's token), else the expert cache takes it as
it takes a prefill (experts.StreamingExperts._call: the union of the rows' experts is fetched
once, in groups where it exceeds the cache). Running ahead acts on a KVCache or
RotatingKVCache only.
Prompts admitted together are prefilled together: P of them in steps of the planned prefill
step / P tokens each (a step's tokens stay what the budget's working reserve was planned for);
each layer's experts are read once for the P prompts.

- Admission by the KV reserve: a request needs its prompt and max_tokens of KV; the batch's
  BatchKVCache holds every row as long as its longest (a row that joins is padded to the
  batch's length), in steps of 256 tokens, so a request joins while rows x (the batch's
  length + the largest need, rounded up to the step) stays within the tokens the reserve
  holds (the plan's context); else it waits, in order. (A request alone always fits: its
  max_tokens is cut to the context.)
- Stats per request: each row (request) of a model call counts its own (CallRows, the
  cache's `rows` during the call; experts.count_rows): its distinct experts per layer call,
  hits where resident when the call came, misses the rest, the bytes the call read shared by
  the rows that routed to each expert read; the cache counts them so too (a call counts each
  row's experts, not their union once). A prompt batch's rows count their prompts' tokens,
  not the right padding of the shorter ones (Prompts). On the resident path a step's host
  work (its hits) is done a step or two later (experts.ResidentCalls) and still goes to its
  own rows; a request's is flushed when it ends. What else changed in the counters since the
  last call (background reads) is shared by the call's rows evenly (the remainder to the
  first rows), the batch's last work by its last rows. So the requests' add up to the
  cache's totals.
- Profiles per request: each request's routing is learnt apart (its `observed` profile, each
  row's part of a layer call: CallRows.learn), as a request alone: at its first token it is
  matched to a stored profile (--profiles; server.ResponseGenerator.decide), which steers the
  cache from then on (the last matched does, for the whole batch); when it ends, the live
  profile and its stored one learn its routing (server.ResponseGenerator.learn), and at a
  stop those still in the batch end so (Batches.end), their replies told ShuttingDown (a
  503, or a stream cut short: not an answer that looks whole).
- A request whose client left (Client.gone, at every step) is stopped through mlx-lm's own
  cancellation (GenerationContext.stop) and its reply ended: its slot goes to the next.
- A step that fails (a shard changed under the server...) fails the requests in the batch.
- The model's generation lock is held while the batch holds requests.
- mlx-lm's loop reads each row's logprob of its token at every step: from host memory
  (HostRow), not an op that would wait for the step queued after it, once a row.
"""

import itertools

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import server as mlx_server
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache

from . import distributed
from .api import generation_lock, prefill_step
from .caching.experts import summary

COUNTS = ("hits", "misses", "read", "skipped", "biased", "substituted")


def counters(cache):
    """The cache's counters a request's usage reports, in COUNTS' order."""
    with cache.lock:
        c = cache.counters
        return c.hits, c.misses, c.demand_bytes + c.prefetch_bytes, c.skipped, c.biased, c.substituted


def usage(counts, profile, **extra):
    """usage.mlxmoe of a request from its `counts` (COUNTS' order)."""
    hits, misses, read, skipped, biased, substituted = counts
    return {"expert_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "expert_hits": hits, "expert_misses": misses,
            "mb_read": read / (1 << 20),  # MB as budgets count them
            "profile": profile, "experts_skipped": skipped, "experts_biased": biased,
            "experts_low_bit": substituted, **extra}


def shares(counts, rows):
    """`counts` shared by `rows` rows: evenly, the remainder to the first rows (they add up)."""
    return [[c // rows + (i < c % rows) for c in counts] for i in range(rows)]


class Share:
    """A batched request's part: its KV need (tokens), counts, model calls and their rows, and
    its routing (`observed`, an ActivationProfile: server.ResponseGenerator.observer)."""

    def __init__(self, need, observed):
        self.need, self.counts, self.steps, self.rows, self.largest = need, [0] * len(COUNTS), 0, 0, 0
        self.observed = observed

    def add(self, counts, rows=0):
        """Counts of a model call of `rows` rows (0: of no call, the host work left at the end)."""
        self.counts = [a + b for a, b in zip(self.counts, counts)]
        self.steps += rows > 0
        self.rows += rows
        self.largest = max(self.largest, rows)

    def usage(self, profile):
        """usage.mlxmoe, with the model calls it took part in and their mean and largest rows."""
        return usage(self.counts, profile, batch_steps=self.steps, batch_mean=self.rows / max(1, self.steps),
                     batch_largest=self.largest)


class CallRows:
    """A model call's rows (sequences) of the batch: what its layer calls count per row
    (experts.count_rows) and their routing (learnt in the live profile's stead: learn) go to
    each row's request, its `share`; before the requests are known (`bind`), they wait.
    `requests`: one per row (None: a row no request holds any more); `real`: each row's
    first tokens that are its own (the rest right padding of a prompt batch), or None: all."""

    def __init__(self, batches, size, requests=None, real=None):
        self.batches, self.size, self.requests, self.waiting, self.real = batches, size, requests, [], real

    def bind(self, requests):
        with self.batches.cache.lock:
            self.requests = requests
            for work, arg in self.waiting:
                work(arg)
            self.waiting = []

    def count(self, per_row):
        """[hits, misses, bytes read] per row (under the cache's lock, as the counters change)."""
        self.batches.counted += per_row.sum(axis=0)
        self._given(self._count, per_row)

    def learn(self, call):
        """A layer call (experts.LayerCall), each row's tokens learnt by its request's profile."""
        self._given(self._learn, call)

    def learn_step(self, layers, experts, mass):
        """A decode step's layer calls at once (ResidentCalls, Verifier): each row's distinct
        experts (`experts` [layers, rows, k]) and router distributions (`mass` [layers, rows,
        experts]) learnt by its request's profile."""
        self._given(self._learn_step, (layers, experts, mass))

    def _given(self, work, arg):
        if self.requests is None:
            self.waiting.append((work, arg))
        else:
            work(arg)

    def _count(self, per_row):
        for request, counts in zip(self.requests, per_row.tolist()):
            if request is not None and request.share is not None:
                request.share.counts[:3] = [a + b for a, b in zip(request.share.counts, counts)]

    def _learn_step(self, step):
        layers, experts, mass = step
        at_layers = np.repeat(layers, experts.shape[-1])
        for i, request in enumerate(self.requests):
            if request is not None and request.share is not None:
                request.share.observed.observe_step(layers, at_layers, experts[:, i].reshape(-1), mass[:, i],
                                                    1 if layers[0] == 0 else 0)

    def _learn(self, call):
        tokens = call.tokens // self.size
        for i, request in enumerate(self.requests):
            real = tokens if self.real is None else int(self.real[i])
            if request is None or request.share is None or not real:
                continue
            if self.size == 1 and real == tokens:  # (as it is: a decode step's, the experts a lossy mode kept)
                request.share.observed.learn(call)
                continue
            part = slice(i * tokens, i * tokens + real)
            experts, scores, mean = summary(call.rows[part], None if call.probs is None else call.probs[part])
            observed = request.share.observed
            if call.ticked:
                observed.tick(real)
            observed.observe(call.layer, experts, scores, mean)


def settle_kv(*caches, room: int = 0) -> None:
    """Evaluate these KV caches (lists of one cache a layer), as many layers at once as `room`
    bytes hold of their new arrays, at least one (each evaluation is a wait on the device).
    Where mlx-lm made each layer's new arrays from the old (prompts joining or leaving a batch,
    rows leaving: copies, gathers and concatenations, left lazy), the old then go a group at a
    time, instead of living beside their copies until a later step evaluates them all."""
    layers = [[c.state for c in layer] for layer in zip(*[c for c in caches if c])]
    for group in layer_groups(layers, room):
        mx.eval(layers[group])


def layer_groups(layers: list, room: int) -> list:
    """Slices of `layers` (each layer's arrays, lazy) of as many layers as `room` bytes hold."""
    nbytes = max((sum(a.nbytes for _, a in tree_flatten(layer) if isinstance(a, mx.array)) for layer in layers),
                 default=0)
    n = max(1, room // nbytes) if nbytes else len(layers) or 1
    return [slice(i, i + n) for i in range(0, len(layers), n)]


def absorb(batch, other, extend) -> None:
    """extend(other): `other`'s rows join `batch` (mlx-lm pads and concatenates each layer's KV,
    lazily); then `batch`'s KV is evaluated as settle_kv does and `other`'s let go with it
    (mlx-lm holds `other` until its step's end: its KV would live beside the copy till then)."""
    joining = other.prompt_cache
    extend(other)
    if joining is batch.prompt_cache:  # (`batch` was empty: it took `other`'s KV as it is)
        settle_kv(joining, room=batch.room())
        return
    states = [ours.state for ours in batch.prompt_cache]
    for group in layer_groups(states, batch.room()):
        mx.eval(states[group])
        for theirs in joining[group]:
            theirs.keys = theirs.values = None


def made(batch, idx: int, extract) -> list:
    """Row `idx`'s cache extracted from `batch` (extract(idx): lazy slices of the whole batch's
    KV), evaluated: mlx-lm's server holds it a while (the last one it saved, in a loop
    variable; a finished row's response, through the next step), and lazy it would keep the
    batch's KV as it was alive beside the batch's next (1.6x the budget with 16 clients).
    Nothing ([]) where the server's prompt cache keeps nothing (`batch.keep` false): it would
    drop the copy at once."""
    if not batch.keep:
        return []
    cache = extract(idx)
    mx.eval([c.state for c in cache])
    return cache


class Prompts(PromptProcessingBatch):
    """mlx-lm's prompt batch, keeping its prefill's prompt lengths and the tokens fed so far:
    beyond its length a row is right padding (Batches.rows_of); its KV is settled where
    prompts join it or leave it (absorb, filter), a row's cache made where extracted (made)."""

    lengths, fed = np.zeros(0, dtype=np.int64), 0
    keep = True  # whether the server's prompt cache keeps a row's cache (made)
    room = staticmethod(lambda: 0)  # bytes free for a KV change's new arrays (Batches.kv_room)
    splitting = False  # (within split: both parts are settled together)

    def prompt(self, tokens):
        self.lengths, self.fed = np.array([len(t) for t in tokens]), 0
        super().prompt(tokens)

    def extend(self, batch):
        absorb(self, batch, super().extend)

    def filter(self, keep):  # (remove: a prompt whose client left)
        super().filter(keep)
        if not self.splitting:
            settle_kv(self.prompt_cache, room=self.room())

    def split(self, indices):
        # (mlx-lm's copy shares the KV's buffers: each part settled alone would hold the whole
        # old KV beside the first part's new one)
        self.splitting = True
        try:
            taken = super().split(indices)
        finally:
            self.splitting = False
        taken.splitting = False
        settle_kv(self.prompt_cache, taken.prompt_cache, room=self.room())
        return taken

    def _copy(self):
        copy = super()._copy()
        copy.splitting = self.splitting
        return copy

    def extract_cache(self, idx):
        return made(self, idx, super().extract_cache)


class HostRow:
    """A row's logprobs (a batch's row, or a sequence's token) as mlx-lm's server loop reads
    them at each token (`[token].item()`): read from the evaluated array's memory. Indexing the
    array is a new op, computed behind the step mlx-lm has queued: each row's read would wait
    for all of that step, and the host would build none of the next meanwhile. Other reads
    (top_logprobs) get the array."""

    def __init__(self, row):
        self.row = row
        if row.dtype == mx.bfloat16:  # (no such numpy dtype: its bits are float32's upper half)
            self.host, self.bits = None, np.frombuffer(memoryview(row), dtype=np.uint16)
        else:
            self.host, self.bits = np.asarray(row), None

    def __getitem__(self, index):
        if not isinstance(index, (int, np.integer)):
            return self.row[index]
        if self.bits is not None:
            return (np.array([self.bits[index]], dtype=np.uint32) << 16).view(np.float32)[0]
        return self.host[index]

    def __neg__(self):
        return -self.row


class Decoding(GenerationBatch):
    """mlx-lm's generation batch whose KV is settled where rows join or leave it (settle_kv), a
    finished row's cache made where extracted (made), each row's logprobs read on the host
    (HostRow)."""

    keep = True  # as Prompts.keep
    room = staticmethod(lambda: 0)  # as Prompts.room

    def next(self):
        responses = super().next()
        for response in responses:
            response.logprobs = HostRow(response.logprobs)
        return responses

    def extract_cache(self, idx):
        return made(self, idx, super().extract_cache)

    def extend(self, batch):
        # (the joining rows' first step, queued on their own KV, is computed before that KV goes)
        mx.eval([a for a in (batch._next_tokens, batch._next_logprobs) if a is not None])
        absorb(self, batch, super().extend)

    def filter(self, keep):
        super().filter(keep)
        settle_kv(self.prompt_cache, room=self.room())


class ShuttingDown(Exception):
    """The server stops before a request's answer is whole: its handler answers 503 (or cuts a
    stream short), so that the client knows to send it again."""

    def __init__(self):
        super().__init__("the server is shutting down before this request's answer was complete; send it again")


class Replies:
    """A request's reply queue as the batch loop fills it: it keeps the request's
    GenerationContext (to stop it) and ends its share before the reply's end (None, or
    ShuttingDown)."""

    def __init__(self, queue, request, finish):
        self.queue, self.request, self.finish = queue, request, finish
        request.replies, request.share, request.ctx = self, None, None

    def put(self, item):
        if isinstance(item, mlx_server.GenerationContext):
            self.request.ctx = item
        elif (item is None or isinstance(item, ShuttingDown)) and self.request.share is not None:
            self.request.shut_out = isinstance(item, ShuttingDown)  # (before its stream's headers: a 503)
            self.finish(self.request)
        self.queue.put(item)


class Rows:
    """The model as the batch calls it: its rows (CallRows, the expert cache's `rows` during the
    call) count and learn per row; after it, the counters' change is recorded with the KV
    cache the call ran on (which tells whose rows they were)."""

    def __init__(self, model, batches):
        self.model, self.batches = model, batches

    def __getattr__(self, name):  # (make_cache, layers: as mlx-lm's make_prompt_cache reads them)
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None, **kwargs):
        expert_cache = self.batches.cache
        rows = expert_cache.rows = self.batches.rows_of(cache, *inputs.shape[:2])
        try:
            out = self.model(inputs, cache=cache, **kwargs)
        finally:
            expert_cache.rows = None
        if rows.real is not None:  # (the tokens counted are the rows' own, not a prompt batch's right padding)
            with expert_cache.lock:
                expert_cache.counters.tokens -= inputs.size - int(rows.real.sum())
        self.batches.record(cache, rows)
        return out


class Batches(BatchGenerator):
    """mlx-lm's BatchGenerator with admission by the KV reserve, per-request shares of the
    cache's counters and stopping requests whose client left. `owner`: the server's
    ResponseGenerator (its `pending` request is the one the loop inserts next)."""

    def __init__(self, model, *, owner, **kwargs):
        super().__init__(Rows(model, self), **kwargs)
        self.base, self.owner, self.max_batch = model, owner, self.completion_batch_size
        self.max_prefill, self.step = self.prefill_batch_size, self.prefill_step_size
        owner.batches = self
        self.cache, self.lock, self.held = model.expert_cache, generation_lock(model), False
        self.requests, self.calls, self.last = {}, [], None  # uid -> request; this step's calls
        self.counted = np.zeros(3, dtype=np.int64)  # hits, misses, bytes given to rows since the last record
        self._empty_batches()

    def _empty_batches(self):
        self._prompt_batch = Prompts.empty(self.model, self.sampler, self.prefill_step_size)
        self._generation_batch = Decoding.empty(self.model, self.sampler)
        keep = getattr(getattr(self.owner, "prompt_cache", None), "max_size", 1) > 0
        self._prompt_batch.keep = self._generation_batch.keep = keep
        self._prompt_batch.room = self._generation_batch.room = self.kv_room

    def kv_room(self) -> int:
        """The bytes a KV change's new arrays may take beside what MLX holds now: the budget
        less it and the working memory (the step queued meanwhile computes in it)."""
        plan = self.base.expert_runtime.plan
        return plan.budget - plan.working - mx.get_active_memory()

    def insert_segments(self, segments, max_tokens=None, *args, **kwargs):
        uids = super().insert_segments(segments, max_tokens, *args, **kwargs)
        request = self.owner.pending
        request.share = Share(request.prompt_tokens + max_tokens[0], self.owner.observer(request))
        self.requests[uids[0]] = request
        return uids

    def rows_of(self, kv, size, tokens):
        """The CallRows of a model call of `size` rows of `tokens` on the KV cache `kv`: of the
        generation batch, or of the prompt batch (its rows' own tokens: within their prompts'
        lengths), in uids' order; else (those joining) known after the step."""
        uids, real, prompts = [], None, self._prompt_batch
        if kv is self._generation_batch.prompt_cache:
            uids = self._generation_batch.uids
        elif kv is prompts.prompt_cache:
            uids = prompts.uids
            if len(prompts.lengths) == size:
                real, prompts.fed = np.clip(prompts.lengths - prompts.fed, 0, tokens), prompts.fed + tokens
        return CallRows(self, size, [self.requests.get(u) for u in uids] if len(uids) == size else None, real)

    def record(self, kv, rows=None):
        """After a model call (`rows`: its CallRows): the counters' change beyond what its rows
        were given, to be shared by them (background reads, work left for later...)."""
        with self.cache.lock:
            now, given, self.counted = counters(self.cache), self.counted, np.zeros(3, dtype=np.int64)
        given = [*given.tolist(), 0, 0, 0]
        # whose KV it ran on, named rather than held (a joining batch's KV would outlive the step)
        whose = "generation" if kv is self._generation_batch.prompt_cache else \
            "prompts" if kv is self._prompt_batch.prompt_cache else None
        self.calls.append((whose, rows, [a - b - c for a, b, c in zip(now, self.last, given)]))
        self.last = now

    def _next(self):
        self.requests = {u: r for u, r in self.requests.items() if r.share is not None}
        for request in self.requests.values():
            if request.ctx is not None and (request.cancelled or request.client.gone()):
                request.ctx.stop()  # (mlx-lm's loop removes it at its next response)
        self._admit()
        self._prefill_chunk()
        if not self.held and self.requests:
            self.lock.acquire()
            with self.cache.lock:
                self.held, self.last, self.counted = True, counters(self.cache), np.zeros(3, dtype=np.int64)
            self.base.expert_runtime.new_sequence()
        gen_uids = list(self._generation_batch.uids)
        self.calls = []
        try:
            prompt_responses, gen_responses = super()._next()
        except Exception as e:  # noqa: BLE001 - each request in the batch gets the error
            return self._failed(e), []
        last = self._account(gen_uids, [r.uid for r in prompt_responses if r.end_of_prompt])
        for response in gen_responses:  # a request's first token: its profile, as one alone gets it then
            request = self.requests.get(response.uid)
            if request is not None and not request.decided.is_set():
                self.owner.decide(request, request.share.observed)
        if self._empty():
            self._settle(last)
        return prompt_responses, gen_responses

    def _empty(self):
        return not (self._unprocessed_sequences or len(self._prompt_batch) or len(self._generation_batch))

    def _settle(self, requests):
        """The batch has emptied: the host work left for later (resident path) is done now and
        counted to `requests` (the last rows), and the model is free again."""
        if self.held:
            self.cache.flush()
            self.record(None)
            for request, share in zip(requests, shares(self.calls.pop()[2], max(1, len(requests)))):
                request.share.add(share)
            self._release()

    def _admit(self):
        """Let the waiting requests in, in order, while the batch's KV stays within the reserve."""
        active = [*self._generation_batch.uids, *self._prompt_batch.uids]
        needs = [self.requests[u].share.need for u in active if u in self.requests]
        # the batches' length (BatchKVCache: rows right-justified to it): the prompt batch's
        # rows join the generation batch at theirs, which rows joining at other steps pad
        length = max((getattr(b.prompt_cache[0], "_idx", 0) for b in (self._generation_batch, self._prompt_batch)
                      if b.prompt_cache), default=0)
        context, step = self.owner.context, BatchKVCache.step  # (it grows by steps of `step` tokens)
        admitted = 0
        for sequence in self._unprocessed_sequences:
            request = self.requests.get(sequence[0])
            need = request.share.need if request is not None else context
            longest = -(-(length + max(needs + [need])) // step) * step
            full = len(active) + admitted >= self.max_batch
            if full or (active or admitted) and (len(needs) + 1) * longest > context:
                break
            needs.append(need)
            admitted += 1
        self.completion_batch_size = max(1, len(active) + admitted)
        # the admitted join the prompt batch now (mlx-lm's _next takes up to prefill_batch_size
        # less those prefilling)
        self.prefill_batch_size = max(1, min(self.max_prefill, len(self._prompt_batch) + admitted))

    def _prefill_chunk(self):
        """The tokens each prompt prefills at the next step: a prompt alone, the step it would
        take alone (api.prefill_step: its tokens and cached prefix); several, the step the
        working memory holds of that many rows against the longest's keys (their mask and
        masked scores are arrays a prompt alone does without), at least the planned step for
        the whole context, shared by them (a shorter prompt's right padding counts and learns
        for no one: Prompts)."""
        joining = list(itertools.islice(self._unprocessed_sequences, max(0, min(
            self.prefill_batch_size - len(self._prompt_batch),
            self.completion_batch_size - len(self._generation_batch), len(self._unprocessed_sequences)))))
        segments = [seq[0] for seq in self._currently_processing] + [seq[1] for seq in joining]
        prompts = sum(not (len(s) == 1 and len(s[0]) == 1) for s in segments)  # (the rest: to generation)
        if prompts:
            # the keys: the prompt batch's length (rows right-justified to it) and the most tokens
            # a prompt has left (a joining one's cached prefix among them)
            kv = self._prompt_batch.prompt_cache
            left = [sum(map(len, seq[0])) for seq in self._currently_processing]
            left += [sum(map(len, seq[1])) + max((getattr(c, "offset", 0) for c in seq[3] or []), default=0)
                     for seq in joining]
            keys = (getattr(kv[0], "_idx", 0) if kv else 0) + max(left)
            step = prefill_step(self.base.expert_runtime.plan, None, range(keys), rows=prompts)
            self.prefill_step_size = max(1, max(self.step, step) // prompts)
            self._prompt_batch.prefill_step_size = self.prefill_step_size  # (its own loop splits by it)

    def _account(self, gen_uids, joined):
        """Give this step's calls their rows where not known at the call: the generation batch's
        (as it was), the prompt batch's, or those that just joined the generation (their first
        step); then share what the rows were not given by them. Returns the last call's rows
        (requests)."""
        rows = list(self.requests.values())[-1:]
        for whose, call_rows, counts in self.calls:
            if call_rows is not None and call_rows.requests is None:
                uids = gen_uids if whose == "generation" else \
                    self._prompt_batch.uids if whose == "prompts" else joined or gen_uids
                call_rows.bind([self.requests.get(u) for u in uids])
            held = call_rows.requests if call_rows is not None else []
            rows = [r for r in held if r is not None] or list(self.requests.values())[:1]
            for request, share in zip(rows, shares(counts, max(1, len(rows)))):
                request.share.add(share, len(rows))
        return rows

    def remove(self, uids, return_prompt_caches=False):
        """mlx-lm's, then the reply of a request stopped mid-way is ended (its handler waits for it)."""
        caches = super().remove(uids, return_prompt_caches)
        gone = [self.requests.pop(uid) for uid in uids if uid in self.requests]
        if self._empty():  # (mlx-lm's loop calls next() no more)
            self._settle(gone)
        for request in gone:
            if request.share is not None:
                request.replies.put(None)
        return caches

    def _failed(self, error):
        """A step raised: every request in the batch gets `error` and is stopped; the batch
        starts empty (the returned prompt responses make mlx-lm's loop remove them)."""
        uids = list(self.requests)
        for request in self.requests.values():
            request.replies.put(error)
            if request.ctx is not None:
                request.ctx.stop()
        self._unprocessed_sequences.clear()
        self._currently_processing = []
        self._empty_batches()
        self._release()
        return [PromptProcessingBatch.Response(uid, (0, 0), False, False) for uid in uids]

    def _release(self):
        if self.held:
            self.owner.last_stats = distributed.merged_stats(self.base)  # (what stats() tells while busy)
            self.held = False
            self.lock.release()

    def end(self):
        """The server stops: the requests still in the batch end (their routing learnt, their
        replies told ShuttingDown), as a request alone does then."""
        for request in list(self.requests.values()):
            if request.share is not None:
                request.replies.put(ShuttingDown())
        self._release()

    def close(self):
        self._release()
        super().close()
