"""Issue 15's reproductions, one test per item (thread safety, item 11, is tested with the
API lock): each bad input ends in one clean error that names the file or option."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import mlxmoe
from mlxmoe.cli import main
from mlxmoe.errors import MlxmoeError
from mlxmoe.loader import DEMO_MODEL
from mlxmoe.workload.profile import ActivationProfile
from mlxmoe.workload.trace import read_trace


@pytest.fixture
def demo(tmp_path):
    """A copy of the bundled demo checkpoint to damage."""
    return shutil.copytree(DEMO_MODEL, tmp_path / "c")


def assert_cli_error(cli, args, *needles):
    code, err = cli(*args)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in err, err


# 1
def test_negative_seed_is_refused(cli):
    assert_cli_error(cli, ["generate", "-p", "hi", "--seed", "-1"], "--seed")


# 2
@pytest.mark.parametrize("damage", ["no tokenizer", "tokenizer not JSON", "tokenizer a folder", "config a folder",
                                    "top-k a string"])
def test_broken_tokenizer_or_config_is_named(demo, damage):
    if damage == "no tokenizer":
        (demo / "tokenizer.json").unlink()
        where = str(demo)
    elif damage == "tokenizer not JSON":
        (demo / "tokenizer.json").write_text("{x")
        where = "tokenizer.json"
    elif damage == "tokenizer a folder":
        (demo / "tokenizer.json").unlink()
        (demo / "tokenizer.json").mkdir()
        where = "tokenizer.json"
    elif damage == "config a folder":
        (demo / "config.json").rename(demo / "saved")
        (demo / "config.json").mkdir()
        where = "config.json"
    else:
        config = json.loads((demo / "config.json").read_text())
        config["num_experts_per_tok"] = "2"
        (demo / "config.json").write_text(json.dumps(config))
        where = "num_experts_per_tok"
    with pytest.raises(MlxmoeError, match=where.replace(".", r"\.")):
        mlxmoe.load(str(demo), cache_experts=8, prewarm=False)


# 3
def test_a_fifo_shard_is_refused_not_waited_on(demo):
    shard = demo / "model.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    r = subprocess.run([sys.executable, "-m", "mlxmoe", "info", "-m", str(demo)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert str(shard) in r.stderr and "regular file" in r.stderr


def profile_file(tmp_path, name="p.json", L=2, E=4, **fields):
    p = ActivationProfile(L, E, 2, model="m", model_fingerprint="fp", workload="w")
    p.tick(4)
    p.observe(0, [1, 2])
    data = p.to_json()
    data.update(fields)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# 4
def test_merge_never_writes_what_load_refuses(tmp_path, cli):
    a, b = profile_file(tmp_path, "a.json"), profile_file(tmp_path, "b.json")
    code, err = cli("profile", "merge", a, b, "--weights", "1e308,1e308", "-o", tmp_path / "m.json")
    assert code == 0, err
    m = ActivationProfile.load(tmp_path / "m.json")
    assert np.isfinite(m.tokens) and m.tokens > 0
    np.testing.assert_allclose(m.rates(), ActivationProfile.load(a).rates(), atol=1e-4)
    # counts of 1e308 over 1e-300 tokens: refused (since issue 29 when read, naming the file), nothing written
    c = profile_file(tmp_path, "c.json", counts=[[1e308] * 4, [1e308] * 4], tokens=1e-300)
    assert_cli_error(cli, ["profile", "merge", c, c, "-o", tmp_path / "n.json"], "c.json", "counts")
    assert not (tmp_path / "n.json").exists()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a.json", "b.json", "c.json", "m.json"]


# 5
@pytest.mark.parametrize("field,value", [("workload", 123), ("expert_bytes", "lots"), ("resident_bytes", "x"),
                                         ("model", ["m"]), ("top_k", 2.5), ("tokens_total", -1)])
def test_profile_fields_of_the_wrong_type_are_refused_at_load(tmp_path, field, value):
    path = profile_file(tmp_path, **{field: value})
    with pytest.raises(MlxmoeError, match=field) as e:
        ActivationProfile.load(path)
    assert str(path) in str(e.value)


# 6
def test_huge_claims_and_deep_json_are_refused_cheaply(tmp_path):
    path = profile_file(tmp_path, num_layers=10 ** 9, num_experts=10 ** 9)
    with pytest.raises(MlxmoeError, match="more than"):
        ActivationProfile.load(path)
    (tmp_path / "deep.json").write_text("[" * 100000)
    with pytest.raises(MlxmoeError, match="deep.json"):
        ActivationProfile.load(tmp_path / "deep.json")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # sparse: refused from its size, never read
        f.truncate(1 << 30)
    with pytest.raises(MlxmoeError, match="too large"):
        ActivationProfile.load(big)


# 7
@pytest.mark.parametrize("header,lines,needle", [
    ({"num_layers": 2, "num_experts": -1}, [], "num_experts"),
    ({"num_layers": 2, "num_experts": 4}, [{"s": 0, "t": 0, "l": 0, "e": [1], "p": ["NaN"]}], "p must be finite"),
    ({"num_layers": 2, "num_experts": 4}, [{"s": 0, "t": 0, "l": 0, "e": [1], "r": [0.1, "NaN", 0, 0]}],
     "r must be finite"),
    ({"num_layers": 2, "num_experts": 4}, [{"s": 0, "t": 0, "l": 0, "e": []}], "experts"),
    ({"num_layers": 2, "num_experts": 4}, [{"s": 0, "t": 0, "l": 0, "e": [1], "n": 10 ** 9}], "n = "),
    ({"num_layers": 2, "num_experts": 4}, [{"s": 0, "t": 0, "l": 0, "e": [1], "n": 2}], "n = 2"),
    ({"num_layers": 2, "num_experts": 4}, [], "no routing lines"),
])
def test_malformed_traces_are_refused(tmp_path, header, lines, needle):
    path = tmp_path / "t.jsonl"
    text = json.dumps({"format": "mlxmoe.trace/1", **header}) + "\n"
    text += "".join(json.dumps(line).replace('"NaN"', "NaN") + "\n" for line in lines)
    path.write_text(text)
    with pytest.raises(MlxmoeError, match=needle) as e:
        read_trace(path)
    assert str(path) in str(e.value)


# 8
def test_show_json_is_strict_json(tmp_path, cli, capsys):
    bad = profile_file(tmp_path, "bad.json", curve={"lru": [[2, float("nan")]]})
    assert_cli_error(cli, ["profile", "show", bad, "--json"], "bad.json", "curve")
    good = profile_file(tmp_path, "good.json", curve={"lru": [[2, 0.5], [8, 1.0]]})
    r = CliRunner().invoke(main, ["profile", "show", str(good), "--json"])
    assert r.exit_code == 0, r.output

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    assert json.loads(r.output, parse_constant=refuse)["curve"]["lru"] == [[2, 0.5], [8, 1.0]]


# 9
@pytest.mark.parametrize("args,needle", [
    (["generate", "-p", "hi", "--memory-budget", "99999999999999999999999GB"], "--memory-budget"),
    (["generate", "-p", "hi", "--memory-budget", "42Mb"], "units: B, K/KB/KiB"),
    (["generate", "-p", "hi", "--cache-size", "2MB", "--cache-experts", "8"], "--cache-size and --cache-experts"),
    (["generate", "-p", "hi", "--temp", "-1"], "--temp"),
    (["generate", "-p", "hi", "--temp", "nan"], "--temp"),
    (["generate", "-p", "hi", "--top-p", "5"], "--top-p"),
    (["info", "--memory-budget", "1e99GB"], "--memory-budget"),
    (["profile", "merge", "a.json", "b.json", "-o", "m.json", "--weights", ""], "--weights"),
    (["chat", "--repetition-penalty", "nan"], "--repetition-penalty"),
])
def test_bad_option_values_are_refused(cli, args, needle):
    assert_cli_error(cli, args, needle)


def test_exclusive_prompt_sources_and_missing_parent(cli, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    chats = tmp_path / "c.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert_cli_error(cli, ["trace", "record", "--prompts", prompts, "--chats", chats, "-o", tmp_path / "t.jsonl"],
                     "--prompts and --chats")
    assert_cli_error(cli, ["convert", DEMO_MODEL, tmp_path / "missing" / "dst", "--bundle"],
                     str(tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()


# 10
def test_stale_partials_of_dead_writers_are_removed_at_start(tmp_path):
    from mlxmoe.storage.files import check_writable, clean_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    target = tmp_path / "p.json"
    stale = [tmp_path / f"p.json.{dead}-abc.tmp", tmp_path / f"p.json.{dead}-trace.tmp.{dead}-x1.tmp"]
    live = tmp_path / f"p.json.{os.getpid()}-mine.tmp"  # a writer still running: kept
    others = [tmp_path / "p.json.bak", tmp_path / f"q.json.{dead}-abc.tmp"]  # not ours: kept
    for f in stale + [live] + others:
        f.write_text("x")
    (tmp_path / f".dst.{dead}-zz.partial").mkdir()
    (tmp_path / f".dst.{dead}-zz.partial" / "model.safetensors").write_text("x")
    check_writable(target)
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(f.name for f in [live] + others + [
        tmp_path / f".dst.{dead}-zz.partial"])
    assert clean_stale(tmp_path / "dst") == [tmp_path / f".dst.{dead}-zz.partial"]


def test_interrupt_at_the_first_save_keeps_the_recording(tmp_path, monkeypatch):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\nIl gatto\n")
    save = ActivationProfile.save

    def interrupted_save(self, path):  # Ctrl-C arrives while the profile is written
        os.kill(os.getpid(), signal.SIGINT)
        save(self, path)

    monkeypatch.setattr(ActivationProfile, "save", interrupted_save)
    out = tmp_path / "p.json"
    r = CliRunner().invoke(main, ["profile", "record", "--prompts", str(prompts), "-w", "x", "-o", str(out),
                                  "--max-tokens", "4", "--cache-experts", "16"])
    assert r.exit_code == 130, r.output  # interrupted: saved, yet not a success (issue 29)
    assert ActivationProfile.load(out).tokens_total > 0
    assert sorted(f.name for f in tmp_path.iterdir()) == ["p.json", "p.txt"]


def test_sigterm_is_handled_like_ctrl_c(tmp_path):
    """SIGTERM during a recording saves what was recorded, as Ctrl-C does."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(["Il gatto e la volpe"] * 200) + "\n")
    out = tmp_path / "p.json"
    proc = subprocess.Popen([sys.executable, "-m", "mlxmoe", "profile", "record", "--prompts", str(prompts), "-w",
                             "x", "-o", str(out), "--max-tokens", "16", "--cache-experts", "16"],
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # the progress bar starts: prompts are running
        if "recording" in line:
            break
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, err  # saved, yet not a success: `record && deploy` stops (issue 29)
    assert "Traceback" not in err and "keeping what was recorded" in err
    assert ActivationProfile.load(out).tokens_total > 0
    assert sorted(f.name for f in tmp_path.iterdir()) == ["p.json", "p.txt"]


@pytest.mark.parametrize("where", ["__enter__", "__exit__"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_landing_in_a_locks_enter_or_exit_leaves_the_lock_free(signum, where):
    """Ctrl-C or SIGTERM landing in a context manager's __enter__ after its lock was taken, before
    its with-block began (a thread pool's submit, a queue's put), or in its __exit__ before it
    gives the lock back (Condition's, concurrent.futures.wait's over its futures' conditions),
    raised there would leave the lock held for ever: a pool's worker waiting on it then hangs the
    exit (`chat` in the kill test, 1 in 100 runs of a pool fed in a loop with Python's own
    handler; `trace record`, its running ahead waiting on its demand reads). mlxmoe's handlers
    act a few ms later instead, once the signal lands elsewhere."""
    from mlxmoe import cli, signals

    lock = threading.Lock()

    class Taking:
        def __enter__(self):
            lock.acquire()
            if where == "__enter__":
                os.kill(os.getpid(), signum)  # its handler runs in this frame, once the call returns
            return self

        def __exit__(self, *exc):
            if where == "__exit__":
                os.kill(os.getpid(), signum)
            lock.release()

    raise_it = signal.default_int_handler if signum == signal.SIGINT else cli._terminate
    previous = signal.signal(signum, signals.interrupting(raise_it))
    try:
        with pytest.raises(KeyboardInterrupt):
            with Taking():
                pass
            time.sleep(30)  # the signal, sent again, lands here
        assert not lock.locked()
    finally:
        signal.signal(signum, previous)
        cli._terminated.clear()


def test_a_signal_landing_as_a_condition_gives_up_its_lock_is_raised_in_its_wait():
    """Condition.wait gives its lock up before the try that takes it back: Ctrl-C raised in
    between leaves the with-block giving back a lock it no longer holds (RuntimeError, a
    traceback, 1 in 200 runs of a pool fed in a loop). mlxmoe's handler raises it in the wait."""
    from mlxmoe import signals

    class Releasing(threading.Condition):
        def _release_save(self):  # (Condition's own for a plain Lock, then the signal)
            self._lock.release()
            os.kill(os.getpid(), signal.SIGINT)

    cond = Releasing(threading.Lock())
    previous = signal.signal(signal.SIGINT, signals.interrupting(signal.default_int_handler))
    try:
        with pytest.raises(KeyboardInterrupt):
            with cond:
                cond.wait(30)
        assert not cond._lock.locked()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_signal_landing_in_a_del_is_raised_after_it():
    """Ctrl-C or SIGTERM landing in a __del__ (a library object collected mid-run, or at exit)
    raised there would be printed as ignored, a traceback on stderr, and lost (the kill test, 1
    in some hundred runs of `convert`). mlxmoe's handler raises it a few ms later, elsewhere."""
    from mlxmoe import signals

    unraisable = []
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable.append

    class Collected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # its handler runs in this frame, once the call returns

    previous = signal.signal(signal.SIGINT, signals.interrupting(signal.default_int_handler))
    try:
        with pytest.raises(KeyboardInterrupt):
            Collected()
            time.sleep(5)  # the signal, sent again, lands here
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
    assert unraisable == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the ignored Terminated)
def test_a_sigterm_lost_in_a_finaliser_still_ends_the_recording(tmp_path, monkeypatch, capsys):
    """SIGTERM's handler raises in whatever Python code runs; where that is a finaliser (a
    generator the garbage collector closes, a __del__), Python prints the exception and goes
    on: the recording must still stop at the next prompt, save, and exit 130."""
    from mlxmoe import api, cli

    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(["Il gatto e la volpe"] * 6) + "\n")
    out, ran = tmp_path / "p.json", []

    class Finaliser:
        def __del__(self):  # the signal lands here: the handler's Terminated is ignored
            cli._terminate(signal.SIGTERM, None)

    def on_prompt_two(model, tokenizer, prompts, max_tokens, on_prompt):
        def each(i, text):
            ran.append(i)
            if i == 1:
                Finaliser()
            on_prompt(i, text)
        return run_prompts(model, tokenizer, prompts, max_tokens, on_prompt=each)

    run_prompts = api.run_prompts
    monkeypatch.setattr(api, "run_prompts", on_prompt_two)
    monkeypatch.setattr(cli, "_terminated", [], raising=False)
    monkeypatch.setattr(signal, "signal", lambda *a: signal.SIG_DFL)  # (this test process keeps its handlers)
    with pytest.raises(SystemExit) as exit_:
        cli.run(["profile", "record", "--prompts", str(prompts), "-w", "x", "-o", str(out), "--max-tokens", "4",
                 "--cache-experts", "16"])
    err = capsys.readouterr().err
    assert exit_.value.code == 130, err
    assert ran == [0, 1] and "keeping what was recorded" in err
    assert ActivationProfile.load(out).tokens_total > 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the ignored Terminated)
def test_a_sigterm_lost_in_a_finaliser_still_ends_a_generation(monkeypatch, capsys):
    """As for a recording: a SIGTERM whose Terminated a finaliser swallowed ends `generate` at
    the next token, which exits 130 with its figures (of what ran), not at the reply's end."""
    from mlxmoe import api, cli

    class Finaliser:
        def __del__(self):  # the signal lands here: the handler's Terminated is ignored
            cli._terminate(signal.SIGTERM, None)

    def lost_at_token_two(*args, **kwargs):
        for i, response in enumerate(stream_generate(*args, **kwargs)):
            if i == 1:
                Finaliser()
            yield response

    stream_generate = api.stream_generate
    monkeypatch.setattr(api, "stream_generate", lost_at_token_two)
    monkeypatch.setattr(cli, "_terminated", [], raising=False)
    monkeypatch.setattr(signal, "signal", lambda *a: signal.SIG_DFL)  # (this test process keeps its handlers)
    with pytest.raises(SystemExit) as exit_:
        cli.run(["generate", "--prompt", "Il gatto e la volpe", "--max-tokens", "40", "--cache-experts", "16"])
    captured = capsys.readouterr()
    assert exit_.value.code == 130, captured.err
    assert "interrupted" in captured.err
    assert "generation: 1 token" in captured.err, captured.err  # (the token after the signal not printed; alone, 13)


# 12 (issue 44, item 5: only size and header count, not the mtime)
def test_a_touched_or_identically_replaced_shard_is_read_on(demo):
    """rsync and backup tools touch a shard or put an identical copy in its place: the
    generation goes on, token for token, and the reads after it go on too."""
    shard = demo / "model.safetensors"
    model, tokenizer = mlxmoe.load(str(demo), cache_experts=8, prefetch=0)
    try:
        want = [r.token for r in mlxmoe.stream_generate(model, tokenizer, "Il gatto e la volpe sono", max_tokens=20)]
        got, store = [], model.expert_cache.store
        for i, r in enumerate(mlxmoe.stream_generate(model, tokenizer, "Il gatto e la volpe sono", max_tokens=20)):
            got.append(r.token)
            if i in (2, 8):  # touched mid-generation
                os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10 ** 9))
                read = store.useful_bytes
            if i == 14:  # an identical copy renamed over it (rsync's way)
                shutil.copy2(shard, demo / "copy")
                os.utime(demo / "copy", ns=(0, 10 ** 9))
                os.replace(demo / "copy", shard)
                read = store.useful_bytes
        assert got == want
        assert store.useful_bytes > read  # experts were read after the last change
        assert {Path(f): s for f, s in store.shards.stamps.items()}[shard] == (shard.stat().st_size, 10 ** 9)  # the new one
    finally:
        model.expert_cache.close()


def test_a_shard_whose_header_changed_is_named_and_can_be_put_back(demo):
    """A shard whose safetensors header changed (same size) fails the generation, naming it and
    how to recover; once the original is back, generation goes on, token for token."""
    shard = demo / "model.safetensors"
    model, tokenizer = mlxmoe.load(str(demo), cache_experts=8, prefetch=0)
    try:
        want = mlxmoe.generate(model, tokenizer, "Il gatto e la volpe sono", max_tokens=20)
        data = shard.read_bytes()
        at = data.index(b'"dtype"')
        with open(shard, "r+b") as f:  # in place, the size kept
            f.seek(at + 1)
            f.write(b"D")
        with pytest.raises(MlxmoeError, match="changed on disk") as e:
            mlxmoe.generate(model, tokenizer, "Le chat et le chien", max_tokens=20)
        assert str(shard) in str(e.value) and "header differs" in str(e.value)
        assert "put the original back, or load the model again" in str(e.value)
        with open(shard, "r+b") as f:
            f.seek(at + 1)
            f.write(b"d")
        assert mlxmoe.generate(model, tokenizer, "Il gatto e la volpe sono", max_tokens=20) == want
        shard.write_bytes(data[:-4096])  # a size change is a change too
        with pytest.raises(MlxmoeError, match=rf"since the model was loaded \(size {len(data)} -> {len(data) - 4096} "):
            mlxmoe.generate(model, tokenizer, "Der Hund und die Katze", max_tokens=20)
    finally:
        model.expert_cache.close()


def test_a_trace_closed_before_any_routing_leaves_nothing(tmp_path):
    from mlxmoe.workload.trace import TraceWriter, read_trace

    empty = TraceWriter(tmp_path / "empty.trace.jsonl", 2, 4, 1)
    empty.close()
    assert list(tmp_path.iterdir()) == []
    whole = TraceWriter(tmp_path / "t.trace.jsonl", 2, 4, 1)
    whole.write(0, 0, [1])
    whole.close()
    assert [p.name for p in tmp_path.iterdir()] == ["t.trace.jsonl"]
    assert read_trace(tmp_path / "t.trace.jsonl") is not None


def test_a_ctrl_c_while_a_calls_lines_are_made_leaves_none_of_them(tmp_path, monkeypatch):
    """A prompt's layer call is one line per token, written as one: a Ctrl-C (`mlxmoe profile
    record`) while they are made leaves the trace readable, the call whole or absent."""
    from mlxmoe.caching.experts import LayerCall
    from mlxmoe.workload.trace import TraceWriter, read_trace

    writer = TraceWriter(tmp_path / "t.trace.jsonl", 2, 4, 1)
    rows = np.array([[0], [1], [2], [3], [1]])
    writer.observe(LayerCall(0, 0, rows, None, 5, [0, 1, 2, 3], None, None, 5))
    line, made = TraceWriter.line, []

    def interrupted(self, *args, **kwargs):
        made.append(args)
        if len(made) == 3:
            raise KeyboardInterrupt
        return line(self, *args, **kwargs)

    monkeypatch.setattr(TraceWriter, "line", interrupted)
    with pytest.raises(KeyboardInterrupt):
        writer.observe(LayerCall(1, 0, rows, None, 5, [0, 1, 2, 3], None, None, 0))
    writer.close()
    _, records = read_trace(tmp_path / "t.trace.jsonl")
    assert [(r[2], r[6]) for r in records] == [(0, 5)] * 5  # the first call, not a part of the second
