"""The package's modules import each other one way: no import circle, counting the imports inside functions too (a
lazy import is still an arrow; it only hides the circle until the function runs). Parsed with `ast`, nothing is
imported: every `import megatron_jetrl...` and `from ... import ...` of megatron_jetrl, relative ones resolved, is
an arrow from its module to the module it names (`from pkg import submodule` to the submodule, `from module import
name` to the module)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "megatron_jetrl"


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _owner(name: str, known: dict) -> str | None:
    """The module a dotted name lives in: its longest prefix that is a module of the package."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path, known: dict) -> dict[str, int]:
    """{imported package module: line of its first import} for one module, every scope."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            target = _owner(name, known) if name.split(".")[0] == PACKAGE else None
            if target and target != module:
                out.setdefault(target, node.lineno)
    return out


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one circle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_circle(sorted(component), edges))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _circle(component: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """One circle inside a component, from its first module back to it (breadth-first, so the shortest)."""
    start, inside = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v]):
            if w == start:
                return paths[v] + [start]
            if w in inside and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return component


def describe(circle: list[str], edges: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


def test_the_parser_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / PACKAGE / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("def f():\n    from megatron_jetrl.sub.b import g\n")
    (pkg / "b.py").write_text("from .a import f\nfrom .. import sub\n")
    known = {
        "megatron_jetrl": tmp_path / PACKAGE / "__init__.py",
        "megatron_jetrl.sub": pkg / "__init__.py",
        "megatron_jetrl.sub.a": pkg / "a.py",
        "megatron_jetrl.sub.b": pkg / "b.py",
    }
    edges = {m: imports(m, p, known) for m, p in known.items()}
    assert edges["megatron_jetrl.sub"] == {"megatron_jetrl.sub.a": 1}
    assert edges["megatron_jetrl.sub.a"] == {"megatron_jetrl.sub.b": 2}
    assert edges["megatron_jetrl.sub.b"] == {"megatron_jetrl.sub.a": 1, "megatron_jetrl.sub": 2}
    found = cycles(edges)
    assert len(found) == 1 and set(found[0]) == {"megatron_jetrl.sub", "megatron_jetrl.sub.a", "megatron_jetrl.sub.b"}


def test_the_package_has_no_import_circle():
    edges = graph()
    assert "megatron_jetrl.rl.config" in edges and "megatron_jetrl.actor.provider" in edges, sorted(edges)
    found = cycles(edges)
    assert not found, "import circles (module (line of the import) -> module ...):\n" + "\n".join(
        describe(c, edges) for c in found
    )


def test_the_split_modules_import_downwards():
    """The two circles broken here stay broken in the direction chosen: the specs and the config's types sit below
    the provider and the config CLI."""
    edges = graph()
    for low, high in [
        ("actor.fp8_layers", "actor.provider"),
        ("actor.te_recipe", "actor.provider"),
        ("actor.gpt", "actor.fp8_layers"),
        ("actor.gpt", "actor.te_recipe"),
        ("rl.config_schema", "rl.config"),
        ("rl.preflight", "rl.config"),
        ("rl.run_state", "rl.config"),
        ("rl.config_schema", "rl.preflight"),
        ("rl.config_schema", "rl.run_state"),
    ]:
        assert f"{PACKAGE}.{high}" not in edges[f"{PACKAGE}.{low}"], f"{low} imports {high}"


def test_the_algorithm_does_not_import_the_run():
    """`grpo` (data, rewards, advantages, loss, batch) sits below `rl` (the run that drives it)."""
    edges = graph()
    algorithm = {m: e for m, e in edges.items() if m.startswith(f"{PACKAGE}.grpo")}
    assert len(algorithm) >= 6, sorted(algorithm)
    up = {m: sorted(t for t in e if t.startswith(f"{PACKAGE}.rl")) for m, e in algorithm.items()}
    assert not any(up.values()), up
