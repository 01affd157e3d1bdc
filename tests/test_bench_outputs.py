"""The benchmarks' outputs under mlxmoe's output rule (issue 43, files.check_outputs through
bench/system.py): each bench script that writes a file refuses, before any work, an output
that is one of its inputs (a file of the checkpoint folder, a trace, the profiles folder, the
heat data...) or another of its outputs, naming both, the input's bytes unchanged. The
scripts run from a copy of bench/ (their fixed outputs land in the copy's out/), with this
repository on PYTHONPATH as an installed mlxmoe would be. Every script's --help works."""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
HEAT = "data/qwen3-30b-a3b-expert-heat.json"
ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "demo")])}

# script -> [(arguments, the output refused, the input it names)]; {M} the checkpoint, {B} the
# copy of bench/, {R} a real-routing folder, {P} a profile
CASES = {
    "bench_disk.py": [(["--model", "{M}", "--output", "{M}/config.json"], "{M}/config.json", "{M}"),
                      (["--model", "{M}", "--routing", "{R}/host.route.csv", "--output", "{R}/host.route.csv"],
                       "{R}/host.route.csv", "{R}/host.route.csv")],
    "bench_runtime.py": [(["--checkpoint", "{M}", "--output", "{M}/model.safetensors"], "{M}/model.safetensors",
                          "{M}")],
    "bench_host.py": [(["--checkpoint", "{M}", "--output", "{M}/config.json"], "{M}/config.json", "{M}"),
                      (["--routing", "{R}/host.route.csv", "--output", "{R}/host.route.csv"], "{R}/host.route.csv",
                       "{R}/host.route.csv")],
    "bench_io.py": [(["--checkpoint", "{M}", "--out", "{M}/tokenizer.json"], "{M}/tokenizer.json", "{M}")],
    "bench_forecast.py": [(["--checkpoint", "{M}", "--output", "{M}/config.json"], "{M}/config.json", "{M}")],
    "bench_lossy.py": [(["--model", "{M}", "--output", "{M}/config.json"], "{M}/config.json", "{M}"),
                       (["--model", "{M}", "--recommend-into", "{P}", "--output", "{P}"], "{P}", "{P}")],
    "bench_prefill.py": [(["--checkpoint", "{M}", "--output", "{M}/config.json"], "{M}/config.json", "{M}")],
    "bench_server.py": [(["--model", "{M}", "--out", "{M}/config.json"], "{M}/config.json", "{M}")],
    "bench_batch.py": [(["--model", "{M}", "--out", "{M}/config.json"], "{M}/config.json", "{M}")],
    "roundtrip.py": [(["--rtt", "150", "--report", "{M}/config.json", "-m", "mlxmoe", "serve", "--model", "{M}"],
                      "{M}/config.json", "{M}")],
    "demo_routing.py": [(["--model", "{M}", "--out", "{M}/config.json"], "{M}/config.json", "{M}")],
    "routing_curves.py": [(["--routing", "{R}", "--out", "{R}/qwen.route.csv"], "{R}/qwen.route.csv", "{R}")],
    "traces.py": [(["-o", "{B}/" + HEAT], "{B}/" + HEAT, "{B}/" + HEAT)],
    # a plot whose name is a link to the heat: the link's target is what would be written
    "plots.py": [(["--out", "{B}/links"], "{B}/links/policies-synthetic.svg", "{B}/" + HEAT)],
    "bench_policies.py": [(["--traces", "{B}/out/policies.json"], "{B}/out/policies.json", "{B}/out/policies.json")],
    "bench_profiles.py": [(["--model", "{M}", "--profiles", "{B}/out", "--only-bookkeeping"],
                           "{B}/out/bookkeeping.json", "{B}/out")],
    "bench_distributed.py": [(["--checkpoint", "{B}/out"], "{B}/out/distributed.json", "{B}/out")],
    "device_kit.py": [(["run", "--kit", "{M}", "--out", "{M}"], "{M}/summary.txt", "{M}")],
}


def digest(folder):
    """{file: sha256} of everything under `folder` (links as their text)."""
    out = {}
    for path in sorted(Path(folder).rglob("*")):
        if path.is_symlink():
            out[str(path)] = os.readlink(path)
        elif path.is_file():
            out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def places(checkpoint, tmp_path_factory):
    """{M}, {B}, {R}, {P}: a tiny checkpoint, a copy of bench/ (its scripts and the heat data),
    a real-routing folder and a profile, all under a temp folder."""
    base = tmp_path_factory.mktemp("bench-outputs").resolve()
    model = base / "model"
    shutil.copytree(checkpoint("qwen3_moe"), model)
    copy = base / "bench"
    (copy / "data").mkdir(parents=True)
    for script in BENCH.glob("*.py"):
        shutil.copy(script, copy)
    shutil.copy(BENCH / HEAT, copy / HEAT)
    (copy / "links").mkdir()
    (copy / "links" / "policies-synthetic.svg").symlink_to(copy / HEAT)
    (copy / "out").mkdir()
    (copy / "out" / "policies.json").write_text('{"kept": true}\n')
    routing = base / "routing"
    routing.mkdir()
    (routing / "qwen.route.csv").write_text("layer,expert\n0,1\n")
    (routing / "host.route.csv").write_text("# model=x n_layer=1 n_expert=4 n_expert_used=1\n"
                                            "turn,phase,step,layer,slot,expert,weight\n0,0,0,0,0,1,1\n0,1,1,0,0,2,1\n")
    profile = base / "profile.json"
    shutil.copy(ROOT / "profiles" / "italian.json", profile)
    return {"{M}": str(model), "{B}": str(copy), "{R}": str(routing), "{P}": str(profile)}


def fill(text, places):
    for key, value in places.items():
        text = text.replace(key, value)
    return text


@pytest.mark.parametrize("script,case", [(s, i) for s, cases in CASES.items() for i in range(len(cases))])
def test_an_output_on_an_input_is_refused_before_any_work(places, script, case):
    args, out, source = CASES[script][case]
    args, out, source = [fill(a, places) for a in args], fill(out, places), fill(source, places)
    before = {key: digest(path) if Path(path).is_dir() else hashlib.sha256(Path(path).read_bytes()).hexdigest()
              for key, path in places.items()}
    tic = time.monotonic()
    proc = subprocess.run([sys.executable, str(Path(places["{B}"]) / script), *args], capture_output=True,
                          text=True, timeout=120, env=ENV, cwd=places["{B}"])
    seconds = time.monotonic() - tic
    assert proc.returncode not in (0, None) and "Traceback" not in proc.stderr, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith(f"{script}: ") and out in message and source in message, message
    assert seconds < 30, f"{script} took {seconds:.1f} s to refuse: work before the check"
    after = {key: digest(path) if Path(path).is_dir() else hashlib.sha256(Path(path).read_bytes()).hexdigest()
             for key, path in places.items()}
    assert after == before  # nothing written, nothing left beside (no temp file, no folder)


def test_every_writing_script_is_in_the_table():
    """A bench script that writes a file (or a new one) without a row here fails: each row's
    script checks its outputs through bench/system.py before its work."""
    # the writers themselves (heldout: bench_policies' prompts); bookkeeping.py writes only its
    # result where its parent (bench_profiles.py) asks, a temp file made for it
    helpers = {"system.py", "heldout.py", "bookkeeping.py"}
    writes = re.compile(r"\bwrite_(json|atomic|heatmap_png)\(|\.write_text\(|open\([^)]*[\"']w")
    writers = {p.name for p in BENCH.glob("*.py") if writes.search(p.read_text())} - helpers
    assert writers == set(CASES)
    for script in CASES:
        assert "check_outputs(" in (BENCH / script).read_text(), script


def test_every_script_explains_itself():
    """--help of every bench script (run from bench/ itself) exits 0 and prints its usage."""
    for script in sorted(BENCH.glob("*.py")):
        if "__main__" not in script.read_text():
            continue
        proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60,
                              env=ENV, cwd=ROOT)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (script.name, proc.stderr[-2000:])


def test_a_server_that_fails_to_start_says_why(tmp_path):
    """The benches' Server: a server that exits before it answers fails at once (not after its
    start timeout) with the status and the end of what it wrote to stderr (here: the missing
    checkpoint named)."""
    sys.path.insert(0, str(BENCH))
    try:
        from bench_server import Server
    finally:
        sys.path.remove(str(BENCH))
    missing = tmp_path / "no-such-model"
    tic = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        Server([sys.executable, "-m", "mlxmoe", "serve", "--model", str(missing)], timeout=100)
    assert time.monotonic() - tic < 60
    assert "exited with status" in str(failed.value) and str(missing) in str(failed.value), failed.value


def test_the_stolen_share_is_read_from_the_machines_cpu_times(tmp_path):
    """bench/system.py's stolen CPU time (printed beside timed figures): /proc/stat's cpu line
    read as (steal, all) ticks that grow with busy work; the share between two readings is
    their steal over their ticks, None where a reading is missing or no time passed."""
    sys.path.insert(0, str(BENCH))
    try:
        from system import cpu_ticks, stolen_share
    finally:
        sys.path.remove(str(BENCH))
    if not Path("/proc/stat").exists():
        pytest.skip("no /proc/stat here")
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    start = cpu_ticks()
    assert start[1] >= sum(fields) and start[0] >= fields[7]
    tic = time.perf_counter()
    while time.perf_counter() - tic < 0.1:  # (ticks are 10 ms)
        pass
    end = cpu_ticks()
    assert end[1] > start[1] and 0.0 <= stolen_share(start, end) <= 1.0
    assert stolen_share((5, 100), (7, 200)) == 0.02
    assert stolen_share(None, end) is None and stolen_share(end, end) is None


def test_bench_host_never_builds_its_checkpoint_into_a_folder_that_holds_another(places, tmp_path):
    """bench_host builds its checkpoint where --checkpoint says when it is missing; a folder
    holding another model (here a tiny qwen3_moe) is refused, named, before any work, unchanged."""
    model = places["{M}"]
    before = digest(model)
    proc = subprocess.run([sys.executable, str(Path(places["{B}"]) / "bench_host.py"), "--checkpoint", model,
                           "--output", str(tmp_path / "host.json")], capture_output=True, text=True, timeout=120,
                          env=ENV, cwd=places["{B}"])
    assert proc.returncode not in (0, None) and "Traceback" not in proc.stderr, proc.stderr
    assert f"{model} does not hold this bench's checkpoint" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert digest(model) == before and not (tmp_path / "host.json").exists()
