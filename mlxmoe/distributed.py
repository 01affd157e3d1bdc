"""Several ranks started by `mlx.launch`: mlx-lm's pipeline split, one expert stream per stage.

Every rank runs the same program. mlx-lm's `model.model.pipeline(group)` gives each rank
a contiguous run of layers (the last rank the first layers); a rank builds only those
layers' weights and StreamingExperts, and streams only their experts under its own
budget. Ranks exchange small JSON messages (errors, stats, profiles, traces) with
`all_gather`: each exchange is a collective that every rank makes at the same point.
A rank that fails reports its error through the next exchange, so that rank 0 names it.
MLX's collectives take no timeout: a peer that never comes, or stops without dying
(SIGSTOP, a hung host), would leave the others waiting forever. Two watchdogs bound the
waits: `bounded` (a process: joining the ranks holds the GIL) for the start-up, and
`waiting` (a thread: a collective waiting in MLX releases the GIL) for every generation
step and stop vote, where a process per wait would cost too much.
"""

import json
import math
import os
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from .errors import MlxmoeError
from .storage.files import write_atomic
from .workload.profile import ActivationProfile

# Seconds a rank waits for its peers: to join (start-up), to finish loading, to answer in a
# generation step or a vote; 0: forever.
TIMEOUT_ENV = "MLXMOE_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 300.0


def timeout():
    try:
        return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    except ValueError:
        raise MlxmoeError(f"{TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r} is not a number of seconds") from None


def launched():
    """Whether a launcher (mlx.launch, mpirun) started this process as one of several ranks."""
    return "MLX_RANK" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ


def bounded(what, fn, seconds=None):
    """fn(), or if it has not returned after `seconds` (a peer that never came, or died
    without a word): the error on standard error and the process ends. The watchdog is a
    separate process: joining the ranks (mx.distributed.init) holds the GIL, so no Python
    thread or signal handler of this process would run."""
    seconds = timeout() if seconds is None else seconds
    if not seconds:
        return fn()
    message = (f"error: {what} did not finish within {seconds:g} s (a rank did not start or stopped; "
               f"{TIMEOUT_ENV} sets this limit)")
    watchdog = subprocess.Popen(["sh", "-c", f'sleep {seconds} && echo "$0" >&2 && kill -TERM {os.getpid()}',
                                 message], stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        return fn()
    finally:
        os.killpg(watchdog.pid, signal.SIGKILL)  # its sleep too
        watchdog.wait()


_waits = {}  # thread id -> (deadline, group, what, seconds) of the waits on other ranks in progress
_watcher = []  # the thread that watches them, once started
_heard = {}  # rank -> when (time.monotonic()) its last heartbeat came
HEARTBEAT = 1.0  # seconds between a rank's heartbeats


@contextmanager
def waiting(group, what, seconds=None):
    """Bound a wait on the other ranks (a collective, a pipeline step): if it has not ended
    after `seconds` (timeout()), the process says which ranks did not answer and exits 2
    at once (a thread cannot unwind a wait inside MLX; the launcher then stops the others).
    The other ranks give rank 0 a few seconds more, so that it speaks for all where it can.
    No cost without a group; nested waits keep the inner bound."""
    seconds = timeout() if seconds is None else seconds
    if group is None or not seconds:
        yield
        return
    if group.rank() != 0:
        seconds += min(seconds, 5.0)
    me = threading.get_ident()
    outer = _waits.get(me)
    _waits[me] = (time.monotonic() + seconds, group, what, seconds)
    if not _watcher:
        _watcher.append(threading.Thread(target=_watch, name="mlxmoe-rank-watchdog", daemon=True))
        _watcher[0].start()
        _start_heartbeat(group)
    try:
        yield
    finally:
        if outer is None:
            del _waits[me]
        else:
            _waits[me] = outer


def _watch():
    while True:
        time.sleep(0.2)
        now = time.monotonic()
        for deadline, group, what, seconds in list(_waits.values()):
            if now > deadline:
                peers = " or ".join(f"rank {r}" for r in silent(group, min(3 * HEARTBEAT, seconds / 2)))
                message = (f"rank {group.rank()}: no answer from {peers} within {seconds:g} s while {what} "
                           f"(a rank stopped or hung without exiting; {TIMEOUT_ENV} sets this limit)")
                os.write(2, (f"error: {message}\n" if group.rank() == 0  # as the CLI prints errors
                             else f"[rank {group.rank()}] error: {message}\n").encode())
                os._exit(2)


def silent(group, quiet):
    """The other ranks whose heartbeat has not come for `quiet` seconds (stopped, hung or cut
    off; the others wait with this one), or all of them when none can be told apart."""
    others = [r for r in range(group.size()) if r != group.rank()]
    now = time.monotonic()
    stopped = [r for r in others if now - _heard.get(r, -math.inf) > quiet]
    return stopped if 0 < len(stopped) < len(others) else others


def _start_heartbeat(group):
    """Each rank's sign of life to the others: a UDP datagram every HEARTBEAT seconds to
    each, on the port of its ring address (where the ring backend listens on TCP). Without
    a ring hostfile (other backends) or where the port is taken, none: `silent` then names
    every other rank."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            addresses = [(ip, int(port)) for ip, port in (h[0].rsplit(":", 1) for h in json.load(f))]
        if len(addresses) != group.size():
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(addresses[group.rank()])
    except (KeyError, OSError, ValueError, TypeError, IndexError, AttributeError):
        return
    sock.settimeout(HEARTBEAT)
    me = group.rank()

    def beat():
        sent = -math.inf
        while True:
            if time.monotonic() - sent >= HEARTBEAT:
                sent = time.monotonic()
                for r, address in enumerate(addresses):
                    if r != me:
                        try:
                            sock.sendto(str(me).encode(), address)
                        except OSError:  # no route yet: the next beat tries again
                            pass
            try:
                data, _ = sock.recvfrom(16)
                _heard[int(data)] = time.monotonic()
            except socket.timeout:
                pass
            except (OSError, ValueError):
                time.sleep(0.1)

    threading.Thread(target=beat, name="mlxmoe-heartbeat", daemon=True).start()


def init(backend="any"):
    """The world group when launched as several ranks, else None. Start-up is bounded."""
    if not launched():
        return None
    group = bounded("joining the other ranks (mx.distributed.init)", lambda: mx.distributed.init(backend=backend))
    return group if group.size() > 1 else None


def free_port_base(count):
    """A port p with p .. p+count-1 free on 127.0.0.1: `mlx.launch -p p` for `count` local ranks
    (the ring backend listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65536:
            continue
        try:
            socks = []
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise MlxmoeError("no free ports on 127.0.0.1")


def _all_gather(group, array):
    return mx.distributed.all_gather(array, group=group, stream=mx.cpu)


def exchange(group, obj):
    """Every rank's `obj` (JSON-able), in rank order, on every rank."""
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    sizes = np.array(_all_gather(group, mx.array([data.size], dtype=mx.int32)))
    buf = np.zeros(int(sizes.max()), dtype=np.uint8)
    buf[:data.size] = data
    rows = np.array(_all_gather(group, mx.array(buf)[None]))
    return [json.loads(bytes(row[:n])) for row, n in zip(rows, sizes.tolist())]


def check(group, error=None, bound=True):
    """Every rank says whether it failed (`error`: an exception or message, None if not);
    if any did, every rank raises MlxmoeError naming the first failing rank and its error.
    Rank 0 raises first: the others wait a moment, so that a launcher that stops all ranks
    once one exits has rank 0's report."""
    if error is not None and not isinstance(error, (MlxmoeError, str)):  # a bug, not bad input: say what it was
        error = f"{type(error).__name__}: {error}"
    mine = None if error is None else {"host": socket.gethostname(), "error": str(error)}
    errors = bounded("waiting for the other ranks", lambda: exchange(group, mine)) if bound else exchange(group, mine)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    r, e = failed[0]
    if group.rank() != 0:
        time.sleep(1.0)
    raise MlxmoeError(f"rank {r} ({e['host']}) failed: {e['error']}")


def barrier(group):
    """Wait until every rank has finished what it queued (mlx-lm queues the step after the
    last token: a rank that exits before its peers ran it leaves them a lost connection)."""
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group, stream=mx.cpu))


def sum_ranks(group, values):
    """The element-wise sum over the ranks of each rank's list of integers (one collective)."""
    total = mx.distributed.all_sum(mx.array(values, dtype=mx.int64), group=group, stream=mx.cpu)
    return total.tolist()


def any_rank(group, flag):
    """Whether `flag` is true on any rank (one cheap collective)."""
    return sum_ranks(group, [int(bool(flag))])[0] > 0


def failed_any(group, error):
    """Whether any rank has an error to report (then call check)."""
    return any_rank(group, error is not None)


SUMMED = ("tokens", "hits", "misses", "bytes_read", "loads_demand", "loads_prefetched", "prefetch_useful",
          "prefetch_late", "prefetch_stale", "prefetch_cancelled", "cancelled_bytes", "disk_busy_seconds",
          "demand_delay_seconds",
          "read_seconds", "bookkeeping_seconds", "evictions", "skipped", "biased", "substituted", "cache_experts",
          "cache_bytes", "fallback_bytes", "peak_memory", "peak_rss")


def gather_stats(group, stats, pipeline=True):
    """{"ranks": [each rank's stats], "total": the sums} on every rank. Every rank sees
    every token, so `tokens` and `decode_tps` are the same on each: the total keeps rank 0's;
    hit_rate is recomputed from the summed hits and misses. Under the tensor split each
    rank caches a slice of the same experts: the expert counts are rank 0's."""
    ranks = exchange(group, stats)
    total = {k: sum(s[k] for s in ranks) for k in SUMMED}
    total["tokens"] = ranks[0]["tokens"]
    total["decode_tps"] = ranks[0]["decode_tps"]
    total["policy"] = ranks[0]["policy"]
    total["verify"] = ranks[0]["verify"]  # (why no step is verified: the same on every rank)
    if not pipeline:
        total["cache_experts"] = ranks[0]["cache_experts"]
    accesses = total["hits"] + total["misses"]
    total["hit_rate"] = total["hits"] / accesses if accesses else 0.0
    total["resident_per_layer"] = ([n for s in ranks[::-1] for n in s["resident_per_layer"]] if pipeline
                                   else ranks[0]["resident_per_layer"])
    total["ranks"] = len(ranks)
    return {"ranks": ranks, "total": total}


def merge_layers(ckpt, *stage_arrays):
    """Each [this stage's layers, experts] array as the whole model's, on every rank. Under
    the pipeline split one all_sum of every rank's arrays placed at its layers, zeros
    elsewhere (so the float64 sums are exact: every cell has one rank's value); under the
    tensor split every rank routes every layer: its arrays are already the whole model's."""
    if ckpt.split != "pipeline":
        return np.stack(stage_arrays)
    full = np.zeros((len(stage_arrays), ckpt.all_layers, ckpt.num_experts))
    full[:, ckpt.layer_offset:ckpt.layer_offset + ckpt.num_layers] = stage_arrays
    return np.array(mx.distributed.all_sum(mx.array(full, dtype=mx.float64), group=ckpt.group, stream=mx.cpu))


def whole_usage(ckpt, observed):
    """A profile of this rank's layers (a server request's routing) as the whole model's,
    the same on every rank (a collective)."""
    if ckpt.group is None:
        return observed
    counts, mass = merge_layers(ckpt, observed.counts, observed.mass)
    return ActivationProfile(ckpt.all_layers, observed.num_experts, observed.top_k, half_life=observed.half_life,
                             counts=counts, mass=mass, tokens=observed.tokens, tokens_total=observed.tokens_total)


def merge_traces(group, offset, text):
    """The whole model's trace from each rank's (its layers numbered from 0): on rank 0 the
    merged text, on other ranks None. Lines are ordered as one process writes them: by
    sequence, layer call (its first token), then layer."""
    texts = exchange(group, {"offset": offset, "text": text})
    if group.rank() != 0:
        return None
    header, lines = None, []
    for part in texts:
        rows = part["text"].splitlines()
        head = json.loads(rows[0])
        if header is None:
            header = head
        else:
            header["num_layers"] += head["num_layers"]
        call, left = None, 0  # the current multi-token call's first token and lines still to come
        for n, row in enumerate(rows[1:]):
            line = json.loads(row)
            line["l"] += part["offset"]
            if left and line.get("n") and (line["s"], line["l"]) == call[:2]:
                left -= 1
            else:
                call, left = (line["s"], line["l"], line["t"]), line.get("n", 1) - 1
            lines.append(((line["s"], call[2], line["l"], n), line))
    lines.sort(key=lambda kv: kv[0])
    return "\n".join([json.dumps(header)] + [json.dumps(l, separators=(",", ":")) for _, l in lines]) + "\n"


def stage_profile(profile, offset, layers):
    """The part of a whole-model profile for the stage whose MoE layers start at `offset`."""
    part = slice(offset, offset + layers)
    return ActivationProfile(layers, profile.num_experts, profile.top_k, profile.half_life, profile.model,
                             profile.fingerprint, profile.workload, profile.counts[part], profile.mass[part],
                             profile.tokens, profile.tokens_total, profile.created, profile.curve,
                             profile.expert_bytes, profile.resident_bytes, profile.recommended_cache_bias)


def whole_profile(runtime):
    """The whole model's live profile from every rank's stage (a collective): the format of
    a one-process profile (resident_bytes: the stages' sum)."""
    p, ckpt = runtime.profile, runtime.checkpoint
    counts, mass = merge_layers(ckpt, p.counts, p.mass)
    resident = sum(r or 0 for r in exchange(ckpt.group, p.resident_bytes))
    return ActivationProfile(ckpt.all_layers, p.num_experts, p.top_k, p.half_life, p.model, p.fingerprint,
                             p.workload, counts, mass, p.tokens, p.tokens_total, p.created, p.curve,
                             p.expert_bytes, resident, p.recommended_cache_bias)


def finish_trace(runtime):
    """After the cache's close() on every rank: the stages' traces merged into the requested
    file (runtime.trace_target) on rank 0 (atomically); each rank's part removed."""
    target = runtime.trace_target
    if target is None:
        return
    part = runtime.trace.path
    text = part.read_text()
    part.unlink()
    merged = merge_traces(runtime.group, runtime.checkpoint.layer_offset, text)
    if merged is not None:
        write_atomic(target, merged)


def cluster_stats(model):
    """gather_stats of every rank's model.expert_cache.stats() (a collective)."""
    runtime = model.expert_runtime
    stats = runtime.cache.stats()
    if runtime.group is None:
        return {"ranks": [stats], "total": stats}
    return gather_stats(runtime.group, stats, runtime.checkpoint.split == "pipeline")


def merged_stats(model):
    """The cache's stats; under several ranks (a collective) summed over them, with "per_rank"."""
    stats = cluster_stats(model)
    return stats["total"] if len(stats["ranks"]) == 1 else {**stats["total"], "per_rank": stats["ranks"]}
