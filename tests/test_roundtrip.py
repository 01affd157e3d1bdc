"""bench/roundtrip.py, the emulated round trip to the device (issue 42): a read of an array
that the decode thread queued with `mx.async_eval` less than S before pays what is left of S,
though on this CPU the array is computed by then; a read of an array queued earlier pays
nothing. Run in a child process: the emulation patches mlx for good."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys, time
sys.path.insert(0, sys.argv[1])
from roundtrip import DeviceWaits
waits = DeviceWaits()
waits.install()
waits.set_rtt(100000)  # 100 ms: far above the sleeps' overshoot and this machine's jitter
import mlx.core as mx
old = mx.array([1.0]) * 2
mx.eval(old)
new = mx.array([3.0]) + 1
mx.async_eval(new)
time.sleep(0.005)
tic = time.perf_counter()
old.item()  # computed long before: no wait
other = time.perf_counter() - tic
tic = time.perf_counter()
mx.eval(new)  # queued ~5 ms ago: ~95 ms of the round trip left
late = time.perf_counter() - tic
listed = mx.array([5.0]) + 1
mx.async_eval([listed])  # a list, as mlx-lm's BatchGenerator passes its rows' logprobs
time.sleep(0.005)
tic = time.perf_counter()
listed.item()
late_listed = time.perf_counter() - tic
print(waits.waits, other, late, late_listed)
"""


def test_a_read_soon_after_async_eval_pays_the_rest_of_the_round_trip():
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "bench")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    waits, other, late, late_listed = out.stdout.split()
    assert int(waits) >= 1 and float(other) < 0.005
    assert 0.05 < float(late) < 0.2, late
    assert 0.05 < float(late_listed) < 0.2, late_listed


def test_stopped_servers_leave_no_half_written_report(tmp_path):
    """bench_batch stops its servers under the round trip with their report threads maybe
    mid-write: the temp file a stopped server left beside its report is removed."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_batch

    report = tmp_path / "batched.waits.json"
    report.write_text('{"waits": 3}')
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    half = tmp_path / f"batched.waits.json.{child.pid}-x1.tmp"
    half.write_text('{"wai')

    class Stub:  # a server whose process is `child`
        def stop(self):
            child.kill()
            child.wait()

    server = Stub()
    server.report = str(report)
    bench_batch.stop([server])
    assert not half.exists() and json.loads(report.read_text()) == {"waits": 3}


QUEUED = """
import sys, threading, time
sys.path.insert(0, sys.argv[1])
from roundtrip import DeviceWaits
waits = DeviceWaits()
waits.install()
import mlx.core as mx
a = mx.random.normal((128, 128))
mx.eval(a)

def chain():
    x = a
    for _ in range(200):  # far more ops than MLX lets be in flight: async_eval holds its caller
        x = mx.tanh(x @ a * 0.01)
    return x

x = chain()
tic = time.perf_counter()
mx.async_eval(x)
held = time.perf_counter() - tic
mx.eval(x)
before = waits.mark()["queued"]
def elsewhere():
    y = chain()
    mx.async_eval(y)
    mx.eval(y)

other = threading.Thread(target=elsewhere)
other.start()
other.join()
print(held, before, waits.mark()["queued"])
"""


def test_the_decode_threads_time_inside_async_eval_is_counted():
    """bench_host's `queued ms/token`: the decode thread's wall time inside mx.async_eval
    (held while too many tasks are in flight), another thread's left out."""
    out = subprocess.run([sys.executable, "-c", QUEUED, str(ROOT / "bench")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    held, before, after = map(float, out.stdout.split())
    assert held > 0.002 and 0.9 * held <= before <= held, (held, before)
    assert after == before


READS = """
import sys, time
sys.path.insert(0, sys.argv[1])
from roundtrip import DeviceWaits
waits = DeviceWaits(read_us=20000)  # 20 ms: far above this machine's jitter
waits.install()
import mlx.core as mx
import numpy as np
row, token = mx.arange(6, dtype=mx.uint32) + 1, mx.array(3) + 1
mx.eval(row, token)
before = waits.waits

def timed(read):
    tic = time.perf_counter()
    read()
    return time.perf_counter() - tic

first = timed(lambda: row.tolist())
again = timed(lambda: np.array(row))
small = timed(lambda: token.item())  # 4 bytes: a managed pool's, no move
print(waits.reads, waits.waits - before, first, again, small)
"""


def test_the_first_host_read_of_an_array_pays_the_read_cost():
    """--read-us R (CUDA's move of a device-made array to managed memory at its first host
    read): the first read of an array of more than 8 bytes pays R and counts a read, not a
    wait; its later reads, and a read of a sampled token (8 bytes or fewer), pay nothing."""
    out = subprocess.run([sys.executable, "-c", READS, str(ROOT / "bench")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    reads, waits, first, again, small = out.stdout.split()
    assert (int(reads), int(waits)) == (1, 0)
    assert 0.015 < float(first) < 0.2 and float(again) < 0.005 and float(small) < 0.005, (first, again, small)


def test_bench_host_flag_reads_is_the_benchs_own_load_argument(monkeypatch):
    """bench_host's `flag_reads_us` (in --load-kwargs or a --variant) never reaches mlxmoe.load:
    it sets, in that process, the first read's cost above which verified checks read flags."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_host
    from mlxmoe.caching import verify

    monkeypatch.setattr(verify, "FLAG_READS", verify.FLAG_READS)
    assert bench_host.load_arguments('{"prefetch": 0, "flag_reads_us": 1e12}') == {"prefetch": 0}
    assert verify.FLAG_READS == 1e6
    assert bench_host.load_arguments('{"prefetch": 0}') == {"prefetch": 0} and verify.FLAG_READS == 1e6


def test_bench_host_paired_ratio_is_taken_within_each_process():
    """--paired: the ratio to stock is each process's own (its mlxmoe generations over the stock
    ones it ran), the median of those, not a ratio of medians over processes (one process runs
    up to 1.5x slower than the next here); the paired stock's tokens join the identity check."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_host

    def process(ours, stock, stock_tokens=(1, 2)):
        row = {"rtt_us": 150.0, "tok_s": ours, "ms_per_token": 1e3 / ours, "host_ms_per_token": 900 / ours,
               "process_cpu_ms_per_token": 1.0, "queued_ms_per_token": 1.0, "waits_per_token": 0.0,
               "calls_per_token": 1.0, "reads_per_token": 0.0, "added_us_per_wait": None, "stolen": 0.0,
               "tokens": [1, 2], "wait_sites": {}}
        return {"rows": [row, row], "paired": [{"rtt_us": 150.0, "tok_s": ours, "stock_tok_s": stock,
                                                "host_ms_per_token": 900 / ours,
                                                "stock_host_ms_per_token": 800 / stock,
                                                "stock_tokens": [list(stock_tokens)] * 2}]}

    # a slow process (both sides at half speed) and two fast ones: each 0.9x within itself
    runs = [process(18.0, 20.0), process(36.0, 40.0), process(37.8, 42.0)]
    p = bench_host.pooled(runs, 150.0)
    assert abs(p["paired_vs_stock"] - 0.9) < 1e-9 and abs(p["paired_host_vs_stock"] - 1.25) < 1e-9
    assert len(p["paired_each"]) == 3 and all(abs(r - 0.9) < 1e-9 for r in p["paired_each"])
    assert all(t == [1, 2] for t in p["tokens"])
    assert bench_host.pooled(runs, 0.0) is None
    odd = bench_host.pooled(runs[:2] + [process(37.8, 42.0, stock_tokens=(1, 3))], 150.0)
    assert [1, 3] in odd["tokens"]
