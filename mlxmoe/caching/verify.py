"""Decode steps that never wait at a layer: a token's experts verified a window behind.

At a decode step (one token) on a partly cached model, each MoE layer looks its experts'
slots up on the device (`tables[layer][indices]`; an expert that is not resident points at
the placeholder, the pools' spare last slot, which no expert ever holds) and computes at
once, and each decoder layer's output is queued (`mx.async_eval`) as soon as it is built:
the device computes while the host builds the next layers. While steps miss, each decoder
layer's routing is checked `lag` layers on (Lag): where the next layer's experts are called (its
attention and router queued), or once the next one or two are queued whole (the device computes
them meanwhile); one wait after the forward reads the rest (stacked on the device at the last
MoE layer call: two host copies, not two a layer call). Where no routed expert was missing
the token is exact: its slots are those the per-layer path would have used, since nothing
is read, evicted or prefetched while a verified token computes. A layer that misses often
(Direct) is checked before its experts are queued instead: held until the next decoder layer
is built, its misses then read into the slots its lookup finds. Otherwise the first layer
that missed reads its experts (the policy chooses victims as on the per-layer path, after
the hits of the layers before it), the KV caches its pass wrote from that decoder layer on
are trimmed by the token, and the forward runs again: the decoder layers before it return
the outputs they gave (their caches as they were), the rest compute with the new slots. The
missed layer's own attention, where its decoder layer called it once and before its experts
(`self_attn`, `attention` or `attn`: mlx-lm's names), returns what it gave, its cache kept: the
replay starts at that layer's experts.

A replay costs the decoder layers it recomputes; the per-layer path costs a wait per layer
call and its own host work. Where the verified steps cost more (Switch: both timed here), the
mode is off for OFF_STEPS steps (doubled at each turn off in a row), then tried again
(`stats()["verify"]` says which and why). A step takes the per-layer path where a
background read is under way, a cache cannot be trimmed (a rotating cache that wrapped),
or every expert is resident (the resident path needs no check at all).

A batch's decode step (`serve --max-batch`: inputs [B, 1] on BatchKVCaches) is verified as one
step of B tokens: each layer call's experts are the union of its rows', a replay trims each
row's token (BatchKVCache.trim takes the same count from every row), and each layer call is
counted per row (experts.count_rows) as the per-layer path counts it. A batch's steps have a
switch of their own (`batch_switch`): its rows' union misses more often than a row alone does,
and its replays turning the mode off must not turn it off for a request alone.
"""

import bisect
import time
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from ..backend import host_dists, host_floats, host_probs
from ..errors import MlxmoeError
from .cache import finish_all, read_later
from .experts import (as_rows, count_hit_rows, count_rows, host_work_meanwhile, observe_calls, resident_table,
                      step_call, step_calls)
from .prefetch import decayed

# the most tokens of a verified step: a decode step's one, or a speculative step's draft and the
# token before it (a batch's rows counted too); a prompt's longer steps go layer by layer (each
# reads its union once)
STEP_TOKENS = 16
# verified tokens weighed at a time, and the fewest before the mode turns off where they cost
# CLEARLY_WORSE times more (a disk's reads behind replays: at once), else after WEIGH_TOKENS (a
# step's replays vary from none to several: a few steps a little costlier are noise); steps
# on the per-layer path before the mode is tried again once it turned itself off: the first,
# doubled at each turn off in a row up to the most (a workload whose misses stay frequent
# pays for a try ever more rarely)
WEIGH_TOKENS, FIRST_WEIGH, CLEARLY_WORSE = 16, 2, 1.25
OFF_STEPS, MOST_OFF_STEPS = 32, 1024
# steps on the per-layer path timed before they are set against the verified steps (which turn
# the mode off only where they cost CLOSE times more); where the
# verified steps keep replaying, that path is timed again OFF_STEPS steps after it last was
# where the two were CLOSE, else RETIME_STEPS (doubled each time up to MOST_OFF_STEPS): a
# timing from a cold cache's first tokens, whose misses are many, would otherwise keep the
# mode on for good
MEASURED_OFF, RETIME_STEPS, CLOSE = 4, 256, 1.1
# a timing of the per-layer path more than FRESH_STEPS steps old is taken again before the
# verified steps turn the mode off on it: the machine's speed drifts (a busy neighbour, a clock
# that drops), and a verified stretch timed while it is slow must not lose to a timing taken while
# it was fast
FRESH_STEPS = OFF_STEPS
# where the verified steps so far cost STAY_OFF times what the per-layer path, timed only to weigh
# them, would have, the mode stays off for the stretch rather than being tried again at once; more
# than CLEARLY_WORSE: the first steps after a prompt, the coldest, weigh in and cost a verified step
# most (replays). Off, it is on again where the share of steps that miss fell MISSING_FELL times below
# the verified steps' (a cache that warmed since: their cost dates from then)
STAY_OFF, MISSING_FELL = 1.5, 2.0
# steps on the per-layer path at most while predicting settles whether it pays (Switch.timed)
MOST_SETTLING = 16
# decode steps before the per-layer path is first timed where the waits' guess keeps the mode on
# (a cold cache's first tokens miss far more than later ones)
WARM_STEPS = 2 * WEIGH_TOKENS
# (BatchKVCache: a batch's decode step in `serve`; trim() takes each row's token back)
KV_TYPES = (KVCache, RotatingKVCache, BatchKVCache)
# decoder layers queued past the last one checked within a forward (while steps miss): the
# device computes them while the host reads that layer's routing, and a miss's replay
# recomputes them, not the rest of the token. At 0 a decoder layer is checked when the next
# one's experts are called, that one's attention and router queued (a replay computes them again,
# not its experts); at 1 once the next one is queued whole; at 2 once two are. Each lag in LAGS
# while checks at it find their routing computed (the host is the slower side: no wait), else
# the next (the device is behind: one more layer queued keeps it busy while the host waits);
# MIN_LAG tried again after LAG_RETRY checks above it
LAGS = (0, 1, 2)
MIN_LAG, LAG = LAGS[0], LAGS[-1]
LAG_RETRY = 1024
# decoder layers built between two queues (mx.async_eval) of a forward without checks within
# it: the device starts on them while the host builds the next, and each queue costs the host
# a graph walk (~40 us here)
QUEUE_EVERY = 4
# a decoder layer's attention module, by mlx-lm's names (the first found)
ATTENTION_NAMES = ("self_attn", "attention", "attn")
# how much a layer's share of missed calls keeps of its past at each check of it (Direct)
KEEP_MISSING = 0.9
# verified steps in a row without a direct check, some layer missing, after which the layer
# that misses most is read directly once (Direct.stepped): its cost measured, not guessed
PROBE_STEPS = 8
# where the first host read of a small array costs more than this (CUDA: ~55 us, a managed
# allocation and a synchronous copy; the CPU and Metal: ~1 us), a check reads each layer call's
# flag, the largest slot its lookup found (one op; 4 bytes, which CUDA keeps in host memory),
# instead of its indices, and the hits' indices at the forward's end (the pack) or at a miss
FLAG_READS = 20e-6


class Replay(Exception):
    """A check within a forward found a layer call that missed (`missed`, a MoE layer) once
    the decoder layers before `ran` had run in this pass."""

    def __init__(self, missed: int, ran: int) -> None:
        super().__init__(missed, ran)
        self.missed, self.ran = missed, ran


def wait_seconds(samples: int = 7) -> float:
    """What one host wait on the device costs with nothing queued: the median of a few."""
    times = []
    for _ in range(samples):
        a = mx.array(1.0) + 1
        tic = time.perf_counter()
        mx.eval(a)
        times.append(time.perf_counter() - tic)
    return float(np.median(times))


def first_read_seconds(samples: int = 5) -> float:
    """What the first host read of a freshly computed 32-byte array (a layer call's indices)
    costs: the median of a few."""
    times = []
    for i in range(samples):
        a = mx.arange(8, dtype=mx.uint32) + i
        mx.eval(a)
        tic = time.perf_counter()
        a.tolist()
        times.append(time.perf_counter() - tic)
    return float(np.median(times))


class Switch:
    """Whether decode steps are verified, weighed every WEIGH_TOKENS tokens: the verified
    steps' time against that of steps on the per-layer path, as measured on the steps the
    mode was off for (`layerwise`; a step that missed, replayed or read at a Direct layer,
    against those that missed where some did, `layerwise_missed`, one that did not against those
    that hit, `layerwise_clean`, a tie at least); before any, the replays' time (beyond a step without
    one, its reads left out) against the waits the per-layer path would have made beyond
    these steps' (one each, and one a replay), each as long as a layer call of that path
    waited last (`layer_wait()`, or an empty round trip before any). Off for `off_steps`
    steps where the verified steps cost more (than a timing at most FRESH_STEPS old: an older
    one is taken again first), doubled at each turn off in a row; on again
    after MEASURED_OFF steps off where a verified step would cost more on that path, each
    class at the share of steps that miss now (now()) (the first guess, from the waits alone,
    leaves out the per-layer path's own host work and counts the device's work within its
    waits: where steps replayed, the mode is off for those MEASURED_OFF steps whichever way it
    went, then weighed against them; where a verified step would cost STAY_OFF times one of
    those, off for the stretch). A step without a replay weighs as a tie at least: it cannot
    cost more than the per-layer path's; and MEASURED_OFF steps off in a row that miss nothing
    (nor use an expert a prefetch read), or a share of such steps MISSING_FELL times below the
    verified steps', turn the mode on again (a cold cache's replays no longer keep a warm one
    off for the doubled stretch).
    The per-layer path's steps are timed only once `settled()` (predicting has settled whether
    it pays, prefetch.Worth), the mode off meanwhile (at most MOST_SETTLING steps): predicting
    that does not pay (a host-bound run's guesses cost 15-20 ms a step) would otherwise
    weigh in that path's timing until it pauses, and keep the mode on for good."""

    def __init__(self, moe_layers: int, layer_wait, first_replay=lambda: None, settled=lambda: True) -> None:
        self.moe_layers, self.layer_wait, self.settled = moe_layers, layer_wait, settled
        self.wait = wait_seconds()
        self.steps = 0  # decode steps seen (verified or not)
        self.off_until = 0  # step count before which the mode is off
        self.off_steps = OFF_STEPS  # for how long it turns off next
        self.reason = None  # why it is off (or was last)
        self.weighed = [0.0, 0.0, 0]  # seconds the verified steps cost, seconds the per-layer path would, tokens
        self.clean = None  # decayed seconds of a verified step without a replay
        self.missed_step = None  # the same of one that missed (a replay, or a Direct layer's reads)
        self.steady = None  # decayed seconds of a verified step, replays included (slowly: keep 0.9)
        self.layerwise = None  # decayed seconds of a step on the per-layer path while off
        self.layerwise_missed = None  # the same of such a step that missed or used an expert a prefetch read
        # (verified, it would have replayed), and of one that did not
        self.layerwise_clean = None
        self.timed_off = 0  # such steps timed since the mode turned off
        self.settling = 0  # such steps not timed since, predicting not settled (`settled`)
        self.retime_at, self.retime_steps = None, RETIME_STEPS  # when the per-layer path is timed again, and then
        self.timed_at = None  # the step at which that path's last timing ended
        self.clean_off = 0  # such steps in a row without a miss (a prefetched expert used counts as one)
        self.missing_off = None  # decayed share of such steps that missed (or used a prefetched expert)
        self.missing = None  # decayed share of verified steps with a replay
        self.windowed = True  # checks within the forward (while steps miss)
        self.direct = Direct(moe_layers, self.per_layer_wait, first_replay)  # layers read at once

    def step(self) -> bool:
        """A decode step starts: whether the mode is on for it."""
        self.steps += 1
        return self.steps > self.off_until

    def on(self) -> bool:
        return self.steps >= self.off_until

    def verified(self, seconds: float, replays: int, replayed: int, decoder_layers: int, missed=None) -> bool:
        """A verified step took `seconds` (its reads left out) with `replays` replays of
        `replayed` decoder layers in all (their cost each to `direct`); `missed`: whether it
        missed (by default, whether it replayed). Returns whether the mode turned itself off."""
        # checks within the forward only while steps miss: a clean step needs one wait
        self.missing = decayed(self.missing, float(replays > 0))
        self.windowed = self.missing > 0.05
        self.steady = decayed(self.steady, seconds, keep=0.9)
        if not replays:
            self.clean = decayed(self.clean, seconds)
        if replays or missed:
            self.missed_step = decayed(self.missed_step, seconds)
        replayed_share = seconds * replayed / (decoder_layers + replayed)  # the replayed layers' share of the step
        if replays:  # (a replay's layers at the step's mean time a layer: robust where clean steps are rare)
            self.direct.replay = decayed(self.direct.replay, replayed_share / replays)
        direct = self.direct.stepped()
        if self.layerwise is not None:  # both paths timed: the step against the per-layer path's
            # (one that missed against its steps that missed, a Direct layer's reads as a replay;
            # one that did not did that path's work less its waits: a tie at worst, whatever
            # the clock says, which moves with the context's length and the machine's load)
            return self.weigh(seconds, self.missed_layerwise() if replays or missed else self.clean_layerwise(seconds))
        if not replays:
            replay_seconds = 0.0
        elif self.clean is not None:
            replay_seconds = max(seconds - self.clean, 0.0)
        else:  # (no step without a replay timed yet)
            replay_seconds = replayed_share
        saved = self.moe_layers - 1 - replays - direct  # (a direct check waits as the per-layer path would)
        return self.weigh(replay_seconds, max(saved, 0) * self.per_layer_wait())

    def missed_layerwise(self) -> float:
        """A step with a miss on the per-layer path, what a step that replayed weighs against: as
        timed while off (the path's steps that read cost more than those that hit: its miss's
        host work after each wait), or any step of that path where none of those missed."""
        return self.layerwise if self.layerwise_missed is None else self.layerwise_missed

    def clean_layerwise(self, seconds: float) -> float:
        """What a verified step without a replay (`seconds`) weighs against: the per-layer path's
        steps that hit, timed while off (its waits), or a tie, never less."""
        return seconds if self.layerwise_clean is None else max(seconds, self.layerwise_clean)

    def per_layer_wait(self) -> float:
        """A wait of the per-layer path: as long as its layer calls waited last, or an empty round trip before any."""
        return self.layer_wait() or self.wait

    def weigh(self, cost: float, instead: float) -> bool:
        """A verified step's `cost` against what the per-layer path would have cost `instead`:
        both the step's time, or its replays' and the waits they saved."""
        w = self.weighed
        w[0] += cost
        w[1] += instead
        w[2] += 1
        if w[2] < FIRST_WEIGH or w[2] < WEIGH_TOKENS and w[0] <= w[1] * CLEARLY_WORSE:
            return False
        self.weighed = [0.0, 0.0, 0]
        # (against a timing, off only where clearly costlier, CLOSE: a near tie is the clock's noise, and
        # each turn off costs the per-layer path's timing and host work)
        near = CLOSE if self.layerwise is not None else 1.0
        worse = w[0] > w[1] * near
        due = self.retime_at is not None and self.steps >= self.retime_at
        stale = worse and self.timed_at is not None and self.steps - self.timed_at > FRESH_STEPS
        retime = self.layerwise is not None and w[0] and (due or stale)
        if not worse and (self.layerwise is not None or not w[0] or self.steps < WARM_STEPS) and not retime:
            self.off_steps = OFF_STEPS
            return False
        if retime:  # (timed afresh: the old timing left out)
            self.layerwise = self.layerwise_missed = self.layerwise_clean = None
            if due:
                self.retime_steps = min(2 * self.retime_steps, MOST_OFF_STEPS)
            self.off_until, self.timed_off, self.clean_off, self.settling = self.steps + MEASURED_OFF, 0, 0, 0
            self.reason = "the per-layer path timed again" + (
                "" if due else f": its timing, {self.steps - self.timed_at} steps old, lost to the verified steps")
            return True
        # before the per-layer path is timed, off only for as long as timing it takes, whichever
        # way the first weighing went where steps replayed (it prices the path's waits by their
        # length, which holds the device's work too, or an empty round trip: not its steps)
        self.off_until = self.steps + (self.off_steps if self.layerwise is not None else MEASURED_OFF)
        self.off_steps = min(2 * self.off_steps, MOST_OFF_STEPS)
        self.timed_off = self.clean_off = self.settling = 0
        worse = "more" if w[0] > w[1] else "less"
        self.reason = (slower(w[0] / w[2], w[1] / w[2]) if self.layerwise is not None else
                       f"replays cost {w[0] / w[2] * 1e3:.2f} ms a token, {worse} than the "
                       f"{w[1] / w[2] * 1e3:.2f} ms of waits they save: the per-layer path timed")
        return True

    def timed(self, cache, call, args, kwargs):
        """`call(*args, **kwargs)`, a step the mode is off for, on the per-layer path, timed
        (its reads left out): where MEASURED_OFF such steps took longer than verified steps,
        or MEASURED_OFF in a row missed nothing, an expert a prefetch read counting as a miss
        (verified, they would have replayed nothing), the mode is on again from the next step."""
        if self.settling < MOST_SETTLING and not self.settled():
            self.settling += 1
            self.off_until += 1  # (the steps that time it still to come)
            return call(*args, **kwargs)
        counters = cache.counters
        tic, read, missed = time.perf_counter(), counters.read_seconds, (counters.misses, counters.prefetch_useful)
        out = call(*args, **kwargs)
        seconds = time.perf_counter() - tic - (counters.read_seconds - read)
        clean = (counters.misses, counters.prefetch_useful) == missed
        self.layerwise = decayed(self.layerwise, seconds)
        if clean:
            self.layerwise_clean = decayed(self.layerwise_clean, seconds)
        else:
            self.layerwise_missed = decayed(self.layerwise_missed, seconds)
        self.clean_off = self.clean_off + 1 if clean else 0
        self.missing_off = decayed(self.missing_off, float(not clean))
        self.timed_off += 1
        if self.timed_off == MEASURED_OFF:
            self.timed_at = self.steps
            close = self.steady is None or self.layerwise < self.steady * CLOSE
            self.retime_at = self.steps + (OFF_STEPS if close else self.retime_steps)
        # (after MEASURED_OFF steps, where steps were verified: both paths' steps at the share that misses now)
        judged = self.timed_off == MEASURED_OFF and self.steady is not None
        verified, per_layer = self.now() if judged else (None, None)
        if judged and per_layer > verified:
            self.on_again(f"a step would take {per_layer * 1e3:.2f} ms on the per-layer path, "
                          f"{verified * 1e3:.2f} ms verified")
        elif self.clean_off >= MEASURED_OFF:
            self.on_again(f"{self.clean_off} steps on the per-layer path without a miss")
        elif self.timed_off >= MEASURED_OFF and self.missing is not None and self.missing_off * MISSING_FELL < self.missing:
            self.on_again(f"{100 * self.missing_off:.0f} % of the steps on the per-layer path miss, "
                          f"{100 * self.missing:.0f} % of the verified ones did")
        elif judged and self.steps >= self.off_until and verified > STAY_OFF * per_layer:
            # (off only to time this path, where a verified step would cost STAY_OFF times one of
            # it: off for the stretch now rather than tried again at once and weighed, which a
            # disk's reads behind the replays pay)
            self.off_until = self.steps + self.off_steps
            self.off_steps = min(2 * self.off_steps, MOST_OFF_STEPS)
            self.reason = slower(verified, per_layer)
        return out

    def now(self) -> tuple:
        """(a verified step, one on the per-layer path) at the share of steps that miss now (of
        those just timed, `missing_off`): class by class, a step that misses (as verified ones
        that missed took, replayed or read at a Direct layer, else a tie) against that path's that
        missed, one without (as verified ones without a replay took, else a tie) against those that
        hit (a tie at least). The verified steps' share would date from their time: a prompt's
        first steps, the coldest, miss most; and where Direct layers read the misses, few replay."""
        m, missed = self.missing_off, self.missed_layerwise()
        clean = self.layerwise if self.clean is None else self.clean
        verified = m * (missed if self.missed_step is None else self.missed_step) + (1 - m) * clean
        return verified, m * missed + (1 - m) * self.clean_layerwise(clean)

    def on_again(self, why: str) -> None:
        self.off_until, self.off_steps = self.steps, OFF_STEPS
        self.timed_off = self.clean_off = 0
        self.reason = f"on again: {why}"


def slower(verified: float, per_layer: float) -> str:
    """Why the mode is off: a verified step's seconds against a step's on the per-layer path."""
    return (f"a verified step took {verified * 1e3:.2f} ms, more than the {per_layer * 1e3:.2f} ms "
            "of one on the per-layer path")


class Lag:
    """Decoder layers queued past the last one checked within a forward (`layers`, see
    LAGS): MIN_LAG until one check in five at it (decayed) waits for the device, longer than
    half an empty round trip (`wait`: a wait for a kernel in flight pays its completion's
    signal), then the next lag, and so on up to LAG; MIN_LAG again after LAG_RETRY checks
    above it."""

    def __init__(self, wait: float) -> None:
        self.wait = wait
        self.layers = MIN_LAG
        self.waits = None  # decayed share of the checks at this lag that waited for the device
        self.checks = 0  # checks above MIN_LAG since it rose

    def checked(self, seconds: float) -> None:
        """A check within a forward waited `seconds` for its routing."""
        if self.layers != MIN_LAG:
            self.checks += 1
            if self.checks >= LAG_RETRY:
                self.layers, self.waits, self.checks = MIN_LAG, None, 0
                return
        if self.layers != LAG:
            self.waits = decayed(self.waits, float(seconds > self.wait / 2), keep=0.9)
            if self.waits > 0.2:
                self.layers, self.waits = LAGS[LAGS.index(self.layers) + 1], None


class Direct:
    """MoE layers whose routing a verified step reads before their experts are queued (then
    the misses read: no replay from them), where that costs less than the replays it saves.
    Such a layer, the last MoE layer of its decoder layer, is held: its experts are built
    from the tables, its routing queued, and read once the next decoder layer is built (the
    device computes the routing while the host builds; the misses are read into the slots the
    lookup will find, the tables written in place); another is read as soon as it is built
    (a wait with nothing queued after it). Chosen where a layer's decayed share of
    checked layer calls that missed x a replay's measured time > a direct check's (`wait`;
    before either is measured, the guesses `first_replay()` and `first_wait()`); after
    PROBE_STEPS steps without one, the layer that misses most is read directly once, so that
    `wait` follows what a check costs now (a held one, overlapped with the host's building, a
    fraction of an empty round trip, the guess). A token's first layers, which no guess sees
    coming, miss far more often than the rest (the host-bound bench, warm: layers 0-2 in a
    third to a half of the tokens at ~99 % hits, layers 0-5 in nearly every token at ~90 %).
    `now`: the layers read at once in the next step, chosen at the end of the one before
    (stepped())."""

    def __init__(self, moe_layers: int, first_wait, first_replay) -> None:
        self.missing = [0.0] * moe_layers  # decayed share of each layer's checked calls that missed
        self.replay = None  # decayed seconds of a replay (its reads left out)
        self.wait = None  # decayed seconds of a direct check (its reads left out)
        self.first_wait, self.first_replay = first_wait, first_replay
        self.step_checks = 0  # direct checks in the step under way
        self.without = 0  # verified steps in a row without a direct check
        self.now = set()

    def at(self, layer: int) -> bool:
        replay = self.replay or self.first_replay()
        return replay is not None and self.missing[layer] * replay > (self.wait or self.first_wait())

    def waited(self, seconds: float) -> None:
        self.wait = decayed(self.wait, seconds)
        self.step_checks += 1

    def stepped(self) -> int:
        """A verified step ended: its direct checks; the next step's layers chosen (where none
        for PROBE_STEPS steps, the layer that misses most: one slow check cannot rule direct
        checks out for good, nor a guess rule them out before any)."""
        n, self.step_checks = self.step_checks, 0
        self.without = 0 if n else self.without + 1
        self.now = {m for m in range(len(self.missing)) if self.at(m)}
        if not self.now and self.without >= PROBE_STEPS and any(self.missing):
            self.now, self.without = {max(range(len(self.missing)), key=self.missing.__getitem__)}, 0
        return n

    def checked(self, layers: list, first: int | None) -> None:
        """A check read layer calls `layers`: those before index `first` hit, that one missed
        (the rest, computed after a missing expert, tell nothing)."""
        missing = self.missing
        for m in layers if first is None else layers[:first + 1]:
            missing[m] *= KEEP_MISSING
        if first is not None:
            missing[layers[first]] += 1 - KEEP_MISSING


def routing_probs(calls) -> list:
    """The router's distribution over the experts (flat, on the host) of each of a pass's
    layer calls [(indices, router logits or probs, tapped)], None where the model gives none;
    softmax in one go."""
    tapped = [c[1] for c in calls if c[2]]
    from_logits = iter(host_probs(tapped) if tapped else ())
    return [None if c[1] is None else (next(from_logits) if c[2] else np.array(c[1])).reshape(-1) for c in calls]


class SlotTables:
    """Where each expert of the cache is, for lookups on the device: a [layers, experts] table
    of slots (`host`), the placeholder where not resident, the same as an mx array per layer
    (`rows`) and as a list per layer (`lists`: a check's few lookups cost less in plain
    Python than in numpy); `version`: the cache's residency version they show (None: none built).
    The arrays come in two sets, each written in place through numpy views of its memory: a
    forward's lookups read the set it started with, its checks' reads written into it at once
    (a lookup built and not queued yet then finds the slot a miss was just read into), while the
    token before, which may still compute, reads the other. read(): a missed layer call's
    experts made resident, and the tables say so."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.placeholder = cache.capacity  # the spare slot (SlotPools' last): never an expert's
        self.host = None
        self.rows = None  # None: to be built before the next verified forward
        self.views = None  # per layer a writable numpy view of rows[layer]
        self.lists = None
        self.key_of = {}  # slot -> the key the table shows in it
        self.version = None
        self.sets = []  # two (rows, views, the table they show)
        self.turn = 0  # the set in use
        self.flags = None  # whether checks read each lookup's flag (FLAG_READS), measured at the first build
        self.pending = []  # the reads read() asked for, each its finish(): settle() before anything computes

    def current(self) -> bool:
        return self.rows is not None and self.version == self.cache.version

    def settle(self) -> None:
        """Wait for the reads read() asked for (all of them, then the first error): before
        anything computes with their slots."""
        pending, self.pending = self.pending, []
        finish_all(pending)

    def build(self, in_place: bool = False) -> None:
        """From the cache's residency, into the set in use `in_place` (after a wait within this
        forward: nothing queued reads it but work a replay drops), else where it changed into
        the other set (the token before may still compute with the one in use)."""
        cache = self.cache
        if self.flags is None:
            self.flags = first_read_seconds() > FLAG_READS
        table = np.full((cache.store.num_layers, cache.store.num_experts), self.placeholder, dtype=np.uint32)
        with cache.lock:
            self.key_of = {}
            for key, slot in cache.slot_of.items():
                table[key] = slot
                self.key_of[slot] = key
            self.version = cache.version
        self.host, self.lists = table, table.tolist()
        if not self.sets:
            self.sets = [_table_set(table.shape) for _ in range(2)]
        elif not in_place and not np.array_equal(self.sets[self.turn][2], table):
            self.turn ^= 1
        self.rows, self.views, shown = self.sets[self.turn]
        for i in np.flatnonzero((shown != table).any(axis=1)):
            self._write(i, table[i])
        shown[:] = table

    def update(self, given: list) -> None:
        """After the slots of `given` [(key, slot)] went to those keys (from the keys that
        held them, now placeholders) and nothing else changed (under the cache's lock); the
        set in use written in place (read() runs after a check's wait)."""
        table, key_of = self.host, self.key_of
        if given:
            changed = set()
            for key, slot in given:  # (distinct slots, each from its old key if any)
                old = key_of.get(slot)
                if old is not None:
                    table[old] = self.placeholder
                    changed.add(old[0])
                table[key] = slot
                key_of[slot] = key
                changed.add(key[0])
            shown = self.sets[self.turn][2]
            for layer in changed:
                self._write(layer, table[layer])
                shown[layer] = table[layer]
                self.lists[layer] = table[layer].tolist()
        self.version = self.cache.version

    def _write(self, layer: int, row: np.ndarray) -> None:
        """A layer's row of the set in use, in place: as the reads put their bytes (on CUDA with
        backend.DEVICE_COPY the runtime's copy: the row's page stays where the GPU reads it)."""
        land = self.cache.store.reader.land
        if land is None:
            self.views[layer][:] = row
        else:
            land(self.views[layer], row)

    def read(self, layer, experts, scores, probs, guesses, row, tokens: int) -> list:
        """Make a missed layer call's experts (`row`, flat) resident (the policy's victims, a
        demand read), then as many of the `guesses` as the policy gives slots to (read
        together: the replay would miss them one layer at a time), and the tables say so.
        Returns the keys read on a guess; the reads, asked of the disk at once, end in settle()
        (the caller builds meanwhile)."""
        cache = self.cache
        missed, taken = [], []
        try:
            with cache.lock:  # (the policy's choices: bookkeeping, as on the per-layer path)
                current = cache.version == self.version
                _, missed = cache.access(layer, experts, scores, probs)
                taken = cache.claim(guesses, protected={(layer, e) for e in experts}, evict=True)
                if current:
                    self.update([((layer, e), slot) for e, slot in missed] + taken)
            reads = read_later(cache, layer, missed, taken)
        except BaseException:  # (Ctrl-C included) a key given a slot but not read must not pass for resident
            cache.forget([(layer, e) for e in experts] + guesses)
            raise
        if self.version != cache.version:
            self.build(in_place=True)
        demand = cache.counters.demand_bytes

        def finish() -> None:
            n = reads()
            if _per_row(cache):
                count_rows(cache, cache.rows, as_rows(row, tokens), experts, [e for e, _ in missed],
                           cache.counters.demand_bytes - demand)
            if taken:
                cache.counters.loads_prefetched += len(taken)
                cache.counters.prefetch_bytes += n
        self.pending.append(finish)
        return [key for key, _ in taken]

    def first_miss(self, layers, rows):
        """The index of the first layer call whose experts (`rows`, lists) are not all resident, or None."""
        lists, placeholder = self.lists, self.placeholder
        if len(layers) > 4 and len({len(row) for row in rows}) == 1:  # (a forward's end: one numpy lookup)
            missing = np.flatnonzero((self.host[np.asarray(layers)[:, None], np.asarray(rows)] == placeholder).any(axis=1))
            return int(missing[0]) if len(missing) else None
        for i, (m, row) in enumerate(zip(layers, rows)):
            if placeholder in map(lists[m].__getitem__, row):
                return i
        return None

    def absent(self, layers, rows) -> list:
        """The keys of these layer calls' experts (`rows`, lists) that are not resident."""
        lists, placeholder = self.lists, self.placeholder
        return [(m, e) for m, row in zip(layers, rows) for e in sorted(set(row)) if lists[m][e] == placeholder]


def _table_set(shape: tuple) -> tuple:
    """A zeroed mx array per row of a [layers, experts] table, a writable numpy view of each,
    and the table they show (SlotTables.build writes the rows that differ)."""
    # (made on the CPU stream, as the slot pools are: on CUDA managed memory, host-writable in place)
    rows = [mx.zeros(shape[1:], dtype=mx.uint32, stream=mx.cpu) for _ in range(shape[0])]
    mx.eval(rows)
    views = [np.array(row, copy=False) for row in rows]
    if not all(v.flags.writeable for v in views):
        raise MlxmoeError("this MLX build does not expose writable array memory; cannot verify decode steps")
    return rows, views, np.zeros(shape, dtype=np.uint32)


class PassRouting:
    """The routing of a verified pass's layer calls (`calls`: MoE layer -> (indices, router
    logits or probs, tapped)), on the device until a check reads it; the routers'
    distributions once on the host (`dists`). At the pass's last MoE layer call the indices of
    the layer calls not checked yet and the routers not read yet (the hits of checks within
    the forward too) are stacked on the device and queued (`packed`): the check at the
    forward's end reads them in two host copies, not one or two a layer call (on CUDA each
    host read of a GPU array is a managed allocation and a synchronous copy). The pack's
    routers are copied to the host with its indices, their softmax done when a distribution is
    first asked for (`unread`): a clean step's by the host work it leaves for later
    (tell_hits; where nothing was packed, its routers copied there: copy_routers). Where a
    first host read costs (FLAG_READS, SlotTables.flags): a check within the
    forward reads each layer call's flag (`flags`: the largest slot its lookup found, 4 bytes),
    the hits' indices left for the pack; a miss found there, a Direct check and the forward's
    end read the layer calls not read yet in two host copies, joined on the device (`join`)."""

    def __init__(self) -> None:
        self.calls, self.dists, self.packed, self.unread = {}, {}, None, []
        self.flags, self.row_of = {}, {}  # MoE layer -> its flag; its experts on the host (flat)
        self.fresh = []  # flags not queued yet
        self.ready = None  # joined as packed, queued with a held layer's routing: what its check reads at a miss

    def clear(self, since: int = 0) -> None:
        """Forget the layer calls from MoE layer `since` on (a replay computes them again)."""
        if since:
            self._read_unread()  # (those before `since`: hits)
        self.unread = []
        for m in [m for m in self.calls if m >= since]:
            del self.calls[m]
            self.dists.pop(m, None)
            self.flags.pop(m, None)
            self.row_of.pop(m, None)
        self.packed, self.fresh, self.ready = None, [], None

    def pack(self, checked: int) -> None:
        """At the pass's last MoE layer call (layer calls before `checked` were checked; those
        of them checked by their flags alone not read yet)."""
        layers = [m for m in sorted(self.calls) if m >= checked or m in self.flags and m not in self.row_of]
        routed = [m for m in sorted(self.calls) if m not in self.dists]
        self.packed = self._joined(layers, routed)
        if self.packed is not None:
            mx.async_eval(self.packed[1], self.packed[3])

    def _joined(self, layers: list, routed: list):
        """(layers, their indices, routed, their routers), each joined on the device, or None
        where they cannot be or would spare no host copy: no router, routers unlike, one layer and
        one router."""
        calls = [self.calls[m] for m in routed]
        alike = {(c[0].shape, c[2], None if c[1] is None else (c[1].shape, c[1].dtype)) for c in calls}
        if not layers or not calls or len(layers) + len(calls) < 3 or len(alike) > 1 or calls[0][1] is None:
            return None
        # (alike: joined along their first axis as they are, not stacked: a node a call fewer)
        return (layers, mx.concatenate([self.calls[m][0] for m in layers]), routed,
                mx.concatenate([c[1] for c in calls]))

    def arrays(self, layer: int) -> list:
        """A layer call's routing arrays: its indices, and its router's where it has one."""
        indices, router, _ = self.calls[layer]
        return [indices] if router is None else [indices, router]

    def wait(self, layers: list, final: bool, hits: list | None = None, flagged: int | None = None) -> tuple:
        """A wait for these layer calls' routing: their flags where `flagged` (the placeholder;
        returned: the index of the first whose lookup found it, or None); else the pack where it holds
        them at the forward's end (`final`; returned second); else, given `hits` (a check with
        nothing queued after it, where a first host read costs), theirs and those of the hits
        not read yet joined (returned second); else their arrays (arrays the queued layers
        compute: a new op now would wait behind the whole queue)."""
        if flagged is not None:
            return self.first_flagged(layers, flagged), None
        packed, self.packed = self.packed, None
        if hits is not None:
            layers = [m for m in hits if m not in self.row_of] + layers
        if final and packed is not None and set(layers) <= set(packed[0]):
            mx.eval(packed[1], packed[3])
            return None, packed
        packed = self._joined(layers, [m for m in layers if m not in self.dists]) if hits is not None else None
        if packed is not None:
            mx.eval(packed[1], packed[3])
            return None, packed
        calls = [self.calls[m] for m in layers]
        mx.eval(*[c[0] for c in calls], *[c[1] for c in calls if c[1] is not None])
        return None, None

    def rows(self, layers: list, packed) -> list:
        """The experts of each of these layer calls (flat lists), from the pack where given
        (its routers' distributions kept then)."""
        if packed is None:
            self.row_of.update((m, _flat(self.calls[m][0].tolist())) for m in layers if m not in self.row_of)
        else:
            packed_layers, indices, routed, routers = packed
            self.unread.append((routed, host_floats(routers)))  # (a host copy now: read later with no device array)
            self.row_of.update(zip(packed_layers, np.array(indices).reshape(len(packed_layers), -1).tolist()))
        return [self.row_of[m] for m in layers]

    def flag(self, layer: int, lookup) -> None:
        """A layer call's flag: the largest slot of its `lookup`, queued with its decoder layer (queued())."""
        self.flags[layer] = lookup.max()
        self.fresh.append(self.flags[layer])

    def queued(self) -> list:
        """The flags to queue with the decoder layer just built (a flag not queued would, when read,
        compute behind the whole queue: a wait with nothing queued after it)."""
        fresh, self.fresh = self.fresh, []
        return fresh

    def queue_held(self, layer: int, checked: int, hits: list | None) -> None:
        """Queue a held Direct layer's routing and the flags built; given `hits` (where checks read
        flags), with them (`ready`) the routing its check reads at a miss (the layer calls from
        `checked` to it, the hits not read yet), joined: no second wait then."""
        arrays = self.arrays(layer) + self.queued()
        if hits is not None:
            window = [m for m in hits if m not in self.row_of] + [m for m in sorted(self.calls) if checked <= m <= layer]
            self.ready = self._joined(window, [m for m in window if m not in self.dists])
            arrays += [] if self.ready is None else [self.ready[1], self.ready[3]]
        mx.async_eval(*arrays)

    def first_flagged(self, layers: list, placeholder: int) -> int | None:
        """The index of the first of these layer calls whose lookup found the placeholder, by their flags."""
        flags = [self.flags[m] for m in layers]
        mx.eval(*flags)
        return next((i for i, f in enumerate(flags) if f.item() == placeholder), None)

    def rows_of(self, layers: list, join: bool) -> list:
        """rows(), those not on the host yet in one host copy (and their routers not read yet in
        another) where `join` (checks read flags), else each its own."""
        unread = [m for m in layers if m not in self.row_of]
        if not unread:
            return [self.row_of[m] for m in layers]
        joined, self.ready = self.ready, None
        if joined is None or not set(unread) <= set(joined[0]):
            joined = self._joined(unread, [m for m in unread if m not in self.dists]) if join else None
        if joined is not None:
            mx.eval(joined[1], joined[3])
        return self.rows(layers, joined)

    def _read_unread(self) -> None:
        unread, self.unread = self.unread, []
        for routed, routers in unread:
            flat = host_dists(routers, self.calls[routed[0]][2])
            for m, dist in zip(routed, flat.reshape(len(routed), -1)):
                if m in self.calls:
                    self.dists[m] = dist

    def copy_routers(self, layers: list) -> None:
        """The distributions of these layer calls not known yet, left for whoever first asks
        for them (`unread`) with no device array to read then: their tapped routers' logits
        copied to the host now in one array, their softmax left (the others' probabilities now)."""
        self.dists_of([m for m in layers if m not in self.dists and not self.calls[m][2]])
        routed = [m for m in layers if m not in self.dists]
        rows = [host_floats(self.calls[m][1]) for m in routed]
        if len({r.shape for r in rows}) == 1:
            self.unread.append((routed, np.concatenate(rows)))
        else:
            self.dists_of(routed)

    def dists_of(self, layers: list) -> list:
        """The router's distribution (flat, on the host) of each of these layer calls, None
        where the model gives none: those not known yet read in one softmax (the pack's, or theirs)."""
        if self.unread and any(m not in self.dists for m in layers):
            self._read_unread()
        unknown = [m for m in layers if m not in self.dists]
        for m, dist in zip(unknown, routing_probs([self.calls[m] for m in unknown]) if unknown else ()):
            self.dists[m] = dist
        return [self.dists[m] for m in layers]


class KeptAttention:
    """Each decoder layer's attention outputs in a token's last pass through it (`outputs`),
    so that a replay from a layer whose attention came once and before its experts
    (`before_experts`) takes them as they were (`kept`): its input and KV cache are as before."""

    def __init__(self) -> None:
        self.outputs, self.before_experts, self.kept = {}, set(), None

    def call(self, forward: bool, d: int, call, attention, args, kwargs):
        if not forward:
            return call(attention, *args, **kwargs)
        if d == self.kept:
            return self.outputs[d][0]
        out = call(attention, *args, **kwargs)
        self.outputs.setdefault(d, []).append(out)
        return out

    def entering(self, d: int) -> None:
        """Decoder layer `d` computes (again)."""
        self.before_experts.discard(d)
        if d != self.kept:
            self.outputs.pop(d, None)

    def experts_of(self, d: int) -> None:
        """Decoder layer `d`'s first experts are called."""
        if len(self.outputs.get(d, ())) == 1:
            self.before_experts.add(d)

    def keep(self, d: int) -> bool:
        """A replay from decoder layer `d`: whether it takes that layer's attention as it was."""
        self.kept = d if d in self.before_experts else None
        return self.kept is not None


class Verifier:
    """Verified decode steps on `model` (mlx-lm's, its MoE layer l in decoder layer
    `decoder_of[l]` of `model.layers`) over `cache`. The model's and its decoder layers'
    instances get subclasses whose calls go through _model_call() and _decoder_call()."""

    def __init__(self, model, decoder_of: list, cache, guess: bool = True, top_k: int = 1) -> None:
        self.cache, self.decoder_of, self.top_k = cache, decoder_of, max(1, top_k)
        self.drafting = False  # in a speculative generation: its steps of several tokens verified too (where they fit)
        self.guess = guess  # read the later layers' misses with a missed layer's (a prefetch: not with prefetch off)
        self.layers = model.layers
        self.tables = SlotTables(cache)
        self.forward, self.replay_from = False, None  # within a verified forward; the decoder layer a replay runs from
        self.outputs = {}  # decoder layer -> its output in this token
        self.attention = KeptAttention()
        self.routing = PassRouting()  # of this token's layer calls
        self.hits = []  # checked layer calls that hit, not told yet (their MoE layers)
        self.observed = []  # this step's layer calls told, (call, row, distribution): observed at its end
        self.guessed = set()  # keys read on a guess (later layers' misses with a missed one) and not used yet
        self.checked = 0  # MoE layers of this token accounted for (hits told, misses read)
        self.held = []  # Direct layers whose experts are built and not queued until their routing is read
        self.unqueued = None  # what a decoder layer left to queue until a held layer's reads end (settle)
        self.tokens, self.width = 1, 1  # this step's (a draft's several, a batch's rows), each row's (KV caches trim them)
        # a sequence's steps, a batch's decode steps (each with its Direct layers: a replay first guessed
        # at MIN_LAG + 1 of the per-layer path's layer calls), the step's
        replay = lambda: cache.layer_seconds and (MIN_LAG + 1) * cache.layer_seconds
        settled = lambda: cache.prefetcher is None or cache.prefetcher.worth.settled()
        self.switch, self.batch_switch = (Switch(len(decoder_of), lambda: cache.layer_wait, replay, settled)
                                          for _ in range(2))
        self.current, self.lag = self.switch, Lag(self.switch.wait)
        self.declined, self.error = False, None  # (declined: the step under way is on the per-layer path, its switch off)
        _wrap(model, self, "_model_call")
        for d, layer in enumerate(self.layers):
            _wrap(layer, self, "_decoder_call", d)
            attention = next((getattr(layer, n) for n in ATTENTION_NAMES if isinstance(getattr(layer, n, None), nn.Module)), None)
            if attention is not None:
                _wrap(attention, self, "_attention_call", d)

    stats = lambda self: verifier_stats(self)  # noqa: E731 (stats()["verify"])

    # -- the model's call ---------------------------------------------------------------

    def _ready(self, args, kwargs):
        """The prompt cache of a call that can be verified, else None."""
        cache = self.cache
        self.declined = False
        inputs = args[0] if args else kwargs.get("inputs")
        kv = kwargs.get("cache", args[1] if len(args) > 1 else None)
        if self.error is not None or self.forward or not isinstance(inputs, mx.array) or inputs.ndim != 2 \
                or kv is None or len(kv) != len(self.layers):
            return None
        rows, width = inputs.shape
        batch = rows > 1 and width == 1 and all(type(c) is BatchKVCache for c in kv)  # a batch's decode step
        most = min(STEP_TOKENS, cache.capacity // self.top_k) if self.drafting or batch else 1
        if not (rows == 1 or batch) or not 0 < inputs.size <= most:
            return None
        self.current = self.batch_switch if batch else self.switch
        if not self.current.step():
            self.declined = True
            return None
        if resident_table(cache) is not None:  # the resident path: no check at all
            return None
        if cache.loader.failed or not cache.loader.prewarm_done(0) or cache.fallback is not None:
            return None
        # (a rotating cache that wrapped overwrites its oldest entry in place: trimmed, a
        # one-token pass's replay writes the same slot again, a longer pass's could not)
        if any(type(c) not in KV_TYPES or inputs.size > 1 and not c.is_trimmable() for c in kv):
            return None
        return kv

    def _model_call(self, call, model, args, kwargs):
        call, kv = partial(call, model), self._ready(args, kwargs)
        cache = self.cache
        if kv is None:
            self.tables.rows = None  # the per-layer path may change what is resident
            return self.current.timed(cache, call, args, kwargs) if self.declined else call(*args, **kwargs)
        if self.tables.rows is None and cache.prefetcher is not None:
            cache.prefetcher.drain()  # what the per-layer path asked for: read before going quiet
        if cache.in_flight:  # (a read under way all the same: this step waits per layer)
            self.tables.rows = None
            return call(*args, **kwargs)
        if not self.tables.current():
            self.tables.build()
        inputs = args[0] if args else kwargs["inputs"]
        self.tokens, self.width = inputs.size, inputs.shape[1]
        cache.tick(self.tokens, later=True)
        self.forward, self.replay_from, self.checked = True, None, 0
        self._clear()
        replayed, replays = 0, 0
        tic, read, misses = time.perf_counter(), cache.counters.read_seconds, cache.counters.misses
        batched = [c for c in kv if isinstance(c, BatchKVCache)]
        for c in batched:
            c.make_mask = _first_mask(c.make_mask)
        try:
            while True:
                try:
                    out = call(*args, **kwargs)
                    missed, ran = self._check(held=self.held.pop() if self.held else None), len(self.layers)
                except Replay as r:
                    missed, ran = r.missed, r.ran
                self.held = []
                if missed is None:
                    break
                first = self.decoder_of[missed]
                for c in kv[first + self.attention.keep(first):ran]:  # what this pass wrote from that layer on
                    c.trim(self.width)
                replayed += ran - first
                replays += 1
                self.replay_from = first
                self.routing.clear(since=missed)
        finally:
            for c in batched:
                del c.make_mask
            self.forward, self.held, self.hits, self.observed, self.unqueued = False, [], [], [], None
            self._clear()
            self.tables.settle()  # (before anything computes: mlx-lm's eval of `out`)
        counters = cache.counters
        counters.verified_tokens += self.tokens
        counters.replays += replays
        counters.replayed_layers += replayed
        seconds = time.perf_counter() - tic - (counters.read_seconds - read)
        if self.current.verified(seconds, replays, replayed, len(self.layers), counters.misses > misses):
            self.tables.rows = None
        # this step's accounting on the host thread from now on, while mlx-lm samples and the next
        # step is built (that step's tick waits for the cache's lock while it is under way)
        if cache.prefetcher is not None:
            cache.prefetcher.hand_off()
        return out

    # -- inside the forward -------------------------------------------------------------

    def _decoder_call(self, d, call, layer, args, kwargs):
        if not self.forward:
            return call(layer, *args, **kwargs)
        if self.replay_from is not None and d < self.replay_from:
            return self.outputs[d]  # as computed before the miss (its cache untouched)
        self.attention.entering(d)
        out = call(layer, *args, **kwargs)
        self.attention.kept = None
        self.outputs[d] = out
        ran = d + 1
        reads_held = self.held and self.decoder_of[self.held[0]] < d
        if reads_held:  # a held layer's routing, computed while this decoder layer was built
            held = self.held.pop(0)
            if (missed := self._check(until=self.decoder_of[held] + 1, direct=True, held=held)) is not None:
                raise Replay(missed, ran)
        queue_built(self, ran, out, reads_held)
        # (at 0: by the next layer's experts where this one's attention came once, before its own; else at 1)
        lag = self.lag.layers or int(d not in self.attention.before_experts)
        if self.current.windowed and 0 < lag < ran < len(self.layers):
            if (missed := self._check(until=ran - lag)) is not None:
                raise Replay(missed, ran)
        return out

    def _attention_call(self, d, call, attention, args, kwargs):
        return self.attention.call(self.forward, d, call, attention, args, kwargs)

    def experts(self, streaming, x, indices):
        """A MoE layer's experts within a verified forward: slots looked up on the device,
        routing kept for the check (at once where the layer is Direct's)."""
        layer, d = streaming._layer, self.decoder_of[streaming._layer]
        if layer == 0 or self.decoder_of[layer - 1] != d:  # (its decoder layer's first)
            self.attention.experts_of(d)
            if self.unqueued is not None:  # (a held layer's reads: they ran while this decoder layer's attention was built)
                settle(self)
            if self.current.windowed and self.lag.layers == 0 and self.checked < layer and not self.held \
                    and d in self.attention.before_experts:  # (its attention ran once, before: a replay trims its KV)
                mx.async_eval(indices)  # (its attention and router: the device computes them while the host waits)
                missed = self._check(until=d)  # (the decoder layers before: queued)
                if missed is not None:
                    raise Replay(missed, d + 1)
        logits = streaming._logits()
        probs = streaming._probs(x) if logits is None else None
        self.routing.calls[layer] = (indices, logits if logits is not None else probs, logits is not None)
        slots = self.tables.rows[layer][indices]
        direct = layer in self.current.direct.now and layer >= self.checked
        if self.tables.flags and (self.current.windowed or self.current.direct.now):  # (checks to come in this forward)
            # (a Direct layer's misses are read before its lookup computes: its flag looks up apart)
            self.routing.flag(layer, self.tables.rows[layer][indices] if direct else slots)
        if direct:  # (no replay from it)
            if holds(self.decoder_of, layer, self.cache.prefetcher):  # read once the next decoder layer is built
                self.held.append(layer)
            else:  # read now
                missed = self._check(until=d + 1, direct=True, held=layer)
                if missed is not None:  # (an earlier one, queued: a replay from it)
                    raise Replay(missed, d + 1)
                self.held = [m for m in self.held if m >= self.checked]  # (an earlier held one: checked too)
        if layer == len(self.decoder_of) - 1 and not (self.held and self.held[0] < layer):
            settle(self)
            self.routing.pack(self.checked)  # (not past a held layer: its routing would compute from its experts)
        return streaming._inner(x, slots)

    def _clear(self) -> None:
        self.outputs.clear()
        self.attention = KeptAttention()
        self.routing.clear()

    # -- the check ----------------------------------------------------------------------

    def _check(self, until: int | None = None, direct: bool = False, held: int | None = None):
        """A wait for the routing of this pass's layer calls not checked yet (in decoder layers
        before `until`, or all; `direct`: up to a Direct layer's), on the host. The layers before
        the first that missed are hits, told to the policy before a read or at the forward's end
        (the observers: at the step's end); that layer's experts are read. Returns that layer
        (a replay from it), or None: where none missed, or where it is `held`, whose experts are
        not queued yet (read into the slots its lookup will find: no replay)."""
        cache, routing = self.cache, self.routing
        settle(self)
        # (a replay's: from the layer it reran; decoder_of ascends)
        end = len(self.decoder_of) if until is None else bisect.bisect_left(self.decoder_of, until)
        layers = [m for m in range(self.checked, end) if m in routing.calls]
        packed, tic, first = None, time.perf_counter(), None
        flagged = until is not None and self.tables.flags and all(m in routing.flags for m in layers)
        if layers:
            if until is None:  # (the step's host work left for later, while the device computes)
                cache.counters.bookkeeping_seconds += host_work_meanwhile(cache)
                tic = time.perf_counter()
            together = self.tables.flags and (direct or until is None)  # (nothing queued after: one wait)
            first, packed = routing.wait(layers, until is None, self.hits if together else None,
                                         self.tables.placeholder if flagged else None)
            if until is not None and not direct:
                self.lag.checked(time.perf_counter() - tic)
        start, read = time.perf_counter(), cache.counters.read_seconds
        if not flagged:
            rows = routing.rows(layers, packed)
            first = self.tables.first_miss(layers, rows) if layers else None
        elif first is not None:  # (the hits' rows with the window's, in one host copy)
            rows = routing.rows_of(self.hits + layers, join=True)[len(self.hits):]
        self.current.direct.checked(layers, first)
        self.hits.extend(layers[:first])
        missed = None
        if first is not None:  # (the missed layer's distribution in the same softmax as the hits')
            dist = routing.dists_of(self.hits + layers[first:first + 1])[-1]
            tell_hits(self)
            call = step_call(layers[first], rows[first], dist, self.tokens)
            missed = call[0]
            # the later layers' misses in this pass: computed from a hidden state that a missing expert
            # left wrong, yet mostly what the replay will route to
            guesses = self.tables.absent(layers[first + 1:], rows[first + 1:]) if self.guess else []
            self.guessed.update(self.tables.read(*call, guesses, rows[first], self.tokens))
            self.observed.append((call, rows[first], dist))
        repaired = missed is not None and missed == held
        if until is None and (missed is None or repaired):  # the step's end: its layer calls observed in one go
            tell_hits(self, last=True)
        if layers:
            self.checked = layers[-1] + 1 if missed is None else missed + 1
        spent = time.perf_counter() - start - (cache.counters.read_seconds - read)
        cache.counters.bookkeeping_seconds += spent
        if direct:  # (its wait and bookkeeping: what it costs instead of a replay)
            self.current.direct.waited(start - tic + spent)
        return None if repaired else missed


def verifier_stats(v: Verifier) -> dict:
    """`stats()["verify"]` of a Verifier `v`: whether the mode is on and why not, its switches' state."""
    switch, batch = v.switch, v.batch_switch
    return {"on": v.error is None and switch.on(), "reason": v.error or switch.reason,
            "wait_us": round(switch.per_layer_wait() * 1e6, 1), "direct": sorted(switch.direct.now),
            "flags": bool(v.tables.flags), "lag": v.lag.layers,
            "batch": {"on": v.error is None and batch.on(), "reason": v.error or batch.reason}}


def queue_built(v: Verifier, ran: int, out, reads_held: bool) -> None:
    """Queue what a verified forward's decoder layers built up to `ran` (its output `out`)
    leave queued, after the reads its checks asked for; where a held layer's check (`reads_held`)
    just asked for some, once the next decoder layer's attention is built (settle()), so that
    they are read while the host builds it."""
    held = v.held[-1] if v.held else None  # (this decoder layer's: its routing queued, its experts not yet)
    if reads_held and v.tables.pending:
        v.unqueued = lambda: _queue(v, ran, out, True, held)
    else:
        settle(v)
        _queue(v, ran, out, reads_held, held)


def _queue(v: Verifier, ran: int, out, reads_held: bool, held: int | None) -> None:
    if held is not None:
        v.routing.queue_held(held, v.checked, v.hits if v.tables.flags else None)
    elif reads_held or v.current.windowed or ran % QUEUE_EVERY == 0:  # (checks a layer behind: each queued)
        mx.async_eval(out, *v.routing.queued())  # the device starts on these layers while the host builds the next


def settle(v: Verifier) -> None:
    """The reads a check of `v` asked for ended, then what waited for them queued (`unqueued`):
    before anything computes."""
    if v.tables.pending:
        v.tables.settle()
    if v.unqueued is not None:
        queue, v.unqueued = v.unqueued, None
        queue()


def holds(decoder_of: list, layer: int, prefetcher) -> bool:
    """Whether a Direct MoE `layer`'s routing is read after its experts are built from the table
    and before they are queued: where it is the last MoE layer of its decoder layer (none after
    it there computes from its output) and predicting is paused or off (where it pays, a held
    step's reads are demand reads it could have hidden: the per-layer path's steps are the
    faster, a read a guess would spare outweighs the waits)."""
    last = layer + 1 == len(decoder_of) or decoder_of[layer + 1] != decoder_of[layer]
    return last and (prefetcher is None or prefetcher.worth.paused)


def tell_hits(v, last: bool = False) -> None:
    """A Verifier `v`'s layer calls checked since the last time whose experts were all
    resident, in order, in one go: counted, their policy updates left for later
    (Residency.deferred), kept for the observers, told the step's calls at its end (`last`).
    There, where no observer but the live profile needs them (it takes no position) and one
    sequence steps, all of it is left for later as one entry of `deferred`, the routing with
    it: its softmax and the policy's and the profile's updates run off the decode thread where
    a prefetcher's host thread gets to them first."""
    layers, v.hits, cache = v.hits, [], v.cache
    rows = v.routing.rows_of(layers, join=bool(v.tables.flags))
    _count_useful(cache, v.guessed, layers, rows)
    if not last:
        v.observed += _tell(cache, v.routing, layers, rows, v.tokens)
    elif cache.rows is None and not cache.observers and cache.defer_hits:
        if not v.routing.unread:  # (no pack: the routers' own arrays copied now, on this thread)
            v.routing.copy_routers(layers)
        # (the hits counted here: the counters are the decode thread's, unlocked)
        cache.counters.hits += sum(len(set(row)) for row in rows)
        cache.deferred.append((_tell, (cache, v.routing, layers, rows, v.tokens, v.observed, True)))
        v.routing, v.observed = PassRouting(), []
    else:
        _tell(cache, v.routing, layers, rows, v.tokens, v.observed)
        v.observed = []


def _count_useful(cache, guessed: set, layers: list, rows: list) -> None:
    """Count the keys read on a guess that these layer calls (their experts in `rows`) use, no longer guesses."""
    if guessed:
        used = guessed.intersection((m, e) for m, row in zip(layers, rows) for e in row)
        cache.counters.prefetch_useful += len(used)
        guessed -= used


def _tell(cache, routing, layers: list, rows: list, tokens: int, observed: list | None = None,
          deferred: bool = False) -> list:
    """Layer calls that hit (their experts in `rows`, their routers in `routing`, a
    PassRouting) counted and their policy updates made, [(call, row, distribution)]
    returned; `observed`: the step's calls told before, at its end, the observers told them
    all. The policy's updates are left for later (hit_calls) but where this is `deferred`
    work itself (its turn in the cache's `deferred`: now, in order; its hits counted when
    it was deferred)."""
    told = []
    if layers:
        probs = routing.dists_of(layers)
        calls = step_calls(layers, rows, probs, tokens)
        if deferred:
            cache.policy.hits(calls)
        else:
            _count_hits(cache, calls, rows, tokens)
            cache.hit_calls(calls)
        told = list(zip(calls, rows, probs))
    if observed is not None:
        _observe(cache, observed + told, tokens)
    return told


def _count_hits(cache, calls: list, rows: list, tokens: int) -> None:
    """Layer calls that hit counted: each call's distinct experts; a batch's per row (at once
    where no row is padding), the cache's hits then each row's distinct experts."""
    union = sum(len(c[1]) for c in calls)
    cache.counters.hits += union
    batch = cache.rows
    if not _per_row(cache):
        return
    if batch.real is None:
        count_hit_rows(cache, batch, np.asarray(rows).reshape(len(rows), batch.size, -1), union)
        return
    for call, row in zip(calls, rows):
        count_rows(cache, batch, as_rows(row, tokens), call[1])


def _observe(cache, observed: list, tokens: int) -> None:
    """The observers told a verified step's layer calls [(call, row, distribution)] at once; a
    batch's decode step (one token a row, no observer but its rows' requests) learnt by each
    row's request in one go (CallRows.learn_step)."""
    if observed:
        calls, rows, dists = map(list, zip(*observed))
        batch, layers = cache.rows, [c[0] for c in calls]
        if _per_row(cache) and batch.real is None and not cache.observers and len(set(layers)) == len(layers) \
                and all(d is not None for d in dists):
            batch.learn_step(layers, np.asarray(rows).reshape(len(rows), batch.size, -1),
                             np.stack(dists).reshape(len(rows), batch.size, -1))
        else:
            observe_calls(cache, calls, rows, tokens, dists)


def _per_row(cache) -> bool:
    """Whether a verified step's layer calls count per row: a batch's of several rows (a batch
    of one gets the counters' change after its call: batching.Batches.record)."""
    return cache.rows is not None and cache.rows.size > 1


def _flat(nested: list) -> list:
    """The items of a nested list (an array's tolist()), in order (a level of one list, as a decode
    step's [1, 1, k] has two, taken as it is)."""
    while nested and isinstance(nested[0], list):
        nested = nested[0] if len(nested) == 1 else [item for inner in nested for item in inner]
    return nested


def _first_mask(make_mask):
    """A BatchKVCache's make_mask that gives a replay the mask the forward's first pass got:
    a replay finds the caches of the layers before the missed one holding the token already
    (a KVCache needs no mask for one token)."""
    made = {}

    def first(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in made:
            made[key] = make_mask(*args, **kwargs)
        return made[key]
    return first


def _wrap(module, owner, method: str, *first):
    """Give the module instance a subclass whose call goes through `owner`'s `method`(*first,
    call, module, args, kwargs), where `call(module, *args, **kwargs)` is its class's own (the
    method and the call looked up at each call; no function made per call)."""
    cls = type(module)

    def __call__(self, *args, **kwargs):
        return getattr(owner, method)(*first, cls.__call__, self, args, kwargs)

    module.__class__ = type(f"Verified{cls.__name__}", (cls,), {"__call__": __call__})
