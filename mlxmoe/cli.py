"""The `mlxmoe` command: generate, chat, info, fit, pull, list, profile, trace, convert, serve."""

import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

from .errors import MlxmoeError
from .signals import interrupting
from .caching.policies import DEFAULT_POLICY, ONLINE
from .storage.files import check_outputs, model_folder
from .workload.tracefile import MAX_EXPERTS


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C (what was recorded is saved), but it also ends a chat."""


class Size(click.ParamType):
    """A memory size such as 12GB (budget.parse_size), or one of `words`, checked when the option is read."""
    name = "size"

    def __init__(self, words=()):
        self.words = words

    def convert(self, value, param, ctx):
        from .budget import parse_size

        if value in self.words:
            return value

        try:
            parse_size(value, "size")
        except MlxmoeError as e:
            self.fail(str(e), param, ctx)
        return value


class Number(click.ParamType):
    """A finite int or float between `low` and `high` (ends excluded where `open`), or one of `words`."""

    def __init__(self, kind=float, low=None, high=None, low_open=False, words=()):
        self.kind, self.low, self.high, self.low_open, self.words = kind, low, high, low_open, words
        self.name = "integer" if kind is int else "number"

    def convert(self, value, param, ctx):
        if value in self.words:
            return value
        try:
            x = self.kind(value)
        except (TypeError, ValueError, OverflowError):
            self.fail(f"{str(value)[:40]!r} is not {'an integer' if self.kind is int else 'a number'}"
                      + "".join(f" or {w}" for w in self.words), param, ctx)
        below = self.low is not None and (x <= self.low if self.low_open else x < self.low)
        if (self.kind is float and not math.isfinite(x)) or below or (self.high is not None and x > self.high):
            lo = "" if self.low is None else f"{'above' if self.low_open else 'at least'} {self.low}"
            hi = "" if self.high is None else f"at most {self.high}"
            what = "an integer" if self.kind is int else "a finite number"
            self.fail(f"{str(value)[:40]} is not {what} {' and '.join(s for s in (lo, hi) if s)}", param, ctx)
        return x


def exclusive(**given):
    """Refuse options that exclude each other when more than one is given."""
    named = [name for name, value in given.items() if value is not None]
    if len(named) > 1:
        raise click.UsageError(f"{' and '.join('--' + n.replace('_', '-') for n in named)} exclude each other; "
                               "give one")


@contextlib.contextmanager
def signals_deferred():
    """Ctrl-C and SIGTERM wait until the block is done (a save that must not be lost),
    then act as they would have (main thread only: Python runs signal handlers there)."""
    caught = []
    old = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if caught:
            handler = old[caught[0]]
            if callable(handler):
                handler(caught[0], None)
            else:
                os.kill(os.getpid(), caught[0])


# what --model says of the bundled demo model (storage.files.named_model)
DEMO_HELP = ("`demo` (the default) is the small demo model that ships with mlxmoe, from any folder; a folder "
             "named demo in the current directory wins.")


def model_options(f):
    """Options shared by every command that loads a model."""
    options = [
        click.option("--model", "-m", "model_path", help="Model folder, or Hugging Face repo id (OWNER/NAME) "
                     "pulled with `mlxmoe pull`. " + DEMO_HELP),
        click.option("--memory-budget", type=Size(words=("auto",)), help="Memory for the whole model: resident "
                     "weights + KV cache + expert cache, e.g. 12GB. Default: 60% of this machine's memory. auto: "
                     "follow the memory available (Linux: MemAvailable and the cgroup's limit; macOS: the memory "
                     "status), the expert cache growing and shrinking within a second (output unchanged)."),
        click.option("--memory-margin", type=Size(), help="With --memory-budget auto: memory left free for the "
                     "rest of the machine. Default: 15% of its memory or 2GB, whichever is smaller."),
        click.option("--cache-size", type=Size(), help="Expert cache size in bytes (e.g. 2GB); overrides the budget's "
                     "share."),
        click.option("--cache-experts", type=Number(int, 1), help="Expert cache size as a number of experts (all "
                     "layers)."),
        click.option("--policy", type=click.Choice(ONLINE), help=f"Eviction policy (default: {DEFAULT_POLICY})."),
        click.option("--backend", type=click.Choice(["cpu", "metal", "cuda"]), help="Default: the best available."),
        click.option("--profile", "profile_path", type=click.Path(dir_okay=False),
                     help="An activation profile (profile record): the policy's prior, and the experts that "
                     "pre-warm the cache in the background."),
        click.option("--force", "force_profile", is_flag=True, help="Use a profile recorded on another model "
                     "whose layer and expert counts agree."),
        click.option("--trace-out", type=click.Path(dir_okay=False), help="Record the routing trace here."),
        click.option("--io", type=click.Choice(["auto", "mmap", "pread", "direct"]), default="auto", show_default=True,
                     help="How experts are read: mmap or pread (through the page cache), direct (around it)."),
        click.option("--max-context", type=Number(int, 16, 1 << 24), default=4096, show_default=True,
                     help="Tokens a conversation may hold (prompt, earlier turns, reply): the budget reserves KV "
                     "cache for them; a longer prompt is refused."),
        click.option("--prefetch", type=Number(int, 0, 64), default=1, show_default=True,
                     help="Read predicted experts this many layer calls ahead in the background (0: off)."),
        click.option("--wait-per-layer", "verify", is_flag=True, flag_value=False, default=True,
                     help="Wait for the device at every MoE layer of a decode step, as before. Default: a step "
                     "whose experts are not all in memory looks them up on the device and waits once, at its "
                     "end; a layer that missed is read and the step computed again from it (exact either way)."),
        click.option("--cache-bias", type=Number(float, 0, words=("profile",)), default=0.0, show_default=True,
                     help="Lossy, try first: add this to resident experts' router logits so close calls go to "
                     "experts in memory (fewer reads; 0: exact; profile: the --profile's recommended value). See "
                     "README, 'Lossy modes'."),
        click.option("--trim", type=Number(float, 0, 1), default=0.0, show_default=True,
                     help="Lossy: skip a routed expert that is not in memory when it carries less than this "
                     "share of the token's routing weight (0: exact)."),
        click.option("--trim-mass", type=Number(float, 0, 1), default=0.0, show_default=True,
                     help="Lossy: skip a routed expert that is not in memory beyond the top ones that carry this "
                     "share of the token's routing weight (e.g. 0.85; 0: exact)."),
        click.option("--fallback", type=click.Path(dir_okay=False), help="Lossy: low-bit copies of the experts "
                     "(convert --fallback-bits), kept in memory within the budget: a missing expert computes with "
                     "its copy at once and is read in the background (no decode step waits on a read)."),
        click.option("--split", type=click.Choice(["pipeline", "tensor"]), default="pipeline", show_default=True,
                     help="Under mlx.launch: each rank runs a stage of layers (pipeline), or a slice of "
                     "every layer (tensor, where mlx-lm can shard the model)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


class JsonObject(click.ParamType):
    """A JSON object given as text (mlx-lm's --chat-template-config), read into a dict."""
    name = "json"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            x = json.loads(value)
        except ValueError as e:
            self.fail(f"not JSON ({e})", param, ctx)
        if not isinstance(x, dict):
            self.fail("a JSON object of keyword arguments, such as '{\"enable_thinking\": false}'", param, ctx)
        return x


class NonEmpty(click.ParamType):
    """A string of at least one character."""
    name = "string"

    def convert(self, value, param, ctx):
        if not value:
            self.fail("an empty string", param, ctx)
        return value


def sampling_options(f):
    """generate's and chat's options, mlx-lm's (mlx_lm.generate --help) under its names and
    defaults, passed to its make_sampler and stream_generate (sampler, kv_options); --stop."""
    options = [
        click.option("--max-tokens", type=Number(int, 1, 1 << 31), default=256, show_default=True,
                     help="Tokens to generate."),
        click.option("--temp", type=Number(float, 0), default=0.0, show_default=True,
                     help="Sampling temperature (0: greedy)."),
        click.option("--top-p", type=Number(float, 0, 1, low_open=True), default=1.0, show_default=True,
                     help="Nucleus sampling mass, in (0, 1]."),
        click.option("--min-p", type=Number(float, 0, 1), default=0.0, show_default=True,
                     help="Sample only tokens at least this share of the likeliest one's probability (0: off)."),
        click.option("--min-tokens-to-keep", type=Number(int, 1), default=1, show_default=True,
                     help="Tokens --min-p keeps at the least."),
        click.option("--top-k", type=Number(int, 0), default=0, show_default=True,
                     help="Sample among the k likeliest tokens (0: all)."),
        click.option("--xtc-probability", type=Number(float, 0, 1), default=0.0, show_default=True,
                     help="Chance of XTC sampling (excluding the top choices) at each token (0: off)."),
        click.option("--xtc-threshold", type=Number(float, 0, 0.5), default=0.1, show_default=True,
                     help="XTC excludes the likeliest tokens above this probability, in [0, 0.5]."),
        click.option("--seed", type=Number(int, 0, (1 << 64) - 1),
                     help="Random seed, to repeat a sampled run. Default: a new one each run, as mlx_lm.generate."),
        click.option("--max-kv-size", type=Number(int, 5, 1 << 24), help="Keep at most this many tokens in the KV "
                     "cache (mlx-lm's rotating cache: the first 4 and the latest). Default: all."),
        click.option("--kv-bits", type=click.Choice(["2", "3", "4", "5", "6", "8"]),
                     help="Quantize the KV cache to this many bits (mlx-lm's QuantizedKVCache). Default: not."),
        click.option("--kv-group-size", type=click.Choice(["32", "64", "128"]), default="64", show_default=True,
                     help="Group size of the KV cache's quantization."),
        click.option("--quantized-kv-start", type=Number(int, 0), default=5000, show_default=True,
                     help="With --kv-bits, quantize the KV cache once it holds this many tokens."),
        click.option("--chat-template-config", type=JsonObject(), help="Keyword arguments for the chat template, "
                     "a JSON object (e.g. '{\"enable_thinking\": false}')."),
        click.option("--stop", multiple=True, type=NonEmpty(), help="End the reply at the first occurrence of this "
                     "text (printed up to it); repeat for several."),
        click.option("--verbose", type=click.BOOL, default=True, show_default=True,
                     help="False: print only the reply (no figures, no progress), as mlx_lm.generate --verbose F."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def draft_options(f):
    """generate's, chat's and serve's speculative decoding options (mlx-lm's names, and --draft ngram)."""
    options = [
        click.option("--draft-model", type=click.Path(file_okay=False), help="A small model with the same tokenizer "
                     "that drafts tokens for the model to verify several at a step (speculative decoding, exact); "
                     "loaded whole, within --memory-budget."),
        click.option("--draft", type=click.Choice(["ngram"]), help="ngram: draft from the prompt and the text so "
                     "far (the tokens that followed the latest match of the last 3 or 2 tokens), no second "
                     "model; paused for a while where its drafts are rarely right or its steps give fewer "
                     "tokens a second than plain ones."),
        click.option("--num-draft-tokens", "--num-draft", "num_draft_tokens", type=Number(int, 1, 1024),
                     help="Tokens drafted a step. Default: 3 with --draft-model (mlx-lm's), 5 with --draft ngram."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def check_drafts(opts):
    """Refuse draft options that exclude each other, before the model loads."""
    exclusive(draft_model=opts["draft_model"], draft=opts["draft"])
    if opts["draft_model"] and opts.get("max_kv_size"):
        raise click.UsageError("--draft-model cannot take back rejected drafts from --max-kv-size's rotating KV "
                               "cache; give one of them (--draft ngram works with it)")


def draft_arguments(model, opts):
    """stream_generate's draft_model and num_draft_tokens from the draft options ({} without)."""
    if opts["draft"]:
        return {"draft_model": "ngram", "num_draft_tokens": opts["num_draft_tokens"]}
    if opts["draft_model"]:
        return {"draft_model": model.expert_runtime.draft_model, "num_draft_tokens": opts["num_draft_tokens"] or 3}
    return {}


def draft_figures(stats, before=None):
    """', A of D drafted tokens accepted' since `before` where drafts were made, else ''."""
    drafted, accepted = (stats.get(k, 0) - (before or {}).get(k, 0) for k in ("drafted", "accepted"))
    return f", {accepted} of {drafted} drafted tokens accepted" if drafted else ""


def kv_options(opts):
    """stream_generate's KV cache arguments from the sampling options (mlx-lm's names)."""
    exclusive(max_kv_size=opts["max_kv_size"], kv_bits=opts["kv_bits"])  # mlx-lm cannot quantize a rotating cache
    return {"max_kv_size": opts["max_kv_size"], "kv_bits": opts["kv_bits"] and int(opts["kv_bits"]),
            "kv_group_size": int(opts["kv_group_size"]), "quantized_kv_start": opts["quantized_kv_start"]}


class Stops:
    """A reply's text up to the first of the --stop strings: feed() returns what can be
    printed now (a tail that may begin a stop string is held back); `done` once one came."""

    def __init__(self, stops):
        self.stops, self.held, self.done = stops, "", False
        self.last, self.text = None, ""  # the last response printed (print_reply), and all its text

    def feed(self, text):
        text, self.held = self.held + text, ""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.done = True
            return text[:min(found)]
        keep = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        if keep:
            text, self.held = text[:-keep], text[-keep:]
        return text

    def rest(self):
        """What is held back at the reply's end (no stop string came)."""
        text, self.held = self.held, ""
        return text


def print_reply(steps, waiting, stops):
    """Print a reply as stream_generate's `steps` give it, up to the first of `stops` (the
    generation is closed there); the last response (also stops.last, after Ctrl-C), or None.
    A SIGTERM whose handler's exception was lost ends it at the next token."""
    with contextlib.closing(steps):
        for response in steps:
            _still_running()
            stops.last = response
            waiting.stop(finished=True)
            text = stops.feed(response.text)
            stops.text += text
            click.echo(text, nl=False)
            if stops.done:
                break
    text = stops.rest()
    stops.text += text
    click.echo(text, nl=False)
    return stops.last


def import_mlx():
    """Import MLX and mlx-lm (most of a second: mlx-lm brings transformers) with Ctrl-C and
    SIGTERM held until done, as an interrupt while MLX's extension initialises aborts the
    process. Only the commands that open a model call it: `profile show`, `trace replay`
    and the like start at once. A line says so if it takes more than 2 s (a busy machine)."""
    waiting = notice(2.0, lambda: "starting MLX and mlx-lm...")
    try:
        with signals_deferred():
            from . import api  # noqa: F401
    finally:
        waiting.cancel()


def _load(opts):
    import_mlx()
    from . import distributed, load

    exclusive(cache_size=opts["cache_size"], cache_experts=opts["cache_experts"])
    group = distributed.init()  # None unless started as several ranks (mlx.launch)
    if group is not None and group.rank() != 0:  # rank 0 speaks for all
        sys.stdout = sys.stderr = open(os.devnull, "w")
    global _compiling_said
    if cpu_kernels() == 0:
        click.echo("first run: MLX compiles its CPU kernels (a few seconds, once)", err=True)
        _compiling_said = True
    loading = notice(2.0, lambda: f"loading {opts['model_path'] or 'the demo model'}...")
    try:
        model, tokenizer = load(opts["model_path"], options=load_options(opts, group))
    finally:
        loading.cancel()
    cache = model.expert_cache
    if opts["profile_path"]:  # the pre-warm reads in the background; say so if it is long
        notice(2.0, lambda: None if cache.prewarm_done(0) else
               f"pre-warming the cache with the hottest experts of {cache.profile.workload!r} in the background "
               "(the first tokens share the disk with it)")
    return model, tokenizer


def load_options(opts, group=None):
    """The api.LoadOptions that a command's model options (model_options) stand for."""
    from dataclasses import fields

    from .api import LoadOptions

    names = {f.name for f in fields(LoadOptions)} - {"profile", "group"}
    return LoadOptions(**{k: v for k, v in opts.items() if k in names}, profile=opts["profile_path"], group=group)


def model_inputs(opts):
    """The files a command's model options (model_options) read: no output may be one (files.check_outputs)."""
    return {"--model": model_folder(opts["model_path"]), "--profile": opts["profile_path"],
            "--fallback": opts["fallback"], "--draft-model": opts.get("draft_model")}


def _prior(model, opts):
    """(workload, tokens) of the --profile the live profile starts from, or None."""
    live = model.expert_runtime.profile
    return (live.workload, live.tokens_total) if opts["profile_path"] else None


_compiling_said = False  # the first run's line said that MLX compiles its kernels


def cpu_kernels():
    """How many kernels MLX's CPU backend has compiled and cached (it builds them with the
    C++ compiler on first use of an operation, into <tmp>/mlx/<version>/cpu); None on a GPU."""
    import tempfile

    import mlx.core as mx

    if mx.metal.is_available() or mx.cuda.is_available():
        return None
    try:
        return len(os.listdir(os.path.join(tempfile.gettempdir(), "mlx", mx.__version__, "cpu")))
    except OSError:
        return 0


def notice(seconds, line):
    """A timer that, `seconds` on, says `line()` on stderr (if it returns one): what a user
    who waits that long is waiting for. cancel() it when the wait is over."""
    def say():
        text = line()
        if text:
            click.echo(text, err=True)

    timer = threading.Timer(seconds, say)
    timer.daemon = True
    timer.start()
    return timer


@contextlib.contextmanager
def said_if_slow(line, seconds=2.0):
    """notice(seconds, line) for a with block: `line` (what it does) said once it takes that
    long; the block gets the timer (cancel() it once the block shows progress of its own)."""
    timer = notice(seconds, lambda: line)
    try:
        yield timer
    finally:
        timer.cancel()


class Waiting:
    """A reply's wait for its first token, said on stderr once it passes `after` seconds: the
    prefill's progress in prompt tokens, redrawn each second on a terminal (a long prompt, a
    slow disk; elsewhere, a log, a line each PLAIN_EVERY seconds), and once, that MLX is
    compiling CPU kernels where new ones have appeared in its cache (a sampler or shape this
    machine has not run before). `progress` is mlx-lm's prompt_progress_callback; stop() at
    the first token (`finished`) or where the prefill was stopped (the last line says where).
    `after` None: nothing is said."""

    PLAIN_EVERY = 10

    def __init__(self, after=2.0):
        self.start, self.kernels, self.tty = time.monotonic(), cpu_kernels(), sys.stderr.isatty()
        self.done, self.total, self.shown = 0, 0, False  # shown: a progress line was said (on a terminal: is open)
        self.lock, self.stopped = threading.Lock(), threading.Event()
        threading.Thread(target=self._watch, args=(after,), daemon=True).start()

    def progress(self, done, total):
        with self.lock:
            self.done, self.total = done, total
            if done >= total:
                self._end_line()

    def stop(self, finished=False):
        with self.lock:
            self.stopped.set()
            if finished:
                self.done = self.total
            self._end_line()

    def _line(self, nl=True):
        """The progress line: redrawn in place on a terminal (open until `nl`), a line of its own elsewhere."""
        line = f"prefill: {self.done}/{self.total} prompt tokens ({time.monotonic() - self.start:.0f} s)"
        click.echo("\r" + line if self.tty else line, err=True, nl=nl or not self.tty)

    def _end_line(self):
        if self.shown:
            self._line()
            self.shown = False

    def _watch(self, after):
        compiling = self.kernels is None or _compiling_said  # nothing to say about kernels
        if after is None or self.stopped.wait(after):  # None: say nothing (--verbose False)
            return
        said_at = -math.inf
        while True:
            with self.lock:
                if self.stopped.is_set():
                    return
                if not compiling and cpu_kernels() > self.kernels:
                    compiling = True
                    click.echo(("\n" if self.shown and self.tty else "") + "MLX is compiling CPU kernels for these "
                               "settings (a few seconds, once: later runs reuse them)", err=True)
                    self.shown = False
                if self.done < self.total and (self.tty or time.monotonic() - said_at >= self.PLAIN_EVERY):
                    self._line(nl=False)
                    self.shown, said_at = True, time.monotonic()
            if self.stopped.wait(1.0):
                return


def _stats(model):
    from .distributed import merged_stats

    return merged_stats(model)


def _sampler(opts, tokenizer):
    """mlx-lm's make_sampler from the sampling options, as mlx_lm.generate builds it (seeded first)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    if opts["seed"] is not None:
        mx.random.seed(opts["seed"])
    return make_sampler(opts["temp"], opts["top_p"], opts["min_p"], opts["min_tokens_to_keep"], top_k=opts["top_k"],
                        xtc_probability=opts["xtc_probability"], xtc_threshold=opts["xtc_threshold"],
                        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))


def summary(stats, before, elapsed_tokens, tps):
    """One line per reply: speed, hit rate and bytes read since `before`."""
    from .budget import format_size

    hits = stats["hits"] - before["hits"]
    total = hits + stats["misses"] - before["misses"]
    read = format_size(stats["bytes_read"] - before["bytes_read"])
    rate = f"{100 * hits / total:.1f}%" if total else "n/a"
    lossy = lossy_figures(stats, before) + draft_figures(stats, before)
    return f"[{_tokens_at(elapsed_tokens, tps)}, expert hit rate {rate}, {read} read{lossy}]"


def lossy_figures(stats, before=None):
    """', N experts skipped, M biased in' since `before` where a lossy mode did anything, else ''."""
    skipped, biased, low = (stats.get(k, 0) - (before or {}).get(k, 0) for k in ("skipped", "biased", "substituted"))
    parts = [f"{plural(n, 'expert')} {what}" for n, what in ((skipped, "skipped"), (biased, "biased in"),
                                                           (low, "low-bit")) if n]
    return "".join(", " + p for p in parts)


CHAT_HELP = """/help          this list
/reset         start a new conversation (the expert cache and the live profile are kept)
/save FILE     write the conversation to FILE as JSON messages ([{"role": ..., "content": ...}])
/load FILE     continue the conversation saved in FILE (/save's format, or any such JSON list)
/stats         the expert cache's figures so far, and the decode steps' path
/profile FILE  take this profile as the cache's prior from now on (pre-warms its hottest experts)
/budget SIZE   resize the expert cache to fit this memory budget (e.g. 8GB), now; output unchanged
/quit          leave (also /exit, /bye or Ctrl-D)
Ctrl-C stops a reply: that message and its partial reply are dropped, the turns before them kept
(Up recalls the message). Several lines make one message: end each but the last with a
backslash, or put them between lines that begin and end with \"\"\", or paste them."""


def stats_table(stats):
    """The cache's stats as a few aligned lines (the whole set is in --stats-json)."""
    from .budget import format_size as size

    rows = [("tokens", stats["tokens"]),
            ("hit rate", f"{100 * stats['hit_rate']:.1f}% ({stats['hits']} hits, {stats['misses']} misses)"),
            ("loads", f"{stats['loads_demand']} on demand, {stats['loads_prefetched']} prefetched "
                      f"({stats['prefetch_useful']} of them used)"),
            ("read", size(stats["bytes_read"])),
            ("cache", f"{stats['cache_experts']} experts ({size(stats['cache_bytes'])}), policy {stats['policy']}"),
            ("memory", f"MLX peak {size(stats['peak_memory'])}, process peak RSS {size(stats['peak_rss'])}"),
            ("decode", decode_path(stats))]
    return "\n".join(f"{name:<9}{value}" for name, value in rows)


def decode_path(stats):
    """Which path the decode steps take: verified (one wait a step, caching/verify.py), with the
    switch's state and its reason, or a wait at every layer call."""
    verify = stats.get("verify") or {}
    if "wait_us" not in verify:  # (no verifier: why not)
        return verify.get("reason") or "a wait at every MoE layer call"
    state = "on" + (f" ({verify['reason']})" if verify.get("reason") else "") if verify.get("on") else \
        f"off: {verify.get('reason')}"
    return (f"{plural(stats.get('verified_tokens', 0), 'step')} verified (one wait each), "
            f"{plural(stats.get('replays', 0), 'replay')}; verified steps {state}")


def expert_line(stats, baseline_rss):
    """The run's expert-cache summary: every figure in the same binary units as the budget,
    loads split the way the bytes were read, and the memory Python and MLX take before any
    weight is loaded named apart from the model's."""
    from .budget import format_size as size

    low = f", low-bit copies {size(stats['fallback_bytes'])}" if stats.get("fallback_bytes") else ""
    held = f" ({size(stats['cache_bytes'])}{low})"
    return (f"experts: {cache_figures(stats, held)}; "
            f"MLX peak memory {size(stats['peak_memory'])}, process peak RSS {size(stats['peak_rss'])} "
            f"(Python and MLX before loading: {size(baseline_rss)})")


def rank_line(rank, stats):
    """One rank's share of the run, in the summary's units and terms."""
    from .budget import format_size as size

    return f"rank {rank}: {cache_figures(stats)}, process peak RSS {size(stats['peak_rss'])}"


def cache_figures(stats, held=""):
    """What the run's summary and each rank's line share: hit rate, bytes read split into
    the loads that read them, the cache's size in experts (then `held`: in bytes), and what
    lossy modes did."""
    from .budget import format_size as size

    return (f"hit rate {100 * stats['hit_rate']:.1f}%, {size(stats['bytes_read'])} read "
            f"({stats['loads_demand']} loads on demand + {stats['loads_prefetched']} prefetched), "
            f"cache {plural(stats['cache_experts'], 'expert')}{held}{lossy_figures(stats)}")


def current_rss():
    """The process's resident memory now, in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlxmoe")
def main():
    """Run Mixture-of-Experts models larger than memory: experts stream from disk
    through a cache that keeps the ones your workload uses."""


def _finish(model, save_profile, prior=None, trace_out=None):
    """Close the cache (ending the --trace-out trace, said where written) and save the live
    profile, atomically, saying how many of its tokens come from the --profile it started
    from (`prior`)."""
    runtime = model.expert_runtime
    with signals_deferred():
        runtime.close()
        live = runtime.save_profile(save_profile) if save_profile else None
    if trace_out and runtime.main_rank() and os.path.exists(trace_out):  # (none where nothing was routed)
        click.echo(f"saved trace {trace_out}", err=True)
    if live is not None and runtime.main_rank():
        parts = "" if prior is None else (f": {prior[1]} of {prior[0]!r} (--profile) + "
                                          f"{live.tokens_total - prior[1]} from this run")
        click.echo(f"saved profile {save_profile} ({live.tokens_total} tokens{parts})", err=True)


save_profile_option = click.option("--save-profile", type=click.Path(dir_okay=False),
                                   help="Write the live profile here at exit (also on Ctrl-C): what this run "
                                   "used, on top of the --profile it started from (profile record saves only "
                                   "what it recorded).")


@main.command()
@model_options
@sampling_options
@click.option("--prompt", "-p", required=True, help="The prompt ('-' reads standard input).")
@click.option("--system-prompt", help="System message for the chat template.")
@click.option("--chat-template/--no-chat-template", " /--raw", " /--ignore-chat-template", default=None,
              help="Wrap the prompt in the model's chat template, as mlx_lm.generate does. Default: on where the "
              "model has one; --raw (or --no-chat-template, or mlx-lm's --ignore-chat-template) continues the "
              "prompt as plain text.")
@click.option("--repetition-penalty", type=Number(float, 1.0), help="mlx-lm's penalty on tokens of the last "
              "--repetition-context-size (1: none). Default: none, as mlx_lm.generate.")
@click.option("--repetition-context-size", type=Number(int, 1), default=20, show_default=True,
              help="Tokens the repetition penalty looks back on.")
@click.option("--prompt-cache-file", type=click.Path(dir_okay=False), help="A KV cache saved by mlx_lm.cache_prompt: "
              "the prompt continues it (--model defaults to the cache's model).")
@click.option("--stats-json", type=click.Path(dir_okay=False), help="Write the cache stats to this file.")
@draft_options
@save_profile_option
def generate(prompt, system_prompt, chat_template, repetition_penalty, repetition_context_size, prompt_cache_file,
             stats_json, save_profile, **opts):
    """Generate text from a prompt, streaming it to standard output."""
    import_mlx()
    from mlx_lm.sample_utils import make_logits_processors

    from .api import stream_generate

    kv = kv_options(opts)
    check_drafts(opts)
    if prompt_cache_file and opts["draft_model"]:
        raise click.UsageError("--prompt-cache-file holds no KV cache of a --draft-model; give one of them")
    prompt_cache = _prompt_cache_file(prompt_cache_file, opts, kv) if prompt_cache_file else None
    check_outputs({"--stats-json": stats_json, "--save-profile": save_profile, "--trace-out": opts["trace_out"]},
                  {**model_inputs(opts), "--prompt-cache-file": prompt_cache_file},
                  updates={"--save-profile": "--profile"})  # (it learns on top of it)
    baseline_rss = current_rss()  # Python, MLX and mlx-lm imported, no weights yet
    model, tokenizer = _load(opts)
    prior = _prior(model, opts)
    if prompt_cache is not None:
        _check_cache_layers(model, prompt_cache, prompt_cache_file)
    if prompt == "-":
        prompt = _read_stdin()
    if not prompt.strip():
        raise MlxmoeError("the prompt is empty")
    templated = chat_template or (chat_template is None and tokenizer.has_chat_template)
    if templated:  # as mlx_lm.generate: after a prompt cache, only what follows its prefix
        messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
        prompt = _chat_prompt(tokenizer, messages, opts["chat_template_config"], tokenize=False)
        if prompt_cache is not None:
            messages[-1]["content"] = "<query>"
            prompt = prompt[_chat_prompt(tokenizer, messages, tokenize=False).index("<query>"):]
    ids = tokenizer.encode(prompt, add_special_tokens=not templated)
    processors = make_logits_processors(repetition_penalty=repetition_penalty,
                                        repetition_context_size=repetition_context_size)
    verbose, stops = opts["verbose"], Stops(opts["stop"])
    interrupted, waiting = False, Waiting(2.0 if opts["verbose"] else None)
    steps = stream_generate(model, tokenizer, ids, max_tokens=opts["max_tokens"], sampler=_sampler(opts, tokenizer),
                            logits_processors=processors, prompt_cache=prompt_cache,
                            prompt_progress_callback=waiting.progress, **kv, **draft_arguments(model, opts))
    try:
        print_reply(steps, waiting, stops)
        click.echo()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the stats and profile of what ran are still written
        if model.expert_runtime.group is not None:
            raise
        interrupted = True
        click.echo()
    finally:
        response = stops.last
        waiting.stop()
        _finish(model, save_profile, prior, opts["trace_out"])
    with signals_deferred():
        _generate_report(model, response, baseline_rss, stats_json, verbose)
    if interrupted:
        click.echo("interrupted", err=True)
        sys.exit(130)


def _prompt_cache_file(path, opts, kv):
    """The KV cache mlx_lm.cache_prompt saved at `path`, checked as mlx_lm.generate checks it
    (its quantization against --kv-bits and --kv-group-size); --model defaults to its model."""
    from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache

    try:
        cache, metadata = load_prompt_cache(path, return_metadata=True)
    except Exception as e:  # a missing file, not safetensors, not a cache: mlx's and mlx-lm's own types
        raise MlxmoeError(f"--prompt-cache-file {path}: not a prompt cache mlx-lm can read "
                          f"({type(e).__name__}: {str(e)[:200]})") from None
    if isinstance(cache[0], QuantizedKVCache):
        for name, key in (("bits", "kv_bits"), ("group_size", "kv_group_size")):
            if (kv[key] is not None or key == "kv_group_size") and kv[key] != getattr(cache[0], name):
                raise click.UsageError(f"--{key.replace('_', '-')} {kv[key]} does not match the KV cache in "
                                       f"--prompt-cache-file ({getattr(cache[0], name)})")
    made_for = metadata.get("model")
    if opts["model_path"] is None:
        opts["model_path"] = made_for
    elif made_for is not None and not _same_model(opts["model_path"], made_for):
        raise click.UsageError(f"--prompt-cache-file {path} was made with the model {made_for}, not "
                               f"{opts['model_path']}")
    return cache


def _same_model(a, b):
    """Whether two --model arguments name the same model (the same folder, else the same text)."""
    fa, fb = model_folder(a), model_folder(b)
    return Path(fa).resolve() == Path(fb).resolve() if fa and fb else str(a) == str(b)


def _check_cache_layers(model, cache, path):
    from mlx_lm.models.cache import make_prompt_cache

    if len(cache) != len(make_prompt_cache(model)):
        raise MlxmoeError(f"--prompt-cache-file {path}: {len(cache)} layers of KV cache, for a model of "
                          f"{len(make_prompt_cache(model))}")


def _generate_report(model, response, baseline_rss, stats_json, verbose=True):
    """generate's closing lines on stderr (unless not `verbose`), and its --stats-json."""
    from .storage.files import write_atomic

    stats = _stats(model)
    if stats_json and model.expert_runtime.main_rank():
        write_atomic(stats_json, json.dumps(stats, indent=1))
        click.echo(f"saved stats {stats_json}", err=True)
    if not verbose:
        return
    for r, s in enumerate(stats.get("per_rank", [])):
        click.echo(rank_line(r, s), err=True)
    if response is not None:
        click.echo(f"prompt: {_tokens_at(response.prompt_tokens, response.prompt_tps)}; "
                   f"generation: {_tokens_at(response.generation_tokens, response.generation_tps)}"
                   f"{draft_figures(stats)}", err=True)
    click.echo(expert_line(stats, baseline_rss), err=True)


def _tokens_at(n, tps):
    """"12 tokens at 34.5 tok/s", without a rate for fewer than 2 tokens (one token's rate
    is the time to reach it: a wait, not a speed)."""
    return plural(n, "token") + (f" at {tps:.1f} tok/s" if n >= 2 else "")


def plural(n, word):
    """"1 expert", "2 experts"."""
    return f"{n} {word}{'s' if n != 1 else ''}"


def _read_stdin():
    """Standard input as text, refused (naming it) where it is not UTF-8."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a text stream (tests): what it holds is text already
        return sys.stdin.read()
    data = stream.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MlxmoeError(f"the prompt on standard input is not UTF-8 text (byte {e.start})") from None


def _input_line(prompt):
    """input(prompt), but from a pipe or file line by line in bytes, so that a line that is
    not UTF-8 (UnicodeDecodeError) loses only itself, not what the text reader had buffered."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None or sys.stdin.isatty():
        return input(prompt)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    line = buffer.readline()
    if not line:
        raise EOFError
    return line.decode("utf-8").rstrip("\r\n")


def _line_editing():
    """Line editing and history (Up recalls a line) for chat where standard input is a
    terminal: the standard library's readline, imported for input() to use. Bracketed paste
    is turned on (Python turns it off for its own prompt), so that a pasted block of lines
    arrives as one message; libedit (some macOS Pythons) ignores the setting."""
    if not sys.stdin.isatty():
        return
    try:
        import readline
    except ImportError:  # (Windows)
        return
    readline.parse_and_bind("set enable-bracketed-paste on")


def _read_message():
    """The user's next message: a line; lines each but the last of which ends with a
    backslash; or the lines from one that begins with \"\"\" to one that ends with it (as
    Ollama). EOFError at the end of input; KeyboardInterrupt (Ctrl-C) drops what was typed."""
    line = _input_line(">> ")
    if line.lstrip().startswith('"""'):
        lines = [line.lstrip()[3:]]
        while not lines[-1].rstrip().endswith('"""'):
            lines.append(_input_line("... "))
        lines[-1] = lines[-1].rstrip()[:-3]
        return "\n".join(lines).strip("\n")
    while line.endswith("\\"):
        line = line[:-1] + "\n" + _input_line("... ")
    return line


def _chat_prompt(tokenizer, messages, template_config=None, tokenize=True):
    """The chat template applied to `messages` up to the assistant's turn (token ids, or the
    text where not `tokenize`), with --chat-template-config's keyword arguments, or an
    MlxmoeError saying why the template refused them."""
    for m in messages:
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as e:
            raise MlxmoeError(f"the {m['role']} message is not valid UTF-8 text (an undecodable byte at character "
                              f"{e.start})") from None
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize,
                                             **(template_config or {}))
    except Exception as e:  # jinja2's errors, the template's own raise_exception, transformers' checks
        raise MlxmoeError(f"the chat template failed ({type(e).__name__}: {str(e)[:200]})") from None


@main.command()
@model_options
@sampling_options
@click.option("--system-prompt", help="System message for the chat template.")
@click.option("--repetition-penalty", type=Number(float, 1.0), default=1.3, show_default=True,
              help="mlx-lm's penalty on tokens of the last --repetition-context-size: keeps small models out of "
              "loops; 1 turns it off.")
@click.option("--repetition-context-size", type=Number(int, 1), default=64, show_default=True,
              help="Tokens the repetition penalty looks back on.")
@draft_options
@save_profile_option
def chat(system_prompt, repetition_penalty, repetition_context_size, save_profile, **opts):
    """Chat with the model. The KV cache carries over between turns; after each reply a
    line gives tokens/s, the expert hit rate and the bytes read. On a terminal, lines are
    edited as in a shell (readline: arrows, Up for history). Ctrl-C stops a reply and keeps
    the conversation: the interrupted message and its partial reply are dropped, as Ollama
    drops the partial reply (Up recalls the message); Ctrl-C at the prompt says how to leave,
    Ctrl-D leaves. /help lists the commands (/save FILE, /load FILE, /reset, /stats,
    /profile FILE, /quit) and how to send several lines."""
    import_mlx()
    from mlx_lm.sample_utils import make_logits_processors

    kv = kv_options(opts)
    check_drafts(opts)
    outputs = {"--save-profile": save_profile, "--trace-out": opts["trace_out"]}
    check_outputs(outputs, model_inputs(opts), updates={"--save-profile": "--profile"})
    model, tokenizer = _load(opts)
    prior = _prior(model, opts)
    penalty = make_logits_processors(repetition_penalty=repetition_penalty,
                                     repetition_context_size=repetition_context_size)
    session = ChatSession(model, tokenizer, system_prompt, opts["max_tokens"], _sampler(opts, tokenizer), penalty,
                          kv, opts["chat_template_config"], opts["stop"], opts["verbose"], draft_arguments(model, opts))
    session.files = model_inputs(opts), outputs  # what /save may not write
    profile = f", profile {model.expert_cache.profile.workload!r}" if opts["profile_path"] else ""
    click.echo(f"mlxmoe chat: {opts['model_path'] or 'the demo model'} with {model.expert_cache.capacity} experts "
               f"cached{profile}. /help for commands, /quit to leave.", err=True)
    _line_editing()
    try:
        while True:
            try:
                query = _read_message()
            except Terminated:  # SIGTERM
                click.echo()
                break
            except KeyboardInterrupt:  # Ctrl-C at the prompt: what was typed is dropped
                click.echo("\n[use /quit, /bye or Ctrl-D to leave; Ctrl-C stops a reply]")
                continue
            except EOFError:  # Ctrl-D
                click.echo()
                break
            except UnicodeDecodeError as e:  # a terminal or pipe that is not UTF-8: this line only
                click.echo(f"[not UTF-8 text (byte {e.start}); the line was not sent]")
                continue
            command = query.strip()
            if command in ("/quit", "/exit", "/bye"):
                break
            if not command or session.command(command, opts["force_profile"]):
                continue
            if command.startswith("//"):
                query = query.replace("//", "/", 1)
            session.reply(query)
    finally:
        _finish(model, save_profile, prior, opts["trace_out"])


class ChatSession:
    """`mlxmoe chat`'s conversation: its messages, its KV cache (which holds the first
    `sent` of them, kept between turns), its commands and its replies."""

    def __init__(self, model, tokenizer, system_prompt, max_tokens, sampler, logits_processors, kv=None,
                 template_config=None, stops=(), verbose=True, draft=None):
        self.model, self.tokenizer, self.system_prompt, self.max_tokens = model, tokenizer, system_prompt, max_tokens
        self.sampler, self.logits_processors, self.template_config = sampler, logits_processors, template_config
        self.kv, self.stops, self.verbose = dict(kv or {}), stops, verbose  # stops: --stop's strings
        self.files = {}, {}  # the run's inputs and outputs, which /save may not overwrite
        self.draft = dict(draft or {})  # stream_generate's draft_model and num_draft_tokens (draft_arguments)
        self.reset()

    def reset(self, messages=None):
        """A new conversation: `messages` (/load), else the system prompt's alone; the KV cache empty."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.messages = system if messages is None else messages
        self._empty_cache()

    def _empty_cache(self):
        from mlx_lm.models.cache import make_prompt_cache

        self.prompt_cache, self.sent = make_prompt_cache(self.model, self.kv.get("max_kv_size")), 0
        draft = self.draft.get("draft_model")
        if draft is not None and not isinstance(draft, str):  # a draft model's layers follow (mlx-lm's rule)
            self.prompt_cache += make_prompt_cache(draft, self.kv.get("max_kv_size"))

    def command(self, command, force_profile=False):
        """Run `command` if it is one (a line starting with one /): True where it was."""
        name, _, arg = command.partition(" ")
        try:
            if command == "/reset":
                self.reset()
                click.echo("[conversation cleared; the expert cache and the live profile are kept]")
            elif command == "/stats":
                click.echo(stats_table(_stats(self.model)))
            elif command == "/help":
                click.echo(CHAT_HELP)
            elif name == "/budget":
                self.budget(arg.strip())
            elif name in ("/profile", "/save", "/load"):
                if not arg.strip():
                    raise MlxmoeError(f"{name} FILE: name a file")
                if name == "/profile":
                    prior = self.model.expert_runtime.use_profile(arg.strip(), force_profile)
                    click.echo(f"[profile {prior.workload!r} is the expert cache's prior now]")
                else:
                    (self.save if name == "/save" else self.load)(arg.strip())
            elif command.startswith("/") and not command.startswith("//"):
                click.echo(f"unknown command {name}; /help lists the commands "
                           "(start a message with // to send one that begins with /)")
            else:
                return False
        except MlxmoeError as e:
            click.echo(f"[{e}]")
        return True

    def budget(self, size):
        """/budget SIZE: the expert cache resized to fit a memory budget of SIZE (Runtime.resize)."""
        from .budget import format_size

        if not size:
            raise MlxmoeError("/budget SIZE: give a memory budget, e.g. /budget 8GB")
        done = self.model.expert_runtime.resize(size)
        click.echo(f"[expert cache: {done['from']} -> {done['to']} experts, memory budget "
                   f"{format_size(self.model.expert_runtime.plan.budget)}"
                   + (f"; {done['message']}]" if done["message"] else "]"))

    def save(self, path):
        """/save: the conversation as JSON messages, written atomically (no input, no other output, overwritten)."""
        from .storage.files import write_atomic

        inputs, outputs = self.files
        check_outputs({"/save": path, **outputs}, inputs, updates={"--save-profile": "--profile"})
        write_atomic(path, json.dumps(self.messages, indent=1, ensure_ascii=False) + "\n")
        click.echo(f"[saved {len(self.messages)} messages to {path}]")

    def load(self, path):
        """/load: continue the conversation in `path` (its KV cache is made at the next reply)."""
        from .storage.files import read_json

        self.reset(conversation(read_json(path, "conversation", 64 << 20), path))
        click.echo(f"[loaded {len(self.messages)} messages from {path}; the next reply continues them]")

    def reply(self, query):
        """Send the user's message `query` and print the reply as it comes, then a line of figures.
        Ctrl-C (not SIGTERM) stops it: the conversation is as it was before `query`."""
        from .api import _within_context, prompt_tokens

        model, tokenizer = self.model, self.tokenizer
        question = {"role": "user", "content": query}
        try:
            if self.sent and not self.messages[self.sent:]:  # the cache holds all: only the new message
                prompt = _chat_prompt(tokenizer, [question], self.template_config)
            else:  # after /load or an interrupt the cache could not undo: the whole conversation
                self._empty_cache()
                prompt = _chat_prompt(tokenizer, self.messages + [question], self.template_config)
            prompt = prompt_tokens(model, tokenizer, prompt)
            _within_context(model.expert_runtime.plan, len(prompt), self.prompt_cache, self.max_tokens)
        except MlxmoeError as e:  # this message refused (not UTF-8, the template's checks, the context full)
            click.echo(f"[{e}]" + ("; /reset starts a new conversation" if "context" in str(e) else ""))
            return
        before, lengths = _stats(model), [getattr(c, "offset", 0) for c in self.prompt_cache]
        kept = len(self.messages), self.sent
        try:
            response, text = self._stream(prompt)
            self.messages += [question, {"role": "assistant", "content": text}]
            self.sent = len(self.messages)
        except Terminated:
            raise
        except KeyboardInterrupt:
            click.echo("\n[interrupted: this message and its partial reply are dropped, the conversation before "
                       "them is kept]")
            del self.messages[kept[0]:]
            self.sent = kept[1]
            self._rewind(lengths)
            return
        click.echo()
        if response is not None and self.verbose:
            click.echo(summary(_stats(model), before, response.generation_tokens, response.generation_tps), err=True)

    def _rewind(self, lengths):
        """The KV cache back to the conversation before an interrupted turn: each layer's cache
        trimmed to its length `lengths` then, or, where mlx-lm cannot trim it (a rotating cache
        that wrapped), made again from the messages at the next turn."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        cache = self.prompt_cache
        if self.sent and can_trim_prompt_cache(cache) and all(c.offset >= n for c, n in zip(cache, lengths)):
            for c, n in zip(cache, lengths):
                c.trim(c.offset - n)
        else:
            self._empty_cache()

    def _stream(self, prompt):
        """Generate the reply, printing its text as it comes: (the last response, None if it
        had no token; the reply's text)."""
        from .api import stream_generate

        waiting, stops = Waiting(2.0 if self.verbose else None), Stops(self.stops)
        kv = {k: v for k, v in self.kv.items() if k != "max_kv_size"}  # (the cache is made: reset)
        steps = stream_generate(self.model, self.tokenizer, prompt, max_tokens=self.max_tokens, sampler=self.sampler,
                                logits_processors=self.logits_processors, prompt_cache=self.prompt_cache,
                                prompt_progress_callback=waiting.progress, **kv, **self.draft)
        try:
            return print_reply(steps, waiting, stops), stops.text
        finally:
            waiting.stop()


def conversation(messages, path):
    """`messages` (the JSON /load read from `path`) if it is a conversation: a list of
    {"role": "system", "user" or "assistant", "content": text}; else an MlxmoeError naming
    the file and what is wrong."""
    if not isinstance(messages, list):
        raise MlxmoeError(f"{path}: not a conversation: a JSON list of messages "
                          '[{"role": "user", "content": "..."}, ...] (as /save writes) was expected')
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str)):
            raise MlxmoeError(f"{path}: message {i} is not {{\"role\": \"system\", \"user\" or \"assistant\", "
                              f"\"content\": text}}: {json.dumps(m)[:80]}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@main.command()
@click.option("--model", "-m", "model_path", help="Model folder, or Hugging Face repo id (OWNER/NAME) pulled with "
              "`mlxmoe pull`. " + DEMO_HELP)
@click.option("--memory-budget", type=Size(), help="Show what this budget buys, e.g. 12GB.")
@click.option("--backend", type=click.Choice(["cpu", "metal", "cuda"]), help="Default: the best available.")
@click.option("--fallback", type=click.Path(dir_okay=False), help="Low-bit expert copies (convert --fallback-bits): "
              "their memory, and what the budget buys beside them.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def info(model_path, memory_budget, backend, fallback, as_json):
    """Architecture, experts, bytes of resident weights and of one expert, the smallest
    budget that works and what a given budget buys. Reads headers only."""
    import_mlx()  # mlx-lm's model classes say what the checkpoint holds
    from .api import model_info
    from .budget import format_size

    out = model_info(model_path, memory_budget, backend, fallback)
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(f"{out['model']}: {out['model_type']} on {out['backend']}")
    ks = sorted(set(out["top_k_per_layer"]))
    per_layer = f" (top-{', '.join(map(str, ks))} by layer)" if len(ks) > 1 else ""
    click.echo(f"  {out['moe_layers']} MoE layers x {out['experts_per_layer']} experts, top-{out['top_k']}{per_layer}")
    click.echo(f"  one expert: {format_size(out['expert_bytes'])} in memory "
               f"({format_size(out['expert_bytes_on_disk'])} on disk); all experts {format_size(out['all_experts_bytes'])}")
    click.echo(f"  resident weights: {format_size(out['resident_bytes'])}, KV reserve {format_size(out['kv_reserve_bytes'])}, "
               f"working memory {format_size(out['working_bytes'])}")
    click.echo(f"  smallest budget that works: {format_size(out['minimum_budget'], math.ceil)}; "
               f"everything resident: {format_size(out['all_resident_budget'], math.ceil)}")
    click.echo(f"  prefill: {out['prefill_step']} prompt tokens a step, {out['prefill_step_at_context']} at a "
               f"{out['context']}-token prompt (what the working memory holds; each step reads its experts once)")
    if fallback:
        click.echo(f"  low-bit fallback copies: {format_size(out['fallback_bytes'])} in memory, within the budget")
    if memory_budget:
        b = out["budget"]
        click.echo(f"  {memory_budget} buys {b['cache_experts']} experts ({format_size(b['cache_bytes'])}), "
                   f"{100 * b['share_of_experts']:.1f}% of all experts")


@main.command()
@click.argument("repo")
def pull(repo):
    """Download the Hugging Face repo REPO (OWNER/NAME) into the hub's cache, the files
    mlx-lm loads (weights, config, tokenizer), with a progress bar on stderr. Run it
    again after an interruption: it resumes where the files stopped. Then `--model
    OWNER/NAME` anywhere uses this copy (never the network)."""
    from .budget import format_size
    from .storage.remote import REPO_ID, pull as pull_repo

    if not REPO_ID.fullmatch(repo) or repo.startswith("."):
        raise MlxmoeError(f"{repo!r} is not a Hugging Face repo id; give OWNER/NAME")
    with signals_deferred():  # MLX (under mlx-lm's patterns) started in this thread: in another, exit aborts
        import mlx_lm.utils  # noqa: F401
    # the download runs in a daemon thread: Ctrl-C (or SIGTERM) then ends the process at once,
    # where the hub client's download threads would hold it until their reads time out
    result = {}
    worker = threading.Thread(target=_pull_into, args=(pull_repo, repo, result), daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.2)
    except KeyboardInterrupt:
        click.echo(f"interrupted; run `mlxmoe pull {repo}` again to resume", err=True)
        _exit_now(130)
    if "error" in result:
        raise result["error"]
    folder = result["folder"]
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    click.echo(f"pulled {repo}: {format_size(size)} in {folder}")


def _pull_into(pull_repo, repo, result):
    try:
        result["folder"] = pull_repo(repo)
    except BaseException as e:  # handed to the main thread, which raises it
        result["error"] = e


@main.command("list")
@click.option("--backend", type=click.Choice(["cpu", "metal", "cuda"]), help="Default: the best available.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_models(backend, as_json):
    """The models on this machine: pulled (the Hugging Face cache), the folders in ./models
    and the bundled demo, each with its size on disk, MoE shape (layers x experts, top-k)
    and what fits this machine: the smallest budget that works and whether its memory
    holds every expert resident (from `info`; headers only)."""
    import_mlx()
    from .api import list_models as local_models
    from .budget import format_size

    rows = local_models(backend)
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    for r in rows:
        if "error" in r:
            click.echo(f"{r['name']}  {format_size(r['disk_bytes'])}  {r['error']}")
            continue
        shape = f"{r['moe_layers']} x {r['experts_per_layer']} experts, top-{r['top_k']}"
        fits = ("every expert resident" if r["fits"] == "all_resident" else
                f"streams experts (min {format_size(r['minimum_budget'], math.ceil)})" if r["fits"] == "streaming"
                else f"needs {format_size(r['minimum_budget'], math.ceil)}, over this machine's memory")
        click.echo(f"{r['name']}  {format_size(r['disk_bytes'])}  {shape}  {r['model_type']}  {fits}")
    if not rows:
        click.echo("no models; `mlxmoe pull OWNER/NAME` downloads one")


@main.command()
@click.option("--model", "-m", "model_path",
              help="Model folder, or Hugging Face repo id: its copy if pulled (mlxmoe pull), else only its "
                   "config.json and safetensors headers are fetched (a few hundred KB, never a weight). " + DEMO_HELP)
@click.option("--memory-budget", "budgets", multiple=True, type=Size(),
              help="A budget to forecast, e.g. 12GB; repeat for several. Default: the budgets that hold "
                   "10, 25, 50 and 100 % of the experts.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False),
              help="A profile of the workload (with its hit-rate curve): its hit rate instead of real routing's.")
@click.option("--force", is_flag=True, help="Use a profile of another model whose layer and expert counts agree.")
@click.option("--disk-gbps", type=Number(float, 0, low_open=True),
              help="The disk's read rate in GB/s. Default: measured for ~0.5 s at the model's expert read size "
                   "(from its non-expert tensors; for a repo id, from a 64 MiB scratch file written in the Hugging "
                   "Face cache folder, where it would be downloaded).")
@click.option("--prompt-tokens", type=Number(int, 1), default=256, show_default=True,
              help="Prompt length for the time to first token.")
@click.option("--max-tokens", type=Number(int, 0), default=256, show_default=True,
              help="Tokens generated after it (with the prompt: the KV cache the run takes).")
@click.option("--backend", type=click.Choice(["cpu", "metal", "cuda"]), help="Default: the best available.")
@click.option("--png", type=click.Path(dir_okay=False),
              help="Also draw decode tok/s (low, likely, high) against the budget as a PNG.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def fit(model_path, budgets, profile_path, force, disk_gbps, prompt_tokens, max_tokens, backend, png, as_json):
    """Will it run, and how fast: memory, hit rate, bytes read a token, decode tok/s and
    time to first token at each budget, forecast before loading the model. Reads the
    config and the safetensors headers, times the disk briefly on non-expert tensors (never
    an expert's bytes) and this machine's matmuls at the model's shapes (a few seconds).
    Each figure is a range (low / likely / high); it says which inputs were measured."""
    from . import backend as backends
    from .budget import format_size
    from .workload.heatmap import write_lines_png
    from .workload.profile import ActivationProfile

    check_outputs({"--png": png}, {"--model": model_folder(model_path), "--profile": profile_path})
    be = backends.detect(backend)
    prof = ActivationProfile.load(profile_path) if profile_path else None
    f, shape = _fit_forecast(model_path, be, budgets, prof, disk_gbps, prompt_tokens, max_tokens, force)
    if png:
        rows = sorted((r for r in f["budgets"] if "error" not in r), key=lambda r: r["budget"])
        lines = {k: [[r["budget"], r["decode_tps"][k]] for r in rows] for k in ("high", "likely", "low")}
        top = max([p[1] for p in lines["high"]], default=1.0) * 1.1
        shown = [r["budget"] for r in rows or f["budgets"]]  # the x axis: the budgets that fit
        write_lines_png(png, lines, max(shown), top, "memory budget", "decode tok/s",
                        f"forecast decode tok/s: {os.path.basename(f['model'])}", x_tick=format_size,
                        y_tick=lambda y: f"{y:.3g}", x_min=min(shown))
    if as_json:
        click.echo(json.dumps(f, indent=1))
        return
    _print_fit(f, shape, prompt_tokens)
    if png:
        click.echo(f"  chart: {png}")


def _fit_forecast(model_path, be, budgets, prof, disk_gbps, prompt_tokens, max_tokens, force=False):
    """fit's forecast (forecast.forecast) and the model's (MoE layers, experts): of a local
    folder, or of a hub repo from its config and shard headers alone, the disk then timed
    where it would be downloaded. Waits over 2 s are said on stderr. The profile `prof` is
    checked against the model as generate checks it (its fingerprint unless `force`, its
    layer and expert counts always)."""
    from .api import model_fingerprint
    from .forecast import forecast, share_budgets
    from .loader import open_checkpoint
    from .storage.remote import header_checkpoint, is_repo_id, snapshot

    remote = is_repo_id(model_path) and snapshot(model_path) is None  # (a pulled repo: its local copy)
    with tempfile.TemporaryDirectory(prefix="mlxmoe-headers-") as headers:
        fetching = notice(2.0, lambda: f"reading {model_path}'s config and safetensors headers from the hub...")
        try:
            path = header_checkpoint(model_path, headers) if remote else model_path
        finally:
            fetching.cancel()
        disk_folder = None
        if remote and not disk_gbps:
            from huggingface_hub.constants import HF_HUB_CACHE as disk_folder
        timing = notice(2.0, lambda: "timing the disk and this machine's matmuls at the model's shapes"
                        + (f" (a scratch file in {disk_folder})" if disk_folder else "") + "...")
        try:
            ckpt = open_checkpoint(path)
            try:
                if prof is not None:
                    prof.check_model(model_fingerprint(ckpt), ckpt.all_layers, ckpt.num_experts, force, prof.source)
                be.apply_dtype_policy(ckpt.model)
                if not budgets:
                    budgets = sorted(set(share_budgets(ckpt, be, (0.1, 0.25, 0.5, 1.0))))
                f = forecast(ckpt, be, budgets, profile=prof, disk_rate=disk_gbps * 1e9 if disk_gbps else None,
                             prompt_tokens=prompt_tokens, new_tokens=max_tokens, disk_folder=disk_folder)
            finally:
                ckpt.store.close()
        except MlxmoeError as e:
            if not remote:
                raise
            raise MlxmoeError(str(e).replace(str(headers), model_path)) from None  # the repo, not our temp folder
        finally:
            timing.cancel()
    if remote:
        f["model"] = model_path
    return f, (ckpt.num_layers, ckpt.num_experts)


def _print_fit(f, shape, prompt_tokens):
    """fit's table: what was measured and assumed, then a row per budget."""
    from .budget import format_size

    click.echo(f"{f['model']}: {f['model_type']} on {f['backend']}, {shape[0]} MoE layers x "
               f"{shape[1]} experts, {f['routed_experts_per_token']} expert reads a token at most, "
               f"{format_size(f['expert_bytes_on_disk'])} each")
    for line in f["measured"]:
        click.echo(f"  measured: {line}")
    for line in f["assumed"]:
        click.echo(f"  assumed:  {line}")
    click.echo(f"  {'budget':>9} {'run takes':>9} {'cache (experts)':>16} {'hit rate (low-likely-high)':>27} "
               f"{'read/token (likely)':>19} {'decode tok/s (low / likely / high)':>35} "
               f"{'TTFT s (' + str(prompt_tokens) + ' tokens)':>22}")
    for r in f["budgets"]:
        if "error" in r:
            click.echo(f"  {format_size(r['budget']):>9}  does not fit: {r['error']}")
            continue
        h, d, t, b = r["hit_rate"], r["decode_tps"], r["ttft_seconds"], r["read_bytes_per_token"]
        cache = f"{r['cache_experts']} ({100 * r['share_of_experts']:.0f}%)"
        hits = f"{100 * h['low']:.0f}-{100 * h['likely']:.0f}-{100 * h['high']:.0f}%"
        click.echo(f"  {format_size(r['budget']):>9} {format_size(r['memory_bytes']):>9} {cache:>16} {hits:>27} "
                   f"{format_size(b['likely']):>19} "
                   f"{d['low']:11.2f} / {d['likely']:.2f} / {d['high']:.2f}{'':>9} "
                   f"{t['low']:6.1f} - {t['likely']:.1f} - {t['high']:.1f}")
    sources = sorted({r["hit_rate_source"] for r in f["budgets"] if "hit_rate_source" in r})
    click.echo(f"  hit rates: {'; '.join(sources)}")
    click.echo("  run takes: the memory the run holds (weights, expert cache, KV cache, working memory), at most "
               "the budget")


def _record(opts, prompts_file, chats, chat_template, max_tokens, what, on_load=None):
    """Load the model (then `on_load(model)`) and feed it the prompts with a progress bar;
    Ctrl-C stops early and keeps what was recorded. Returns (model, interrupted). On an
    error, a trace being written is dropped, not left behind half-written."""
    import_mlx()
    from .api import read_prompts, run_prompts

    model, tokenizer = _load(opts)
    interrupted = False
    try:
        prompts = read_prompts(chats or prompts_file, tokenizer, chats=bool(chats), chat_template=chat_template)
        if on_load is not None:
            on_load(model)
        try:  # (the bar too: an interrupt while it draws stops the run like any other)
            with click.progressbar(length=len(prompts), file=sys.stderr,
                                   label=f"{what} {len(prompts)} prompt{'s' if len(prompts) != 1 else ''}") as bar:
                run_prompts(model, tokenizer, prompts, max_tokens,
                            on_prompt=lambda i, text: (bar.update(1), _still_running()))
        except KeyboardInterrupt:
            interrupted = True
    except BaseException:
        model.expert_runtime.abort()
        raise
    if interrupted:
        click.echo("interrupted: keeping what was recorded so far", err=True)
    return model, interrupted


def prompt_source(f):
    options = [
        click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
                     help="Text file, one prompt per line."),
        click.option("--chats", type=click.Path(exists=True, dir_okay=False),
                     help="JSONL, one conversation per line ({\"messages\": [{\"role\", \"content\"}, ...]})."),
        click.option("--chat-template/--no-chat-template", default=False,
                     help="Wrap each line of --prompts in the chat template."),
        click.option("--max-tokens", type=Number(int, 1, 1 << 31), default=64, show_default=True,
                     help="Tokens generated per prompt."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@main.group()
def profile():
    """Record, inspect, merge and compare activation profiles (which experts a workload uses)."""


@profile.command("record")
@model_options
@prompt_source
@click.option("--workload", "-w", required=True, help='Name of the workload, e.g. "Italian chat".')
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="Profile file to write.")
@click.option("--half-life", type=Number(float, 1), default=None,
              help="Decay half-life in tokens (default 4096).")
@click.option("--recommend-bias", type=Number(float, 0), default=None,
              help="Store this cache bias in the profile as the one to use (measured by bench/bench_lossy.py): "
              "--cache-bias profile takes it.")
def profile_record(prompts_file, chats, chat_template, max_tokens, workload, out, half_life, recommend_bias, **opts):
    """Run a workload's prompts through the model and save which experts it used, with
    a predicted hit-rate-vs-cache-size curve. Ctrl-C saves what was recorded so far.
    With --profile, that profile is the policy's prior and pre-warms the cache; the file
    written holds only what this run recorded."""
    if not (prompts_file or chats):
        raise click.UsageError("give --prompts FILE or --chats FILE.jsonl")
    exclusive(prompts=prompts_file, chats=chats)
    check_outputs({"--out": out, "--trace-out": opts["trace_out"]},
                  {**model_inputs(opts), "--prompts": prompts_file, "--chats": chats})

    def fresh_profile(model):  # the live profile starts empty (not from --profile's counts)
        model.expert_runtime.record_profile(workload, half_life)
        model.expert_runtime.profile.recommended_cache_bias = recommend_bias

    # without --trace-out, the trace the curve is computed from is a partial file of OUT's
    # (files.py naming): removed at the end, or by the next run if this one is killed
    scratch = None if opts["trace_out"] else f"{out}.{os.getpid()}-trace.tmp"
    opts["trace_out"] = opts["trace_out"] or scratch
    try:
        model, interrupted = _record(opts, prompts_file, chats, chat_template, max_tokens, "recording",
                                     on_load=fresh_profile)
        runtime = model.expert_runtime
        live = runtime.profile
        try:
            with signals_deferred():  # Ctrl-C from here on keeps what was recorded
                runtime.close()
                # now, so that Ctrl-C while the curve is computed still leaves the profile
                live = runtime.save_profile(out)  # rank 0 writes the whole model's
                if not runtime.main_rank():
                    return
            if live.tokens_total:
                with click.progressbar(length=len(ONLINE), file=sys.stderr,
                                       label="predicting the hit rate at each cache size, policy by policy") as bar:
                    curve = runtime.predict_curve(progress=lambda policy: bar.update(1))
                with signals_deferred():  # written whole, or the profile stays as saved above
                    live.curve = curve
                    live.save(out)
        except KeyboardInterrupt:
            interrupted = True
            click.echo("interrupted: saved without the hit-rate curve", err=True)
    finally:
        if scratch is not None and os.path.exists(scratch):
            os.unlink(scratch)
    click.echo(f"saved {out}: {live.tokens_total} tokens of {workload!r}" + (" (interrupted)" if interrupted else ""),
               err=True)
    if interrupted:  # what was recorded is saved, but the run did not end: `record && deploy` must not go on
        sys.exit(130)


@profile.command("from-trace")
@click.argument("traces", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="Profile file to write.")
@click.option("--workload", "-w", help="Name of the workload (default: the first trace's file name).")
@click.option("--half-life", type=Number(float, 1), default=None,
              help="Decay half-life in tokens (default 4096).")
@click.option("--curve/--no-curve", default=True, show_default=True,
              help="Predict the hit rate at each cache size by replaying the traces.")
@click.option("--model", "-m", "model_path", help="The checkpoint (folder or repo id; `demo`: the bundled "
              "demo model) the profile is for: its fingerprint and expert size (then `profile show --budget` works). "
              "Its layer and expert counts must be the traces'.")
def profile_from_trace(traces, out, workload, half_life, curve, model_path):
    """Build a profile from routing traces (trace record, or trace import) of one model,
    learnt as a run's live profile learns. The model is the traces' header's. A trace
    recorded by mlxmoe carries its model's fingerprint; an imported one only its shape
    (fingerprint shape-LxE), so its profile loads on a real model with --force, where the
    layer and expert counts agree, or without once built with --model naming it."""
    from .workload.curves import predicted_curve
    from .caching.policies import HALF_LIFE_PROFILE
    from .workload.trace import build_profile, read_trace

    check_outputs({"--out": out}, {"TRACES": traces, "--model": model_path and model_folder(model_path)})
    with said_if_slow(f"reading {plural(len(traces), 'trace')} and counting their routing..."):
        loaded = [(path, *read_trace(path)) for path in traces]
        name = workload or os.path.basename(traces[0]).split(".")[0]
        p = build_profile(loaded, name, half_life or HALF_LIFE_PROFILE)
    if model_path:
        import_mlx()
        from .api import bind_profile

        bind_profile(p, model_path, where=f"{traces[0]} (for --model {model_path})")
    p.save(out)
    if curve:
        header, records = loaded[0][1], [r for _, _, records in loaded for r in records]
        with click.progressbar(ONLINE, file=sys.stderr,
                               label="predicting the hit rate at each cache size, policy by policy") as policies:
            for policy in policies:  # one at a time: a long trace takes a while each
                p.curve.update(predicted_curve(header, records, [policy]))
        p.save(out)
    click.echo(f"saved {out}: {p.tokens_total} tokens of {p.workload!r} ({_model_of(p)}, fingerprint {p.fingerprint})",
               err=True)


def _model_of(p):
    """How a profile's model is named in messages: its name, or where the routing it was
    built from named none, that it is known by its shape only."""
    return f"model {p.model}" if p.model else "a model known by its shape only"


@profile.command("show")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--top", type=Number(int, 0, 1 << 31), default=5, show_default=True,
              help="Hot experts listed per layer.")
@click.option("--png", type=click.Path(dir_okay=False), help="Write a layers x experts heatmap PNG (activations "
              "per token).")
@click.option("--curve-png", type=click.Path(dir_okay=False), help="Write a PNG of the predicted hit rate against "
              "cache size, per policy (with --budget: the cache it buys marked).")
@click.option("--budget", type=Size(), help="Also show what this memory budget buys (e.g. 16GB).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def profile_show(file, top, png, curve_png, budget, as_json):
    """Per-layer hot experts, skew, and the predicted hit rate at each cache size."""
    from .workload.heatmap import write_curve_png, write_heatmap_png
    from .workload.profile import ActivationProfile

    check_outputs({"--png": png, "--curve-png": curve_png}, {"FILE": file})
    p = ActivationProfile.load(file)
    if curve_png and not p.curve:
        raise MlxmoeError(f"{file} holds no predicted hit-rate curve (recorded without one: profile record, or "
                          "profile from-trace without --no-curve, predicts it)")
    share = p.hot_share(0.25)
    layers = [{"layer": l, "hot25_share": round(float(share[l]), 3),
               "hot": [[e, round(r, 4)] for _, e, r in p.top(top, layer=l)]} for l in range(p.num_layers)]
    out = {"workload": p.workload, "model": p.model, "tokens": p.tokens_total, "half_life": p.half_life,
           "layers": layers, "hot25_share_mean": round(float(share.mean()), 3), "curve": p.curve,
           "recommended_cache_bias": p.recommended_cache_bias}
    if png:
        write_heatmap_png(png, p.rates(), f"{p.workload!r} on {_model_of(p)}: activations per token")
    if budget:
        out.update(_profile_budget(p, file, budget))
    if curve_png:
        c = out.get("budget", {}).get("cache_experts")
        write_curve_png(curve_png, p.curve, p.num_layers * p.num_experts,
                        f"{p.workload!r} on {_model_of(p)}: predicted hit rate by cache size",
                        marker=None if c is None else (c, f"{budget}: {c} experts"))
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(f"{p.workload!r} on {_model_of(p)}: {p.tokens_total} tokens, half-life {p.half_life} tokens")
    click.echo(f"hottest 25% of experts carry {100 * share.mean():.1f}% of activations (mean over layers)")
    for row in layers:
        hot = ", ".join(f"{e}:{r:.2f}" for e, r in row["hot"])
        click.echo(f"  layer {row['layer']:3d}  hot25 {100 * row['hot25_share']:5.1f}%  hottest (expert:rate) {hot}")
    _show_curve(p)
    if "budget" in out:
        _show_budget(p, out["budget"])
    if p.recommended_cache_bias is not None:  # (lossy: after the cache sizes, which are not)
        click.echo(f"recommended cache bias: {p.recommended_cache_bias:g} (lossy; --cache-bias profile uses it)")
    for what, path in (("heatmap", png), ("hit-rate curve", curve_png)):
        if path:
            click.echo(f"{what}: {path}")


def _profile_budget(p, file, budget):
    """{"budget": what `budget` buys by the profile (curves.profile_budget)}, or {} with a
    line saying why where the profile does not hold its model's expert size."""
    from .workload.curves import profile_budget

    bought = profile_budget(p, budget)
    if bought is None:
        click.echo(f"--budget {budget}: {file} does not hold the model's expert size (a profile built from routing "
                   "alone); `mlxmoe profile from-trace TRACE --model CHECKPOINT` records it", err=True)
        return {}
    return {"budget": bought}


def _show_curve(p):
    """The profile's predicted hit rate by cache size, a column per policy."""
    from .budget import format_size

    if not p.curve:
        return
    names = list(p.curve)
    widths = [max(12, len(n) + 2) for n in names]  # a column per policy, at least one space apart
    click.echo("predicted hit rate by cache size:")
    click.echo("  experts" + ("     memory" if p.expert_bytes else "") + "".join(f"{n:>{w}}" for n, w in
                                                                                zip(names, widths)))
    for i, (c, _) in enumerate(p.curve[names[0]]):
        mem = f"{format_size(c * p.expert_bytes):>11}" if p.expert_bytes else ""
        click.echo(f"  {c:7d}{mem}" + "".join(f"{100 * p.curve[n][i][1]:{w - 1}.1f}%" for n, w in
                                              zip(names, widths)))


def _show_budget(p, bought):
    """What a budget buys by the profile (curves.profile_budget's `bought`)."""
    from .budget import format_size

    c = bought["cache_experts"]
    every = " (every expert)" if c == p.num_layers * p.num_experts else ""
    click.echo(f"{bought['budget']} holds {c} experts{every} beside {format_size(p.resident_bytes or 0)} of resident "
               "weights, KV cache reserve and working memory")
    if c < p.top_k:
        click.echo(f"  too small: a layer needs {p.top_k} experts at once")
    elif bought["predicted_hit_rate"]:
        rates = bought["predicted_hit_rate"]
        click.echo("  predicted hit rate there: " + ", ".join(f"{n} {100 * r:.1f}%" for n, r in rates.items()))


@profile.command("merge")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="Merged profile file to write.")
@click.option("--weights", help="Comma-separated weight per profile (default: equal).")
@click.option("--workload", "-w", help="Name of the merged workload.")
def profile_merge(files, out, weights, workload):
    """Merge profiles (weighted) into one."""
    from .workload.profile import ActivationProfile

    check_outputs({"--out": out}, {"FILES": files})
    try:
        w = [float(x) for x in weights.split(",")] if weights is not None else None
    except ValueError:
        raise click.BadParameter("give numbers separated by commas", param_hint="--weights") from None
    if w is not None and (len(w) != len(files) or not all(math.isfinite(x) and x >= 0 for x in w) or not any(w)):
        raise click.BadParameter(f"{weights[:80]!r}: give one finite, non-negative number per profile (not all 0)",
                                 param_hint="--weights")
    merged = ActivationProfile.merge([ActivationProfile.load(f) for f in files], w, workload)
    merged.save(out)
    click.echo(f"saved {out}: {merged.workload!r}", err=True)


@profile.command("diff")
@click.argument("a", type=click.Path(dir_okay=False))
@click.argument("b", type=click.Path(dir_okay=False))
@click.option("--top", type=Number(int, 0, 1 << 31), default=5, show_default=True, help="Experts listed per layer.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def profile_diff(a, b, top, as_json):
    """Which experts two workloads disagree on, per layer (with the Jensen-Shannon
    divergence of their usage, in bits: 0 same, 1 disjoint; n/a where either profile has
    no activations)."""
    from .workload.profile import ActivationProfile

    pa, pb = ActivationProfile.load(a), ActivationProfile.load(b)
    rows = pa.diff(pb, top)
    if as_json:
        click.echo(json.dumps({"a": pa.workload, "b": pb.workload, "layers": rows}, indent=1))
        return
    click.echo(f"{pa.workload!r} vs {pb.workload!r} (rates per token)")
    for row in rows:
        experts = ", ".join(f"{e}: {x:.2f} vs {y:.2f}" for e, x, y in row["experts"])
        js = "  n/a" if row["js_divergence"] is None else f"{row['js_divergence']:.3f}"
        click.echo(f"  layer {row['layer']:3d}  JS {js}  {experts}")


@main.group()
def trace():
    """Record routing traces and replay them through the cache policies."""


@trace.command("record")
@model_options
@prompt_source
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="Trace file (JSONL).")
def trace_record(prompts_file, chats, chat_template, max_tokens, out, **opts):
    """Run prompts through the model and write the routing of every token and layer."""
    if not (prompts_file or chats):
        raise click.UsageError("give --prompts FILE or --chats FILE.jsonl")
    exclusive(prompts=prompts_file, chats=chats)
    if opts["trace_out"]:
        raise click.UsageError("trace record writes its trace to --out; --trace-out is for the other commands")
    check_outputs({"--out": out}, {**model_inputs(opts), "--prompts": prompts_file, "--chats": chats})
    opts["trace_out"] = out
    model, interrupted = _record(opts, prompts_file, chats, chat_template, max_tokens, "tracing")
    model.expert_runtime.close()
    click.echo(f"saved {out}" + (" (interrupted: the prompts run so far)" if interrupted else ""), err=True)
    if interrupted:
        sys.exit(130)


@trace.command("replay")
@click.argument("trace_file", type=click.Path(dir_okay=False))
@click.option("--policy", default="all", show_default=True, type=click.Choice(ONLINE + ["belady", "all"]))
@click.option("--cache-experts", type=Number(int, 1, MAX_EXPERTS), required=True,
              help="Cache size in experts (all layers).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per policy.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False),
              help="Start as a model loaded with this profile does: the policy's prior and pins, the cache "
              "pre-warmed with its hottest experts.")
@click.option("--force", is_flag=True, help="Use a profile of another model whose layer and expert counts agree.")
def trace_replay(trace_file, policy, cache_experts, as_json, profile_path, force):
    """Hit rate of a policy (or all) at a cache size on a recorded trace, beside Belady's
    optimum for the same size."""
    from .workload.profile import ActivationProfile
    from .workload.trace import policy_names, read_trace, replay_all, trace_fingerprint

    names = policy_names(policy)
    width = max(map(len, names))

    def show(r):  # each policy as it ends (a long trace takes a while each)
        waiting.cancel()
        if as_json:
            click.echo(json.dumps(r))
        else:
            click.echo(f"{r['policy']:>{width}}: hit rate {100 * r['hit_rate']:.2f}% ({r['hits']}/{r['accesses']}), "
                       f"belady {100 * r['belady_hit_rate']:.2f}%")

    # until the first policy's line: a long trace takes a while to read, then each policy to replay
    with said_if_slow(f"reading {trace_file} and replaying it, a line per policy as each ends...") as waiting:
        header, records = read_trace(trace_file)
        prior = None
        if profile_path:
            prior = ActivationProfile.load(profile_path)
            prior.check_model(trace_fingerprint(header), header["num_layers"], header["num_experts"], force,
                              profile_path)
        replay_all(header, records, names, cache_experts, prior, done=show)


@trace.command("import")
@click.argument("fmt", metavar="FORMAT", type=click.Choice(["specmoe", "bigmoeonedge", "moe-ocs", "vllm", "sglang"]))
@click.argument("src", type=click.Path(dir_okay=False))
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="Trace file to write (JSONL).")
@click.option("--only", help="Keep only these sequences, comma-separated: problem ids (specmoe), turns "
              "(bigmoeonedge), request ids (vllm, sglang).")
@click.option("--num-layers", type=Number(int, 1, 1 << 16), help="MoE layers (sglang: the layers of its array, "
              "dense ones included). Default: what the file says, else the largest layer + 1.")
@click.option("--num-experts", type=Number(int, 1, 1 << 16), help="Experts per layer. Default: what the file says, "
              "else the largest id + 1.")
@click.option("--top-k", type=Number(int, 1, 1 << 16), help="Experts per token (sglang, when the response lacks "
              "its token counts).")
@click.option("--model-name", help="Model name for the trace header. Default: what the file says.")
def trace_import(fmt, src, out, only, num_layers, num_experts, top_k, model_name):
    """Convert routing recorded by another engine (FORMAT, file SRC) into an mlxmoe trace,
    to replay here (`trace replay`, `profile from-trace`) and see what a cache size buys.

    \b
    FORMAT is one of
      specmoe       speculative-moe JSONL (Mixtral-8x7B): {"dataset", "problem_id", "layer",
                    "token_idx", "experts", "gating_probs"}; one sequence per problem
      bigmoeonedge  BigMoeOnEdge route_trace CSV (`#` preamble, turn,phase,step,layer,slot,expert,weight)
      moe-ocs       moe_ocs_learning JSON ({"meta", "routes": [{"token_pos", "phase", "layers"}]})
      vllm          JSONL of {"type": "route", "req_id", "token_idx", "layer", "topk_ids",
                    "topk_weights"[, "phase"]}; one sequence per req_id; a profiling run's
                    repeated routing at the start is dropped (with a warning)
      sglang        SGLang responses with return_routed_experts (meta_info.routed_experts or
                    choices[].sgl_ext.routed_experts: base64 int32 [tokens, layers, top_k]);
                    needs --num-layers

    Each sequence is written as mlxmoe runs a request: its prompt as mlx-lm prefills it
    (all its tokens but the last in one call per layer, then the last; lines marked "ph":
    "prefill"), then each generated token through every layer; gating weights are kept as
    the lines' "p"."""
    from .workload.importers import import_trace

    check_outputs({"--out": out}, {"SRC": src})
    wanted = [x.strip() for x in only.split(",") if x.strip()] if only else None

    with said_if_slow(f"reading {src}...") as reading:
        def writing(sequences):  # the second stage, a bar (a line off a terminal): the source is read
            reading.cancel()
            return click.progressbar(sequences, label=f"writing {out}", file=sys.stderr)

        summary, warnings = import_trace(fmt, src, out, wanted, num_layers, num_experts, top_k, model_name,
                                         progress=writing)
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
    n = summary["sequences"]
    click.echo(f"saved {out}: {n} sequence{'s' if n != 1 else ''}, {summary['tokens']} tokens "
               f"({summary['prefill_tokens']} of prompts), {summary['num_layers']} layers x "
               f"{summary['num_experts']} experts, top-{summary['top_k']}", err=True)


@main.command()
@click.argument("src", type=click.Path(file_okay=False))
@click.argument("dst", type=click.Path())
@click.option("--bundle", is_flag=True, help="Repack the experts so that each is one 4096-byte aligned range.")
@click.option("--fallback-bits", type=click.Choice(["2", "3", "4"]), help="Write low-bit copies of SRC's experts "
              "to the file DST (for --fallback).")
def convert(src, dst, bundle, fallback_bits):
    """Repack checkpoint SRC into the new folder DST, or (--fallback-bits) write low-bit copies
    of its experts to the file DST.

    With --fallback-bits B, every expert is quantized to B bits (MLX's affine quantization,
    groups of 64) into one safetensors file: run with `--fallback DST`, a decode step computes
    a missing expert with its copy at once and reads the full one in the background. The
    copies stay in memory (counted in the budget): on the demo model 51 % of its 4-bit experts'
    bytes at 2 bits, 71 % at 3 bits; a larger cache often buys more (bench/RESULTS.md, 'Lossy modes').

    Without either, in mlx-lm's stacked layout, as mlx-lm loads it: for a Hugging Face
    checkpoint whose experts mlxmoe cannot stream as they are, because mlx-lm's sanitize
    computes them (fp8 dequantized to bf16); the per-expert and fused layouts stream as
    they are.

    With --bundle, each expert's tensors (weight, scales and biases of gate, up and down,
    or whatever the architecture has) are written back to back as one range starting at
    a 4096-byte aligned offset, so loading an expert is one read (with --io direct, one
    aligned O_DIRECT request) instead of one per tensor (9 for a stacked 4-bit
    checkpoint): 1.4x the read throughput in bench/bench_io.py. Non-expert
    tensors, config.json and the tokenizer are copied unchanged; DST loads with
    `--model DST` like any checkpoint (not with stock mlx-lm). SRC is any checkpoint
    mlxmoe streams. DST appears only when the conversion is complete.
    """
    from .storage.convert import bundle as bundle_checkpoint, restack

    if bundle and fallback_bits:
        raise click.UsageError("--bundle and --fallback-bits exclude each other; give one")
    if fallback_bits:
        check_outputs({"DST": dst}, {"SRC": model_folder(src)})  # before the work: not after it
        from .api import build_fallback
        from .budget import format_size

        n = build_fallback(src, dst, int(fallback_bits), progress=lambda line: click.echo(line, err=True))
        click.echo(f"wrote {dst} ({format_size(n)})", err=True)
        return
    if bundle:
        bundle_checkpoint(src, dst, progress=lambda line: click.echo(line, err=True))
    else:
        with said_if_slow(f"writing {dst} as mlx-lm loads {src} (every weight read and written once)..."):
            restack(src, dst)
    click.echo(f"wrote {dst}", err=True)


@main.command()
@model_options
@click.option("--profiles", "profiles_dir", type=click.Path(file_okay=False),
              help="A folder of profiles (*.json): each request takes the one nearest its prompt's routing "
              "(or names one: \"mlxmoe\": {\"profile\": NAME} in its body).")
@click.option("--save-profiles", is_flag=True, help="Keep learning the profiles (--profiles, or --profile) from "
              "the requests served and write them back at shutdown and every --save-every requests.")
@click.option("--save-every", type=click.IntRange(min=0), default=16, show_default=True,
              help="Requests between profile saves (0: only at shutdown).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0: any free port.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Tokens per response where a request does not say.")
@click.option("--temp", type=Number(float, 0), default=0.0, show_default=True,
              help="Sampling temperature where a request does not say.")
@click.option("--top-p", type=Number(float, 0, 1, low_open=True), default=1.0, show_default=True,
              help="Nucleus sampling where a request does not say (above 0, at most 1).")
@click.option("--prompt-cache-size", type=Number(int, 0, 4096), default=0, show_default=True,
              help="Conversations whose KV cache is kept for the next request (mlx-lm's prompt cache; memory "
              "beside the budget, bounded by its KV reserve).")
@click.option("--max-queue", type=Number(int, 1, 4096), default=64, show_default=True,
              help="Generation requests waiting or running at once; more are answered 503 with Retry-After.")
@click.option("--max-batch", type=Number(int, 1, 256), default=8, show_default=True,
              help="Concurrent requests decoded together, one forward pass a step through the expert cache (the "
              "experts they share read once); a request joins while the KV reserve holds the batch's contexts, else "
              "it waits. Each request's greedy output is its answer alone, its usage and profile its own. 1: one "
              "request at a time. Off (one at a time) with a draft model or --draft ngram.")
@draft_options
@click.option("--idle-timeout", type=Number(float, 0, 86400, low_open=True), default=30, show_default=True,
              help="Seconds a connection waits for its client: a kept-alive connection idle this long, or a request "
              "whose line and headers take longer in all, is closed; so is one where any read or write stalls this "
              "long.")
def serve(profiles_dir, save_profiles, save_every, host, port, max_tokens, temp, top_p, prompt_cache_size, max_queue,
          max_batch, idle_timeout, **opts):
    """Serve the model over HTTP: OpenAI /v1/chat/completions, /v1/completions and
    /v1/models, Anthropic /v1/messages, /health and the expert cache's /v1/mlxmoe/stats and
    /v1/mlxmoe/residency (mlx-lm's server on mlxmoe's model). Concurrent requests decode in
    batches (--max-batch). Open the address in a browser for a page: a chat with the model
    beside the expert cache live (what is resident, hot and being read; hit rate and MB read per token)."""
    import_mlx()
    from .api import model_name
    from .server import serve as run_server

    if profiles_dir and opts["profile_path"]:
        raise click.UsageError("--profile and --profiles exclude each other")
    check_drafts(opts)
    stored = sorted(Path(profiles_dir).glob("*.json")) if profiles_dir else []  # (--profiles' are written back)
    kept = (stored or opts["profile_path"]) if save_profiles else None
    check_outputs({"--save-profiles": kept, "--trace-out": opts["trace_out"]},
                  {**model_inputs(opts), "--profiles": stored},
                  updates={"--save-profiles": "--profiles" if profiles_dir else "--profile"})
    model, tokenizer = _load(opts)
    try:
        name = model_name(model.expert_runtime.checkpoint.path)  # as profiles and traces name it
        run_server(model, tokenizer, name, host, port, profiles_dir, save_profiles, save_every, max_tokens, temp,
                   top_p, prompt_cache_size, opts["force_profile"], opts["profile_path"], max_queue=max_queue,
                   idle_timeout=idle_timeout, max_batch=max_batch, **_serve_draft(model, opts))
    except BaseException:
        model.expert_cache.close()
        raise
    _finish(model, None, trace_out=opts["trace_out"])  # under several ranks: the trace merged on rank 0
    global _exit_at_once
    _exit_at_once = True


def _serve_draft(model, opts):
    """serve's draft_model and num_draft_tokens (mlx-lm's default 3 where --num-draft-tokens is not given)."""
    draft = draft_arguments(model, opts)
    return {"draft_model": draft.get("draft_model"), "num_draft_tokens": draft.get("num_draft_tokens") or 3}


# Set by serve once everything is saved and closed: run() then ends the process without the
# interpreter's teardown, where MLX, used by mlx-lm's generation thread, now and then aborts
# ('terminate called without an active exception', about 1 exit in 25).
_exit_at_once = False


def _exit_now(code):
    """End the process at once, without the interpreter's teardown (everything is closed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    sys.__stderr__.flush()
    os._exit(code)


_terminated = []  # SIGTERMs received


def _terminate(signum, frame):
    _terminated.append(signum)
    raise Terminated()


def _still_running():
    """Raise Terminated where a SIGTERM came: its handler's exception is lost where it lands
    in a finaliser (a generator closed by the garbage collector, a __del__), which Python
    reports and ignores."""
    if _terminated:
        raise Terminated()


def run(args=None):
    """Entry point: bad input prints one clear line, not a traceback; SIGTERM is handled
    like Ctrl-C (what was recorded is saved, temp files removed), and either exits 130."""
    signal.signal(signal.SIGTERM, interrupting(_terminate))
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (not where SIGINT is ignored)
        signal.signal(signal.SIGINT, interrupting(signal.default_int_handler))
    try:
        main(args, standalone_mode=False)
        if _exit_at_once:
            _exit_now(0)
    except MlxmoeError as e:
        rank = os.environ.get("MLX_RANK", "0")  # under mlx.launch every rank says it, rank 0 first
        if rank == "0":
            click.echo(f"error: {e}", err=True)
        else:  # its stderr is silenced (see _load)
            click.echo(f"[rank {rank}] error: {e}", file=sys.__stderr__)
        if "MLX_RANK" in os.environ:
            # the launcher stops the other ranks once one exits: rank 0, which names the failing
            # rank, must exit within the second the others wait (distributed.check), which the
            # interpreter's teardown took itself now and then (0.4-1.7 s measured)
            _exit_now(2)
        sys.exit(2)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("interrupted", err=True)
        sys.exit(130)
    except click.UsageError as e:  # one line, as for bad input (-h shows the usage)
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
