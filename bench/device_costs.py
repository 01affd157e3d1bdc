"""What the decode thread pays for each kind of wait on the device and host read, on this
machine's default device: the figures that price the runtime's reads of routing on a GPU.

- `wait`: `mx.eval` of one small op with nothing else queued (the round trip S that
  bench_host.py's --rtt emulates on the CPU).
- `item`: `.item()` of an evaluated one-element array (stock mlx-lm's one read a token).
- `read`: `np.array` of an evaluated array of --bytes made on the device, read once (the
  resident path's packed routing, read a step or two after it was computed). On CUDA (MLX
  0.32) a device-made array is moved to managed memory at its first host read: a managed
  allocation and a synchronous copy on the reading thread.
- `read ... 32 bytes`: the same of a layer call's top-8 indices (what a verified step's checks read
  one array at a time: bench_host.py's reads/token, priced by its --read-us).
- `read again`: the same array read a second time (already host-readable).
- `cpu copy`: the same array copied by an op on the CPU stream (`mx.add(a, 0, stream=mx.cpu)`,
  async_eval'd, done by MLX's CPU thread), then read: the decode thread's part only.
- `slot write`: an expert's bytes (--expert-bytes) written by the host into a slot of a pool
  made as SlotPools makes it (on the CPU stream: managed memory on CUDA) and viewed by numpy,
  as a read from disk lands: after the device used that slot (on CUDA its pages then live on
  the GPU and move back at the host's write), and after the host wrote it last (a plain copy).
- `slot use`: the device's sum over that slot, waited for: right after the host wrote it
  (on CUDA its pages move to the GPU first), and again; and the same sum over an array the
  device made (on CUDA device memory, not managed: whether kernels read managed memory slower). `upload`: the same bytes as a new
  array (`mx.array` of host memory) summed on the device, waited for: the other way to land a
  read there (a copy into device memory), less a copy from it into a slot.
- `slot copy` (where the CUDA runtime loads: backend.DeviceCopy, the runtime's what-if
  DEVICE_COPY): the same bytes copied into the slot by cudaMemcpy from a pinned buffer after the
  device used it, and the device's use of it after that copy.

- `build`: what building a layer's graph costs the host (perf_counter around mlx calls that
  only build: 48 layers of 60 one-row ops a token) with nothing computing, as stock mlx-lm
  builds a token before queuing it once, against while the layers queued before compute, as a
  verified step queues each decoder layer once built; and the whole token each way (its
  building, its queues, the wait at its end). On this VM's CPU backend a layer's building took
  1.7-2.7x longer beside the computing layers (mlx-lm's own, in the host-bound model: 1.4-1.65x),
  all of it the decode thread's own CPU time, not a wait (pure Python ran as fast beside MLX's
  work: not a shared core).

Each figure is the median of --samples, in microseconds; every read's array is evaluated and
left a few ms before it is read, so no figure but `wait` waits for the device.

    python bench/device_costs.py [--samples 200] [--bytes 2048]
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from mlxmoe.backend import DeviceCopy
from mlxmoe.errors import MlxmoeError
from system import cpu_ticks, stolen_share


def made(n, k):
    """A fresh int32 array of n elements computed on the default device, evaluated."""
    a = mx.arange(n, dtype=mx.int32) + k
    mx.eval(a)
    return a


def median_us(samples, setup, timed):
    """Median over `samples` of timed(setup()) in us, each after a 2 ms pause (work done)."""
    out = []
    for k in range(samples):
        arg = setup(k)
        time.sleep(2e-3)
        tic = time.perf_counter()
        timed(arg)
        out.append((time.perf_counter() - tic) * 1e6)
    return statistics.median(out)


def slot_rows(samples, nbytes, slots=8):
    """The slot figures: (name, us) of a host write into a pool slot, the device's use of it
    and an upload, for an expert of `nbytes`; each sample uses the next of `slots` slots."""
    pool = mx.zeros((slots, nbytes), dtype=mx.uint8, stream=mx.cpu)  # (as SlotPools: managed memory on CUDA)
    mx.eval(pool)
    view = np.array(pool, copy=False)
    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)

    def use(slot):
        mx.eval(pool[slot].sum())
        return slot

    def written(slot):
        view[slot % slots] = source
        return slot % slots

    def upload(_):
        mx.eval(mx.array(source).sum())

    def write(slot):
        view[slot] = source

    mb = nbytes / 2**20
    made_here = mx.zeros((nbytes,), dtype=mx.uint8) + 1  # (the default device's memory: not managed on CUDA)
    mx.eval(made_here)
    copied = []
    try:
        copy = DeviceCopy()
        pinned = copy.buffer(nbytes)  # (page-locked: a copy from it has landed when it returns)
        pinned[:] = source

        def copy_after_use(slot):
            copy(view[slot], pinned)

        def copied_slot(slot):
            copy(view[slot % slots], pinned)
            return slot % slots

        use(0)
        copy(view[0], pinned)  # (fails here without a GPU: no rows then)
        seen = mx.sum(pool[0].astype(mx.uint32)).item() == int(source.sum(dtype=np.uint64))
        print(f"a slot copy is seen by the device's next use: {'yes' if seen else 'NO'}")
        copied = [(f"slot copy (cudaMemcpy, page-locked source), used by the device last ({mb:.1f} MiB)",
                   median_us(samples, lambda k: use(k % slots), copy_after_use)),
                  ("slot use, right after the copy", median_us(samples, copied_slot, use))]
    except MlxmoeError as e:
        print(f"(no slot copy rows: {e})")
    return copied + [(f"slot write, used by the device last ({mb:.1f} MiB)", median_us(samples, lambda k: use(k % slots), write)),
            (f"slot write, written by the host last ({mb:.1f} MiB)", median_us(samples, written, write)),
            ("slot use, right after the host wrote it", median_us(samples, written, use)),
            ("slot use, again", median_us(samples, lambda k: use(k % slots), use)),
            ("the same use of a device-made array", median_us(samples, lambda k: k, lambda _: mx.eval(made_here.sum()))),
            (f"upload, then its use ({mb:.1f} MiB)", median_us(samples, lambda k: k, upload))]


def overlap_rows(samples, layers=48, blocks=15, width=64):
    """The `build` figures: (name, us) of a layer's building and of a whole token, queued once
    and queued a layer at a time, `samples` tokens each way, alternated; a layer is `blocks`
    blocks of four one-row ops (a matmul, a tanh, a scale, an add)."""
    x0 = mx.random.normal((1, width))
    w = mx.random.normal((width, width)) / width ** 0.5
    mx.eval(x0, w)

    def token(per_layer):
        y, build, tic = x0, 0.0, time.perf_counter()
        for _ in range(layers):
            t = time.perf_counter()
            for _ in range(blocks):
                y = mx.tanh(y @ w) * 0.5 + y
            build += time.perf_counter() - t
            if per_layer:
                mx.async_eval(y)  # (the device starts on this layer while the next is built)
        mx.eval(y)
        return build / layers * 1e6, (time.perf_counter() - tic) * 1e6

    timed = {False: [], True: []}
    for k in range(samples + 2):
        for per_layer in (False, True) if k % 2 else (True, False):
            result = token(per_layer)
            if k >= 2:  # (two warm-up tokens each way)
                timed[per_layer].append(result)
    med = {q: (statistics.median(b for b, _ in r), statistics.median(t for _, t in r)) for q, r in timed.items()}
    return [(f"build a layer ({blocks * 4} ops), nothing computing", med[False][0]),
            ("build a layer, the layers queued before computing", med[True][0]),
            (f"a token of {layers} layers, queued once", med[False][1]),
            ("a token, queued a layer at a time", med[True][1])]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=200, help="timings per figure")
    ap.add_argument("--bytes", type=int, default=2048, help="size of the arrays read (int32 elements x 4)")
    ap.add_argument("--expert-bytes", type=int, default=2_949_120,
                    help="bytes of one expert for the slot figures (Qwen3-30B-A3B's at 4 bit by default)")
    args = ap.parse_args()
    n = max(1, args.bytes // 4)
    ticks = cpu_ticks()
    x = mx.zeros((1,))
    mx.eval(x)

    def wait(k):
        mx.eval(x + k)

    def copied(k):
        c = mx.add(made(n, k), 0, stream=mx.cpu)
        mx.async_eval(c)
        return c

    def fresh_scalar(k):
        s = (x + k).sum()
        mx.eval(s)
        return s

    def read_twice(k):
        a = made(n, k)
        np.array(a)
        return a

    rows = [("wait (eval of one op)", median_us(args.samples, lambda k: k, wait)),
            ("item (one element)", median_us(args.samples, fresh_scalar, lambda s: s.item())),
            (f"read ({args.bytes} bytes, first)", median_us(args.samples, lambda k: made(n, k), np.array)),
            ("read (32 bytes, first: a layer call's indices)", median_us(args.samples, lambda k: made(8, k),
                                                                           lambda a: a.tolist())),
            (f"read again ({args.bytes} bytes)", median_us(args.samples, read_twice, np.array)),
            (f"cpu copy, then read ({args.bytes} bytes)", median_us(args.samples, copied, np.array)),
            ("cpu copy: its async_eval", median_us(args.samples, lambda k: mx.add(made(n, k), 0, stream=mx.cpu),
                                                   mx.async_eval))]
    rows += slot_rows(args.samples, args.expert_bytes)
    tokens = max(10, args.samples // 4)
    rows += overlap_rows(tokens)
    print(f"device {mx.default_device()}, mlx {mx.__version__}; medians of {args.samples} (the build rows: of {tokens} tokens), us")
    for name, us in rows:
        print(f"  {name:<48} {us:9.1f}")
    stolen = stolen_share(ticks, cpu_ticks())
    print(f"CPU stolen by the hypervisor over the run: {'-' if stolen is None else f'{stolen:.1%}'}")


if __name__ == "__main__":
    main()
