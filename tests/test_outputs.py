"""Issue 43's rule for every file mlxmoe writes (files.check_outputs): an output may not be
an input of its run, a file of the model folder (its Hugging Face snapshot's blobs
included), another output of the run, a folder, an empty path or a symlink loop; refused
before any work, naming both, the input's bytes unchanged. A symlink as output is kept and
its target written. The writers are enumerated from the CLI's options: a new output option
without a row here fails test_every_writer_is_in_the_table."""

import hashlib
import io
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import click
import pytest
from conftest import run_cli

import mlxmoe
from mlxmoe.api import build_fallback
from mlxmoe.cli import main
from mlxmoe.errors import MlxmoeError
from mlxmoe.loader import DEMO_MODEL
from mlxmoe.storage import files

ROOT = Path(__file__).resolve().parent.parent

# what a command runs on, before the output under test: {M} the model, {P} a profile of it
# (with a curve), {T} a trace, {R} a vllm routing log, {PROMPTS} a prompts file, {X} another
# output of the run (a fresh path, or the output under test's file in the "other" cases)
GEN = ["generate", "-m", "{M}", "-p", "hi", "--raw", "--max-tokens", "2", "--cache-experts", "16"]
CHAT = ["chat", "-m", "{M}", "--max-tokens", "2", "--cache-experts", "16"]
RECORD = ["-m", "{M}", "--prompts", "{PROMPTS}", "--max-tokens", "2", "--cache-experts", "16"]
SERVE = ["serve", "-m", "{M}", "--cache-experts", "16", "--port", "0"]
MODEL = ["model shard", "config.json", "tokenizer.json", "new file in the model", "link to a shard",
         "hard link to a shard", "snapshot blob", "repo id blob"]
EVERY = ["folder", "empty", "symlink loop"]
RUNS = ["symlink"]  # the writer runs: the link kept, its target written

# (command, parameter) -> (option as the error names it, arguments with {out}, input kinds,
# other outputs of the run, standard input)
WRITERS = {
    ("generate", "stats_json"): ("--stats-json", GEN + ["--stats-json", "{out}"],
                                 MODEL + ["--profile", "--fallback"] + EVERY + RUNS,
                                 ["--save-profile", "--trace-out"], None),
    ("generate", "save_profile"): ("--save-profile", GEN + ["--save-profile", "{out}"],  # (--profile: written back)
                                   MODEL + ["--fallback"] + EVERY + RUNS, ["--stats-json", "--trace-out"], None),
    ("generate", "trace_out"): ("--trace-out", GEN + ["--trace-out", "{out}"],
                                MODEL + ["--profile", "--fallback"] + EVERY + RUNS,
                                ["--stats-json", "--save-profile"], None),
    ("chat", "save_profile"): ("--save-profile", CHAT + ["--save-profile", "{out}"], MODEL + ["--fallback"] + EVERY
                               + RUNS, ["--trace-out"], "hi\n/quit\n"),
    ("chat", "trace_out"): ("--trace-out", CHAT + ["--trace-out", "{out}"], MODEL + ["--profile", "--fallback"]
                            + EVERY + RUNS, ["--save-profile"], "hi\n/quit\n"),
    ("fit", "png"): ("--png", ["fit", "-m", "{M}", "--disk-gbps", "1", "--png", "{out}"],
                     MODEL + ["--profile"] + EVERY + RUNS, [], None),
    ("profile record", "out"): ("--out", ["profile", "record", *RECORD, "-w", "w", "-o", "{out}"],
                                MODEL + ["--profile", "--fallback", "--prompts"] + EVERY + RUNS, ["--trace-out"], None),
    ("profile record", "trace_out"): ("--trace-out", ["profile", "record", *RECORD, "-w", "w", "-o", "{X}",
                                                      "--trace-out", "{out}"],
                                      MODEL + ["--profile", "--fallback", "--prompts"] + EVERY + RUNS, ["-o"], None),
    ("profile from-trace", "out"): ("--out", ["profile", "from-trace", "{T}", "-o", "{out}"],
                                    ["the trace read"] + MODEL + EVERY + RUNS, [], None),
    ("profile show", "png"): ("--png", ["profile", "show", "{P}", "--png", "{out}"],
                              ["the profile read"] + EVERY + RUNS, ["--curve-png"], None),
    ("profile show", "curve_png"): ("--curve-png", ["profile", "show", "{P}", "--curve-png", "{out}"],
                                    ["the profile read"] + EVERY + RUNS, ["--png"], None),
    ("profile merge", "out"): ("--out", ["profile", "merge", "{P}", "-o", "{out}"],
                               ["the profile read"] + EVERY + RUNS, [], None),
    ("trace record", "out"): ("--out", ["trace", "record", *RECORD, "-o", "{out}"],
                              MODEL + ["--profile", "--fallback", "--prompts"] + EVERY + RUNS, [], None),
    ("trace record", "trace_out"): ("--trace-out", ["trace", "record", *RECORD, "-o", "{X}", "--trace-out", "{out}"],
                                    ["refused"], [], None),  # (its trace goes to --out)
    ("trace import", "out"): ("--out", ["trace", "import", "vllm", "{R}", "-o", "{out}"],
                              ["the log read"] + EVERY + RUNS, [], None),
    ("convert", "dst"): ("DST", ["convert", "--fallback-bits", "3", "{M}", "{out}"], MODEL + EVERY + RUNS, [], None),
    ("serve", "trace_out"): ("--trace-out", SERVE + ["--trace-out", "{out}"],
                             MODEL + ["--profile", "--fallback"] + EVERY, [], None),
    ("serve", "save_profiles"): ("--save-profiles", SERVE + ["--save-profiles", "--profile", "{out}"],
                                 MODEL + ["--fallback", "symlink loop"], ["--trace-out"], None),
}

# the files commands read, and options that name no file: the rest of the path options
# (and of the options whose help says they write or save) are writers
READS = {"profile_path", "fallback", "prompts_file", "chats", "traces", "file", "files", "a", "b", "trace_file", "src",
         "prompt_cache_file", "draft_model",
         "profiles_dir"}
NOT_FILES = {"disk_gbps", "fallback_bits", "save_every", "idle_timeout"}


def commands(group=main, prefix=()):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from commands(cmd, prefix + (name,))
        else:
            yield " ".join(prefix + (name,)), cmd


def test_every_writer_is_in_the_table():
    writers = set()
    for name, cmd in commands():
        for p in cmd.params:
            says = re.search(r"\b(write|writes|written|save|saves)\b", getattr(p, "help", None) or "", re.I)
            if (isinstance(p.type, click.Path) or says) and p.name not in READS | NOT_FILES:
                writers.add((name, p.name))
    assert writers == set(WRITERS)


def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The files a run reads: the demo model, its snapshot in a Hugging Face cache (files
    linked into blobs), a profile of it, a trace, a routing log, prompts, a fallback file."""
    root = tmp_path_factory.mktemp("outputs")
    w = {"root": root, "M": shutil.copytree(DEMO_MODEL, root / "M"), "P": root / "p.json",
         "PROMPTS": root / "prompts.txt", "F": root / "fallback.safetensors", "R": root / "routes.jsonl",
         "T": root / "t.jsonl"}
    shutil.copy(ROOT / "profiles" / "italian.json", w["P"])
    w["PROMPTS"].write_text("hello\n")
    w["F"].write_bytes(b"low-bit copies (never read: refused first)")
    w["R"].write_text("".join(json.dumps({"type": "route", "req_id": "a", "token_idx": t, "layer": l,
                                          "topk_ids": [t % 4, (t + 1) % 4], "topk_weights": [0.6, 0.4]}) + "\n"
                              for t in range(4) for l in range(2)))
    code, _, err = run_cli("trace", "import", "vllm", w["R"], "-o", w["T"])
    assert code == 0, err
    repo = root / "hub" / "models--o--n"
    snapshot = repo / "snapshots" / "rev"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("rev")
    for f in w["M"].iterdir():
        blob = repo / "blobs" / hashlib.sha1(f.name.encode()).hexdigest()
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    w["snapshot"], w["hub"] = snapshot, root / "hub"
    return w


def fill(args, values):
    return [str(values[a[1:-1]]) if re.fullmatch(r"\{\w+\}", str(a)) else str(a) for a in args]


def place(kind, w, tmp, args, others):
    """(arguments, output path, the input path the error names, file whose bytes must stay)."""
    m = w["M"]
    named = hashed = None
    if kind in ("model shard", "config.json", "tokenizer.json"):
        out = m / {"model shard": "model.safetensors"}.get(kind, kind)
        named, hashed = m, out
    elif kind == "new file in the model":
        out, named = m / f"new-{tmp.name}.json", m
    elif kind == "link to a shard":
        out = tmp / "link.safetensors"
        out.symlink_to(m / "model.safetensors")
        named, hashed = m, m / "model.safetensors"
    elif kind == "hard link to a shard":
        out = tmp / "hard.safetensors"
        os.link(m / "model.safetensors", out)
        named, hashed = m, out
    elif kind in ("snapshot blob", "repo id blob"):
        out = Path(os.path.realpath(w["snapshot"] / "model.safetensors"))
        m = w["snapshot"] if kind == "snapshot blob" else "o/n"
        named, hashed = w["snapshot"], out
    elif kind in ("--profile", "--fallback", "--prompts"):
        out = named = hashed = w[{"--profile": "P", "--fallback": "F", "--prompts": "PROMPTS"}[kind]]
        if kind not in args:
            args = args + [kind, out]
    elif kind in ("the trace read", "the profile read", "the log read"):
        out = named = hashed = w[{"the trace read": "T", "the profile read": "P", "the log read": "R"}[kind]]
    elif kind in others:  # another output of the run, on the same (existing) file
        out = named = hashed = tmp / "both.json"
        out.write_text("keep")
        if "{X}" not in args:
            args = args + ([kind, "{X}"] if kind != "--save-profiles" else ["--profile", "{X}", "--save-profiles"])
    elif kind == "folder":
        out = tmp / "folder"
        out.mkdir()
    elif kind == "empty":
        out = ""
    elif kind == "symlink loop":
        out = tmp / "loop1"
        out.symlink_to(tmp / "loop2")
        (tmp / "loop2").symlink_to(out)
    elif kind == "refused":
        out = tmp / "trace.jsonl"
    if "-m" not in args and named is not None and named in (w["M"], w["snapshot"]) and "convert" not in args:
        args = args + ["-m", "{M}"]  # (profile from-trace: the model it is for)
    values = {**w, "M": m, "out": out, "X": out if kind in others else tmp / "other.json"}
    return fill(args, values), out, named, hashed


def run(args, stdin=None, seconds=60):
    """run_cli(*args) with `stdin`, stopped after `seconds` (serve, let through, would serve on)."""
    def expired(signum, frame):
        raise TimeoutError(f"{args} ran past {seconds} s")

    old, previous = sys.stdin, signal.signal(signal.SIGALRM, expired)
    sys.stdin = io.StringIO(stdin or "")
    signal.alarm(seconds)
    try:
        return run_cli(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        sys.stdin = old


CASES = [(writer, kind) for writer, (_, _, kinds, others, _) in WRITERS.items()
         for kind in kinds + others if kind != "symlink"]


@pytest.mark.parametrize("writer,kind", CASES, ids=[f"{' '.join(w)}-{k}" for w, k in CASES])
def test_an_output_that_would_destroy_an_input_is_refused_first(world, tmp_path, monkeypatch, writer, kind):
    opt, args, _, others, stdin = WRITERS[writer]
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(world["hub"]))
    args, out, named, hashed = place(kind, world, tmp_path, args, others)
    before, model = digest(hashed) if hashed else None, sorted(os.listdir(world["M"]))
    code, stdout, err = run(args, stdin)
    assert code == 2 and "Traceback" not in err and stdout == "", (args, code, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and opt in lines[0], (args, err)
    assert kind == "refused" or str(out) in lines[0] and (named is None or str(named) in lines[0]), (args, err)
    if hashed:
        assert digest(hashed) == before
    assert sorted(os.listdir(world["M"])) == model
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp") or f.name.startswith("other")]


RUN_CASES = [writer for writer, (_, _, kinds, _, _) in WRITERS.items() if "symlink" in kinds]


@pytest.mark.parametrize("writer", RUN_CASES, ids=[" ".join(w) for w in RUN_CASES])
def test_a_symlink_output_is_kept_and_its_target_written(world, tmp_path, writer):
    opt, args, _, _, stdin = WRITERS[writer]
    target = tmp_path / "target"
    target.write_text("old")
    link = tmp_path / "link"
    link.symlink_to(target)
    code, _, err = run(fill(args, {**world, "out": link, "X": tmp_path / "other.json"}), stdin)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.stat().st_size > 3 and target.read_bytes() != b"old"
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted({"target", "link"} | (
        {"other.json"} if "{X}" in args else set()))


# the Python API's writers: the same rule, before any work
@pytest.fixture(scope="module")
def demo(world):
    model, tokenizer = mlxmoe.load(str(world["M"]), cache_experts=16, prefetch=0, prewarm=False)
    yield model, tokenizer
    model.expert_runtime.close()


def test_the_api_writers_refuse_first(world, demo, tmp_path):
    rt = demo[0].expert_runtime
    shard = world["M"] / "model.safetensors"
    before = digest(shard)
    for call, needle in [(lambda: rt.save_profile(tmp_path), "it is a folder"),
                         (lambda: rt.save_profile(""), "an empty path"),
                         (lambda: rt.save_profile(shard), "lies in the model"),
                         (lambda: rt.save_curve(world["M"] / "config.json", rt.profile), "lies in the model"),
                         (lambda: rt.record_trace(tmp_path), "it is a folder"),
                         (lambda: rt.record_trace(world["M"] / "t.jsonl"), "lies in the model"),
                         (lambda: build_fallback(world["M"], shard, 3), "lies in the model"),
                         (lambda: build_fallback(world["M"], tmp_path, 3), "it is a folder"),
                         (lambda: mlxmoe.load(str(world["M"]), profile=world["P"], trace_out=world["P"]),
                          "it is the input profile")]:
        with pytest.raises(MlxmoeError, match=needle):
            call()
    assert digest(shard) == before and list(tmp_path.iterdir()) == [] and rt.trace is None


def test_the_api_writes_a_symlinks_target(demo, tmp_path):
    rt = demo[0].expert_runtime
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    rt.save_profile(link)
    assert link.is_symlink() and json.loads(target.read_text())["format"] == "mlxmoe.profile/1"


def test_a_profile_written_back_over_its_own_file_is_allowed(tmp_path):
    p = tmp_path / "p.json"
    shutil.copy(ROOT / "profiles" / "italian.json", p)
    files.check_outputs({"--save-profile": p}, {"--profile": p}, updates={"--save-profile": "--profile"})
    with pytest.raises(MlxmoeError, match="--save-profile .* and --trace-out .* are the same file"):
        files.check_outputs({"--save-profile": p, "--trace-out": p}, {"--profile": p},
                            updates={"--save-profile": "--profile"})


def test_fallback_temp_file_is_one_the_cleaner_knows(world, tmp_path, monkeypatch):
    """convert --fallback-bits killed while saving leaves a partial that the next run removes."""
    import mlx.core as mx

    dst, seen = tmp_path / "f.safetensors", []
    save = mx.save_safetensors

    def watched(f, *args, **kwargs):
        seen.extend(p.name for p in tmp_path.iterdir())
        return save(f, *args, **kwargs)

    monkeypatch.setattr(mx, "save_safetensors", watched)
    build_fallback(world["M"], dst, 3)
    assert len(seen) == 1 and files._partial_name(dst.name).fullmatch(seen[0])
    assert [p.name for p in tmp_path.iterdir()] == ["f.safetensors"]


def test_convert_into_a_read_only_folder_fails_before_the_work(world, tmp_path):
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
    elif os.path.isdir("/sys"):
        folder = Path("/sys")  # (root writes a chmod'ed folder; sysfs takes no new file)
    else:
        pytest.skip("no read-only folder to write as root")
    code, _, err = run_cli("convert", "--fallback-bits", "3", world["M"], folder / "f.safetensors")
    assert code == 2 and "DST: cannot write" in err and "layer 1/" not in err, err
    assert not (folder / "f.safetensors").exists()
