"""Prefetch: predict the experts of the next MoE layer calls while the current one
computes, and read them in background threads so the decode thread finds them resident.

Predictors, each scored for precision and recall on every layer it predicted:
- `router`: the target layer's router applied to the current layer's hidden state (the
  lookahead of mixtral-offloading; hidden states change little from layer to layer).
  Past the last layer, `router_next_token`: the same for the next token's first layers
  (cross-token), which are otherwise never prefetched,
- `coactivation`: the experts the next layer call used, so far, in the same decode steps
  as the experts the current layer uses now (MoE-Infinity's activation matrix, learned
  online; past the last layer, the next token's first layer after this token's last),
- `previous_token`: the experts the target layer used at its last call,
- `profile`: the layer's hottest experts in the profile prior,
- `speculative`: what the next layers route to when the decode thread runs them ahead
  while it waits for reads (speculate.py; read as far as its precision clears the bar).
What is loaded: the router's confident guesses and those it shares with the previous
token; then the router's next guesses (top 2k) and the co-activation's, each only where
the cache policy would rather evict its victim than the guess, judged by how often the
guess of that rank has been used, above a threshold that follows the disk's occupancy:
low while it idles (a read the disk has time for costs nothing), higher as it fills.
A prefill step reads, while a layer computes, the experts the next layers' routers pick
for the prompt's tokens (their lookahead; nothing else predicts a prompt's many experts).

The cache's `BackgroundLoader` does the loads (the pre-warm's and the predictions') into its
slots, behind the decode thread's own reads.
"""

import functools
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from ..backend import host_probs
from .policies import hottest

PREDICTORS = ("router", "router_next_token", "coactivation", "previous_token", "profile", "speculative")


def hottest_per_layer(rates, k):
    """The profile predictor: each layer's k experts with the highest rate (`k`: one for
    every layer, or a list of each layer's)."""
    ks = list(k) if isinstance(k, (list, tuple)) else [k] * len(rates)
    return [{e for _, e in hottest(rates, ks[layer], layer)} for layer in range(len(rates))]


def count_prediction(counts, predicted, used):
    """Add one prediction to counts = [correct, predicted, actually used]."""
    counts[0] += len(predicted & used)
    counts[1] += len(predicted)
    counts[2] += len(used)


def precision_recall(counts):
    """{predictor: {precision, recall}} for the predictors that predicted anything."""
    return {name: {"precision": c[0] / c[1], "recall": c[0] / c[2] if c[2] else 0.0}
            for name, c in counts.items() if c[1]}


@functools.cache
def calls_ahead(layer, depth, cross_token, L):
    """(step, target layer, tokens ahead) of the layer calls predicted after `layer` of `L`:
    the next `depth`, past the last layer the next token's first ones (`cross_token`)."""
    return [(step, (layer + step) % L, (layer + step) // L)
            for step in range(1, min(depth, L - 1) + 1) if layer + step < L or cross_token]


def visit_steps(estimate, key, p):
    """Layer steps until `key` is used if each visit of its layer uses it with chance p:
    the estimate's steps() with p as the long-run rate too, d + L (1/p - 1), over its miss
    cost of that layer (as the policy's victim choice weighs them)."""
    return estimate.steps(key, p, max(p, 1e-9)) / estimate.miss_cost[key[0]]


def outranks(policy, likely):
    """beats_victim(key, victim) for Residency.claim: a key with a chance `likely[key]` of use at
    its layer's next visit is loaded only in place of a victim whose own chance (the
    `activation` policy's decayed estimates, `chance`) puts its use later; keys not in
    `likely` always. A guess pays off at that one visit or not at all (unused, it is soon
    the victim), so neither the victim's long-run rate nor the router's favour of it at
    its layer's last call, which the eviction order weighs, enters: with them nearly every
    guess loses to every victim. None where the policy keeps no such estimate."""
    estimate = policy.estimate
    if estimate is None:
        return None
    return lambda key, victim: key not in likely or visit_steps(estimate, key, likely[key]) < visit_steps(
        estimate, victim, estimate.chance(victim))


def rank_chances(target, guesses, resident):
    """For `target`'s guesses, {source: (experts best first, [used, guessed] of each rank)}:
    each guessed key's chance, the best of its ranks' used / guessed; and the guesses with
    the resident ones as None, to be scored at the layer's visit (a rank's chance counts
    only guesses that were not resident: those are the ones a load is for, and they are
    right far less often than the rest)."""
    chance, scored = {}, {}
    for source, (wide, counts) in guesses.items():
        scored[source] = [None if (target, e) in resident else e for e in wide]
        for e, (used, guessed) in zip(wide, counts.tolist()):
            chance[(target, e)] = max(chance.get((target, e), 0.0), used / guessed)
    return chance, scored


def most_picked(probs, order, k):
    """The experts that a prompt's tokens (`probs` [tokens, experts], `order` each token's
    experts by falling probability) route to in their top k, the most picked first, then
    the most routing mass."""
    picks = np.bincount(order[:, :k].reshape(-1), minlength=probs.shape[-1])
    return [int(e) for e in np.lexsort((-probs.sum(axis=0), -picks)) if picks[e]]


def paced(chance, busy, busy_target, floor, ceiling):
    """The chance bar after a decode step whose reads kept the disk busy `busy` of it: 1.5x
    down while under busy_target[0], up while over busy_target[1], within [floor, ceiling]."""
    if busy > busy_target[1]:
        return min(ceiling, chance * 1.5)
    if busy < busy_target[0]:
        return max(floor, chance / 1.5)
    return chance


def decayed(mean, value, keep=0.7):
    """A decayed mean updated with `value` (the value itself if there was none)."""
    return value if mean is None else keep * mean + (1 - keep) * value


class HostThread:
    """One thread that runs jobs in the order they were put, off the decode thread: each
    job is given to `work`, or called if it is a function. The first error a job raised is
    raised again on the caller's thread, at its next put() or settle()."""

    def __init__(self, work) -> None:
        self.work = work
        self.jobs = queue.SimpleQueue()  # a put costs far less than a pool's submit; None stops
        self.error = None
        self.thread = threading.Thread(target=self._loop, name="mlxmoe-predict", daemon=True)
        self.thread.start()

    def _loop(self):
        while (job := self.jobs.get()) is not None:
            try:
                job() if callable(job) else self.work(job)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                self.error = self.error or e

    def _raise(self):
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def put(self, job) -> None:
        self._raise()
        self.jobs.put(job)

    def settle(self) -> None:
        """Wait for the jobs put so far (raising the first error, if any)."""
        if self.thread.is_alive():
            done = threading.Event()
            self.jobs.put(done.set)
            done.wait()
        self._raise()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def close(self) -> None:
        """Drop the jobs not started and stop the thread."""
        while True:
            try:
                self.jobs.get_nowait()
            except queue.Empty:
                break
        self.jobs.put(None)
        self.thread.join()


class ReadBar:
    """The chance a guess needs to be read (called with how many layer calls ahead it is),
    from the disk's recent occupancy (pace(), once per decode step) and `cache`'s timings."""

    def __init__(self, cache, min_chance=0.1, chance_floor=0.05, max_chance=0.25, busy_target=(0.5, 0.8)):
        self.cache = cache
        self.min_chance, self.chance_floor, self.max_chance = min_chance, chance_floor, max_chance
        self.busy_target = busy_target
        self.paced = None  # (time, the disk's busy seconds) at the last decode step's start
        self.busy = None  # [busy, all] decayed seconds of decode steps: the disk's recent occupancy (pace)

    def pace(self, now, busy_seconds):
        """Once per decode step: the share of the step during which the disk was busy with
        expert reads, demand or background (`busy_seconds`, the cache's ReadGate's so far),
        moves `min_chance`: a step of 1.5x down while under busy_target[0], up while over
        busy_target[1]. Reads the disk has time for cost nothing; where the disk is the
        bottleneck only the likeliest guesses pay for the slots they take and the bytes."""
        if self.paced is not None and now > self.paced[0] and busy_seconds >= self.paced[1]:
            busy, seconds = busy_seconds - self.paced[1], now - self.paced[0]
            self.min_chance = paced(self.min_chance, busy / seconds, self.busy_target, self.chance_floor, self.max_chance)
            self.busy = [busy, seconds] if self.busy is None else [0.7 * self.busy[0] + busy, 0.7 * self.busy[1] + seconds]
        self.paced = (now, busy_seconds)

    def expert_read(self):
        """Seconds to read one expert at the disk's measured rate (None before one is measured)."""
        rate = self.cache.loader.gate.rate
        return None if rate is None else self.cache.store.expert_file_bytes() / rate

    def __call__(self, steps):
        """The chance a guess for the layer call `steps` calls ahead needs to be read: at least
        `min_chance`, and what makes its read pay. A right guess hides at most the compute
        until its call (steps x a decode layer's, measured) and never more than its read. A
        wrong one is cancelled at its next piece once its call comes, and while it is read a
        demand read waits for the pieces it asked at most: it costs about a piece of disk
        time (its whole read where it is one piece; charged the store.PIECES_AHEAD pieces
        asked at once, fewer right guesses get in where reads are quick and the decode waits
        more) as far as the disk was busy of late (time-weighted over the last decode
        steps; taken as always until one is measured).
        So where a layer computes in far less than a read of one piece (the demo model: 0.5
        against 29 ms at 2 MB/s) no guess is worth its read; none is read before a read and a
        decode layer were timed."""
        gate, layer, read = self.cache.loader.gate, self.cache.layer_seconds, self.expert_read()
        if read is None or layer is None:
            return float("inf")
        busy = 1.0 if self.busy is None else min(1.0, self.busy[0] / self.busy[1])
        gain, cost = min(steps * layer, read), min(read, gate.chunk() / gate.rate) * busy
        return max(self.min_chance, cost / (gain + cost))


class Worth:
    """Whether predicting pays for its host work, weighed once per decode step (step()).
    Its cost: the host seconds of predicting, of loading guesses and of running ahead past
    the reads it ran beside (speculate.py): `work`, added by the threads that do it. In the
    host-bound regime the decode thread pays for it (the GIL, the cores the device's
    compute wants). Its gain: the demand reads the useful guesses spared, each at the
    decode thread's mean demand read. Paused where the gain is less than MARGIN x the cost
    over decayed steps (reads from the page cache: a few us an expert against hundreds of us
    of predicting a layer call), after WARMUP steps: what the two leave out (the verified
    steps kept off while predicting is weighed, the host thread's share of the cores) makes
    a break-even a loss. On again where the share of a step's demand reads that the last
    try spared (at least SHARE_FLOOR: a disk grown slower may make a try that spared nothing
    pay), of a paused step's demand reads, exceeds MARGIN x the cost last measured, once
    paused for `pause_for` steps: HOLD, doubled (up to MOST_HOLD) at each try that pauses at
    its first weighing (guesses that never pay, where the disk is slow, would otherwise be
    tried WARMUP steps out of every WARMUP + 1)."""

    WARMUP, KEEP, MARGIN, SHARE_FLOOR = 8, 0.9, 1.5, 0.25
    HOLD, MOST_HOLD = 8, 512

    def __init__(self) -> None:
        self.paused = False
        self.work = 0.0  # host seconds so far (a lost += between threads only lowers an estimate)
        self.cost = self.gain = None  # decayed seconds a decode step, measured while predicting
        self.reads = None  # decayed demand-read seconds a step, measured while paused
        self.on_reads = None  # ... measured while predicting
        self.per_read = None  # decayed seconds of one demand read of an expert
        self.steps = 0  # steps weighed since predicting (re)started
        self.last = None  # (work, useful loads, demand-read seconds, demand loads, tokens) at the last step's start
        self.pause_for, self.held = self.HOLD, 0  # paused steps before a try, and so far
        self.next_hold = self.HOLD  # pause_for at the next pause where its try never paid

    def step(self, counters, read_guess=None, tokens: int = 1) -> bool:
        """A decode step of `tokens` starts: weigh the last one; True where predicting is on again.
        `read_guess`: an expert's read in seconds by the disk's rate, until a demand read
        is timed (where the guesses hide every miss, none is). The last step is weighed only
        where it came right before this one: steps between that did not come here (verified
        steps, a prompt) are none of predicting's, and their reads no paused step's."""
        now = (self.work, counters.prefetch_useful, counters.demand_seconds, counters.loads_demand, counters.tokens)
        last, self.last = self.last, now
        if last is None or any(a < b for a, b in zip(now, last)) or now[-1] - last[-1] != tokens:  # (or stats reset)
            return False
        work, useful, read, loads, _ = (a - b for a, b in zip(now, last))
        if loads:
            self.per_read = decayed(self.per_read, read / loads, self.KEEP)
        if self.paused:
            self.reads = decayed(self.reads, read, self.KEEP)
            self.held += 1
            if self.held >= self.pause_for and self.share * self.reads > self.MARGIN * self.cost:
                self.paused, self.steps, self.gain, self.on_reads = False, 0, None, None
                return True
            return False
        self.cost = decayed(self.cost, work, self.KEEP)
        per_read = self.per_read if self.per_read is not None else read_guess
        self.gain = decayed(self.gain, useful * (per_read or 0.0), self.KEEP)
        self.on_reads = decayed(self.on_reads, read, self.KEEP)
        self.steps += 1
        if self.steps >= self.WARMUP and self.gain < self.MARGIN * self.cost:
            # (where it paid for a while, tried again soon)
            self.pause_for = self.next_hold if self.steps == self.WARMUP else self.HOLD
            self.next_hold = min(2 * self.pause_for, self.MOST_HOLD)
            self.paused, self.reads, self.held = True, None, 0
        return False

    @property
    def share(self) -> float:
        """Of a step's demand reads, the share the last try spared (at least SHARE_FLOOR): its
        gain over what its steps would have read without the guesses (both kept while paused)."""
        reads = (self.gain or 0.0) + (self.on_reads or 0.0)
        return max(self.SHARE_FLOOR, self.gain / reads if reads > 0 else 0.0)

    def settled(self) -> bool:
        """Whether predicting's host work is what it will be on the steps to come: paused, or
        weighed WARMUP steps since it (re)started (until then it may be tens of ms a step
        that a pause is about to drop)."""
        return self.paused or self.steps >= self.WARMUP

    def stats(self) -> dict:
        ms = lambda v: round(1e3 * (v or 0.0), 3)  # noqa: E731
        if self.cost is None:
            return {"on": True, "reason": "not weighed yet (no decode step on the per-layer path)"}
        if self.paused:
            reason = (f"predicting spared {ms(self.gain)} ms of demand reads a token, less than {self.MARGIN} x "
                      f"its {ms(self.cost)} ms of host work (paused for {self.pause_for} steps at least)")
        else:
            reason = f"predicting spares {ms(self.gain)} ms of demand reads a token for {ms(self.cost)} ms of host work"
        return {"on": not self.paused, "reason": reason}


class Workers:
    """The prefetch workers: loads handed to the cache's BackgroundLoader (see its prefetch),
    a decode step's counted in the host work `worth` weighs."""

    def __init__(self, cache, worth, workers) -> None:
        self.cache, self.worth = cache, worth
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="mlxmoe-prefetch")
        self.jobs = []  # futures of queued and running loads
        self.lock = threading.Lock()  # queue() is called from the host thread and the decode thread

    def queue(self, keys, when, target, beats_victim=None, decode=True):
        """Load those of `keys` not resident, for `target`'s call at token count `when`."""
        keys = [k for k in keys if k not in self.cache.slot_of]
        if keys:
            with self.lock:
                self.jobs = [j for j in self.jobs if not j.done()]
                self.jobs.append(self.pool.submit(self._load, keys, when, target, beats_victim, decode))

    def _load(self, keys, when, target, beats_victim, decode):
        tic = time.thread_time()
        try:
            self.cache.loader.prefetch(keys, when, target, beats_victim)
        finally:
            if decode:
                self.worth.work += time.thread_time() - tic

    def drain(self):
        """Wait until every queued load has ended."""
        with self.lock:
            jobs, self.jobs = self.jobs, []
        wait(jobs)

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


class Prefetcher:
    def __init__(self, cache, routers, top_k, depth=1, workers=2, prior=None, confidence=0.1, cross_token=True,
                 candidates=2, min_chance=0.1, chance_floor=0.05, busy_target=(0.5, 0.8), max_chance=0.25,
                 num_experts=None):
        """`routers[l]`: x -> router scores over layer l's experts (None if unknown);
        `top_k`: the experts a token is routed to, one number or each layer's (a list);
        `num_experts`: the experts of a layer (default: the cache's store's), which bounds
        every width of guesses; `prior`: profile rates [layers, experts] or None.
        `cross_token`: the last layers predict the next token's first ones. `candidates`: beyond the sure guesses, the
        router's top candidates x top_k are loaded where the policy ranks them above its
        victim (0: only the sure guesses), if a guess of its rank was used at least
        `min_chance` of the time so far: a guess costs a whole read, and on a model whose
        lookahead guesses badly (random weights: 2 % used) the policy alone would let
        nearly every guess in and multiply the bytes read. `min_chance` is paced by the
        disk's occupancy (see pace): it falls towards `chance_floor` while reads keep the
        disk busy less than busy_target[0] of each decode step and rises (up to
        `max_chance`) above busy_target[1], so guesses are read as far as the disk has time
        for them."""
        self.top_ks = list(top_k) if isinstance(top_k, (list, tuple)) else [top_k] * len(routers)
        self.cache, self.routers, self.top_k, self.depth = cache, routers, max(self.top_ks, default=1), depth
        if num_experts is None and cache is not None:
            num_experts = cache.store.num_experts
        # the router's guesses of each layer call scored by rank: candidates x top_k of them,
        # never more than there are experts (an argsort over them is no wider)
        self.width = candidates * self.top_k if num_experts is None else min(candidates * self.top_k, num_experts)
        self.confidence = confidence  # router probability above which a lookahead guess is loaded alone
        self.cross_token, self.candidates = cross_token, candidates
        self.bar = ReadBar(cache, min_chance, chance_floor, max_chance, busy_target)
        # scoring and predicting run in this one thread, in the layer calls' order, while
        # the decode thread goes on (False: on the decode thread, after each layer call);
        # so do the cache's updates left for later (ExpertCache.host_work)
        self.off_thread = True
        self.host = HostThread(self._layer_work)
        self.previous = {}  # layer -> experts it used at its last call
        self.pending = {}  # layer -> {predictor: set of experts predicted for its next visit}
        # how often the router's i-th guess for a layer `step` layer calls ahead was used:
        # [step - 1, layer, i] -> [used, guessed], counted whether the guess was loaded or
        # not, from a prior of 1 in 16: below min_chance, so no guess is read before
        # its rank has shown it is used (an optimistic prior read ~20 guesses per layer
        # call for the first tokens on a model whose lookahead guesses badly)
        self.ranked = {}  # layer -> {step, or "coactivation": guesses best first} for its next visit
        self.prompt_ranked = {}  # layer -> (step, [tokens, rank] guesses, -1 where resident) at a prefill step
        self.rank_counts = np.tile([1.0, 16.0], (max(depth, 1), len(routers), self.width, 1))
        self.co_rank_counts = np.tile([1.0, 16.0], (len(routers), self.width, 1))  # the same, [layer, i]
        # [layer, i, j]: decode steps in which `layer` used expert i and the next layer call
        # (past the last layer: the next token's first) used expert j
        E = num_experts if num_experts is not None and candidates else 0
        self.coactive = np.zeros((len(routers), E, E), dtype=np.float32) if E else None
        self.hottest: list[set] | None = None  # the profile predictor's guesses per layer (set_prior)
        self.lossy = None  # lossy.Lossy where a lossy mode is on: the guesses follow its rule (lossy.attach_lossy)
        self.set_prior(prior)
        self.worth = Worth()  # decode steps predict only where it pays for its host work
        self.workers = Workers(cache, self.worth, workers)
        # predictor -> [correct, predicted, actually used]
        self.counts = {name: [0, 0, 0] for name in PREDICTORS}

    def set_prior(self, prior: np.ndarray | None) -> None:
        """Take a profile's rates [layers, experts] (None: no profile) for the profile
        predictor, as Policy.set_prior does for the policy; under the cache's lock mid-run."""
        self.hottest = None if prior is None else hottest_per_layer(prior, self.top_ks)

    def layer_done(self, layer, rows, ahead_scores=None, token=0, decode=True):
        """A layer call has its experts (`rows`: each token's, [tokens, top_k], a list of one
        list at a decode step): observe() what it used, and after_layer() (a decode step) or
        prefill() predicts the next calls (see off_thread). While `worth` holds predicting
        paused, a decode step does nothing more (its deferred host work: see experts.wait_for)."""
        if decode and layer == 0 and self.worth.step(self.cache.counters, self.bar.expert_read(), self.cache.step_tokens):
            # on again: what was predicted before the pause is for calls long gone
            self.pending.clear(), self.ranked.clear(), self.previous.clear()
            self.bar.paced = None
        if decode and self.worth.paused:
            return
        job = (layer, rows, ahead_scores, token, decode)
        self.host.put(job) if self.off_thread else self._layer_work(job)

    def _layer_work(self, job):
        if job:
            tic = time.thread_time()
            layer, rows, ahead_scores, token, decode = job
            last = rows[-1]  # a decode step's experts as a list, a prefill step's rows as an array
            self.observe(layer, last if isinstance(last, list) else last.tolist(), decode=decode,
                         rows=None if decode else rows, token=token)
            (self.after_layer if decode else self.prefill)(layer, ahead_scores, token)
            if decode:  # (a prompt's predictions are no decode step's cost)
                self.worth.work += time.thread_time() - tic
        if self.off_thread and self.cache is not None:
            self.cache.host_work()

    def hand_off(self):
        """The host thread does the cache's deferred host work (the job `()`, as while paused)."""
        self.host.put(())

    def settle(self):
        """Wait for the queued scoring and predicting (raising its error, if any)."""
        self.host.settle()

    def observe(self, layer, experts, decode=True, rows=None, token=None):
        """The experts `layer` really used (at the last token of the call): score what
        was predicted for it, if this is the decode step it was predicted for. At a prefill
        step, `rows` (each token's experts) score the router's guesses of each rank for
        each prompt token (see prefill)."""
        guesses = self.prompt_ranked.pop(layer, None)
        if rows is not None and guesses is not None and len(guesses[1]) == len(rows):
            step, ranked = guesses
            hit = (ranked[:, :, None] == np.asarray(rows)[:, None, :]).any(axis=-1)
            counts = self.rank_counts[step - 1, layer]
            counts[:, 0] += hit.sum(axis=0)
            counts[:, 1] += (ranked >= 0).sum(axis=0)
        used = set(experts)
        pending = self.pending.pop(layer, {})
        for name, predicted in pending.items() if decode else ():
            count_prediction(self.counts[name], predicted, used)
        # what running ahead found (BackgroundLoader.routed_ahead), no longer needed once the call came
        speculated = None if self.cache is None else self.cache.loader.routed_ahead.pop((token, layer), None)
        if decode and speculated is not None:
            count_prediction(self.counts["speculative"], speculated, used)
        for step, guesses in self.ranked.pop(layer, {}).items() if decode else ():
            counts = self.co_rank_counts[layer] if step == "coactivation" else self.rank_counts[step - 1, layer]
            for i, e in enumerate(guesses):
                if e is not None:
                    counts[i, 0] += e in used
                    counts[i, 1] += 1
        L = len(self.routers)
        source = self.previous.get((layer - 1) % L)
        if decode and source and self.coactive is not None:
            self.coactive[(layer - 1) % L][np.ix_(sorted(source), sorted(used))] += 1.0
        self.previous[layer] = used

    def calls_ahead(self, layer):
        return calls_ahead(layer, self.depth, self.cross_token, len(self.routers))

    def lookahead(self, layer, x, decode=True):
        """{step: the target layer's router scores for hidden states x}, unevaluated (a row
        per token; the next step's layers from the last token's alone): the caller evaluates
        them together with `layer`'s own routing, in one sync. Only the router is an op: its
        distribution is taken on the host, off the decode thread (prefill(), after_layer())."""
        out = {}
        if decode and self.worth.paused:
            return out
        for step, target, ahead in self.calls_ahead(layer):
            if self.routers[target] is not None:
                # the next step's first layers: from the last token's hidden state
                h = x if decode or not ahead else x.reshape(-1, x.shape[-1])[-1:]
                out[step] = self.routers[target](h)
        return out

    def prefill(self, layer, ahead_scores, token):
        """After a prefill layer call has its experts, with `ahead_scores` = lookahead() evaluated:
        queue the loads of the experts the next layers' routers pick for the prompt's
        tokens (each token's top_k; past the last layer, the last token's for the next
        step, where the router's first guess at that distance clears the bar), the most
        picked first, to run while this layer computes. Each token's
        guesses of each rank are scored as a decode step's are (a prompt teaches the rank
        chances that admit decode's guesses)."""
        for step, target, ahead in self.calls_ahead(layer):
            if step in ahead_scores:
                probs = host_probs([ahead_scores[step]])[0]  # [tokens, experts]
                order = np.argsort(-probs, axis=-1, kind="stable")
                wide = order[:, : self.width]
                if not ahead and self.candidates:  # each token's guesses by rank, resident ones left out
                    resident = [[(target, e) in self.cache.slot_of for e in row] for row in wide.tolist()]
                    self.prompt_ranked[target] = (step, np.where(resident, -1, wide))
                used, guessed = self.rank_counts[step - 1, target, 0]
                if ahead and used / guessed < self.bar(step):
                    continue  # the next step's guesses: read where the router's first was right often enough
                self.queue([(target, e) for e in most_picked(probs, order, self.top_ks[target])], token + ahead, target,
                           decode=False)

    def after_layer(self, layer, ahead_scores, token):
        """Called once `layer` has its experts (decode only), with `ahead_scores` = lookahead()
        evaluated: predict the next layer calls and queue their loads, to run while this
        layer computes."""
        if layer == 0:
            self.bar.pace(time.perf_counter(), self.cache.loader.gate.busy_seconds())
        for step, target, ahead in self.calls_ahead(layer):
            when = token + ahead
            predicted, probs, ranked, skip = {}, None, None, ()
            if step in ahead_scores:
                probs = host_probs([ahead_scores[step]])[0][-1]
                if self.lossy is not None:  # as the layer will route: biased, trimmed guesses not read
                    probs, skip = self.lossy.guesses(probs, target, self.cache.slot_of, self.top_ks[target])
                ranked = np.argsort(-probs, kind="stable")[: max(self.width, self.top_k)].tolist()
                guess = set(ranked[: self.top_ks[target]])
                predicted["router" if when == token else "router_next_token"] = guess
            co = None
            if step == 1 and self.coactive is not None and self.previous.get(layer):
                row = self.coactive[layer][sorted(self.previous[layer])].sum(axis=0)
                if row.any():
                    co = np.argsort(-row, kind="stable")[: self.width].tolist()
                    predicted["coactivation"] = set(co[: self.top_ks[target]])
            if target in self.previous:  # for a layer of the next token: its experts at this token
                predicted["previous_token"] = self.previous[target]
            if self.hottest is not None:
                predicted["profile"] = self.hottest[target]
            self.pending[target] = predicted
            self.submit(target, step, when, predicted, probs, ranked, co, skip)

    def submit(self, target, step, when, predicted, probs, ranked=None, co=None, skip=()):
        """Queue the loads for `target`'s call at token count `when`. What is not resident is
        mostly what the predictors got wrong, and a wrong load costs a read and may evict
        something useful: load what the router is sure of, or what it agrees on with the
        previous token; then the router's next most likely guesses and the co-activation's
        (`co`, best first), each only in place of a victim the policy values less. A
        guess's chance is how often that predictor's guess of that rank was used so far
        (the router's own probability as the chance let far fewer good guesses in: useful
        share 0.35 against 0.57 at 25 % cache on the demo model). No guess, sure or not, is
        read while its chance is below `min_chance` (paced by the disk's occupancy, see
        pace); the likeliest are claimed first. `ranked`: the experts by falling `probs`, at
        least the top candidates x top_k; `skip`: experts a lossy mode would not use (never read)."""
        router = predicted.get("router", predicted.get("router_next_token", set()))
        previous = predicted.get("previous_token", set())
        sure = (router & previous) | {e for e in router if probs[e] >= self.confidence}
        keys = [(target, e) for e in sorted(sure, key=lambda e: -probs[e])]
        likely = {}  # the guesses beyond the sure ones, with their chance
        beats_victim = outranks(self.cache.policy, likely)
        if beats_victim is not None and self.candidates:
            guesses = {}  # source -> (guesses best first, [used, guessed] of each rank)
            if probs is not None:
                if ranked is None:
                    ranked = np.argsort(-probs, kind="stable").tolist()
                guesses[step] = (ranked[: self.width], self.rank_counts[step - 1, target])
            if co is not None:
                guesses["coactivation"] = (co, self.co_rank_counts[target])
            chance, scored = rank_chances(target, guesses, self.cache.slot_of)
            self.ranked.setdefault(target, {}).update(scored)
            bar = self.bar(step)
            keys = [k for k in keys if chance.get(k, 1.0) >= bar]
            likely.update((k, c) for k, c in chance.items() if k[1] not in sure and c >= bar)
            keys += sorted(likely, key=lambda k: -likely[k])
        if skip:
            keys = [k for k in keys if k[1] not in skip]
        self.queue(keys, when, target, beats_victim)

    def queue(self, keys, when, target, beats_victim=None, decode=True):
        """Load those of `keys` not resident (see Workers.queue)."""
        self.workers.queue(keys, when, target, beats_victim, decode)

    def stats(self):
        """The cache's stats of prefetch: each predictor's precision and recall, and `worth`'s."""
        self.settle()
        return {"predictors": precision_recall(self.counts), "prefetch": self.worth.stats()}

    def drain(self):
        """Wait until every queued prediction and load has ended."""
        self.settle()
        self.workers.drain()

    def close(self):
        self.host.close()  # what is queued is dropped, not waited for
        self.workers.close()
