"""The package's shape: imports run one way (no cycles), commands never import each other, and
the package's modules stay readable (<= 400 lines, functions <= 60 lines)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "scratchformer"
COMMANDS = {"scratchformer.train", "scratchformer.evaluate", "scratchformer.generate", "scratchformer.ablate",
            "scratchformer.score", "scratchformer.average", "scratchformer.compare"}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG)
        if rel.parts[0] == "kernels":  # a link to ../kernels: the Triton layer, no package imports
            continue
        parts = ["scratchformer", *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Package modules `name` imports, anywhere in the file (late imports count too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert "scratchformer.training.trainer" in graph  # the walk saw the new packages


def test_commands_never_import_each_other_and_libraries_never_import_commands():
    graph = _graph()
    for name, deps in graph.items():
        bad = deps & COMMANDS
        assert not bad, f"{name} imports the command(s) {sorted(bad)}"
    assert not any(d.startswith("scratchformer.training") for d in graph["scratchformer.evaluation.evaluate"])


def test_package_modules_and_functions_stay_small():
    """Every module of scratchformer/ <= 400 lines, every function <= 60 (the Triton kernels, a
    link to ../kernels, are outside: their bodies are long by nature)."""
    too_long = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG)
        if rel.parts[0] == "kernels":
            continue
        src = p.read_text(encoding="utf-8")
        n = len(src.splitlines())
        if n > 400:
            too_long.append(f"{rel}: {n} lines")
        for f in ast.walk(ast.parse(src)):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno + 1 > 60:
                too_long.append(f"{rel}:{f.lineno} {f.name}: {f.end_lineno - f.lineno + 1} lines")
    assert not too_long, too_long
