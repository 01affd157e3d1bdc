"""`mlxmoe serve`: mlx-lm's OpenAI-compatible server (mlx_lm/server.py) on an mlxmoe model,
with Anthropic's /v1/messages, the expert cache's stats and per-request profiles.

mlx-lm's request parsing and checks, chat templates, stop handling, SSE framing and its
generation thread are used as they are; the subclasses below change only what had to differ:
- ModelProvider: the model is the one mlxmoe.load gave (expert cache, memory budget), loaded
  before serving so that a bad checkpoint exits 2 instead of leaving a server whose generation
  thread died; every requested model name is served by it (one model per process, as clients
  send names of their own); batchable with --max-batch N above 1 (batching.py: mlx-lm's
  BatchGenerator, a decode step of several requests in one forward pass through the expert
  cache, each request's greedy output its solo answer, usage and profile its own), except with
  a draft model (mlx-lm's rule) or under several ranks: then requests queue and each runs alone.
- mlx_lm.server's stream_generate is mlxmoe's (its generation lock, the prefill step the
  budget plans for, the deferred host work) inside the per-request stats and profile matching
  (ResponseGenerator.stream); mlx-lm's prefill_step_size is dropped for the planned one.
- The prompt cache (KV caches kept across requests) is off unless --prompt-cache-size says
  otherwise, and then bounded by the KV reserve: stored caches are memory beside the budget.
- max_tokens is cut to the context the budget's KV reserve holds (finish_reason "length"),
  and a prompt beyond it is refused (HTTP 413, its body naming the field as the 400s do).
- Every request gets an HTTP answer: its body is checked before mlx-lm reads it (UTF-8, at
  most MAX_DEPTH deep, no NaN/Infinity), its fields beyond mlx-lm's checks (bools for numbers,
  seed, n, stop, logit_bias ids within the vocabulary, stream_options, mlxmoe.profile): 400
  naming the field; more than --max-queue requests at once: 503 with Retry-After; anything
  else that fails: 500. The listen backlog holds many clients (the stdlib's 5 resets them).
  A stop (SIGTERM, Ctrl-C) answers the requests it cuts short or never began 503 with
  Retry-After (a stream under way ends without its last chunk), never a 200 that looks whole
  (mlx-lm's handler finishes any answer with "stop"); it waits up to 5 s for those answers.
- /v1/messages (Anthropic) is mapped onto the chat path and its responses rewritten from
  OpenAI's; /v1/models lists the served model (mlx-lm lists the Hugging Face cache).
- Under mlx.launch rank 0 serves HTTP and mlx-lm's generation thread shares each request
  with the other ranks, which run the same generation. On top of it every rank votes, once
  per poll and once per token, whether to stop (a signal on any rank, a client gone), so
  that all stop together; a rank that fails or leaves makes the collectives raise, and
  every rank exits with the error; one that stops answering without leaving ends the
  others after MLXMOE_DIST_TIMEOUT seconds (distributed.waiting). Each rank sees its own
  layers' routing: with --profiles a request's prefill routing is summed over the ranks
  (each its layers, zeros elsewhere), so that every rank picks the same profile of the
  whole model and takes its own layers' part; every rank learns the whole request's
  routing, and rank 0 writes the profiles.
"""

import argparse
import copy
import functools
import io
import itertools
import json
import logging
import math
import re
import select
import signal
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from queue import Empty
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import numpy as np
from mlx_lm import server as mlx_server
from mlx_lm.models.cache import LRUPromptCache

from . import distributed, webpage
from .api import generation_lock, model_fingerprint, prefill_step, stream_generate, vocab_size
from .batching import Batches, HostRow, Replies as BatchReplies, ShuttingDown, counters, usage
from .budget import DEFAULT_CONTEXT, format_size
from .errors import MlxmoeError
from .drafting import NGram
from .signals import interrupting
from .http11 import KeepAlive, TooLarge, read_chunked
from .workload.profile import ActivationProfile, js_divergence

PROFILE_HEADER = "X-Mlxmoe-Profile"
POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions", "/v1/messages", "/v1/mlxmoe/cache")
GET_PATHS = ("/health", "/v1/models", "/v1/mlxmoe/stats", "/v1/mlxmoe/residency", "/")  # (and /v1/models/NAME)
MAX_BODY = 64 << 20  # bytes of a request body, at most
BODY_BYTES_PER_TOKEN = 256  # a body may hold this many bytes per token of the context (at least 1 MiB)
IDLE_TIMEOUT = 30.0  # seconds a connection may wait for its client (idle, sending its headers, any read or write)
DISCARD_SECONDS = 2.0  # how long the body of a refused request is read and dropped (its client then reads the answer)
MAX_DEPTH = 64  # nesting of a request body's JSON
# body fields that are numbers: true/false (Python's bools are ints) refused for them
NUMBER_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "num_draft_tokens",
                 "repetition_penalty", "repetition_context_size", "presence_penalty", "presence_context_size",
                 "frequency_penalty", "frequency_context_size", "xtc_probability", "xtc_threshold", "top_logprobs",
                 "seed", "n")
ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class Profiles:
    """The stored profiles a server matches requests to (--profiles DIR: every *.json there,
    named by file stem), each learning from the requests matched to it."""

    def __init__(self, paths, ckpt, force=False):
        self.paths, self.by_name, self.force = {}, {}, force
        fp = model_fingerprint(ckpt)
        for path in sorted(paths):
            prof = ActivationProfile.load(path)
            prof.check_model(fp, ckpt.all_layers, ckpt.num_experts, force, str(path))
            self.paths[path.stem], self.by_name[path.stem] = path, prof
        if not self.by_name:
            raise MlxmoeError("no profiles (*.json) in the --profiles folder")
        self.matched = Counter()
        self.changed = set()

    def nearest(self, observed):
        """The profile whose per-layer expert usage is nearest `observed`'s (a request's
        prefill): the least mean Jensen-Shannon divergence over the layers both used. Usage
        is the router's probability mass where both recorded it (a prefill's distinct
        experts are most of a layer's: their counts barely tell prompts apart), else counts."""
        use_mass = observed.mass.sum() > 0 and all(p.mass.sum() > 0 for p in self.by_name.values())

        def distance(prof):
            a, b = (observed.mass, prof.mass) if use_mass else (observed.counts, prof.counts)
            d = [js_divergence(a[l], b[l]) for l in range(observed.num_layers) if a[l].sum() > 0 and b[l].sum() > 0]
            return float(np.mean(d)) if d else float("inf")
        return min(self.by_name, key=lambda name: distance(self.by_name[name]))

    def learn(self, name, observed):
        self.by_name[name].absorb(observed)
        self.changed.add(name)

    def save(self):
        """Write the profiles that learnt since the last save (each atomically); return their files."""
        names = sorted(self.changed)
        for name in names:
            self.by_name[name].save(self.paths[name])
        self.changed.clear()
        return [self.paths[name] for name in names]


class Provider(mlx_server.ModelProvider):
    """mlx-lm's model provider holding the one model mlxmoe.load gave."""

    def __init__(self, cli_args, model, tokenizer, draft_model=None):
        super().__init__(cli_args)
        self.model, self.tokenizer = model, tokenizer
        self.draft_model = draft_model  # serve's, for every request: the runtime's draft model, or an NGram
        self.model_key = (cli_args.model, None, None)
        # mlx-lm's rule (no draft model, KV caches that merge), on one rank, batches above 1
        self.is_batchable = (cli_args.decode_concurrency > 1 and draft_model is None
                             and model.expert_runtime.group is None
                             and all(hasattr(c, "merge") for c in mlx_server.make_prompt_cache(model)))

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if adapter_path is not None or draft_model_path not in (None, "default_model"):
            raise ValueError("mlxmoe serve takes no adapters or draft models")
        return self.model, self.tokenizer

    def load_default(self):
        pass


class SharedEvent(threading.Event):
    """A threading.Event that pickles as a fresh one: what the copy of a request that
    mlx-lm sends to the other ranks holds."""

    def __reduce__(self):
        return SharedEvent, ()


class Client:
    """A request's client connection as the generation thread sees it: `gone()` at every token
    (a streaming client's failed write would tell only once the handler thread, behind the
    generation, writes; a non-streaming one writes nothing until the end). It pickles as no
    connection: the other ranks learn of a client gone through rank 0's vote."""

    def __init__(self, sock=None):
        self.sock, self.left, self.readable = sock, False, None
        if sock is not None:  # (poll, not select: select takes no descriptor above 1023)
            self.readable = select.poll()
            self.readable.register(sock, select.POLLIN)

    def __reduce__(self):
        return Client, ()

    def gone(self):
        """Whether the client closed or reset its connection (then `left` is set)."""
        try:
            if not self.left and self.readable is not None and self.readable.poll(0):
                self.left = self.sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:  # reset, or closed here
            self.left = True
        return self.left  # (readable with bytes: the client sent more, a next request: not gone)


class Replies:
    """A request's reply queue under several ranks. mlx-lm's handler stops a generation
    whose client went away through GenerationContext.stop(), which would end it on rank 0
    alone; here stop() marks the request, and every rank stops at the next token's vote."""

    def __init__(self, queue, request):
        self.queue, self.request = queue, request

    def put(self, item):
        if isinstance(item, mlx_server.GenerationContext):
            item.stop = self.cancel
        self.queue.put(item)

    def cancel(self):
        self.request.cancelled = True


class Refused(BaseException):
    """ShuttingDown raised before a request's answer began, carried past mlx-lm's handler
    (which answers any Exception there with a 404) to Handler.do_POST's 503."""


class ResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's generation thread: one request at a time, each with its profile and stats, or
    concurrent ones in batches (batching.Batches: --max-batch)."""

    def __init__(self, provider, prompt_cache, profiles=None, save_every=0, profile_path=None):
        """`save_every`: requests between profile saves (0: none); `profile_path`: where the
        live profile is saved without `profiles`."""
        self.profiles, self.save_every, self.profile_path = profiles, save_every, profile_path
        self.served, self.active, self.failure, self.ended = 0, None, None, threading.Event()
        self.stopping = False  # this rank wants to stop (under several ranks `_stop` is what they agreed)
        runtime = provider.model.expert_runtime
        self.runtime, self.group = runtime, runtime.group  # (mlx-lm drops the model when it stops)
        with distributed.waiting(self.group, "starting the server"):  # (what stats() tells while the first runs)
            self.last_stats = distributed.merged_stats(provider.model)
        # the tokens the budget's KV reserve is sized for (load's max_context, api.checkpoint_plan)
        self.context = getattr(runtime.plan, "context", DEFAULT_CONTEXT)
        self.live = runtime.profile  # the load's live profile, learning from every request
        self.pending = None  # the request tokenized last (batching.Batches inserts it)
        self.batches = None  # the batching.Batches mlx-lm's loop generates with, once it made one
        super().__init__(provider, prompt_cache)  # starts the generation thread

    def _run_generate(self):
        try:
            self._generate()
            if self.batches is not None:  # stopping: those still in the batch end as one alone does
                self.batches.end()
            self._refuse_queued()
        except Exception as e:  # a rank that failed or left (the collectives raise), or a bug
            self.failure = e
            self._generation_failed = True
        finally:
            self.ended.set()

    def _refuse_queued(self):
        """The server stops: the requests still queued for the generation thread are told so."""
        while True:
            try:
                self.requests.get_nowait()[0].put(ShuttingDown())
            except Empty:
                return

    def shutting_down(self):
        return self._stop or self.stopping

    def generate(self, request, generation_args, progress_callback=None):
        if self.shutting_down():  # (mlx-lm's would raise 'generation thread died', a 404)
            raise Refused()
        try:
            return super().generate(request, generation_args, progress_callback)
        except ShuttingDown as e:  # (refused before its answer began: mlx-lm's handler would make it a 404)
            raise Refused() from e

    def _await_response(self, response_queue):
        """mlx-lm's; where the generation thread ended as the server stops (not in a failure),
        a request it never took (queued after the last were told, or held aside by mlx-lm's
        loop) is told ShuttingDown."""
        try:
            return super()._await_response(response_queue)
        except RuntimeError:
            if self.failure is None and self.shutting_down():
                raise ShuttingDown() from None
            raise

    def _next_request(self, timeout=None):
        """mlx-lm's (under several ranks rank 0 takes it and shares it with the others);
        then every rank says whether it is stopping, and all stop together."""
        with distributed.waiting(self.group, "sharing the next request"):
            request = super()._next_request(timeout)
            if self.group is not None and distributed.any_rank(self.group, self.stopping):
                self._stop = True
        if request is not None and self.group is None:  # (a batched request's reply ends with its usage)
            rqueue, req, args = request
            request = BatchReplies(rqueue, req, self.finish), req, args
        return request

    def observer(self, request):
        """A request's own routing, learnt apart until it ends (an ActivationProfile of this
        rank's layers); the profile it names, if any, steers the cache from now on."""
        ckpt = self.runtime.checkpoint
        if request.mlxmoe_profile is not None:
            self._use_profile(request.mlxmoe_profile)
        return ActivationProfile(ckpt.num_layers, ckpt.num_experts, ckpt.top_k, half_life=0)

    def decide(self, request, observed):
        """A request's first token came: its profile is the one it names, else (with --profiles)
        the stored one nearest its routing so far (`observed`), which steers the cache from now on.
        Returns its name (None: no profile); the request's headers may go."""
        name = request.mlxmoe_profile
        if name is None and self.profiles is not None:
            self.runtime.cache.flush()  # the host work left for later (resident path) observes its routing
            with distributed.waiting(self.group, "merging a prefill's routing"):
                name = self.profiles.nearest(distributed.whole_usage(self.runtime.checkpoint, observed))
            self._use_profile(name)
        request.profile = name
        request.decided.set()
        return name

    def learn(self, name, observed):
        """A request ended: the live profile and its profile `name` (if any) learn its routing."""
        if self.live is not None:
            self.live.absorb(observed)
        if name is not None and self.profiles is not None:
            self.profiles.learn(name, distributed.whole_usage(self.runtime.checkpoint, observed))
            self.profiles.matched[name] += 1

    def finish(self, request):
        """A batched request ends (batching.Replies): its routing learnt as a request's alone
        is, its usage; counted as served."""
        self.runtime.cache.flush()  # (its last steps' host work left for later: counted and learnt)
        share, request.share = request.share, None
        name = request.profile if request.decided.is_set() else request.mlxmoe_profile  # (ended before its first token)
        self.learn(name, share.observed)
        request.usage = share.usage(name)
        request.decided.set()
        self.served += 1
        if self.save_every and self.served % self.save_every == 0:
            self.save()

    def stop_and_join(self):
        if self.group is None:
            return super().stop_and_join()
        self.stopping = True  # every rank stops at the next vote, at once
        self.join()

    def _serve_single(self, item, stream):
        rqueue, request, args = item
        if self.group is not None:
            item = Replies(rqueue, request), request, args
        self.active = request
        try:
            super()._serve_single(item, stream)
        finally:
            self.active = None
            request.decided.set()
            self.served += 1
            if self.save_every and self.served % self.save_every == 0:
                self.save()

    def _tokenize(self, tokenizer, request, args):
        tokenized = super()._tokenize(tokenizer, request, args)
        request.prompt_tokens = len(tokenized[0])  # (Anthropic's message_start tells it)
        self.pending = request  # (a batch inserts it next: Batches.insert_segments)
        args.max_tokens = max(1, min(args.max_tokens, self.context - len(tokenized[0])))
        return tokenized

    def stream(self, model, tokenizer, prompt, **kwargs):
        """mlx_lm.server's stream_generate: mlxmoe's, the request's prefill matched to a
        profile (or the one it names) whose rates become the policy's prior; the request's
        hits and bytes read in request.usage once it ends (before mlx-lm ends its response)."""
        request, runtime = self.active, model.expert_runtime
        cache, name = runtime.cache, request.mlxmoe_profile
        kwargs.pop("prefill_step_size", None)
        observed = self.observer(request)
        before = counters(cache)
        runtime.swap_live(observed)  # this request's routing, apart until its profile is known
        generation = stream_generate(model, tokenizer, prompt, **kwargs)
        try:
            for i, response in enumerate(generation):
                if i == 0:
                    name = self.decide(request, observed)
                response.logprobs = HostRow(response.logprobs)  # (mlx-lm's loop reads its token's at once)
                yield response
                # shutting down, or the client went away (told by the handler, or seen now: within one token)
                shutting, left = self.shutting_down(), request.cancelled or request.client.gone()
                if self.group is not None:  # (one vote on both: every rank takes the same way out)
                    with distributed.waiting(self.group, "voting to stop"):
                        shutting, left = (n > 0 for n in distributed.sum_ranks(self.group, [int(shutting), int(left)]))
                if shutting and not (left or response.finish_reason is not None):
                    raise ShuttingDown()  # (an answer cut short must not pass for a whole one)
                if shutting or left:
                    break
        finally:
            generation.close()
            runtime.swap_live(self.live)
            with distributed.waiting(self.group, "gathering a request's routing and stats"):
                self.learn(name, observed)
                counts = [a - b for a, b in zip(counters(cache), before)]
                if self.group is not None:
                    counts = distributed.sum_ranks(self.group, counts)
                request.usage = usage(counts, name)
                self.last_stats = distributed.merged_stats(model)

    def _use_profile(self, name):
        """`name`'s rates become the policy's prior and the prefetcher's profile guess;
        its hottest experts fill the cache's free slots in the background (of a profile of the
        whole model, this rank's layers)."""
        self.runtime.use_profile(self.profiles.by_name[name], self.profiles.force)

    def stats(self):
        """model.expert_cache.stats(), or while a generation holds the model (and always
        under several ranks: their stats are gathered by all at once) the snapshot taken
        when the last one ended ("busy": whether one runs), with the server's own counts."""
        model = self.model_provider.model
        lock = generation_lock(model)
        if self.group is None and lock.acquire(blocking=False):
            try:
                stats = dict(model.expert_cache.stats(), busy=False)
            finally:
                lock.release()
        else:
            stats = dict(self.last_stats, busy=lock.locked())
        stats["server"] = {"requests": self.served, "context": self.context,
                           "memory_budget": self.runtime.plan.budget,
                           "profiles": {n: self.profiles.matched[n] for n in self.profiles.by_name}
                           if self.profiles is not None else {}}
        return stats

    def save(self):
        """Under several ranks rank 0 writes: every rank's profiles learnt the whole model's
        routing; the live profile is the stages' merged (a collective). Returns the files written."""
        if self.profiles is not None:
            if self.group is None or self.group.rank() == 0:
                return self.profiles.save()
        elif self.live is not None and self.profile_path is not None:
            self.runtime.save_profile(self.profile_path)  # between requests: the live profile is self.live
            return [self.profile_path]
        return []


class OpenAIErrors:
    """mlx-lm's error bodies, {"error": "max_tokens must be ..."}, in OpenAI's form (what
    clients read the message from): {"error": {"message", "type", "param": the field}}."""

    def __init__(self, out):
        self.out = out

    def write(self, data):
        return self.out.write(self.convert(data))

    @staticmethod
    def convert(data):
        try:
            body = json.loads(data)
        except ValueError:
            body = None
        if isinstance(body, dict) and list(body) == ["error"] and isinstance(body["error"], str):
            field = re.match(r"([A-Za-z_][\w.\[\]]*)(:| must)", body["error"])
            data = json.dumps({"error": {"message": body["error"], "type": "invalid_request_error",
                                         "param": field and field.group(1), "code": None}}).encode()
        return data

    def flush(self):
        self.out.flush()


class AnthropicStream:
    """The OpenAI chunks mlx-lm's handler writes, rewritten as Anthropic's message events
    (anything that is not a `data:` line, such as headers, passes as it is); `start()`: the
    message that message_start tells (its usage: the prompt's tokens, known once tokenized)."""

    def __init__(self, out, start):
        self.out, self.start, self.started, self.stop_reason = out, start, False, "end_turn"

    def write(self, data):
        if not data.startswith(b"data: "):
            return self.out.write(data)
        payload = data[6:].strip()
        events = []
        if payload != b"[DONE]":
            chunk = json.loads(payload)
            if not self.started:
                self.started = True
                events += [("message_start", {"type": "message_start", "message": self.start()}),
                           ("content_block_start", {"type": "content_block_start", "index": 0,
                                                    "content_block": {"type": "text", "text": ""}})]
            if chunk["choices"]:
                choice = chunk["choices"][0]
                text = choice.get("delta", {}).get("content")
                if text:
                    events.append(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                           "delta": {"type": "text_delta", "text": text}}))
                if choice.get("finish_reason"):
                    self.stop_reason = ANTHROPIC_STOP.get(choice["finish_reason"], "end_turn")
                    events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
            else:  # the usage chunk: the message's end
                usage = chunk["usage"]
                events += [("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": self.stop_reason, "stop_sequence": None},
                                              "usage": {"input_tokens": usage["prompt_tokens"],
                                                        "output_tokens": usage["completion_tokens"],
                                                        "mlxmoe": usage.get("mlxmoe")}}),
                           ("message_stop", {"type": "message_stop"})]
        self.out.write(b"".join(f"event: {e}\ndata: {json.dumps(d)}\n\n".encode() for e, d in events))
        return len(data)

    def flush(self):
        self.out.flush()


def anthropic_to_chat(body):
    """An Anthropic Messages body as the chat-completion body mlx-lm reads (in place):
    system -> a system message, content blocks -> their text, stop_sequences -> stop."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ValueError("messages must be a list")

    def text(content, field):
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
            return "".join(str(b.get("text", "")) for b in content)
        raise ValueError(f"{field}: only text content is supported")

    chat = [{"role": "system", "content": text(body["system"], "system")}] if body.get("system") else []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ValueError(f"messages[{i}]: a message is {{'role': 'user' or 'assistant', 'content': ...}}")
        chat.append({"role": m["role"], "content": text(m.get("content", ""), f"messages[{i}].content")})
    body["messages"] = chat
    if "stop_sequences" in body:
        body["stop"] = body.pop("stop_sequences")


class Requests(KeepAlive, mlx_server.APIHandler):
    """The HTTP side of the handler, over HTTP/1.1 (http11.KeepAlive: one handler serves a
    connection's requests in turn): routes and methods (404, 405), error answers, request
    bodies read and checked before mlx-lm reads them (by Content-Length or chunked, within
    the limit, UTF-8, JSON of a bounded depth)."""

    headers_sent = False

    def parse_request(self):
        """The stdlib's, then the path without a trailing slash: every route answers with
        or without one (/v1/models/ as /v1/models)."""
        self.headers_sent = False
        ok = super().parse_request()
        if ok and len(self.path) > 1:
            self.path = self.path.rstrip("/") or "/"
        if ok and self.path.startswith("/?"):  # the page's query (?q=...) is read by the page
            self.path = "/"
        return ok

    def _no_route(self):
        """404 for a path served by no method, 405 (with Allow) for one served by another;
        True where it answered."""
        if self.path in POST_PATHS:
            allow = "POST"
        elif self.path in GET_PATHS or self.path.startswith("/v1/models/"):
            allow = "GET, HEAD"
        else:
            self._send_json(404, {"error": {"message": f"{self.path[:200]}: no such route", "type": "invalid_request_error",
                                            "param": None, "code": None}})
            return True
        if self.command in allow.split(", "):
            return False
        self._send_json(405, {"error": {"message": f"{self.path}: {self.command} is not served here; use {allow}",
                                        "type": "invalid_request_error", "param": None, "code": None}},
                        [("Allow", allow)])
        return True

    def do_PUT(self):
        self._no_route()

    do_DELETE = do_PATCH = do_OPTIONS = do_PUT

    def end_headers(self):
        self.headers_sent = True
        super().end_headers()

    def _error(self, status, message, headers=()):
        """An error answer in mlx-lm's form (OpenAIErrors gives it OpenAI's; the server's own
        failures, 5xx, are typed server_error)."""
        error = message if status < 500 else {"message": message, "type": "server_error", "param": None,
                                              "code": None}
        data = json.dumps({"error": error}).encode()
        self._set_completion_headers(status)
        for name, value in headers:
            self.send_header(name, value)
        if isinstance(self.wfile, OpenAIErrors):  # (as it will write it: the length told is the body's)
            data = OpenAIErrors.convert(data)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self):
        """Read and check the body before mlx-lm does (it then reads the same bytes): by its
        Content-Length or chunked, UTF-8, JSON nested at most MAX_DEPTH deep, no NaN or Infinity
        anywhere (named by where they are). False once it has answered 400 or 413."""
        context = self.response_generator.context
        most = min(MAX_BODY, max(1 << 20, context * BODY_BYTES_PER_TOKEN))
        try:
            raw = self._body(most)
        except TooLarge as e:  # answered at once, before the rest is read
            self.close_connection = True
            self._error(413, f"{e} (a prompt within the {context}-token context takes far fewer)",
                        [("Connection", "close")])
            self._discard(e.size if "Content-Length" in self.headers else e.most)
            return False
        except ValueError as e:
            self.close_connection = True  # (where the next request would start is unknown)
            self._error(400, str(e), [("Connection", "close")])
            return False
        if raw is None:
            return True  # mlx-lm answers 411
        self.body_read = True
        self.rfile = io.BytesIO(raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self._error(400, f"request body: not UTF-8 text (byte {e.start})")
            return False
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            return True  # mlx-lm answers 400 with the parser's message
        except RecursionError:
            self._error(400, f"request body: JSON nested too deeply (at most {MAX_DEPTH} levels)")
            return False
        problem = _check_json(body)
        if problem is not None:
            self._error(400, problem)
            return False
        return True

    def _body(self, most):
        """The request's body (bytes), of its Content-Length or chunked; None without either;
        TooLarge beyond `most` bytes, ValueError for framing that cannot be read."""
        chunked = self.headers.get("Transfer-Encoding")
        length = self.headers.get("Content-Length")
        if chunked is not None:
            if chunked.strip().lower() != "chunked" or length is not None:
                raise ValueError(f"Transfer-Encoding {chunked[:40]!r}: only chunked is taken, without Content-Length")
            raw = read_chunked(self.rfile, most)
            del self.headers["Transfer-Encoding"]
            self.headers["Content-Length"] = str(len(raw))  # (as mlx-lm reads it)
            return raw
        if length is None:
            return None
        if not re.fullmatch(r"[0-9]+", length.strip()):
            raise ValueError("Invalid Content-Length header")
        if int(length) > most:
            raise TooLarge(int(length), most)
        return self.rfile.read(int(length))

    def _discard(self, length):
        """Read and drop up to `length` bytes of a refused body for DISCARD_SECONDS at most,
        so that a client still sending it gets to read the answer (not a reset connection)."""
        self.wfile.flush()
        self.close_connection = True
        deadline = time.monotonic() + DISCARD_SECONDS
        try:
            self.connection.settimeout(0.1)
            while length > 0 and time.monotonic() < deadline:
                try:
                    chunk = self.connection.recv(min(length, 1 << 20))  # (past what rfile holds: dropped too)
                except TimeoutError:  # the client sends no more (rfile held the rest)
                    break
                if not chunk:
                    break
                length -= len(chunk)
        except OSError:
            pass

    def _send_json(self, status, body, headers=()):
        data = json.dumps(body).encode()
        self._set_completion_headers(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_page(self, data):
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class Handler(Requests):
    """mlx-lm's handler with /v1/messages, /v1/mlxmoe/stats, the page (webpage.py) and the
    mlxmoe request checks."""

    too_long = False  # the request's prompt is beyond the context: its 400 from mlx-lm becomes a 413

    def parse_request(self):
        """(The last request's state dropped first.)"""
        self.anthropic = self.too_long = False
        self.request = self.legacy_logprobs = None
        return super().parse_request()

    def do_GET(self):
        if self._no_route():
            return
        if self.path == "/v1/mlxmoe/stats":
            return self._send_json(200, self.response_generator.stats())
        if self.path == "/v1/mlxmoe/residency":
            return self._send_json(200, webpage.residency(self.response_generator))
        if self.path == "/":
            return self._send_page(webpage.page())
        model = {"id": self.response_generator.cli_args.model, "object": "model", "created": self.created,
                 "owned_by": "mlxmoe"}
        if self.path == "/v1/models":
            return self._send_json(200, {"object": "list", "data": [model]})
        if self.path.startswith("/v1/models/"):  # (openai's models.retrieve)
            name = unquote(self.path[len("/v1/models/"):])
            if name == model["id"]:
                return self._send_json(200, model)
            return self._send_json(404, {"error": {"message": f"model {name[:200]!r} not found (served: {model['id']})",
                                                   "type": "invalid_request_error", "param": "model",
                                                   "code": "model_not_found"}})
        super().do_GET()

    def _set_completion_headers(self, status_code=200):
        super()._set_completion_headers(413 if status_code == 400 and self.too_long else status_code)

    def do_POST(self):
        admitted, wfile, rfile, self.wfile = False, self.wfile, self.rfile, OpenAIErrors(self.wfile)
        try:
            if self._no_route():
                return
            if not self._read_body():
                return
            if self.path == "/v1/mlxmoe/cache":
                return self._resize()
            if self.path == "/v1/messages":
                self.anthropic, self.path = True, "/v1/chat/completions"
            if self.response_generator.shutting_down():
                raise Refused()  # (a kept-alive connection's request while the server stops)
            admitted = self.server.admit()
            if not admitted:
                return self._error(503, f"server busy: {self.server.max_queue} requests are queued or running "
                                   "(mlxmoe serve --max-queue); retry later", [("Retry-After", "1")])
            super().do_POST()
            if self.request is not None and self.request.client.left:  # (its answer's writes went unnoticed)
                self.went_away()
        except TimeoutError:  # the client stopped sending its body (or reading the answer)
            self.close_connection = True
            self.framing.mode = None
            self.log_message('"%s": the client sent or read nothing for %s s', self.requestline, self.timeout)
            if not self.headers_sent:
                self._error(408, f"request body: nothing came for {self.timeout} s (serve --idle-timeout)",
                            [("Connection", "close")])
        except ConnectionError:  # the client went away: nobody to answer
            self.went_away()
        except (ShuttingDown, Refused) as e:  # 503 (send it again), or a stream cut short (no last chunk)
            self.close_connection = True
            self.framing.mode = None
            if not self.headers_sent:
                self._headers_buffer = []
                try:
                    self._error(503, str(ShuttingDown()), [("Retry-After", "1"), ("Connection", "close")])
                except OSError:
                    pass
        except Exception as e:  # a bug, or a body mlx-lm's code could not take: an answer all the same
            logging.exception("mlxmoe serve: a request failed")
            self.close_connection = True
            self.framing.mode = None  # (a response cut short gets no last chunk)
            if not self.headers_sent:  # (a status line and headers only buffered: replaced by the 500)
                self._headers_buffer = []
                try:
                    self._error(500, f"internal error ({type(e).__name__}: {str(e)[:200]})")
                except OSError:
                    pass
        finally:
            self.wfile, self.rfile = wfile, rfile
            if admitted:  # (once its answer is written: a stopping server waits for that, Server.answered)
                self.server.leave()

    def _resize(self):
        """POST /v1/mlxmoe/cache {"memory_budget": "8GB"}: the expert cache resized to fit it
        (Runtime.resize: now, or between two tokens of the generation under way)."""
        try:
            body = json.loads(self.rfile.read() or b"null")  # (_read_body checked it)
            if not isinstance(body, dict) or "memory_budget" not in body:
                raise MlxmoeError('give a JSON object such as {"memory_budget": "8GB"}')
            done = self.response_generator.runtime.resize(body["memory_budget"], "asked by POST /v1/mlxmoe/cache")
        except (ValueError, MlxmoeError) as e:
            return self._send_json(400, {"error": {"message": f"/v1/mlxmoe/cache: {e}", "type": "invalid_request_error",
                                                   "param": "memory_budget", "code": None}})
        self._send_json(200, done)

    def validate_model_parameters(self):
        """mlx-lm's checks, then mlxmoe's: where mlx-lm calls this the body is parsed and
        the request not yet built, so a ValueError here is its HTTP 400 naming the field."""
        body = self.body
        _check_numbers(body)
        if self.path == "/v1/completions" and isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool):
            self._legacy_logprobs(self.logprobs)
        super().validate_model_parameters()
        self.requested_model = self.response_generator.cli_args.model  # the served model's name, whatever was asked
        self._check_parameters()
        if self.anthropic:
            anthropic_to_chat(body)
        _check_stop(body)
        _check_profile(body, self.response_generator.profiles)
        field, n = self._prompt_tokens()
        if n == 0:
            raise ValueError(f"{field}: the prompt is empty (no tokens to start from)")
        context = self.response_generator.context
        if n >= context:
            self.too_long = True  # answered 413 (Payload Too Large), the body naming the field
            raise ValueError(f"{field}: the prompt is {n} tokens, beyond the {context}-token context the "
                             "memory budget reserves")

    def _legacy_logprobs(self, n):
        """/v1/completions' integer logprobs (OpenAI's legacy API): the top `n` tokens at each
        position, asked of mlx-lm as logprobs and top_logprobs, answered in the legacy shape."""
        if not 0 <= n <= 11:  # (mlx-lm's range for top_logprobs)
            raise ValueError(f"logprobs must be true, false or an integer from 0 to 11 (the top tokens listed at "
                             f"each position), not {n}")
        if self.stream is True:
            raise ValueError("logprobs: a number of top tokens is answered without stream only (mlx-lm's stream "
                             "carries no logprobs)")
        self.legacy_logprobs, self.logprobs, self.top_logprobs = n, True, n

    def _check_parameters(self):
        """What mlx-lm takes and mlxmoe does not (adapters, a draft model, several choices)
        or takes without bounds, on the parameters mlx-lm has read from the body."""
        body = self.body
        for key in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            if getattr(self, key) > 1 << 24:
                raise ValueError(f"{key} must be at most {1 << 24}")
        if self.stream is True and body.get("logprobs") is True:
            raise ValueError("logprobs: answered without stream only (mlx-lm's stream carries no logprobs)")
        if self.adapter is not None:
            raise ValueError("adapters: mlxmoe serve takes no adapters (fuse them into the model first)")
        if self.requested_draft_model not in (None, "default_model"):
            raise ValueError("draft_model: mlxmoe serve takes no draft model")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("chat_template_kwargs must be an object")
        if body.get("tools") is not None and not isinstance(body["tools"], list):
            raise ValueError("tools must be a list")
        if self.seed is not None and not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed must be an integer from 0 to {(1 << 63) - 1}")
        n = body.get("n", 1)
        if n is not None and n != 1:
            raise ValueError(f"n: {str(n)[:40]} choices asked; this server answers with one (n must be 1)")
        if self.logit_bias is not None:
            size = vocab_size(self.response_generator.model_provider.model)
            for token in self.logit_bias:
                if size is not None and not 0 <= token < size:
                    raise ValueError(f"logit_bias: token id {token} is outside the vocabulary (0 to {size - 1})")
        _check_fields(body, chat=not self.anthropic and self.path.endswith("chat/completions"))
        if self.stream_options is not None:
            if not isinstance(self.stream_options, dict) or not isinstance(
                    self.stream_options.get("include_usage", False), bool):
                raise ValueError("stream_options must be an object, e.g. {\"include_usage\": true}")
            self.stream_options = {**self.stream_options,  # (mlx-lm reads the key without a default)
                                   "include_usage": self.stream_options.get("include_usage", False)}

    def _prompt_tokens(self):
        """(field, tokens) of the request's prompt, tokenized as mlx-lm will."""
        tokenizer = self.response_generator.model_provider.tokenizer
        if self.path.endswith("/completions") and not self.path.endswith("chat/completions"):
            prompt = self.body.get("prompt")
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
            return "prompt", len(tokenizer.encode(prompt))
        messages = self.body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        try:
            messages = copy.deepcopy(messages)
            mlx_server.process_message_content(messages)
            if not tokenizer.has_chat_template:
                return "messages", len(tokenizer.encode(mlx_server.convert_chat(messages,
                                                                               self.body.get("role_mapping"))))
            return "messages", len(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                 tools=self.body.get("tools") or None))
        except Exception as e:
            raise ValueError(f"messages: {e}") from None

    def handle_completion(self, request, stop_words):
        request.mlxmoe_profile = (self.body.get("mlxmoe") or {}).get("profile")
        request.decided, request.usage, request.profile, request.cancelled = SharedEvent(), None, None, False
        request.client, request.prompt_tokens = Client(self.connection), 0
        self.request = request
        wfile = self.wfile
        if self.anthropic:
            self.stream_options = {"include_usage": True}
            if self.stream:
                self.wfile = AnthropicStream(wfile, lambda: self._anthropic_message([], None, request.prompt_tokens, 0))
        try:
            super().handle_completion(request, stop_words)
        finally:
            self.wfile = wfile

    def _set_stream_headers(self, status_code=200):
        # the header names the request's profile, chosen after its prefill: wait for it
        while not self.request.decided.wait(1.0) and self.response_generator.generation_available():
            pass
        if getattr(self.request, "shut_out", False):  # (a batch's request the server stopped before it began)
            raise Refused()
        super()._set_stream_headers(status_code)
        self.send_header(PROFILE_HEADER, str(self.request.profile or "none"))

    def generate_response(self, text, finish_reason, prompt_token_count=None, completion_token_count=None,
                          *args, **kwargs):
        response = super().generate_response(text, finish_reason, prompt_token_count, completion_token_count,
                                             *args, **kwargs)
        if self.stream:
            return response
        # the whole response at once: the generation has ended; its headers are still open
        self.send_header(PROFILE_HEADER, str(self.request.profile or "none"))
        response["usage"]["mlxmoe"] = self.request.usage
        if self.anthropic:
            return self._anthropic_message([{"type": "text", "text": text or ""}],
                                           ANTHROPIC_STOP.get(finish_reason, "end_turn"),
                                           prompt_token_count, completion_token_count)
        if self.legacy_logprobs is not None:
            response["choices"][0]["logprobs"] = legacy_logprobs(
                self.response_generator.model_provider.tokenizer, kwargs["tokens"], kwargs["token_logprobs"],
                kwargs["top_tokens"] if self.legacy_logprobs > 0 else None, text or "")
        return response

    def completion_usage_response(self, *args, **kwargs):
        response = super().completion_usage_response(*args, **kwargs)
        response["usage"]["mlxmoe"] = self.request.usage
        return response

    def _anthropic_message(self, content, stop_reason, input_tokens, output_tokens):
        usage = {"input_tokens": input_tokens, "output_tokens": output_tokens}
        if self.request is not None and self.request.usage is not None:
            usage["mlxmoe"] = self.request.usage
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "model": self.requested_model, "content": content, "stop_reason": stop_reason,
                "stop_sequence": None, "usage": usage}


def legacy_logprobs(tokenizer, tokens, token_logprobs, top_tokens, text):
    """The logprobs of OpenAI's legacy completions: each token's text (as the streaming
    detokenizer gave the completion's `text`: together they are that text) and logprob, the top
    tokens at each position ({text: logprob}; None where none were asked) and where each
    token's text starts in the completion (`tokens`, `token_logprobs`, `top_tokens`: mlx-lm's).
    The tokens past the text (an end-of-sequence token, a stop sequence: mlx-lm leaves their
    text out) are left out, a token cut by the text's end cut with it."""
    detokenizer, texts = tokenizer.detokenizer, []  # (a fresh one)
    for token in tokens:
        detokenizer.add_token(token)
        texts.append(detokenizer.last_segment)
    detokenizer.finalize()
    if texts:
        texts[-1] += detokenizer.last_segment
    kept, length = [], 0
    for piece in texts:
        if length >= len(text):
            break
        kept.append(piece[:len(text) - length])
        length += len(kept[-1])
    texts, n = kept, len(kept)
    tokens, token_logprobs, top_tokens = tokens[:n], token_logprobs[:n], top_tokens and top_tokens[:n]
    offsets = list(itertools.accumulate(map(len, texts[:-1]), initial=0))[:len(texts)]
    top = None if top_tokens is None else [  # (the token taken named by its text above)
        {text if t["id"] == token else tokenizer.decode([t["id"]]): t["logprob"] for t in position}
        for text, token, position in zip(texts, tokens, top_tokens)]
    return {"tokens": texts, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _check_numbers(body):
    """The body's numbers that mlx-lm's own checks would take and MLX could not (before them)."""
    for key in NUMBER_FIELDS:
        v = body.get(key)
        if isinstance(v, bool):
            raise ValueError(f"{key} must be a number, not {json.dumps(v)}")
        if isinstance(v, int) and not -(1 << 63) <= v < 1 << 63:  # MLX takes 64-bit numbers (else bad_cast)
            raise ValueError(f"{key} must be at most {(1 << 63) - 1} in magnitude")
    most = body.get("max_completion_tokens")  # (mlx-lm reads it as max_tokens, and names that field)
    if most is not None and not (isinstance(most, int) and not isinstance(most, bool) and most >= 1):
        raise ValueError(f"max_completion_tokens must be an integer of at least 1, not {json.dumps(most)[:40]}")
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                          and abs(v) < 1e300 for v in bias.values()):
        raise ValueError("logit_bias must be a dict of int to float (finite, below 1e300 in magnitude)")


def _check_fields(body, chat):
    """Values mlx-lm takes where they mean nothing, or reads a default from, or ignores (a
    field given is a field used): ValueError naming the field."""
    top_p = body.get("top_p")
    if isinstance(top_p, (int, float)) and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be above 0 and at most 1, not {top_p}")
    penalty = body.get("repetition_penalty")
    if isinstance(penalty, (int, float)) and not penalty > 0:
        raise ValueError(f"repetition_penalty must be above 0 (1: no penalty), not {penalty}")
    if "top_logprobs" in body and body["top_logprobs"] == -1:  # (mlx-lm's value for "none", not a client's)
        raise ValueError("top_logprobs must be an integer from 0 to 11")
    mapping = body.get("role_mapping")
    if mapping is not None and not (isinstance(mapping, dict) and all(isinstance(v, str) for v in mapping.values())):
        raise ValueError("role_mapping must be an object of roles to prompt strings, e.g. {\"user\": \"USER: \"}")
    form = body.get("response_format")
    if form is not None and not isinstance(form, dict):
        raise ValueError("response_format must be an object, e.g. {\"type\": \"text\"}")
    if form is not None and form.get("type") != "text":
        raise ValueError(f"response_format: only {{\"type\": \"text\"}} is served, not {json.dumps(form)[:80]} "
                         "(no JSON mode or schema)")
    messages = body.get("messages") if chat else None
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a role (a string) and a content")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts, not null "
                             "(null only beside tool_calls)")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")


def _check_stop(body):
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(w, str) for w in stop)):
        raise ValueError("stop must be a string or a list of strings")
    if stop == "" or isinstance(stop, list) and "" in stop:
        raise ValueError("stop: an empty stop sequence")


def _check_profile(body, profiles):
    """The request's "mlxmoe" object and the profile it names, one of `profiles` (a Profiles, or None)."""
    ext = body.get("mlxmoe") or {}
    if not isinstance(ext, dict):
        raise ValueError("mlxmoe must be an object, e.g. {\"profile\": \"italian\"}")
    name = ext.get("profile")
    if name is not None and not isinstance(name, str):
        raise ValueError("mlxmoe.profile must be a string, the name of a profile")
    if name is not None and (profiles is None or name not in profiles.by_name):
        known = ", ".join(profiles.by_name) if profiles is not None else "none: start with --profiles DIR"
        raise ValueError(f"mlxmoe.profile: unknown profile {name!r} (known: {known})")


def _check_json(body):
    """What is wrong with a parsed request body, naming where (None if nothing): nesting
    deeper than MAX_DEPTH, or NaN/Infinity (Python's json reads them; JSON has no such numbers)."""
    stack = [(body, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"request body: JSON nested too deeply (at most {MAX_DEPTH} levels)"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{where or 'request body'}: must be a finite number, not {value}"
        if isinstance(value, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    return None


class Server(ThreadingHTTPServer):
    """The HTTP server: a listen backlog for many clients at once (the stdlib's 5 resets
    them), at most `max_queue` generation requests admitted at once (more get 503), each
    connection waiting `idle_timeout` seconds at most for its client (http11.KeepAlive);
    `connections`: how many it accepted."""

    request_queue_size = 1024
    daemon_threads = True

    def __init__(self, address, handler, max_queue=64, idle_timeout=IDLE_TIMEOUT):
        self.max_queue, self.admitted, self.admit_lock = max_queue, 0, threading.Lock()
        self.idle_timeout, self.connections = idle_timeout, 0
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        self.connections += 1  # (on the serving thread, one connection at a time)
        super().process_request(request, client_address)

    def admit(self):
        with self.admit_lock:
            if self.admitted >= self.max_queue:
                return False
            self.admitted += 1
            return True

    def leave(self):
        with self.admit_lock:
            self.admitted -= 1

    def answered(self, timeout):
        """Wait up to `timeout` seconds for the admitted requests' answers to be written (the
        generation stopped: each is whole, a 503, or cut short)."""
        end = time.monotonic() + timeout
        while self.admitted and time.monotonic() < end:
            time.sleep(0.02)


def cli_args(model, max_tokens, temp, top_p, prompt_cache_size, num_draft_tokens=3, max_batch=1,
             prefill_step_size=None):
    """The namespace mlx-lm's server reads its settings from, with mlx-lm's defaults; batches of
    `max_batch` requests decoding, up to as many prompts prefilled together in steps of
    `prefill_step_size` tokens in all (batching.Batches)."""
    return argparse.Namespace(
        model=model, adapter_path=None, draft_model=None, num_draft_tokens=num_draft_tokens, trust_remote_code=False,
        chat_template="", use_default_chat_template=False, chat_template_args={}, temp=temp, top_p=top_p, top_k=0,
        min_p=0.0, max_tokens=max_tokens, allowed_origins=["*"], decode_concurrency=max_batch, prompt_concurrency=max_batch,
        prefill_step_size=prefill_step_size, prompt_cache_size=prompt_cache_size, prompt_cache_bytes=None, kv_bits=None,
        kv_group_size=64, quantized_kv_start=0, pipeline=False)


def say(line):
    print(line, file=sys.stderr, flush=True)


def serving_line(model_name, runtime, profiles_dir, profiles, profile_path, save_profiles, save_every, batch=""):
    """What `serve` says it serves: the model, the budget and what the expert cache holds,
    the profiles and whether they are written back; `batch`: how requests are batched."""
    cache, ckpt = runtime.cache, runtime.checkpoint
    total = ckpt.num_layers * ckpt.num_experts  # (under several ranks, this rank's stage)
    line = (f"serving {model_name}: memory budget {format_size(runtime.plan.budget)}, expert cache "
            f"{cache.capacity} of {total} experts ({format_size(cache.capacity * cache.pools.slot_bytes)}), "
            f"policy {cache.policy.name}")
    if profiles is not None:
        line += f"; profiles {', '.join(profiles.by_name)} from {profiles_dir}"
    elif profile_path is not None:
        line += f"; profile {profile_path}"
    else:
        line += "; no profile"
    if save_profiles:
        line += f" (learning: written back {f'every {save_every} requests and ' if save_every else ''}at exit)"
    return line + batch


def batch_line(generator, max_batch):
    """How serve batches requests, for its serving line."""
    provider = generator.model_provider
    if provider.is_batchable:
        own = ", each with its own profile" if generator.profiles is not None else ""
        return f"; batches of up to {max_batch} requests (within the KV reserve{own})"
    if max_batch == 1:
        return "; one request at a time (--max-batch 1)"
    why = ("speculative decoding" if provider.draft_model is not None else
           "several ranks" if generator.group is not None else "this model's KV caches")
    return f"; one request at a time ({why} does not batch)"


def response_generator(model, tokenizer, model_name, max_tokens=512, temp=0.0, top_p=1.0, prompt_cache_size=0,
                       profiles=None, save_every=0, profile_path=None, draft_model=None, num_draft_tokens=3,
                       max_batch=1):
    """mlx-lm's generation thread on `model`, started, with the prompt cache bounded by the
    KV reserve; mlx-lm's server generates through it from now on. `draft_model`: the
    runtime's draft model, or "ngram" (see serve); `max_batch`: requests decoded together."""
    plan = model.expert_runtime.plan
    step = prefill_step(plan, tokenizer, [0] * getattr(plan, "context", DEFAULT_CONTEXT))  # (the longest prompt's)
    provider = Provider(cli_args(model_name, max_tokens, temp, top_p, prompt_cache_size, num_draft_tokens, max_batch,
                                 step), model, tokenizer, NGram() if draft_model == "ngram" else draft_model)
    prompt_cache = LRUPromptCache(prompt_cache_size, max(1, plan.kv_reserve))
    generator = ResponseGenerator(provider, prompt_cache, profiles, save_every, profile_path)
    mlx_server.stream_generate = generator.stream  # what mlx-lm's generation thread calls
    if provider.is_batchable:  # what it batches with
        mlx_server.BatchGenerator = functools.partial(Batches, owner=generator)
    return generator


def http_server(generator, host="127.0.0.1", port=0, max_queue=64, idle_timeout=IDLE_TIMEOUT):
    """The HTTP server of `generator`'s requests, serving on a thread of its own until its shutdown()."""
    httpd = Server((host, port), lambda *a, **k: Handler(
        generator, *a, system_fingerprint=mlx_server.get_system_fingerprint(), **k), max_queue, idle_timeout)
    threading.Thread(target=httpd.serve_forever, name="mlxmoe-http", daemon=True).start()
    return httpd


def serve(model, tokenizer, model_name, host="127.0.0.1", port=8080, profiles_dir=None, save_profiles=False,
          save_every=16, max_tokens=512, temp=0.0, top_p=1.0, prompt_cache_size=0, force_profile=False,
          profile_path=None, max_queue=64, idle_timeout=IDLE_TIMEOUT, draft_model=None, num_draft_tokens=3,
          max_batch=1):
    """Serve `model` until SIGINT or SIGTERM; then, with save_profiles, save the profiles
    (--profiles) or the live one to `profile_path` (the --profile it was loaded with).
    `draft_model` (the runtime's draft model, or "ngram"), drafting `num_draft_tokens` a step
    where a request does not say: speculative decoding for every request (then no batches).
    `max_batch`: concurrent requests decoded in one step (batching.py; 1: one at a time).
    Under several ranks (model loaded with a group) every rank calls this: rank 0 serves
    HTTP, the others follow its requests; a signal to any rank stops them all."""
    if not (isinstance(temp, (int, float)) and math.isfinite(temp) and temp >= 0):
        raise MlxmoeError(f"temp {temp!r}: a finite number, at least 0")
    if not (isinstance(top_p, (int, float)) and 0 <= top_p <= 1):
        raise MlxmoeError(f"top_p {top_p!r}: a number from 0 to 1")
    runtime = model.expert_runtime
    group = runtime.group
    profiles = None if profiles_dir is None else _open_profiles(profiles_dir, runtime, force_profile)
    if save_profiles and profiles is None and profile_path is None:
        raise MlxmoeError("--save-profiles needs --profiles DIR or --profile FILE (where to write them)")
    generator = response_generator(model, tokenizer, model_name, max_tokens, temp, top_p, prompt_cache_size, profiles,
                                   save_profiles and save_every, profile_path, draft_model, num_draft_tokens, max_batch)

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupting(stop))
    httpd = None
    try:
        if group is None or group.rank() == 0:
            httpd = http_server(generator, host, port, max_queue, idle_timeout)
            say(serving_line(model_name, runtime, profiles_dir, profiles, profile_path, save_profiles, save_every,
                             batch_line(generator, max_batch)))
            say(f"mlxmoe serve: {model_name} at http://{host}:{httpd.server_port}")
        # until a signal (on any rank) stops the generation, or it fails; not Thread.join(): a
        # Ctrl-C that interrupts it leaves the thread taken for ended (Python 3.11, bpo-45274)
        generator.ended.wait()
    except KeyboardInterrupt:
        pass
    except OSError as e:
        raise MlxmoeError(f"cannot serve on {host}:{port}: {e.strerror}") from None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM does not cut the save short
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        generator.stop_and_join()
        # what was learnt is kept on any exit caught here; after a failure under several ranks
        # the save's exchanges could not complete (a rank is gone), in one process they need none
        if save_profiles and (generator.failure is None or group is None):
            _save_profiles(generator, group)
        if httpd is not None:
            httpd.answered(5.0)
        signal.signal(signal.SIGTERM, previous)
    if generator.failure is not None:
        e = generator.failure
        left = "; a rank failed or its connection was lost" if group is not None else ""
        raise MlxmoeError(f"generation stopped ({type(e).__name__}: {e}){left}")


def _open_profiles(profiles_dir, runtime, force_profile):
    """The Profiles of the folder `profiles_dir`; under several ranks every rank has them
    (a folder on each host), or every rank raises."""
    group = runtime.group
    try:
        folder = Path(profiles_dir)
        if not folder.is_dir():
            raise MlxmoeError(f"--profiles {profiles_dir}: not a folder")
        profiles = Profiles(folder.glob("*.json"), runtime.checkpoint, force_profile)
        error = None
    except MlxmoeError as e:
        if group is None:
            raise
        profiles, error = None, e
    if group is not None:
        distributed.check(group, error)
    return profiles


def _save_profiles(generator, group):
    """Save what the profiles learnt (a collective under several ranks), rank 0 saying what it wrote."""
    with distributed.waiting(group, "saving the profiles"):
        saved = generator.save()
    if group is None or group.rank() == 0:
        say(f"saved {', '.join(map(str, saved))}" if saved else "profiles unchanged since the last save")
