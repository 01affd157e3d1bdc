"""The memory governor: the expert cache grows and shrinks at run time (Runtime.resize), and
with `memory_budget="auto"` follows the memory this machine (and the process's cgroup)
has available, keeping a margin. Exact output does not depend on the cache's size, so a
resize changes speed, never tokens.

A resize is applied between decode steps on the thread that generates (stream_generate,
between two tokens), or at once where no generation holds the model: the policy's victims
leave until the rest fits, the rest are copied into new slot pools of the new size (the
old ones stay whole for the token in flight, and are freed after it), and everything that
knew the old slots is told (the verifier's tables, the resident path's table, the layers'
weights)."""

import math
import os
import re
import subprocess
import sys
import threading
import time

from dataclasses import replace

import mlx.core as mx

from .budget import format_size, machine_memory, parse_size
from .errors import MlxmoeError
from .loader import attach_cache

CHECK_SECONDS = 0.5  # how often `auto` reads the memory available: a shrink within a second
MOVE_SHARE = 0.03  # `auto` resizes where the expert cache it allows moved by more than this share
MARGIN_SHARE, MOST_MARGIN = 0.15, 2 << 30  # the default margin: 15 % of memory, 2 GB at most
NO_LIMIT = 1 << 60  # a cgroup v1 limit at or above this is none


def default_margin(total: int) -> int:
    return min(int(total * MARGIN_SHARE), MOST_MARGIN)


def _numbers(path) -> dict:
    """`name value` lines (meminfo, memory.stat) as {name: int}; a meminfo value in kB as bytes."""
    out = {}
    with open(path) as f:
        for line in f:
            m = re.match(r"\s*([\w()]+):?\s+(\d+)\s*(kB)?", line)
            if m:
                out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def _read(path) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_folder() -> str | None:
    """The memory cgroup folder of this process (MLXMOE_CGROUP where set): v2's
    (memory.max) or v1's (memory.limit_in_bytes); None where there is none."""
    if os.environ.get("MLXMOE_CGROUP"):
        return os.environ["MLXMOE_CGROUP"]
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        _, controllers, path = line.split(":", 2)
        for root, probe in (("/sys/fs/cgroup", "memory.max"), ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")):
            folder = root + path
            if (controllers == "" and probe == "memory.max" or "memory" in controllers.split(",")) \
                    and os.path.exists(os.path.join(folder, probe)):
                return folder
    return None


def cgroup_room(folder) -> tuple[int, int] | None:
    """(bytes below the cgroup's limit, the limit): the limit less its usage, its page cache
    (active and inactive file pages, which the kernel drops under the limit: the experts read
    through it would else fill it and shrink the cache) not counted as used; None where it
    has no limit."""
    v2 = os.path.exists(os.path.join(folder, "memory.max"))
    limit = _read(os.path.join(folder, "memory.max" if v2 else "memory.limit_in_bytes"))
    if limit is None or limit == "max" or int(limit) >= NO_LIMIT:
        return None
    usage = int(_read(os.path.join(folder, "memory.current" if v2 else "memory.usage_in_bytes")) or 0)
    try:
        stat = _numbers(os.path.join(folder, "memory.stat"))
    except OSError:
        stat = {}
    prefix = "" if v2 else "total_"
    usage -= stat.get(prefix + "active_file", 0) + stat.get(prefix + "inactive_file", 0)
    return max(int(limit) - max(usage, 0), 0), int(limit)


def available_memory() -> tuple[int, int]:
    """(bytes this process could still take, the memory it may have in all): Linux's
    MemAvailable and MemTotal (of MLXMOE_MEMINFO where set, else /proc/meminfo), each lowered
    to the cgroup's room and limit; macOS's memory status level (the share free) of hw.memsize."""
    if sys.platform == "darwin":
        total = machine_memory()
        level = subprocess.run(["sysctl", "-n", "kern.memorystatus_level"], capture_output=True, text=True,
                               timeout=5).stdout.strip()
        return (total * int(level) // 100 if level.isdigit() else total // 2), total
    path = os.environ.get("MLXMOE_MEMINFO") or "/proc/meminfo"
    try:
        info = _numbers(path)
        available, total = info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError) as e:
        raise MlxmoeError(f"--memory-budget auto: cannot read the memory available from {path} ({e})") from None
    folder = cgroup_folder()
    room = cgroup_room(folder) if folder else None
    if room is not None:
        available, total = min(available, room[0]), min(total, room[1])
    return available, total


def held_memory() -> int:
    """What MLX holds now: the budget's part in use."""
    return mx.get_active_memory() + mx.get_cache_memory()


def allowed_budget(source, margin: int) -> tuple[int, int]:
    """(the budget `auto` allows now, the memory available): what MLX holds now and what is
    available beyond it, less the margin."""
    available, _ = source()
    return held_memory() + available - margin, available


def resize_cache(runtime, capacity: int) -> None:
    """Give the runtime's cache `capacity` slots now (between decode steps, on the thread
    that generates, or with no generation running), evicting the policy's victims first."""
    cache = runtime.cache
    with cache.loader.gate.background:  # no background read is under way, none starts
        cache.flush()
        with cache.lock:
            kept = cache.resize(capacity)
            cache.pools.resize(capacity, kept)
            cache.slot_table = None  # the resident path's table, built again once all are in
            cache.awaited.clear()
            if cache.verifier is not None:  # its tables (placeholder: the new spare slot)
                cache.verifier.tables = type(cache.verifier.tables)(cache)
    attach_cache(runtime.checkpoint, runtime)  # the layers' weights: the new pools
    mx.clear_cache()  # (the old pools, once the token in flight is done with them)


class Governor:
    """`memory_budget="auto"`: a thread that reads `source()` ((available, total) bytes,
    available_memory by default) every CHECK_SECONDS and resizes the runtime's cache where
    the expert cache the budget allows moved by more than MOVE_SHARE."""

    def __init__(self, runtime, margin: int, source=available_memory) -> None:
        self.runtime, self.margin, self.source = runtime, margin, source
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="mlxmoe-governor", daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stopped.wait(CHECK_SECONDS):
            if self.runtime.cache.loader.stop.is_set():  # (the cache closed without the runtime)
                return
            try:
                self.check()
            except Exception as e:  # (a source that failed once: said, and tried again)
                print(f"mlxmoe: memory governor: {e}", file=sys.stderr)

    def check(self) -> None:
        runtime = self.runtime
        budget, available = allowed_budget(self.source, self.margin)
        ckpt, current = runtime.checkpoint, runtime.resizer.wanted
        every = ckpt.num_layers * ckpt.num_experts
        slots, now = slots_for(runtime.plan, budget, every)[0], slots_for(runtime.plan, current, every)[0]
        if abs(slots - now) <= MOVE_SHARE * now:  # (the cache's share of the budget moved by a few % at most)
            return
        why = "fell" if budget < current else "rose"
        runtime.resize(max(budget, 0), f"memory available {why} to {format_size(available)} "
                       f"(margin {format_size(self.margin)})")

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join()


def auto_budget(margin, source=available_memory) -> tuple[int, int]:
    """(the budget `auto` starts with, the margin in bytes: `margin` or the default share)."""
    _, total = source()
    margin = default_margin(total) if margin is None else parse_size(margin, "memory margin")
    return max(allowed_budget(source, margin)[0], 0), margin


def slots_for(plan, budget: int, all_experts: int) -> tuple[int, bool]:
    """(the cache's slots within `budget` beside the plan's fixed part, at least its minimum
    and at most every expert; whether the minimum was what it could hold)."""
    fixed = plan.resident + plan.kv_reserve + plan.working
    least = math.ceil((plan.minimum - fixed) / plan.slot_bytes)
    slots = (budget - fixed) // plan.slot_bytes
    return min(max(slots, least), all_experts), slots < least


class Resizer:
    """A runtime's resizes: request() one (queued), apply_pending() between two tokens of a
    generation (stream_generate) or holding the model's generation lock (Runtime.resize)."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.wanted = runtime.plan.budget  # the budget last asked for
        self.pending = None  # (slots, budget, reason) to apply between two tokens
        self.lock = threading.Lock()
        self.said_minimum = False

    def request(self, memory_budget, reason: str | None = None) -> dict:
        runtime = self.runtime
        if runtime.group is not None:
            raise MlxmoeError("resize: the expert cache of a model across ranks keeps its size")
        budget = parse_size(memory_budget, "memory budget")
        ckpt = runtime.checkpoint
        slots, floored = slots_for(runtime.plan, budget, ckpt.num_layers * ckpt.num_experts)
        reason = reason or f"asked for a budget of {format_size(budget)}"
        message = None
        if floored:
            message = (f"a budget of {format_size(budget)} is below this model's minimum of "
                       f"{format_size(runtime.plan.minimum, math.ceil)}: the expert cache keeps its minimum, "
                       f"{slots} experts")
            reason += " (held at the minimum)"
            if not self.said_minimum:  # said once, however often the governor asks
                self.said_minimum = True
                print(f"mlxmoe: {message}", file=sys.stderr)
        with self.lock:
            self.wanted, self.pending = budget, (slots, max(budget, runtime.plan.minimum), reason)
        return {"from": runtime.cache.capacity, "to": slots, "memory_budget": budget, "message": message}

    def apply_pending(self) -> None:
        """Apply the resize asked for last, if any (on the thread that generates, or holding
        the model's generation lock)."""
        with self.lock:
            pending, self.pending = self.pending, None
        if pending is None:
            return
        slots, budget, reason = pending
        runtime, was = self.runtime, self.runtime.cache.capacity
        if slots != was:
            resize_cache(runtime, slots)
            runtime.cache.resizes.append({"from": was, "to": slots, "reason": reason, "at": round(time.time(), 3)})
        runtime.plan = replace(runtime.plan, budget=budget, expert_cache=slots * runtime.plan.slot_bytes,
                               cache_experts=slots)
        runtime.backend.activate(budget)
