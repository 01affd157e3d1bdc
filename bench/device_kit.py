"""The GPU check of issue 42 on a lent NVIDIA machine (the `device` tool), prepared so that it
fits the minutes a session is lent: MLX's CUDA build carried in two calls, then one call that
installs it, warms MLX's kernels and runs the benches, each bounded, its log back under $OUT.

The lent machine reaches no package index and a call carries at most 64 MiB with the working
tree, while the `mlx-cuda-13` wheel is ~90 MB: `pack` (here, with network) downloads it with
the `mlx` and `mlx-lm` wheels of the versions installed here (for the machine's Python 3.12),
strips its libmlx.so, compresses everything with xz and splits it into parts of at most
PART_MIB under .device/ (ignored by git), with the real routing the host-bound rows use.

    python bench/device_kit.py pack              # here: .device/part1.., MANIFEST.json; prints the calls
    # then, with the device tool, at once one after the other (a machine stays warm ~30 s):
    #   run(carry=[".device/part1"], command="python3 bench/device_kit.py stage")
    #   run(carry=[".device/part2", ".device/MANIFEST.json"], timeout_s=600,
    #       command="PYTHONUNBUFFERED=1 python3 bench/device_kit.py run --out $OUT")
    #   (`run ... --only resident,profile,disk,host`: those steps alone; one start a session: a second
    #   machine compiles MLX's kernels again, 134 to over 180 s)
    python bench/device_kit.py run --out /tmp/o --no-install --quick    # the same steps on this machine's mlx

`run` checks the parts' digest, installs into /tmp/mlxmoe-device/site, shows that MLX sees the
GPU, then (each step in its own process, bounded; a failed or late step does not stop the next):
stock mlx-lm once to compile MLX's CUDA kernels (the first process on a fresh machine took
71-180 s, the next 17), host_warmth (what host work costs right after a wait on the device,
against warm: whether the bookkeeping figures of this VM, 5-15x warm after a wait, hold there),
device_costs (what a wait and each kind of host read cost the decode thread), decode_profile
(the decode thread's functions by time, stock beside every expert resident), bench_runtime's
resident row against stock, bench_disk on the machine's disk at 50 % cached (off, the
default, and device-copy: the default with reads put into the slots by CUDA's copy), read_contention (expert reads on a thread while the
main thread runs Python), and last bench_host on Qwen3-30B-A3B's recorded routing with no
emulated round trip (the device's own; stock's first process compiles the float32 kernels: 98 s
on an H200), ~99 % also with its checks reading indices, not flags (`hit99:indices`: what the
flags of d792244 save where a first read costs 55 us). `--only` picks steps. Its summary (`summary.txt`) and each step's log but the
warm-up's come back under --out (the tool returns 8 files at most; the JSON results and the
warm-up's log stay in /tmp/mlxmoe-device).

The kit also carries CUDA's crt/ headers (CRT), which the lent machine lacks and MLX's JIT
needs for some kernels; `run` joins them to the machine's own CUDA headers."""

import argparse
import hashlib
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from system import check_outputs, write_atomic  # noqa: E402  (no mlx needed: the machine's python3 has none)

KIT = ROOT / ".device"
STAGE = Path("/tmp/mlxmoe-device")
PART_MIB = 45  # a part and the working tree (~13 MiB) within the 64 MiB a call carries
DEVICE_PYTHON = "3.12"  # the lent machine's python3 (device tool's KINDS.md)
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64")  # (pip matches each exactly)
ROUTING = ROOT.parent / "shared/data/real-routing/bigmoeonedge/qwen.route.csv"
# CUDA's crt/ headers, which MLX's JIT includes for some kernels (the float32 tensor-core
# gather_qmm): a package of their own from CUDA 13, not among mlx-cuda-13's requirements and
# missing on the lent machine ("cannot open source file crt/mma.h"); 13.0 as its driver's CUDA
CRT = "nvidia-cuda-crt==13.0.*"
LOGS_KEPT_THERE = {"warmup"}  # (in STAGE: the tool returns 8 files, and the summary gives its rc)


def download(spec: str, dest: Path) -> Path:
    """pip download `spec` (no dependencies) as a wheel for the lent machine's Python."""
    before = set(dest.glob("*.whl"))
    platforms = [a for tag in PLATFORMS for a in ("--platform", tag)]
    subprocess.run([sys.executable, "-m", "pip", "download", spec, "--no-deps", "--only-binary=:all:",
                    "--python-version", DEVICE_PYTHON, *platforms, "-d", str(dest)],
                   check=True, stdout=subprocess.DEVNULL)
    new = set(dest.glob("*.whl")) - before
    if len(new) != 1:
        raise SystemExit(f"pip download {spec}: expected one wheel in {dest}, got {sorted(new)}")
    return new.pop()


def split(data: bytes, part_bytes: int) -> list[bytes]:
    return [data[i:i + part_bytes] for i in range(0, len(data), part_bytes)] or [b""]


def pack(args) -> None:
    mlx_version, lm_version = version("mlx"), version("mlx-lm")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cuda = download(f"mlx-cuda-13=={mlx_version}", tmp)
        wheels = [download(f"mlx=={mlx_version}", tmp), download(f"mlx-lm=={lm_version}", tmp)]
        with zipfile.ZipFile(download(CRT, tmp)) as z:  # (its headers only: no wheel to install)
            z.extractall(tmp / "crt", [n for n in z.namelist() if n.startswith("nvidia/")])
        cuda_tree = tmp / "cuda"
        with zipfile.ZipFile(cuda) as z:
            z.extractall(cuda_tree)
        lib = cuda_tree / "mlx/lib/libmlx.so"
        if shutil.which("strip") and lib.exists():  # (its symbols: ~25 MB of the 145)
            subprocess.run(["strip", "--strip-unneeded", str(lib)], check=True)
        archive = tmp / "kit.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(cuda_tree, "cuda")
            for w in wheels:
                tar.add(w, f"wheels/{w.name}")
            tar.add(tmp / "crt/nvidia", "crt")
            if ROUTING.exists():
                tar.add(ROUTING, "routing/qwen.route.csv")
        print(f"compressing {archive.stat().st_size / 2**20:.0f} MiB with xz -9 ...", flush=True)
        if shutil.which("xz"):
            subprocess.run(["xz", "-9", "-T2", str(archive)], check=True)
            data = archive.with_suffix(".tar.xz").read_bytes()
        else:
            data = lzma.compress(archive.read_bytes(), preset=9)
    shutil.rmtree(KIT, ignore_errors=True)
    KIT.mkdir()
    parts = split(data, PART_MIB * 2**20)
    names = []
    for i, part in enumerate(parts, start=1):
        (KIT / f"part{i}").write_bytes(part)
        names.append(f"part{i}")
    manifest = {"sha256": hashlib.sha256(data).hexdigest(), "parts": names, "mlx": mlx_version,
                "mlx_lm": lm_version, "routing": ROUTING.exists()}
    write_atomic(KIT / "MANIFEST.json", json.dumps(manifest, indent=1))  # (last: a kit cut short has none)
    print(f"{KIT}: {len(data) / 2**20:.1f} MiB in {len(names)} parts ({', '.join(names)}); mlx {mlx_version}, "
          f"mlx-lm {lm_version}. The device calls, one right after the other:")
    for call in device_calls(names):
        print("  run(" + ", ".join(f"{k}={v!r}" for k, v in call.items()) + ")")


def device_calls(names: list) -> list[dict]:
    """The device tool's calls: each part but the last staged to /tmp by a call of its own, then run."""
    calls = [{"carry": [f".device/{n}"], "command": "python3 bench/device_kit.py stage", "timeout_s": 120}
             for n in names[:-1]]
    calls.append({"carry": [f".device/{names[-1]}", ".device/MANIFEST.json"], "timeout_s": 600,
                  "command": "PYTHONUNBUFFERED=1 python3 bench/device_kit.py run --out $OUT"})
    return calls


def stage(args) -> None:
    """Copy the carried parts to STAGE, where the next call's `run` finds them."""
    STAGE.mkdir(parents=True, exist_ok=True)
    for part in sorted(KIT.glob("part*")):
        shutil.copyfile(part, STAGE / part.name)
        print(f"staged {part.name} ({part.stat().st_size / 2**20:.1f} MiB)")


def install(site: Path, kit: Path = KIT, staged: Path = STAGE) -> Path | None:
    """Join the parts (checked against the manifest), unpack, install into `site`; return the routing file."""
    manifest = json.loads((kit / "MANIFEST.json").read_text())
    found = {p.name: p for where in (staged, kit) for p in where.glob("part*")}
    missing = [n for n in manifest["parts"] if n not in found]
    if missing:
        raise SystemExit(f"parts missing: {missing} (neither in {kit} nor staged in {staged}); "
                         "carry each in its call, one right after the other")
    data = b"".join(found[n].read_bytes() for n in manifest["parts"])
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise SystemExit("the joined parts do not match MANIFEST.json's digest: pack again and carry them all")
    unpacked = staged / "unpacked"
    shutil.rmtree(unpacked, ignore_errors=True)
    staged.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=staged, suffix=".tar") as tar_file:
        tar_file.write(lzma.decompress(data))
        tar_file.flush()
        with tarfile.open(tar_file.name) as tar:
            tar.extractall(unpacked, filter="data")
    shutil.rmtree(site, ignore_errors=True)
    wheels = sorted(str(w) for w in (unpacked / "wheels").glob("*.whl"))
    if wheels:
        if "{}.{}".format(*sys.version_info[:2]) != DEVICE_PYTHON:
            raise SystemExit(f"this python is {sys.version.split()[0]}; the kit's wheels are for {DEVICE_PYTHON}: "
                             "set DEVICE_PYTHON to the lent machine's and pack again")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                        "--target", str(site), "--only-binary=:all:", "--python-version", DEVICE_PYTHON, *wheels],
                       check=True)
    shutil.copytree(unpacked / "cuda", site, dirs_exist_ok=True)  # libmlx.so and the headers MLX compiles with
    if (unpacked / "crt").is_dir():
        shutil.copytree(unpacked / "crt", site / "crt-headers")  # (joined to the machine's own: cuda_libraries)
    routing = unpacked / "routing/qwen.route.csv"
    return routing if routing.exists() else None


def cuda_libraries(site: Path, env: dict) -> None:
    """libmlx.so finds CUDA's libraries at $ORIGIN/../../nvidia (its RPATH): link the machine's
    own `nvidia` packages there, and name their folders in LD_LIBRARY_PATH too."""
    found = subprocess.run([sys.executable, "-c", "import nvidia; print(list(nvidia.__path__)[0])"],
                           capture_output=True, text=True)
    if found.returncode:
        print("no `nvidia` Python packages on this machine: MLX's CUDA build may not load", flush=True)
        return
    nvidia = Path(found.stdout.strip())
    tree = site / "nvidia"
    if not tree.exists():  # the machine's files linked one by one, then the kit's headers it lacks added
        shutil.copytree(nvidia, tree, symlinks=True, copy_function=os.symlink)
        for header in sorted((site / "crt-headers").rglob("*")):
            target = tree / header.relative_to(site / "crt-headers")
            if header.is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(header, target)
    folders = [str(d) for d in sorted(nvidia.glob("*/lib")) + sorted(nvidia.glob("*/*/lib"))]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(folders + [env.get("LD_LIBRARY_PATH", "")])
    if Path("/usr/local/cuda").exists():
        env.setdefault("CUDA_HOME", "/usr/local/cuda")


def steps(routing: Path | None, quick: bool) -> list[tuple[str, list, int]]:
    """(name, command, seconds at most) of each bench, in order."""
    py = sys.executable
    tokens = "8" if quick else "32"
    run = [
        ("warmup", [py, "bench/bench_runtime.py", "--layers", "8", "--only", "stock-f32", "--rounds", "1", "--runs",
                    "1", "--tokens", "4", "--no-drop", "--output", str(STAGE / "warmup.json")], 240),
        # host work right after a wait on the device against the same work warm (5-15x here)
        ("warmth", [py, "bench/host_warmth.py", "--samples", "20" if quick else "60"], 60),
        # what each kind of wait and host read costs the decode thread there
        ("costs", [py, "bench/device_costs.py", "--samples", "50" if quick else "200"], 60),
        # where the decode thread's time goes, stock beside every expert resident (cProfile)
        ("profile", [py, "bench/decode_profile.py", "--tokens", tokens, "--top", "30"], 120),
        ("resident", [py, "bench/bench_runtime.py", "--layers", "8", "--only", "stock-f32,resident", "--rounds", "2",
                      "--runs", "2", "--tokens", tokens, "--prompt", "Hello world", "--output",
                      str(STAGE / "runtime.json")], 120),
    ]
    # device-copy: reads put into the managed slot pools by CUDA's copy, not the host's stores (backend.DeviceCopy)
    run.append(("disk", [py, "bench/bench_disk.py", "--rates", "disk", "--cache", "0.5", "--configs",
                         "off,default,device-copy", "--tokens", tokens, "--runs", "1", "--output",
                         str(STAGE / "disk.json")], 200))
    # expert reads on a thread while the main thread runs Python, at 5 and 0.2 ms switch intervals
    run.append(("contention", [py, "bench/read_contention.py", "--experts", "20"], 60))
    if routing is not None:  # (last: it takes what time is left)
        run.append(("host", [py, "bench/bench_host.py", "--routing", str(routing),
                             "--configs", "stock,resident,hit99,hit99:indices,hit95,hit90",
                             # (:indices: checks read the layer calls' indices, not flags, as where reads are free)
                             "--variant", 'indices={"flag_reads_us": 1e12}',
                             "--cache-experts", "hit99=3425,hit95=1926,hit90=1552", "--rtt", "0",
                             "--tokens", "16" if quick else "32", "--rounds", "1", "--output",
                             str(STAGE / "host.json")], 240))
    return run


def outputs(routing: Path | None, quick: bool) -> list[str]:
    """The files `run` writes under --out (the device tool returns 8 at most)."""
    return ["summary.txt", *(f"{name}.log" for name, _, _ in steps(routing, quick) if name not in LOGS_KEPT_THERE)]


def bounded(command: list, env: dict, log, seconds: int):
    """Run `command` in a process group of its own, killed whole after `seconds` (a bench's
    own child processes too: left running, they would share the GPU with the next step)."""
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timed out"


def run(args) -> None:
    deadline = time.monotonic() + args.seconds  # (from the start: the install counts)
    out, kit = Path(args.out), Path(args.kit)
    routing = Path(args.routing) if args.routing else None
    names = outputs(routing or ROUTING, args.quick)
    installs = not args.no_install
    check_outputs({"--out": [str(out / n) for n in names]},
                  {"--kit": str(kit) if installs else None, "the staged parts": str(STAGE) if installs else None,
                   "--routing": args.routing})
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    STAGE.mkdir(parents=True, exist_ok=True)  # (the warm-up's log, the JSON results)
    if installs:
        site = STAGE / "site"
        routing = install(site, kit) or routing
        cuda_libraries(site, env)
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    else:
        env["PYTHONPATH"] = str(ROOT)
        routing = routing or (ROUTING if ROUTING.exists() else None)
    summary, lines = out / "summary.txt", []

    def say(line: str) -> None:  # (the summary rewritten at each line: it comes back even if the call is cut short)
        lines.append(line)
        print(line, flush=True)
        write_atomic(summary, "\n".join(lines) + "\n")

    probe = ("import mlx.core as mx, mlx_lm; "
             "print('mlx', mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available())")
    checked = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True)
    seen = (checked.stdout or checked.stderr[-800:]).strip()
    say(f"device_kit run, {time.strftime('%Y-%m-%d %H:%M:%S')}: {seen}")
    todo = steps(routing, args.quick)
    if args.only:  # (in the order given, after the warm-up)
        by_name = {step[0]: step for step in todo}
        unknown = [name for name in args.only.split(",") if name not in by_name]
        if unknown:
            raise SystemExit(f"--only: no step {', '.join(unknown)} (the steps: {', '.join(by_name)})")
        todo = [by_name[name] for name in dict.fromkeys(["warmup", *args.only.split(",")])]
    for name, command, limit in todo:
        tic = time.monotonic()
        limit = min(limit, int(deadline - tic))
        if limit < 30:
            say(f"{name}: skipped, {max(limit, 0)} s left of --seconds {args.seconds}")
            continue
        with open((STAGE if name in LOGS_KEPT_THERE else out) / f"{name}.log", "w") as log:
            rc = bounded(command, env, log, limit)
        say(f"{name}: rc {rc}, {time.monotonic() - tic:.0f} s (at most {limit}): {' '.join(command[1:])}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("pack", help="Here: download, strip, compress and split MLX's CUDA build into .device/.")
    sub.add_parser("stage", help="There: copy the carried parts to /tmp for the next call.")
    p = sub.add_parser("run", help="There: install, warm up and run the benches.")
    p.add_argument("--out", required=True, help="Folder of the logs and results ($OUT on the lent machine).")
    p.add_argument("--no-install", action="store_true", help="Use this machine's mlx (a rehearsal without a GPU).")
    p.add_argument("--quick", action="store_true", help="8 tokens a generation instead of 32.")
    p.add_argument("--only", help="These steps only, in this order, after the warm-up (names as in the summary: "
                                  "resident,profile).")
    p.add_argument("--routing", help="Recorded routing for the host-bound rows, where the kit has none.")
    p.add_argument("--kit", default=str(KIT), help="The folder of the carried parts and MANIFEST.json.")
    p.add_argument("--seconds", type=int, default=570,
                   help="The whole run's time, the install included (within the device call's timeout_s).")
    args = parser.parse_args(argv)
    {"pack": pack, "stage": stage, "run": run}[args.verb](args)


if __name__ == "__main__":
    main()
