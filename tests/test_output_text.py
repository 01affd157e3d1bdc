"""Issue 44, item 6, as a user reads the output: a checkpoint of another model's shape
says so in a line (the first mismatching tensor, the count), a fallback file loads
whatever its name, long steps say what they wait on (a bar on a terminal, lines in a
log), fit's table and chart say what they show, the cache's size before lossy figures."""

import json
import os
import pty
import shutil
import subprocess
import sys

import pytest
from safetensors.numpy import load_file, save_file

import mlxmoe
from conftest import run_cli
from mlxmoe import MlxmoeError
from mlxmoe.budget import format_size


@pytest.fixture
def edited(checkpoint, tmp_path):
    """edited(change) -> a copy of a tiny checkpoint whose tensors `change(tensors)` edited
    (the index's weight map kept in step)."""
    def make(change):
        path = tmp_path / f"model{len(list(tmp_path.iterdir()))}"
        shutil.copytree(checkpoint("qwen3_moe", quant="4bit"), path)
        f = path / "model.safetensors"
        tensors = load_file(f)
        change(tensors)
        save_file(tensors, f, metadata={"format": "mlx"})
        index = path / "model.safetensors.index.json"
        if index.exists():
            data = json.loads(index.read_text())
            data["weight_map"] = {name: f.name for name in tensors}
            index.write_text(json.dumps(data))
        return path
    return make


def load_error(path):
    with pytest.raises(MlxmoeError) as e:
        mlxmoe.load(str(path))
    return str(e.value)


def test_a_missing_or_extra_tensor_is_named_in_one_line(edited):
    import numpy as np

    missing = edited(lambda t: t.pop("model.layers.0.input_layernorm.weight"))
    message = load_error(missing)
    assert message == (f"{missing}: 1 parameter does not match the 'qwen3_moe' model of config.json (first: "
                       "model.layers.0.input_layernorm.weight missing); is this checkpoint for this architecture?")
    extra = edited(lambda t: t.update({"model.layers.1.extra.weight": np.zeros((4, 4), np.float32)}))
    message = load_error(extra)
    assert "\n" not in message and "1 parameter does not match" in message
    assert "(first: model.layers.1.extra.weight not in the model)" in message
    # the CLI too: one line on stderr, not a line per parameter
    code, _, err = run_cli("info", "--model", extra)
    assert code != 0 and err.strip().splitlines() == [f"error: {message}"]


def test_many_mismatches_are_counted_not_listed(edited):
    """Every norm's weight gone: the count and the first, sorted, in one line."""
    dropped = []

    def drop(tensors):
        dropped.extend(n for n in tensors if n.endswith("norm.weight"))
        for name in dropped:
            del tensors[name]

    message = load_error(edited(drop))
    assert len(dropped) > 10  # each layer's 4 (input, post-attention, q and k) and the final one
    assert "\n" not in message and len(message) < 300, message
    assert f": {len(dropped)} parameters do not match" in message and f"(first: {min(dropped)} missing)" in message


def test_a_checkpoint_of_another_architecture_restacked(checkpoint, tmp_path):
    """convert (restack) says it as load does."""
    path = tmp_path / "model"
    shutil.copytree(checkpoint("qwen3_moe", quant="4bit"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="mixtral", num_local_experts=config["num_experts"])
    (path / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli("convert", path, tmp_path / "out")
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert "parameters do not match the 'mixtral' model" in lines[0] and "(first: model." in lines[0]
    assert not (tmp_path / "out").exists()


def test_fallback_file_of_any_name(cli, checkpoint, tmp_path):
    """convert --fallback-bits writes a file --fallback reads whatever its name; a name
    missing its .safetensors, or a file that is not one, is told what is needed."""
    path, dst, stats = checkpoint("qwen3_moe", quant="4bit"), tmp_path / "demo.fb", tmp_path / "s.json"
    code, err = cli("convert", "--fallback-bits", "3", path, dst)
    assert code == 0 and dst.is_file(), err
    code, err = cli("generate", "-m", path, "--cache-experts", "6", "--fallback", dst, "--prompt", "The cat",
                    "--max-tokens", "6", "--stats-json", stats)
    assert code == 0, err
    assert json.loads(stats.read_text())["substituted"] > 0
    named = tmp_path / "fb3.safetensors"
    dst.rename(named)
    code, err = cli("info", "-m", path, "--fallback", tmp_path / "fb3")
    assert code != 0 and f"did you mean {named}?" in err
    (tmp_path / "notes.txt").write_text("not fallback copies")
    code, err = cli("info", "-m", path, "--fallback", tmp_path / "notes.txt")
    assert code != 0 and "notes.txt: not a readable safetensors file" in err and "convert --fallback-bits" in err


def vllm_routes(path, requests=3, tokens=4, layers=2):
    with open(path, "w") as f:
        for req in range(requests):
            for t in range(tokens):
                for layer in range(layers):
                    f.write(json.dumps({"type": "route", "req_id": f"r{req}", "token_idx": t, "layer": layer,
                                        "topk_ids": [t % 4, 4 + layer], "topk_weights": [0.5, 0.5],
                                        "phase": "prefill" if t < 2 else "decode"}) + "\n")
    return path


@pytest.fixture
def said_at_once(monkeypatch):
    """cli.notice says its line at once (a wait as long as its seconds, without waiting)."""
    import mlxmoe.cli as cli_module

    class Said:
        def cancel(self):
            pass

    def notice(seconds, line):
        text = line()
        if text:
            print(text, file=sys.stderr)
        return Said()

    monkeypatch.setattr(cli_module, "notice", notice)


def test_long_steps_say_what_they_wait_on_a_line_each(tmp_path, said_at_once):
    """Off a terminal each stage is one plain line, no carriage return: trace import's read
    and write, trace replay's read and replay, profile from-trace's read."""
    src, trace = vllm_routes(tmp_path / "routes.jsonl"), tmp_path / "t.jsonl"
    code, _, err = run_cli("trace", "import", "vllm", src, "-o", trace, "--num-experts", "8")
    assert code == 0, err
    lines = err.splitlines()
    assert lines[:2] == [f"reading {src}...", f"writing {trace}"] and lines[-1].startswith(f"saved {trace}")
    assert "\r" not in err
    code, out, err = run_cli("trace", "replay", trace, "--cache-experts", "4", "--policy", "lru")
    assert code == 0 and out.startswith("lru: hit rate"), err
    assert err == f"reading {trace} and replaying it, a line per policy as each ends...\n"
    code, _, err = run_cli("profile", "from-trace", trace, "-o", tmp_path / "p.json", "--no-curve")
    assert code == 0 and err.startswith("reading 1 trace and counting their routing...\n"), err


def test_trace_import_draws_a_bar_on_a_terminal(tmp_path):
    src, trace = vllm_routes(tmp_path / "routes.jsonl", requests=40), tmp_path / "t.jsonl"
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "mlxmoe", "trace", "import", "vllm", str(src), "-o", str(trace),
                             "--num-experts", "8"], stderr=slave, stdout=subprocess.DEVNULL, env=env)
    os.close(slave)
    said = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # (the terminal closed with the process)
            break
        if not chunk:
            break
        said += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, said
    text = said.decode()
    assert f"\rwriting {trace}" in text.replace("\x1b[?25l", "") and "100%" in text, text


def test_fit_table_and_chart_say_what_they_show(checkpoint, tmp_path, monkeypatch):
    """fit's columns name what they hold in the budget's units; its chart's x axis runs
    from the smallest budget that fits to the largest, each tick label inside the image."""
    from mlxmoe.workload import heatmap

    drawn = []
    real_text = heatmap.Canvas.text

    def text(self, x, y, s, color=heatmap.INK, anchor="left", vertical=False):
        drawn.append((x, y, s, anchor, vertical, self.img.shape[1]))
        return real_text(self, x, y, s, color, anchor, vertical)

    monkeypatch.setattr(heatmap.Canvas, "text", text)
    png = tmp_path / "fit.png"
    code, out, err = run_cli("fit", "-m", checkpoint("qwen3_moe", quant="4bit"), "--disk-gbps", "2", "--backend",
                             "cpu", "--png", png, "--memory-budget", "100MB", "--memory-budget", "1KB",
                             "--memory-budget", "20MB")
    assert code == 0, err
    header = next(l for l in out.splitlines() if "budget" in l and "hit rate" in l)
    assert "MiB" not in out and "run takes" in header and "read/token" in header
    assert "  run takes: the memory the run holds" in out
    rows = [l.split() for l in out.splitlines() if l.strip().startswith(("20.0 MB", "100.0 MB"))]
    assert [r[7:9] for r in rows] == [["0", "B"]] * 2  # read/token: a size with its unit
    ticks = [(x, s, width) for x, y, s, anchor, vertical, width in drawn
             if anchor == "center" and not vertical and s != "memory budget"]
    assert len(ticks) == 5
    assert ticks[0][1] == format_size(20 << 20) and ticks[-1][1] == format_size(100 << 20)  # 1KB does not fit
    for x, s, width in ticks:
        assert x + (6 * len(s)) // 2 <= width, (s, x, width)  # inside the image


def test_cache_size_before_lossy_figures_and_profile_bias_last(tmp_path):
    from mlxmoe.cli import expert_line
    from mlxmoe.workload.profile import ActivationProfile

    stats = {"hit_rate": 0.5, "bytes_read": 1 << 20, "loads_demand": 3, "loads_prefetched": 1, "cache_experts": 6,
             "cache_bytes": 6 << 10, "fallback_bytes": 2 << 10, "substituted": 4, "skipped": 1, "peak_memory": 1 << 20,
             "peak_rss": 1 << 30}
    line = expert_line(stats, 1 << 20)
    assert "cache 6 experts (6.0 KB, low-bit copies 2.0 KB), 1 expert skipped, 4 experts low-bit;" in line
    p = ActivationProfile(2, 8, 2, workload="w", tokens_total=10, recommended_cache_bias=1.5,
                          curve={"lru": [[4, 0.5], [16, 1.0]]})
    p.save(tmp_path / "p.json")
    code, out, err = run_cli("profile", "show", tmp_path / "p.json")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[-1] == "recommended cache bias: 1.5 (lossy; --cache-bias profile uses it)"
    assert lines.index("predicted hit rate by cache size:") < len(lines) - 1


def test_a_chart_of_one_point_shows_it(tmp_path, monkeypatch):
    """fit --png of one budget: its point drawn (no line joins it to another), the axis from 0."""
    import numpy as np

    from mlxmoe.workload import heatmap

    images = []
    real_png = heatmap.Canvas.png
    monkeypatch.setattr(heatmap.Canvas, "png", lambda self: images.append(self.img) or real_png(self))
    heatmap.write_lines_png(tmp_path / "one.png", {"likely": [[20 << 20, 5.0]]}, 20 << 20, 10.0, "budget", "tok/s",
                            "one", x_min=20 << 20)
    assert (images[0] == np.array(heatmap.COLORS[0], np.uint8)).all(axis=-1).sum() >= 9
