"""The README, followed top to bottom as a user would on a fresh clone: every command in its
code blocks (and in examples/routing/README.md) runs as written and succeeds, the summary
it shows has the shape a run prints, and no command leaves the user waiting in silence.
Skipped: the setup itself (pip install, the test suite), and synopses with placeholders
(PATH, [options]), the server and mlx.launch, which need a model or hosts of one's own."""

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# a gap longer than this between two outputs, with nothing said about the wait, is a silent wait
SILENCE = 2.0
NOTICES = ("starting", "compil", "prefill:", "loading", "pre-warming", "predicting", "recording", "tracing")


def code_blocks(path):
    """(language, [lines]) of each fenced block of a markdown file, in order."""
    blocks, current = [], None
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            if current is None:
                current = (line[3:].strip(), [])
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current[1].append(line)
    return blocks


def commands(path):
    """The mlxmoe command lines of a markdown file's blocks, as argument lists (comments
    dropped, a `pip install ... &&` in front of one dropped), with the block that follows
    each (what it prints, where the README shows it)."""
    out = []
    blocks = code_blocks(path)
    for i, (lang, lines) in enumerate(blocks):
        if lang or any("PATH" in l or "[" in l for l in lines):  # code, or a synopsis with placeholders
            continue
        for line in lines:
            line = line.split(" && ", 1)[-1] if line.startswith("pip install") else line
            if not line.startswith("mlxmoe "):
                continue
            shown = blocks[i + 1][1] if i + 1 < len(blocks) and not blocks[i + 1][0] else []
            out.append((shlex.split(line, comments=True), shown))
    return out


def shape(line):
    """A regex of a printed line with every number a number: what a run prints in its place."""
    return re.compile("".join(r"\d+(\.\d+)?" if part[:1].isdigit() else re.escape(part)
                              for part in re.split(r"(\d+(?:\.\d+)?)", line)))


def run_timed(args, cwd, env, limit):
    """Run `args`; (return code, output, the longest silence not explained by a notice)."""
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    start = last = time.monotonic()
    output, worst = b"", (0.0, "")
    while True:
        chunk = os.read(proc.stdout.fileno(), 4096)
        now = time.monotonic()
        said = output.decode(errors="replace").rsplit("\n", 2)[-2:]
        if now - last > worst[0] and not any(n in "\n".join(said) for n in NOTICES):
            worst = (now - last, f"after {output[-120:].decode(errors='replace')!r}" if output else "at the start")
        if not chunk:
            break
        output, last = output + chunk, now
        assert now - start < limit, f"{args}: still running after {limit} s"
    return proc.wait(), output.decode(errors="replace"), worst


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A folder holding the files of a fresh clone that the README names (profiles,
    examples), where the commands write theirs; not the package: the demo model is
    found by name (`--model demo`, or none), from any folder."""
    where = tmp_path_factory.mktemp("clone")
    for name in ("profiles", "examples"):
        (where / name).symlink_to(ROOT / name)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return where, env, pace(env)


def pace(env):
    """This machine's pace: the time Python takes to import mlxmoe and MLX (about 1 s on the
    README's 2-core VM), which scales the allowed silence on a slower or busier machine."""
    tic = time.monotonic()
    subprocess.run([sys.executable, "-c", "import mlxmoe.api"], env=env, check=True)
    return max(1.0, time.monotonic() - tic)


README_COMMANDS = commands(ROOT / "README.md") + commands(ROOT / "examples" / "routing" / "README.md")


def test_the_readme_has_commands_to_run():
    names = [" ".join(args[:3]) for args, _ in README_COMMANDS]
    assert "mlxmoe generate --prompt" in names and "mlxmoe trace import" in names, names
    assert sum(n.startswith("mlxmoe trace import") for n in names) >= 6  # README + one per format


@pytest.mark.parametrize("args,shown", README_COMMANDS, ids=[" ".join(a[1:3]) for a, _ in README_COMMANDS])
def test_readme_command_runs_as_written(clone, args, shown):
    where, env, slow = clone
    code, output, (silence, when) = run_timed([sys.executable, "-m", *args], where, env, 300)
    assert code == 0, output
    assert "Traceback" not in output and "error:" not in output, output
    if silence > SILENCE * slow:  # the machine's load may have grown since the module's pace
        slow = max(slow, pace(env))
    assert silence <= SILENCE * slow, f"{silence:.1f} s without a word {when} (allowed {SILENCE * slow:.1f} s)"
    for line in shown:  # the summary the README shows, as a run prints it (numbers aside)
        if line.split(":")[0] in ("prompt", "experts"):
            assert any(shape(line).fullmatch(l) for l in output.splitlines()), (line, output)


def test_readme_python_runs_as_written(clone):
    where, env, _ = clone
    code = [lines for lang, lines in code_blocks(ROOT / "README.md") if lang == "python"]
    assert code
    r = subprocess.run([sys.executable, "-c", "\n".join(code[0])], cwd=where, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "'hits'" in r.stdout and (where / "live.json").exists()
