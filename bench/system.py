"""What the benchmarks read off the machine (the page cache, memory, block-layer reads) and
how they write their results (mlxmoe's output rule and atomic writer)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def drop_page_cache():
    """sync; echo 3 > /proc/sys/vm/drop_caches. Returns True if it worked (needs root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        print(f"[bench] could not drop the page cache ({e}); numbers may be warm", file=sys.stderr)
        return False


def _field(path, name, scale=1):
    try:
        with open(path) as f:
            return int(next(l for l in f if l.startswith(name)).split()[1]) * scale
    except (OSError, StopIteration):
        return None


def meminfo_cached():
    """The page cache's size in bytes (/proc/meminfo Cached)."""
    return _field("/proc/meminfo", "Cached:", 1024)


def disk_read_bytes():
    """Bytes this process made the block layer fetch (/proc/self/io read_bytes): reads
    served from the page cache do not count."""
    return _field("/proc/self/io", "read_bytes:")


def cpu_ticks():
    """(stolen, all) CPU time of the machine so far in clock ticks (/proc/stat's cpu line), None
    where unreadable. Stolen: time a virtual machine's cores ran other guests, the noise of a
    shared host that slows a timed run without showing in its load average."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def stolen_share(start, end):
    """The share of the machine's CPU time stolen between two cpu_ticks() (None if unknown)."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


def proc_status():
    """VmRSS and VmHWM of this process in bytes."""
    return _field("/proc/self/status", "VmRSS:", 1024), _field("/proc/self/status", "VmHWM:", 1024)


# ---------------------------------------------------------------- what a benchmark writes


def _files():
    """mlxmoe.storage.files, from this repository when no mlxmoe is installed (appended last to
    sys.path, as the benchmarks do: a baseline's mlxmoe on PYTHONPATH stays first)."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.append(root)
    from mlxmoe.storage import files

    return files


def model_folder(model):
    """The folder of a model argument (a path, "demo", None: the demo model; a Hugging Face
    repo: its snapshot in the hub's cache), as an input of check_outputs; or None."""
    return _files().model_folder(model)


def check_outputs(outputs, inputs=None, updates=None):
    """mlxmoe's rule for the files a run writes (mlxmoe.storage.files.check_outputs: no output
    is an input, lies in the model folder or is another output), for a benchmark before its
    work: a refusal ends the script with the error, which names both paths. Folders missing on
    the way to an output are made first, as the benchmarks always did (bench/out/), and
    removed again on a refusal."""
    files = _files()
    made = []
    try:
        for value in outputs.values():
            for path in value if isinstance(value, (list, tuple)) else [value]:
                if path:
                    missing = [d for d in Path(path).absolute().parents if not d.exists()]
                    for folder in reversed(missing):
                        folder.mkdir()
                        made.append(folder)
        files.check_outputs(outputs, inputs, updates)
    except (files.MlxmoeError, OSError) as e:
        for folder in reversed(made):
            folder.rmdir()
        raise SystemExit(f"{Path(sys.argv[0]).name}: {e}") from None


def write_atomic(path, data):
    """`data` (str or bytes) at `path`, whole or not at all: mlxmoe's write_atomic (a temp file
    beside it, fsync'd and renamed; a symlink's target is written and the link kept)."""
    _files().write_atomic(path, data)


def clean_stale(path):
    """Remove the temp files that writers of `path` killed mid-write left beside it (mlxmoe's
    clean_stale: only those whose process has exited); returns them."""
    return _files().clean_stale(path)


def write_json(path, value):
    """`value` as indented JSON at `path`, whole or not at all (write_atomic)."""
    write_atomic(path, json.dumps(value, indent=1) + "\n")


def baseline_code(ref=None, folder=None):
    """An older commit's mlxmoe to run beside this tree's (--baseline REF or --baseline-path
    DIR): (its sha or None, the folder holding its mlxmoe/ package, a label)."""
    if ref and folder:
        raise SystemExit("--baseline REF or --baseline-path DIR, not both")
    if ref:
        sha, tree = baseline_tree(ref)
        return sha, tree, f"commit {sha[:10]} ({tree})"
    tree = baseline_path(folder)
    return None, tree, f"mlxmoe from {tree}"


def baseline_tree(ref):
    """A detached git worktree of `ref` at /tmp/mlxmoe-baseline-<sha> (made once, then reused)."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True)
    if sha.returncode:
        raise SystemExit(f"--baseline {ref}: not a commit ({sha.stderr.strip()})")
    sha = sha.stdout.strip()
    tree = Path(f"/tmp/mlxmoe-baseline-{sha}")
    if not (tree / "mlxmoe" / "__init__.py").exists():
        print(f"[bench] git worktree add --detach {tree} {ref} ({sha[:10]})", file=sys.stderr, flush=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True,
                       stdout=sys.stderr)
    return sha, tree


def baseline_path(folder):
    """--baseline-path DIR: a folder that already holds the old code's mlxmoe/ package
    (git archive REF mlxmoe | tar -x -C DIR), for machines without the git history."""
    tree = Path(folder).resolve()
    if not (tree / "mlxmoe" / "__init__.py").exists():
        raise SystemExit(f"--baseline-path {folder}: no mlxmoe/__init__.py in it "
                         f"(make it with: git archive REF mlxmoe | tar -x -C {folder})")
    return tree


def baseline_env(tree):
    """The environment a child runs the baseline's mlxmoe in: its folder first on PYTHONPATH."""
    return {"PYTHONPATH": os.pathsep.join([str(tree)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                         else []))}


def imported_from(module, tree):
    """Where `module` (mlxmoe, imported) loaded from; stop where that is not within the folder `tree`."""
    where = Path(module.__file__).resolve()
    if Path(tree).resolve() not in where.parents:
        raise SystemExit(f"imported {module.__name__} from {where}, not from {tree}")
    return where
