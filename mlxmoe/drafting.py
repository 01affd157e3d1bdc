"""Speculative decoding: a draft model loaded within the memory budget, and drafting from
the sequence itself (n-gram lookup), both verified by mlx-lm's speculative_generate_step.

A step that verifies several tokens is a multi-token call of the model: through the expert
cache it takes the per-layer path a prefill step takes (the verified one-token path is for
one-token steps), so every token it accepts is the one greedy decoding gives; mlx-lm trims
the KV caches of the drafts it rejects.

N-gram drafting (prompt lookup): the last 3 (else 2) tokens of the sequence are
looked up earlier in it, and the tokens that followed the latest match are proposed. Where
there is no match, or while drafting gives little (few drafts accepted, or drafted steps
slower a token than plain ones), steps carry one token (mlx-lm's generate_step), so free text
pays little for it.
"""

import time
from contextlib import closing
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import GenerationResponse, generate_step, speculative_generate_step, wired_limit
from mlx_lm.models.cache import make_prompt_cache

from .budget import kv_reserve_bytes
from .errors import MlxmoeError

NGRAM_SIZES = (3, 2)
# n-gram drafting weighs its drafted steps over its first FIRST_WEIGH of them (at the start of
# drafting, and after a pause), drafting PROBE_TOKENS at most in them (a failed probe costs a
# short step), then every WEIGH_STEPS, and pauses for OFF_TOKENS tokens where their acceptance
# is below MIN_ACCEPTANCE or they gave fewer tokens a second than plain steps (where a step of
# several tokens costs several, as on a CPU), the pause doubled at each pause in a row up to
# MOST_OFF_TOKENS; the pause, what is left of it, and a plain step's time carry over to the
# model's next generation (a chat's short replies of free text do not each try again). Until a
# plain step is timed, a good window is followed by MEASURE_TOKENS plain steps.
WEIGH_STEPS, FIRST_WEIGH, MIN_ACCEPTANCE = 4, 1, 0.3
OFF_TOKENS, MOST_OFF_TOKENS, PROBE_TOKENS, MEASURE_TOKENS = 16, 512, 2, 4
NGRAM_DRAFT_TOKENS = 5  # tokens an n-gram step proposes at most, by default


class NGram:
    """`draft_model` for n-gram drafting (as a draft model it has no KV cache of its own:
    mlx-lm's server adds make_prompt_cache(draft) to a request's cache)."""

    layers = ()

    def make_cache(self):
        return []


def load_draft(path, tokenizer, backend, context):
    """A draft model (mlx_lm.load, not evaluated yet) for a model whose tokenizer is
    `tokenizer`, with the dtype policy of `backend`, and the bytes it takes: its weights and
    a KV cache of `context` tokens. Refused where its tokenizer's vocabulary differs."""
    from mlx_lm import load

    try:
        draft, draft_tokenizer, config = load(str(path), lazy=True, return_config=True)
    except Exception as e:  # a missing folder, no config.json, an architecture mlx-lm lacks...
        raise MlxmoeError(f"draft model {path}: mlx-lm cannot load it ({type(e).__name__}: {str(e)[:200]})") from None
    theirs, ours = draft_tokenizer.get_vocab(), tokenizer.get_vocab()
    if theirs != ours:
        differ = next((t for t in sorted(ours) if theirs.get(t) != ours[t]), None)
        which = f"{differ!r} is {theirs.get(differ)} there, {ours[differ]} here" if differ is not None else \
            f"{len(theirs)} tokens there, {len(ours)} here"
        raise MlxmoeError(f"draft model {path}: its tokenizer differs from the model's ({which}); a draft model "
                          "must share the model's vocabulary")
    backend.apply_dtype_policy(draft)
    weights = sum(v.nbytes for _, v in tree_flatten(draft.parameters()))
    return draft, weights + kv_reserve_bytes(config, backend.activation_bytes(draft), context)


def ngram_draft(seq, n, most):
    """Up to `most` tokens that followed the latest earlier occurrence of the last 3 (else 2)
    of the first `n` tokens of `seq` (a numpy array); [] where none occurs (one token alone
    matches too often in free text: each failed draft costs a step)."""
    for size in NGRAM_SIZES:
        if n <= size:
            continue
        tail = seq[n - size:n]
        windows = np.lib.stride_tricks.sliding_window_view(seq[:n - 1], size)
        found = np.flatnonzero((windows == tail).all(axis=1))
        if len(found):
            start = found[-1] + size
            return seq[start:min(start + most, n)].tolist()
    return []


@dataclass
class Switch:
    """What a model's generations share of n-gram drafting's switch (Runtime.ngram_switch)."""

    pause: int = OFF_TOKENS  # the next pause's length, in tokens
    left: int = 0  # the tokens left of the pause under way
    plain: float | None = None  # a plain step's seconds a token, once timed


class Lookup:
    """One generation's n-gram drafting: the sequence so far, and whether drafting is on
    (off for a while where its drafts gave little). `switch`: a Switch, shared by a model's
    generations."""

    def __init__(self, tokens, most, switch=None):
        self.seq = np.zeros(max(64, 2 * len(tokens)), dtype=np.int64)
        self.n, self.most = 0, most
        self.switch = switch if switch is not None else Switch()
        self.made, self.off_until = 0, self.switch.left
        self.window = [0, 0, 0, 0.0, 0]  # drafted, accepted, steps since the last weighing, their seconds and tokens
        self.first = True  # the first window since drafting (re)started: FIRST_WEIGH steps
        self.extend(tokens)

    def extend(self, tokens):
        if self.n + len(tokens) > len(self.seq):
            self.seq = np.concatenate([self.seq, np.zeros(self.n + len(tokens), dtype=np.int64)])
        self.seq[self.n:self.n + len(tokens)] = tokens
        self.n += len(tokens)

    def add(self, token):
        self.extend([token])
        self.made += 1
        self.switch.left = max(self.off_until - self.made, 0)

    def propose(self):
        if self.made < self.off_until:
            return []
        return ngram_draft(self.seq, self.n, min(self.most, PROBE_TOKENS) if self.first else self.most)

    def plain(self, seconds):
        """The time from a plain step's token to the next's."""
        last = self.switch.plain
        self.switch.plain = seconds if last is None else 0.75 * last + 0.25 * seconds

    def weigh(self, drafted, accepted, seconds=0.0, tokens=0):
        """A drafted step's outcome (its drafts, those accepted, and where it was timed, its
        seconds and the tokens it gave); off for a while where drafting gives little."""
        w = self.window
        w[:] = w[0] + drafted, w[1] + accepted, w[2] + 1, w[3] + seconds, w[4] + tokens
        if w[2] < (FIRST_WEIGH if self.first else WEIGH_STEPS):
            return
        plain = self.switch.plain
        slower = plain is not None and w[4] > 0 and w[3] > plain * w[4]
        self.first = w[1] < MIN_ACCEPTANCE * w[0] or slower
        if self.first:
            switch = self.switch
            self.off_until = self.made + switch.pause
            switch.pause, switch.left = min(2 * switch.pause, MOST_OFF_TOKENS), switch.pause
        else:
            self.switch.pause = OFF_TOKENS
            if plain is None and w[4] > 0:  # time plain steps once to weigh the next windows against
                self.off_until = self.made + MEASURE_TOKENS
        self.window = [0, 0, 0, 0.0, 0]


class Proposal:
    """A draft "model" for one step of speculative_generate_step: its calls give, one after
    the other, logits that choose the tokens of `draft`."""

    layers = ()

    def __init__(self, draft, vocab):
        self.draft, self.vocab, self.i = draft, vocab, 0

    def __call__(self, inputs, cache=None):
        token = self.draft[min(self.i, len(self.draft) - 1)]
        self.i += 1
        return mx.where(mx.arange(max(self.vocab, token + 1)) == token, 0.0, -1e9)[None, None]


def trimmable(cache, n):
    """Whether every KV cache of `cache` can be trimmed after `n` more tokens (a rotating one
    only until it wraps: trimmed after, it would keep the rejected drafts)."""
    return all(c.is_trimmable() and c.offset + n < (getattr(c, "max_size", None) or 1 << 62) for c in cache)


def after(processors, before):
    """`processors` given the tokens `before` a step ahead of those the step gives them
    (mlx-lm's step functions give theirs only), so that they see the whole sequence."""
    if not processors or before is None:
        return processors
    return [lambda tokens, logits, p=p: p(mx.concatenate([before, tokens]), logits) for p in processors]


class Ahead:
    """A sampler that keeps what it gave last: the token generate_step has computed ahead of
    the one it yields, and its logprobs."""

    def __init__(self, sampler):
        self.sampler, self.last = sampler or (lambda x: mx.argmax(x, axis=-1)), None

    def __call__(self, logprobs):
        token = self.sampler(logprobs)
        self.last = token, logprobs
        return token


def ngram_steps(prompt, model, stream, lookup, vocab, counters, max_tokens=256, prompt_cache=None,
                logits_processors=None, prompt_progress_callback=None, max_kv_size=None, sampler=None, **kwargs):
    """mlx-lm's (token, logprobs, from_draft) steps of a generation from `prompt` (an mx
    array) whose drafts come from `lookup` (a Lookup): a step with a draft runs
    speculative_generate_step for that step, the others generate_step until a draft comes
    (then the token generate_step computed ahead is taken as the next one, and drafting
    starts after it). Drafted and accepted tokens are counted in `counters` (the expert
    cache's)."""
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model, max_kv_size)
    max_tokens = max_tokens if max_tokens >= 0 else 1 << 62  # (-1: no limit)
    ahead = Ahead(sampler)
    y, done, before = prompt, 0, None
    while done < max_tokens:
        left = max_tokens - done
        draft = lookup.propose()[:left - 1] if done else []
        draft = draft if trimmable(cache, len(draft) + 1) else []
        processors = after(logits_processors, before)
        if draft:
            accepted, start, given = 0, time.perf_counter(), 0
            steps = speculative_generate_step(y, model, Proposal(draft, vocab), stream, num_draft_tokens=len(draft),
                                              max_tokens=left, prompt_cache=cache, logits_processors=processors,
                                              sampler=ahead.sampler, **kwargs)
            with closing(steps):
                for token, logprobs, from_draft in steps:
                    done, accepted, given = done + 1, accepted + from_draft, given + 1
                    lookup.add(token)
                    yield token, logprobs, from_draft
                    if not from_draft:
                        break
            counters.drafted += len(draft)
            counters.accepted += accepted
            lookup.weigh(len(draft), accepted, time.perf_counter() - start, given)
        else:
            steps = generate_step(y, model, stream, max_tokens=left, prompt_cache=cache, logits_processors=processors,
                                  prompt_progress_callback=prompt_progress_callback if not done else None,
                                  sampler=ahead, **kwargs)
            with closing(steps):
                last = None  # when the previous token came (the first of a run waits for the run's start)
                for token, logprobs in steps:
                    now = time.perf_counter()
                    if last is not None:
                        lookup.plain(now - last)
                    done, last = done + 1, now
                    lookup.add(token)
                    yield token, logprobs, False
                    if done < max_tokens and lookup.propose() and trimmable(cache, 2):
                        token, logprobs = ahead.last  # computed from `token`, which the KV cache holds
                        token, logprobs = token.item(), logprobs.squeeze(0)
                        done += 1
                        lookup.add(token)
                        yield token, logprobs, False
                        break
        before = mx.array(lookup.seq[:lookup.n - 1]) if logits_processors else None
        y = mx.array([token], mx.uint32)


def respond(model, tokenizer, prompt, steps, max_tokens, stream):
    """mlx_lm.stream_generate's GenerationResponses for the token `steps` of a generation
    from `prompt` (its token ids), as it makes them from its own steps."""
    detokenizer = tokenizer.detokenizer
    token = None
    with wired_limit(model, [stream]):
        tic = time.perf_counter()
        for n, (token, logprobs, from_draft) in enumerate(steps):
            if n == 0:
                prompt_tps = len(prompt) / (time.perf_counter() - tic)
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                break
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                break
            yield GenerationResponse(detokenizer.last_segment, token, logprobs, from_draft, len(prompt), prompt_tps,
                                     n + 1, (n + 1) / (time.perf_counter() - tic), mx.get_peak_memory() / 1e9)
        if token is None:
            return
        detokenizer.finalize()
        yield GenerationResponse(detokenizer.last_segment, token, logprobs, from_draft, len(prompt), prompt_tps, n + 1,
                                 (n + 1) / (time.perf_counter() - tic), mx.get_peak_memory() / 1e9,
                                 "stop" if token in tokenizer.eos_token_ids else "length")


class DraftCount:
    """Drafted and accepted tokens of a draft model's generation, counted in `counters`
    from its responses: mlx-lm's speculative_generate_step drafts min(num_draft, tokens
    left) at each step, whose tokens are the drafts it accepted, then one of its own."""

    def __init__(self, counters, num_draft, max_tokens):
        self.counters, self.num_draft, self.max_tokens = counters, num_draft, max_tokens
        self.step_starts = True

    def __call__(self, response):
        if self.step_starts:
            left = self.max_tokens - response.generation_tokens + 1
            self.counters.drafted += self.num_draft if self.max_tokens < 0 else min(self.num_draft, left)
        self.counters.accepted += bool(response.from_draft)
        self.step_starts = not response.from_draft
