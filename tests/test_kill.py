"""`profile record`, `trace record`, `convert` and `chat --save-profile` killed with
SIGINT, SIGTERM and SIGKILL at random moments (seeded, KILLS per signal): after each
kill the target is absent or loads; SIGINT and SIGTERM end without a traceback; and the
next complete run leaves nothing but the target (what a SIGKILL left beside it, our
partial files, is removed when a run starts). Figures printed with -s (bench/RESULTS.md)."""

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mlxmoe.loader import DEMO_MODEL, open_checkpoint
from mlxmoe.workload.profile import ActivationProfile
from mlxmoe.workload.trace import read_trace

KILLS = int(os.environ.get("MLXMOE_KILLS", 1))  # per command and signal (bench/RESULTS.md: 5)
PROMPTS = ["Il gatto e la volpe", "The quick brown fox", "hello", "La casa sul lago", "Der Hund", "Once upon a time",
           "El perro", "Bonjour à tous"]


def check_profile(path):
    ActivationProfile.load(path)


def check_trace(path):
    read_trace(path)


def check_checkpoint(path):
    open_checkpoint(path).store.close()


# command -> (arguments with {out} and {prompts}, the target's name, how to load it, stdin)
COMMANDS = {
    "profile record": (["profile", "record", "--prompts", "{prompts}", "-w", "w", "-o", "{out}", "--max-tokens", "8",
                        "--cache-experts", "16"], "p.json", check_profile, None),
    "trace record": (["trace", "record", "--prompts", "{prompts}", "-o", "{out}", "--max-tokens", "8",
                      "--cache-experts", "16"], "t.jsonl", check_trace, None),
    "convert": (["convert", str(DEMO_MODEL), "{out}", "--bundle"], "bundled", check_checkpoint, None),
    "chat --save-profile": (["chat", "--save-profile", "{out}", "--max-tokens", "8", "--cache-experts", "16"],
                            "c.json", check_profile, "\n".join(PROMPTS) + "\n"),
}


def remove(target):
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()


def start(args, stdin_text, tmp):
    """`mlxmoe ARGS` with its temp folder `tmp` (nothing may stay there either)."""
    proc = subprocess.Popen([sys.executable, "-m", "mlxmoe", *args], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp)})
    if stdin_text is not None:
        proc.stdin.write(stdin_text)
    proc.stdin.close()
    return proc


@pytest.mark.parametrize("command", list(COMMANDS))
def test_killed_runs_leave_a_whole_target_or_none_and_no_litter(command, tmp_path):
    template, name, check, stdin_text = COMMANDS[command]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out_dir, tmp = tmp_path / "out", tmp_path / "tmp"
    out_dir.mkdir()
    tmp.mkdir()
    target = out_dir / name
    args = [a.format(out=target, prompts=prompts) for a in template]
    t0 = time.perf_counter()
    proc = start(args, stdin_text, tmp)  # a whole run first: how long one takes
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    duration = time.perf_counter() - t0
    rng = random.Random(command)
    kills, littered, wholes = 0, 0, 0
    for sig in [signal.SIGINT, signal.SIGTERM, signal.SIGKILL] * KILLS:
        remove(target)
        proc = start(args, stdin_text, tmp)
        time.sleep(rng.uniform(0.2, duration))  # (Python's own start-up, before mlxmoe runs, excluded)
        proc.send_signal(sig)
        err = proc.stderr.read()
        code = proc.wait(timeout=120)
        kills += 1
        if sig != signal.SIGKILL:
            assert "Traceback" not in err, err
            # 0: stopped early with what was recorded kept, or done; 130: interrupted; killed by
            # the signal: it came once all was done, while Python shut down
            assert code in (0, 130, -signal.SIGINT, -signal.SIGTERM), (sig, code, err)
        if target.exists():  # whole, or not there at all
            check(target)
            wholes += 1
        littered += any(p != target for p in out_dir.iterdir())
    if target.is_dir():  # convert writes a new folder only
        remove(target)
    proc = start(args, stdin_text, tmp)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    check(target)
    assert sorted(p.name for p in out_dir.iterdir()) == [name]  # nothing left of the killed runs
    assert [p.name for p in tmp.iterdir() if p.name != "mlx"] == []  # (mlx: MLX's cache of compiled CPU kernels)
    print(f"\nkill {command}: {kills} runs killed (SIGINT, SIGTERM, SIGKILL x {KILLS}) at random moments in "
          f"0.2-{duration:.1f} s; target whole after {wholes}, absent after {kills - wholes}; partial files beside it "
          f"after {littered}, none after the next run")
