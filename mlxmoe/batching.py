"""Batched serving (`serve --max-batch N`): mlx-lm's BatchGenerator on the mlxmoe model,
driven by mlx-lm's own server loop (mlx_lm/server.py ResponseGenerator._generate).

A decode step of B requests calls the model with inputs [B, 1]: the expert cache takes it
as it takes a prefill (experts.StreamingExperts._call: the union of the rows' experts is
fetched once, in groups where it exceeds the cache). A batch of one request decodes as a
request alone does (the verified step takes a BatchKVCache of one row: caching/verify.py);
running ahead acts on a KVCache or RotatingKVCache only.
Prompts admitted together are prefilled together: P of them in steps of the planned prefill
step / P tokens each (a step's tokens stay what the budget's working reserve was planned for),
and of no more than the shortest has left (none is padded); each layer's experts are read once
for the P prompts.

- Admission by the KV reserve: a request needs its prompt and max_tokens of KV; the batch's
  BatchKVCache holds every row as long as its longest (a row that joins is padded to the
  batch's length), in steps of 256 tokens, so a request joins while rows x (the batch's
  length + the largest need, rounded up to the step) stays within the tokens the reserve
  holds (the plan's context); else it waits, in order. (A request alone always fits: its
  max_tokens is cut to the context.)
- Stats per request: the cache's counters are read after every model call; what changed
  since the last reading (background reads included) is shared by the call's rows, the
  requests in it, evenly (the remainder to the first rows). On the resident path a step's
  host work (its hits) is done at the next step (experts.ResidentCalls): it counts to the
  next call's rows; the batch's last work is flushed when it empties. So the requests' shares
  add up to the cache's totals over the batch.
- A request whose client left (Client.gone, at every step) is stopped through mlx-lm's own
  cancellation (GenerationContext.stop) and its reply ended: its slot goes to the next.
- A step that fails (a shard changed under the server...) fails the requests in the batch.
- The model's generation lock is held while the batch holds requests. The live profile
  (--profile) learns every step's routing as it comes, all requests' together; with
  --profiles requests are not batched (server.py).
"""

import itertools

from mlx_lm import server as mlx_server
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache

from . import distributed
from .api import generation_lock

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
    """A batched request's part: its KV need (tokens), counts, model calls and their rows."""

    def __init__(self, need):
        self.need, self.counts, self.steps, self.rows, self.largest = need, [0] * len(COUNTS), 0, 0, 0

    def add(self, counts, rows=0):
        """Counts of a model call of `rows` rows (0: of no call, the host work left at the end)."""
        self.counts = [a + b for a, b in zip(self.counts, counts)]
        self.steps += rows > 0
        self.rows += rows
        self.largest = max(self.largest, rows)

    def usage(self):
        """usage.mlxmoe, with the model calls it took part in and their mean and largest rows."""
        return usage(self.counts, None, batch_steps=self.steps, batch_mean=self.rows / max(1, self.steps),
                     batch_largest=self.largest)


class Replies:
    """A request's reply queue as the batch loop fills it: it keeps the request's
    GenerationContext (to stop it) and ends its share before the reply's end (None)."""

    def __init__(self, queue, request, finish):
        self.queue, self.request, self.finish = queue, request, finish
        request.replies, request.share, request.ctx = self, None, None

    def put(self, item):
        if isinstance(item, mlx_server.GenerationContext):
            self.request.ctx = item
        elif item is None and self.request.share is not None:
            self.finish(self.request)
        self.queue.put(item)


class Rows:
    """The model as the batch calls it: after each call, the counters' change is recorded
    with the KV cache the call ran on (which tells whose rows they were)."""

    def __init__(self, model, batches):
        self.model, self.batches = model, batches

    def __getattr__(self, name):  # (make_cache, layers: as mlx-lm's make_prompt_cache reads them)
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None, **kwargs):
        out = self.model(inputs, cache=cache, **kwargs)
        self.batches.record(cache)
        return out


class Batches(BatchGenerator):
    """mlx-lm's BatchGenerator with admission by the KV reserve, per-request shares of the
    cache's counters and stopping requests whose client left. `owner`: the server's
    ResponseGenerator (its `pending` request is the one the loop inserts next)."""

    def __init__(self, model, *, owner, **kwargs):
        super().__init__(Rows(model, self), **kwargs)
        self.base, self.owner, self.max_batch = model, owner, self.completion_batch_size
        self.max_prefill, self.step = self.prefill_batch_size, self.prefill_step_size
        self.cache, self.lock, self.held = model.expert_cache, generation_lock(model), False
        self.requests, self.calls, self.last = {}, [], None  # uid -> request; this step's calls

    def insert_segments(self, segments, max_tokens=None, *args, **kwargs):
        uids = super().insert_segments(segments, max_tokens, *args, **kwargs)
        request = self.owner.pending
        request.share = Share(request.prompt_tokens + max_tokens[0])
        self.requests[uids[0]] = request
        request.decided.set()  # (no profile is matched in a batch: the headers may go)
        return uids

    def record(self, kv):
        now = counters(self.cache)
        self.calls.append((kv, [a - b for a, b in zip(now, self.last)]))
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
            self.held, self.last = True, counters(self.cache)
            self.base.expert_runtime.new_sequence()
        gen_kv, gen_uids = self._generation_batch.prompt_cache, list(self._generation_batch.uids)
        self.calls = []
        try:
            prompt_responses, gen_responses = super()._next()
        except Exception as e:  # noqa: BLE001 - each request in the batch gets the error
            return self._failed(e), []
        last = self._account(gen_kv, gen_uids, [r.uid for r in prompt_responses if r.end_of_prompt])
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
            for request, share in zip(requests, shares(self.calls.pop()[1], max(1, len(requests)))):
                request.share.add(share)
            self._release()

    def _admit(self):
        """Let the waiting requests in, in order, while the batch's KV stays within the reserve."""
        active = [*self._generation_batch.uids, *self._prompt_batch.uids]
        needs = [self.requests[u].share.need for u in active if u in self.requests]
        kv = self._generation_batch.prompt_cache
        length = getattr(kv[0], "_idx", 0) if kv else 0  # (BatchKVCache: the batch's length)
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
        """The tokens each prompt prefills at the next step: the planned step shared by the
        prompts that prefill then, and no more than the shortest has left in its segment, so
        that none is padded (a pad's tokens would be routed, read and learned as the prompt's)."""
        joining = min(self.prefill_batch_size - len(self._prompt_batch),
                      self.completion_batch_size - len(self._generation_batch), len(self._unprocessed_sequences))
        segments = [seq[0] for seq in self._currently_processing]
        segments += [seq[1] for seq in itertools.islice(self._unprocessed_sequences, max(0, joining))]
        left = [len(s[0]) for s in segments if not (len(s) == 1 and len(s[0]) == 1)]  # (those: to generation)
        if left:
            self.prefill_step_size = max(1, min(self.step // len(left), *left))
            self._prompt_batch.prefill_step_size = self.prefill_step_size  # (its own loop splits by it)

    def _account(self, gen_kv, gen_uids, joined):
        """Share this step's calls' counts by their rows: the generation batch's (as it was),
        the prompt batch's, or those that just joined the generation (their first step).
        Returns the last call's rows (requests)."""
        rows = list(self.requests.values())[-1:]
        for kv, counts in self.calls:
            if kv is gen_kv:
                uids = gen_uids
            elif kv is self._prompt_batch.prompt_cache:
                uids = self._prompt_batch.uids
            else:
                uids = joined or gen_uids
            rows = [self.requests[u] for u in uids if u in self.requests] or list(self.requests.values())[:1]
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
        self._prompt_batch = PromptProcessingBatch.empty(self.model, self.sampler, self.prefill_step_size)
        self._generation_batch = GenerationBatch.empty(self.model, self.sampler)
        self._release()
        return [PromptProcessingBatch.Response(uid, (0, 0), False, False) for uid in uids]

    def _release(self):
        if self.held:
            self.owner.last_stats = distributed.merged_stats(self.base)  # (what stats() tells while busy)
            self.held = False
            self.lock.release()

    def close(self):
        self._release()
        super().close()
