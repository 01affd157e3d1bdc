"""bench/device_kit.py: what a session lent a GPU carries and runs there must work the first time."""

import hashlib
import io
import json
import lzma
import os
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import device_kit  # noqa: E402


def kit_of(tmp_path, files: dict, part_bytes: int):
    """A kit as `pack` writes it: a tar of `files`, xz-compressed, split, with its manifest."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = lzma.compress(buf.getvalue())
    kit = tmp_path / "kit"
    kit.mkdir()
    names = []
    for i, part in enumerate(device_kit.split(data, part_bytes), start=1):
        (kit / f"part{i}").write_bytes(part)
        names.append(f"part{i}")
    (kit / "MANIFEST.json").write_text(json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "parts": names}))
    return kit, names


def test_parts_staged_in_one_call_and_carried_in_the_next_install_as_packed(tmp_path):
    files = {"cuda/mlx/lib/libmlx.so": os.urandom(20000), "routing/qwen.route.csv": b"layer,token\n"}
    kit, names = kit_of(tmp_path, files, part_bytes=4096)
    assert len(names) >= 2
    staged = tmp_path / "staged"
    staged.mkdir()
    (kit / "part1").rename(staged / "part1")  # the first call's part, copied to /tmp by `stage`
    routing = device_kit.install(tmp_path / "site", kit=kit, staged=staged)
    assert (tmp_path / "site/mlx/lib/libmlx.so").read_bytes() == files["cuda/mlx/lib/libmlx.so"]
    assert routing.read_bytes() == b"layer,token\n"


def test_the_kits_crt_headers_join_the_machines_cuda_headers_without_replacing_one(tmp_path, monkeypatch):
    machine = tmp_path / "machine"
    (machine / "nvidia/cu13/include").mkdir(parents=True)
    (machine / "nvidia/cu13/lib").mkdir()
    (machine / "nvidia/cu13/include/mma.h").write_text('#include "crt/mma.h"')
    (machine / "nvidia/cu13/lib/libcudart.so.13").write_bytes(b"lib")
    files = {"cuda/mlx/lib/libmlx.so": b"mlx", "crt/cu13/include/crt/mma.h": b"crt",
             "crt/cu13/include/mma.h": b"the kit's copy: the machine's stays"}
    kit, _ = kit_of(tmp_path, files, part_bytes=1 << 20)
    site = tmp_path / "site"
    device_kit.install(site, kit=kit, staged=tmp_path / "staged")
    monkeypatch.setenv("PYTHONPATH", str(machine))  # (where the probe's `import nvidia` finds the machine's)
    env = {}
    device_kit.cuda_libraries(site, env)
    include = site / "nvidia/cu13/include"
    assert (include / "crt/mma.h").read_bytes() == b"crt"
    assert (include / "mma.h").resolve() == (machine / "nvidia/cu13/include/mma.h").resolve()
    assert (site / "nvidia/cu13/lib/libcudart.so.13").read_bytes() == b"lib"
    assert str(machine / "nvidia/cu13/lib") in env["LD_LIBRARY_PATH"].split(os.pathsep)


def test_a_missing_or_changed_part_is_refused_by_name(tmp_path):
    kit, names = kit_of(tmp_path, {"cuda/a": os.urandom(20000)}, part_bytes=4096)
    last = kit / names[-1]
    last.write_bytes(last.read_bytes()[:-1] + b"\0")
    with pytest.raises(SystemExit, match="digest"):
        device_kit.install(tmp_path / "site", kit=kit, staged=tmp_path / "none")
    last.unlink()
    with pytest.raises(SystemExit, match=names[-1]):
        device_kit.install(tmp_path / "site", kit=kit, staged=tmp_path / "none")


def test_the_device_calls_fit_the_tools_limits():
    calls = device_kit.device_calls(["part1", "part2"])
    assert [c["carry"][0] for c in calls] == [".device/part1", ".device/part2"]
    assert all(len(c["command"]) <= 2000 and len(c["carry"]) <= 8 and c["timeout_s"] <= 600 for c in calls)
    assert ".device/MANIFEST.json" in calls[-1]["carry"] and "run --out $OUT" in calls[-1]["command"]
    # a part and the working tree (tracked files) within the 64 MiB a call carries
    tree = sum(p.stat().st_size for p in Path(device_kit.ROOT).rglob("*")
               if p.is_file() and ".git" not in p.parts and "out" not in p.parts and ".device" not in p.parts)
    assert device_kit.PART_MIB * 2**20 + tree < 64 * 2**20
    # what comes back: at most 8 files, the host-bound rows' and the warmth probe's logs among them
    names = device_kit.outputs(device_kit.ROUTING, quick=False)
    assert len(names) <= 8 and {"host.log", "warmth.log", "costs.log", "profile.log", "disk.log", "contention.log"} <= set(names)


def test_a_step_past_its_time_is_killed_with_the_processes_it_started(tmp_path):
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    # a bench that starts a child of its own (as bench scripts start each configuration), then hangs
    script = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    with open(tmp_path / "log", "w") as log:
        tic = time.monotonic()
        rc = device_kit.bounded([sys.executable, "-c", script], dict(os.environ), log, 3)
    assert rc == "timed out" and time.monotonic() - tic < 30
    child = int(pid_file.read_text())
    for _ in range(50):  # (reaped by init once its parent died)
        if subprocess.run(["ps", "-p", str(child), "-o", "stat="], capture_output=True, text=True).stdout.strip() \
                in ("", "Z"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {child} outlived its step")
