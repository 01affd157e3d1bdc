"""bench/bookkeeping.py: the demo's bookkeeping beside an older commit's, each side in its own
process with its own mlxmoe (bench_profiles.py --baseline)."""

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import bookkeeping  # noqa: E402
import system  # noqa: E402
from mlxmoe.loader import DEMO_MODEL  # noqa: E402


def test_each_side_runs_its_own_mlxmoe_and_the_ratio_is_theirs(tmp_path, capfd):
    base = tmp_path / "base"
    shutil.copytree(ROOT / "mlxmoe", base / "mlxmoe", ignore=shutil.ignore_patterns("__pycache__"))
    # the baseline's package tells itself apart: it reports its bookkeeping 1000x
    counters = base / "mlxmoe" / "caching" / "counters.py"
    line = '"bookkeeping_seconds": self.bookkeeping_seconds,'
    assert line in counters.read_text()
    counters.write_text(counters.read_text().replace(line, '"bookkeeping_seconds": 1000 * self.bookkeeping_seconds,'))
    out = bookkeeping.side_by_side(str(DEMO_MODEL), "Il gatto dorme", base, "a copy", runs=1, tokens=6, timeout=300)
    mine, theirs = out["runs"]["this tree"][0], out["runs"]["baseline"][0]
    assert Path(mine["mlxmoe"]).parent == ROOT / "mlxmoe"
    assert Path(theirs["mlxmoe"]).parent == base / "mlxmoe"
    L = bookkeeping._experts(str(DEMO_MODEL))[0]
    for r in (mine, theirs):
        assert r["layer_calls"] == 6 * L and r["bookkeeping_seconds"] > 0
    assert out["ratio"] == pytest.approx(bookkeeping.per_call_us(mine) / bookkeeping.per_call_us(theirs))
    assert out["ratio"] < 0.01  # (each side's figure is its own package's)
    printed = capfd.readouterr().out
    assert "this tree / baseline" in printed and "a copy" in printed


def test_a_child_that_imported_another_mlxmoe_stops(tmp_path):
    import mlxmoe

    with pytest.raises(SystemExit, match="not from"):
        system.imported_from(mlxmoe, tmp_path)
    system.imported_from(mlxmoe, ROOT)


def test_a_baseline_folder_without_mlxmoe_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no mlxmoe/__init__.py"):
        system.baseline_code(folder=str(tmp_path))
    with pytest.raises(SystemExit, match="not both"):
        system.baseline_code("HEAD", str(tmp_path))
