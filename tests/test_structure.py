"""Module structure: no import cycles among mlxmoe's modules, each importable on its own."""

import ast
import subprocess
import sys
from pathlib import Path

import mlxmoe

PACKAGE = Path(mlxmoe.__file__).parent


def module_name(path):
    """'caching.cache' for mlxmoe/caching/cache.py."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def imports_of(path):
    """The mlxmoe modules (dotted, under mlxmoe) and names `path` imports, at module level or
    inside functions; relative imports resolved from its package."""
    package = module_name(path).split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.startswith("mlxmoe."):
                base = node.module.split(".")[1:]
            else:
                continue
            out.add(".".join(base))
            out.update(".".join(base + [a.name]) for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("mlxmoe."))
    return out


def graph():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py") if p.stem != "__init__"}
    return {m: sorted(imports_of(p) & set(modules) - {m}) for m, p in modules.items()}


def find_cycle(edges):
    """A cycle [a, b, ..., a] in the graph `edges`, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in edges.get(node, ()):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


def test_no_import_cycle():
    edges = graph()
    assert "workload.profile" in edges and "workload.trace" in edges and "caching.cache" in edges
    assert find_cycle(edges) is None, f"import cycle: {' -> '.join(find_cycle(edges))}"
    assert "workload.trace" not in edges["workload.profile"]


def test_the_layers_inside_a_folder_run_one_way():
    """The policies' registry builds on the baselines and the default (the default on the
    baselines' Policy, never the reverse); replay and the importers build on the trace file
    format, which knows neither."""
    edges = graph()
    assert {"caching.baselines", "caching.default"} <= set(edges["caching.policies"])
    assert "caching.default" not in edges["caching.baselines"]
    assert {"workload.tracefile", "workload.importers"} <= set(edges["workload.trace"])
    assert not {"workload.trace", "workload.importers"} & set(edges["workload.tracefile"])
    assert "workload.trace" not in edges["workload.importers"]


def test_each_module_imports_in_a_fresh_interpreter():
    # profile and trace in both orders (trace builds on profile), then every module on its own
    modules = ["mlxmoe.workload.profile, mlxmoe.workload.trace", "mlxmoe.workload.trace, mlxmoe.workload.profile"] + [
        f"mlxmoe.{m}" for m in sorted(graph()) if m != "__main__"]
    code = "; ".join(f"subprocess.run([sys.executable, '-c', 'import {m}'], check=True)" for m in modules)
    r = subprocess.run([sys.executable, "-c", f"import subprocess, sys; {code}"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr


def test_the_checkpoints_builder_is_shared_not_shipped():
    """The synthetic checkpoints' builder (synthetic.py at the repository's root) serves the
    tests and the benchmarks: the package neither ships nor imports it, and no benchmark
    reaches into tests/ for it."""
    root = PACKAGE.parent
    assert not (PACKAGE / "synthetic.py").exists() and (root / "synthetic.py").exists()
    for path in PACKAGE.rglob("*.py"):
        assert "mlxmoe.synthetic" not in path.read_text() and "synthetic" not in imports_of(path), path
    for path in [*(root / "bench").glob("*.py"), *(root / "demo").glob("*.py")]:
        assert '"tests"' not in path.read_text(), path


def test_the_demo_builder_is_not_a_benchmark():
    """demo/train_demo.py builds the shipped demo model (mlxmoe/demo): beside the demo's
    sources, not among the benchmarks in bench/."""
    root = PACKAGE.parent
    assert (root / "demo" / "train_demo.py").exists() and not (root / "bench" / "train_demo.py").exists()


def test_functions_and_classes_a_reader_can_hold():
    """The size rule (issue 42): no function in the package over 60 lines, no class over 250,
    from `def`/`class` to the last line, docstring included."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            limit = 250 if isinstance(node, ast.ClassDef) else 60
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    node.end_lineno - node.lineno + 1 > limit:
                too_long.append(f"{path.relative_to(PACKAGE)}: {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long
