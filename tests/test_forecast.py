"""`mlxmoe fit`: the forecast reads headers, times the disk on non-expert tensors only, and
gives ordered ranges; a budget below the minimum is a row that says so."""

import json
from pathlib import Path

import pytest

from conftest import run_cli
from mlxmoe import backend as backends
from mlxmoe.api import checkpoint_plan
from mlxmoe.budget import parse_size
from mlxmoe.forecast import family_curves, forecast, hit_rates
from mlxmoe.loader import open_checkpoint
from mlxmoe.workload.profile import ActivationProfile
from mlxmoe.storage.store import ExpertStore


def expert_spans(store):
    return [(r.file, r.offset, r.offset + r.nbytes) for layer in store.ranges for row in layer for r in row]


@pytest.mark.parametrize("quant", [None, "4bit"])
def test_fit_times_the_disk_without_reading_an_expert(checkpoint, on_disk, monkeypatch, quant):
    path = on_disk(checkpoint("qwen3_moe", quant=quant))
    reads = []
    real = ExpertStore._read_run

    def spy(self, run):
        reads.append((run[0], run[1], run[2]))
        return real(self, run)

    monkeypatch.setattr(ExpertStore, "_read_run", spy)
    be = backends.detect("cpu")
    ckpt = open_checkpoint(str(path))
    be.apply_dtype_policy(ckpt.model)
    total = ckpt.num_layers * ckpt.num_experts
    budgets = [checkpoint_plan(ckpt, be, cache_experts=c).budget for c in (ckpt.top_k, total // 2, total)]
    f = forecast(ckpt, be, budgets, prompt_tokens=16, new_tokens=16)
    assert reads, "the disk was not timed"
    experts = expert_spans(ckpt.store)
    for file, lo, hi in reads:  # no request touches an expert's bytes
        assert not any(f == file and lo < e_hi and e_lo < hi for f, e_lo, e_hi in experts), (file, lo, hi)
    assert ckpt.store.useful_bytes == 0 and f["disk_bytes_per_second"] > 0
    assert f["compute_seconds_per_token"] > 0
    rows = f["budgets"]
    for r in rows:
        d, t, h = r["decode_tps"], r["ttft_seconds"], r["hit_rate"]
        assert d["low"] <= d["likely"] <= d["high"]
        assert t["low"] <= t["likely"] <= t["high"]
        assert r["read_bytes_per_token"]["low"] <= r["read_bytes_per_token"]["high"]
        assert 0 <= h["low"] <= h["likely"] <= h["high"] <= 1
        assert r["memory_bytes"] <= r["budget"]
    # more budget: never slower, never more reads; every expert resident: no reads at all
    assert [r["decode_tps"]["likely"] for r in rows] == sorted(r["decode_tps"]["likely"] for r in rows)
    assert rows[-1]["read_bytes_per_token"]["likely"] == 0 and rows[-1]["hit_rate_source"] == "every expert resident"


def test_fit_cli_json_given_disk_reads_nothing(checkpoint, on_disk, monkeypatch):
    path = on_disk(checkpoint("qwen3_moe", quant="4bit"))
    monkeypatch.setattr(ExpertStore, "_read_run", lambda self, run: pytest.fail(f"read {run[:3]}"))
    code, out, err = run_cli("fit", "-m", path, "--disk-gbps", "2", "--memory-budget", "1KB",
                             "--memory-budget", "1GB", "--json", "--backend", "cpu")
    assert code == 0, err
    f = json.loads(out)
    assert f["disk_bytes_per_second"] == 2e9 and any("given" in a for a in f["assumed"])
    small, big = f["budgets"]
    assert "below the minimum" in small["error"] and small["budget"] == parse_size("1KB")
    assert big["budget"] == parse_size("1GB") and big["decode_tps"]["high"] > 0


def test_fit_text_names_what_was_measured(checkpoint, on_disk, tmp_path):
    png = tmp_path / "fit.png"
    code, out, err = run_cli("fit", "-m", on_disk(checkpoint("qwen3_moe", quant="4bit")), "--backend", "cpu",
                             "--png", png)
    assert code == 0, err
    assert "measured: disk" in out and "measured: compute" in out and "assumed:" in out
    assert "decode tok/s" in out and "hit rates:" in out and f"chart: {png}" in out
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_hit_rates_from_profile_curve_or_real_routing(tmp_path):
    families = {f for f, _ in family_curves()}
    assert {"qwen3_moe", "gemma4", "gpt_oss"} <= families
    (lo, likely, hi), source = hit_rates("qwen3_moe", 0.25, 100)
    assert lo <= likely <= hi and "real routing of qwen3_moe" in source
    (lo2, likely2, hi2), source2 = hit_rates("mixtral_unknown", 0.25, 100)
    assert (lo2, hi2) == (lo, hi) and "other families" in source2
    # smaller caches hit less
    assert hit_rates("qwen3_moe", 0.05, 10)[0][1] < likely < hit_rates("qwen3_moe", 0.5, 200)[0][1]
    # a profile's curve: as it is (a first run) at low, over its value at every expert above
    p = ActivationProfile(num_layers=2, num_experts=8, top_k=2, curve={"activation-floor": [[4, 0.4], [16, 0.8]]})
    assert hit_rates("qwen3_moe", 0.5, 8, profile=p)[0] == pytest.approx((0.5333, 0.6667, 0.6667), abs=1e-4)
    assert hit_rates("qwen3_moe", 1.0, 16, profile=p)[0] == (1.0, 1.0, 1.0)


def fake_hub(monkeypatch, folder, repo_id):
    """huggingface_hub's get_safetensors_metadata and hf_hub_download serving `folder`'s
    config.json and safetensors headers as the hub's range requests do (nothing else);
    returns the files hf_hub_download was asked for."""
    import huggingface_hub
    from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo

    from mlxmoe.storage.shards import shard_files

    asked = []

    def metadata(repo, revision=None):
        assert repo == repo_id
        files, weight_map = {}, {}
        for shard in shard_files(folder):
            raw = shard.read_bytes()
            header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
            meta = header.pop("__metadata__", {})
            files[shard.name] = SafetensorsFileMetadata(meta, {name: TensorInfo(h["dtype"], h["shape"], tuple(h["data_offsets"]))
                                                               for name, h in header.items()})
            weight_map.update((name, shard.name) for name in header)
        return SafetensorsRepoMetadata(None, len(files) > 1, weight_map, files)

    def download(repo, filename, revision=None):
        assert repo == repo_id
        asked.append(filename)
        return str(folder / filename)

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", metadata)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    return asked


def test_fit_a_hub_repo_from_its_headers_alone(checkpoint, on_disk, monkeypatch, tmp_path):
    """A repo id: the config and the shards' headers only (sparse shards, holes for the
    weights), the same forecast as from the real files; the disk timed on a scratch file in
    the hub's cache folder, removed after; no read reaches the real checkpoint."""
    import huggingface_hub.constants

    path = on_disk(checkpoint("qwen3_moe", quant="4bit"))
    asked = fake_hub(monkeypatch, path, "someone/tiny-moe")
    args = ("--memory-budget", "1GB", "--json", "--backend", "cpu", "--prompt-tokens", "8")
    code, out, err = run_cli("fit", "-m", path, "--disk-gbps", "2", *args)
    assert code == 0, err
    local = json.loads(out)
    reads = []
    real = ExpertStore._read_run
    monkeypatch.setattr(ExpertStore, "_read_run", lambda self, run: reads.append(run[0]) or real(self, run))
    cache_folder = tmp_path / "hub-cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache_folder))
    code, out, err = run_cli("fit", "-m", "someone/tiny-moe", *args)
    assert code == 0, err
    remote = json.loads(out)
    assert asked == ["config.json"] and remote["model"] == "someone/tiny-moe"
    assert reads and all(Path(file).parent == cache_folder for file in reads)  # the scratch file only
    assert list(cache_folder.iterdir()) == []  # and it is gone
    assert any("scratch file" in m for m in remote["measured"]) and remote["disk_bytes_per_second"] > 0
    for key in ("memory_bytes", "cache_experts", "hit_rate", "read_bytes_per_token"):
        assert remote["budgets"][0][key] == local["budgets"][0][key], key
    # and without the hub: a clear error naming the repo
    import huggingface_hub

    def offline(*a, **k):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", offline)
    code, out, err = run_cli("fit", "-m", "someone/tiny-moe", *args)
    assert code != 0 and "someone/tiny-moe" in err and "headers" in err


def test_the_scratch_file_fits_an_expert_and_is_closed_and_removed(checkpoint, on_disk, tmp_path):
    """A scratch file asked smaller than one expert's ranges grows to fit them (the disk is
    timed, not None); it is closed and removed after."""
    from mlxmoe.forecast import scratch_disk_rate

    ckpt = open_checkpoint(str(on_disk(checkpoint("qwen3_moe", quant="4bit"))))
    try:
        folder = tmp_path / "scratch"
        (rate, done, requests), nbytes = scratch_disk_rate(ckpt.store, folder, nbytes=4096)
        assert rate > 0 and requests > 0 and nbytes > 4096
        assert list(folder.iterdir()) == [] and not any(str(folder) in str(f) for f in ckpt.store.reader._fds)
    finally:
        ckpt.store.close()
