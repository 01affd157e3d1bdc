"""An emulated round trip to the device: S us added to every host wait on the device, from
outside the runtime (stock mlx-lm and mlxmoe alike). bench_host.py installs it on its decode
thread; run as a script, it runs a module (`python -m` style) with it installed on the threads
named by --thread (mlx_lm.server's generation thread by default, which mlxmoe serve reuses):

    python bench/roundtrip.py --rtt 150 -m mlxmoe serve --model DIR --port 8080
    python bench/roundtrip.py --rtt 150 -m mlx_lm server --model DIR --port 8081
    (--report FILE: the calls and waits counted so far, written to FILE as JSON twice a second;
    --routing [FORMAT:]FILE: every model the module loads routes as this recording of a real model,
    each row of a batch at its own position, moved by its input token: bench/routed.py's by_token)

A patched call (mx.eval, mx.synchronize, np.array and np.asarray given an mx.array, and
mx.array's item, tolist, __bool__, __int__, __float__) is a *wait* when the thread slept in it
(its voluntary context switches, getrusage(RUSAGE_THREAD).ru_nvcsw, went up): the device had
not finished what it reads. Each wait then costs S more, added when it returns, by time.sleep
with the thread's timer slack at 1 ns (inherited by the threads started after the install),
shortened by the sleeps' mean overshoot so far so that they add S on average. A call that did
not sleep but reads an array of the thread's last `mx.async_eval`, less than S after it, is a
wait too, of what is left of S: the round trip runs from the submission (on this CPU,
`async_eval` of small ops returns once they are computed, so without this an `eval` split into
`async_eval`, a little host work and `eval` would pass for no wait at all).

With a host read cost R (`read_us`), the first host read of an array of more than 8 bytes (np.array,
np.asarray, item, tolist, ...) costs R more, slept after it: MLX's CUDA backend moves a
device-made array to managed memory at its first host read (a `cudaMallocManaged` and a
synchronous copy on the reading thread; 55 us on an H200, bench/device_costs.py), while arrays of at
most 8 bytes (a sampled token) live in a managed pool and cost nothing. Metal's unified memory
costs no such thing (R = 0).
"""

import argparse
import ctypes
import json
import resource
import runpy
import sys
import threading
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from system import check_outputs, model_folder, write_atomic  # noqa: E402

GENERATION_THREAD = "_run_generate"  # (in mlx_lm.server's generation thread's default name)


class DeviceWaits:
    """Counts the decode thread's host calls that read the device (`calls`), the waits among
    them (`waits`: the thread slept in the call) and adds `rtt_us` to each wait (see the
    module's docstring). The decode thread: the one that made this, or with `thread_name`,
    every thread whose name holds it."""

    def __init__(self, spin=False, every_call=False, thread_name=None, read_us=0.0):
        self.thread = threading.get_ident()
        self.read_cost = read_us * 1e-6  # added to the first host read of an array of more than 8 bytes
        self.reads, self.read_overshoot = 0, 0.0  # such reads, their sleeps' mean overshoot
        self.read_seen = {}  # id -> a weak reference to the array whose first read was done
        self.thread_name = thread_name
        self.spin, self.every_call = spin, every_call
        self.calls = self.waits = 0
        self.added = self.emulation_cpu = 0.0  # wall seconds added; decode-thread CPU seconds spent adding them
        self.sites = {}  # "file:line" of the caller -> waits
        self.rtt = self.overshoot = 0.0
        self.submitted, self.submitted_at = (), 0.0  # ids of the arrays of the last async_eval, and when
        # decode-thread seconds inside mx.async_eval: MLX holds its caller there while more tasks than
        # it allows are in flight (on the CPU backend a task an op: most of a token here)
        self.queued = 0.0
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns: this thread's sleeps end on time

    def set_rtt(self, rtt_us):
        self.rtt = rtt_us * 1e-6

    def mark(self):
        return {"calls": self.calls, "waits": self.waits, "added": self.added, "emulation_cpu": self.emulation_cpu,
                "queued": self.queued, "reads": self.reads,
                "sites": dict(self.sites)}

    def _decode_thread(self):
        if self.thread_name is None:
            return threading.get_ident() == self.thread
        return self.thread_name in threading.current_thread().name

    def _wait(self, left=None):
        """Count a wait at the caller's caller and add the round trip (`left`: what is left of it)."""
        self.waits += 1
        frame = sys._getframe(2)  # _wait <- call <- the caller
        site = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        self.sites[site] = self.sites.get(site, 0) + 1
        if not self.rtt:
            return
        tic, cpu = time.perf_counter(), time.thread_time()
        if self.spin:
            while time.perf_counter() - tic < (self.rtt if left is None else left):
                pass
        elif left is not None:
            time.sleep(max(0.0, left - self.overshoot))
        else:
            self.overshoot = sleep_about(self.rtt, self.overshoot)
        self.added += time.perf_counter() - tic
        self.emulation_cpu += time.thread_time() - cpu

    def _read(self, a):
        """A host read of mx array `a`: its first, where it holds more than 8 bytes, costs the read cost."""
        seen = self.read_seen.get(id(a))
        if a.nbytes <= 8 or seen is not None and seen() is a:
            return
        if len(self.read_seen) >= 4096:  # (the oldest let go)
            del self.read_seen[next(iter(self.read_seen))]
        self.read_seen[id(a)] = weakref.ref(a)  # (an id a later array takes anew is another array)
        self.reads += 1
        if not self.read_cost:
            return
        cpu = time.thread_time()
        self.read_overshoot = sleep_about(self.read_cost, self.read_overshoot)
        self.emulation_cpu += time.thread_time() - cpu

    @staticmethod
    def _ids(args):
        """The ids of the arrays in `args` (arrays, or lists of them), as mx.eval and mx.async_eval take them."""
        return {id(b) for a in args for b in (a if isinstance(a, (list, tuple)) else [a])}

    def _submitted(self, args):
        """Whether `args` hold one of the last async_eval's arrays."""
        return not self.submitted.isdisjoint(self._ids(args))

    def submit(self, fn):
        """mx.async_eval, noting its arrays and when on the decode thread."""
        def call(*args):
            if not self._decode_thread():
                return fn(*args)
            self.submitted, self.submitted_at = self._ids(args), time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.queued += time.perf_counter() - self.submitted_at

        return call

    def wrap(self, fn, reads):
        """`fn` counted on the decode thread (`reads`: only where its first argument is an mx.array)."""
        import mlx.core as mx

        def call(*args, **kwargs):
            if not self._decode_thread() or reads and not (args and isinstance(args[0], mx.array)):
                return fn(*args, **kwargs)
            slept = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
            submitted = bool(self.submitted) and self._submitted(args)
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls += 1
                left = self.submitted_at + self.rtt - time.perf_counter() if submitted else 0.0
                if self.every_call or resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw > slept:
                    self._wait()
                elif left > 0:
                    self._wait(left)
                if reads:  # (after the wait's test: its own sleep is no wait)
                    self._read(args[0])

        return call

    def install(self):
        """Patch mlx and numpy (this process, for good); returns the counting's cost per call, us."""
        import mlx.core as mx
        import numpy as np

        a = mx.array(1)
        mx.eval(a)
        n = 2000
        tic = time.perf_counter()
        for _ in range(n):
            a.item()
        plain = time.perf_counter() - tic
        mx.eval = self.wrap(mx.eval, False)
        mx.async_eval = self.submit(mx.async_eval)
        mx.synchronize = self.wrap(mx.synchronize, False)
        np.array = self.wrap(np.array, True)
        np.asarray = self.wrap(np.asarray, True)
        for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
            setattr(mx.array, name, self.wrap(getattr(mx.array, name), True))
        tic = time.perf_counter()
        for _ in range(n):
            a.item()
        cost = (time.perf_counter() - tic - plain) / n * 1e6
        self.calls = self.waits = 0
        self.sites.clear()
        return cost


def sleep_about(seconds, overshoot):
    """Sleep `seconds` on average: shortened by `overshoot`, the mean overshoot of such sleeps so
    far; returns that mean with this sleep's."""
    tic, asked = time.perf_counter(), max(0.0, seconds - overshoot)
    time.sleep(asked)
    return overshoot + 0.1 * (time.perf_counter() - tic - asked - overshoot)


def report_every(waits, path, seconds=0.5):
    """Write waits.mark() to `path` (JSON, whole or not at all) every `seconds`, on a daemon thread."""
    def run():
        while True:
            time.sleep(seconds)
            try:
                marked = waits.mark()
            except RuntimeError:  # (its sites grew while copied: the next time)
                continue
            write_atomic(path, json.dumps(marked))
    threading.Thread(target=run, name="roundtrip-report", daemon=True).start()


def main(argv):
    i = argv.index("-m") if "-m" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="python bench/roundtrip.py --rtt US [--thread NAME] [--report FILE] -m MODULE [ARGS...]")
    ap.add_argument("--rtt", type=float, required=True, help="the round trip added to each wait, us")
    ap.add_argument("--read-us", type=float, default=0.0, help="added to the first host read of each array of "
                    "more than 8 bytes, us (CUDA's move to managed memory)")
    ap.add_argument("--thread", default=GENERATION_THREAD, help="the threads it applies to: those whose name holds this")
    ap.add_argument("--report", help="write the calls and waits counted so far here (JSON, twice a second)")
    ap.add_argument("--routing", help="[FORMAT:]FILE: every model loaded routes as this recording (bench/routed.py, "
                    "by position and input token)")
    args = ap.parse_args(argv[:i])
    if i + 1 >= len(argv):
        ap.error("-m MODULE [ARGS...]: the module to run")
    module, module_args = argv[i + 1], argv[i + 2:]
    if args.report:  # (not into the model folder the module is given, if any)
        model = module_args[module_args.index("--model") + 1] if "--model" in module_args[:-1] else None
        check_outputs({"--report": args.report}, {"--model": model_folder(model)} if model else None)
    waits = DeviceWaits(thread_name=args.thread, read_us=args.read_us)
    waits.install()
    waits.set_rtt(args.rtt)
    if args.report:
        report_every(waits, args.report)
    sys.argv = [module, *module_args]
    sys.path.insert(0, str(ROOT))  # (mlxmoe from this checkout)
    if args.routing:
        import routed

        routed.install(args.routing, "", by_token=True)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
