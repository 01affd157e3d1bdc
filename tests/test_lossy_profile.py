"""A profile's recommended cache bias (profile record --recommend-bias): stored in the JSON,
shown by profile show, taken by cache_bias="profile" / --cache-bias profile only when asked;
profiles without one load as before, and asking one for it is refused saying why."""

import json

import pytest

import mlxmoe
from conftest import run_cli
from mlxmoe.errors import MlxmoeError
from mlxmoe.workload.profile import ActivationProfile


@pytest.fixture(scope="module")
def recorded(checkpoint, tmp_path_factory):
    """(checkpoint, a profile recorded with --recommend-bias 1.25, one recorded without)."""
    path, tmp = checkpoint("mixtral"), tmp_path_factory.mktemp("bias")
    (tmp / "p.txt").write_text("The cat sleeps on the sofa\nIl gatto dorme\n")
    out = {}
    for name, extra in (("with", ["--recommend-bias", "1.25"]), ("without", [])):
        code, _, err = run_cli("profile", "record", "-m", path, "--prompts", tmp / "p.txt", "-w", "w", "-o",
                               tmp / f"{name}.json", "--max-tokens", "4", *extra)
        assert code == 0, err
        out[name] = tmp / f"{name}.json"
    return path, out["with"], out["without"]


def test_recorded_shown_and_used_only_when_asked(recorded):
    path, with_bias, without = recorded
    assert json.loads(with_bias.read_text())["recommended_cache_bias"] == 1.25
    assert "recommended_cache_bias" not in json.loads(without.read_text())  # old profiles: written as before
    code, out, _ = run_cli("profile", "show", with_bias)
    assert code == 0 and "recommended cache bias: 1.25" in out
    code, out, _ = run_cli("profile", "show", without, "--json")
    assert code == 0 and json.loads(out)["recommended_cache_bias"] is None
    model, _ = mlxmoe.load(str(path), cache_experts=6, profile=str(with_bias), cache_bias="profile")
    assert model.expert_runtime.lossy.cache_bias == 1.25
    assert all(type(e._router.gate).__name__.startswith("Biased") for e in model.expert_runtime.checkpoint.experts)
    model.expert_runtime.close()
    model, _ = mlxmoe.load(str(path), cache_experts=6, profile=str(with_bias))  # not asked: exact
    assert model.expert_runtime.lossy is None
    model.expert_runtime.close()


def test_the_cli_takes_it_and_the_summary_counts_it(recorded, tmp_path):
    path, with_bias, _ = recorded
    stats = tmp_path / "s.json"
    code, _, err = run_cli("generate", "-m", path, "--cache-experts", "6", "--profile", with_bias, "--cache-bias",
                           "profile", "--prompt", "The quick brown fox jumps", "--max-tokens", "12",
                           "--stats-json", stats)
    assert code == 0, err
    assert json.loads(stats.read_text())["biased"] > 0 and "biased in" in err


def test_asking_without_one_is_refused(recorded):
    path, _, without = recorded
    with pytest.raises(MlxmoeError, match="recommends no cache bias"):
        mlxmoe.load(str(path), cache_experts=6, profile=str(without), cache_bias="profile")
    with pytest.raises(MlxmoeError, match="give one"):
        mlxmoe.load(str(path), cache_experts=6, cache_bias="profile")
    code, _, err = run_cli("generate", "-m", path, "--cache-bias", "profile", "--prompt", "x")
    assert code != 0 and "--profile" in err and "Traceback" not in err


@pytest.mark.parametrize("value", [-1, "1", True, float("inf")])
def test_bad_values_are_refused(recorded, tmp_path, value):
    _, with_bias, _ = recorded
    data = json.loads(with_bias.read_text())
    data["recommended_cache_bias"] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data).replace("Infinity", "1e999"))
    with pytest.raises(MlxmoeError, match="recommended_cache_bias"):
        ActivationProfile.load(bad)


def test_bad_options_are_refused_naming_them(tmp_path):
    code, _, err = run_cli("profile", "record", "-m", "x", "--prompts", __file__, "-w", "w", "-o", tmp_path / "o.json",
                           "--recommend-bias", "-0.5")
    assert code == 2 and "--recommend-bias" in err
    code, _, err = run_cli("generate", "-m", "x", "--cache-bias", "banana", "-p", "x")
    assert code == 2 and "--cache-bias" in err and "profile" in err
    with pytest.raises(MlxmoeError, match="cache_bias"):
        mlxmoe.load("x", cache_bias="Profile")


def test_merge_keeps_it_where_all_agree(recorded):
    _, with_bias, without = recorded
    a, b = ActivationProfile.load(with_bias), ActivationProfile.load(without)
    assert ActivationProfile.merge([a, a]).recommended_cache_bias == 1.25
    assert ActivationProfile.merge([a, b]).recommended_cache_bias is None
