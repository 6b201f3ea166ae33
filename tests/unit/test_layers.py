# SPDX-License-Identifier: Apache-2.0
"""Imports go one way (docs/design/layers.md): parsed from the source, nothing is imported.

`python tests/unit/test_layers.py` prints the graph's figures (imports, imports inside
functions, cycles) for a change's note.
"""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_disagg"

# Bottom to top. A component is a top-level module or folder of vllm_disagg. A module may import its
# own component and any layer below; components that share the base layer may import each other.
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"config", "envs", "errors", "liveness", "logs", "models", "observe", "overlap", "patches"}),
    ("transport", {"transport"}),
    ("attention", {"attention"}),
    ("kv", {"kv"}),
    ("nanoflow", {"nanoflow"}),
    ("wiring", {"wiring"}),
    ("router", {"router"}),
    ("planner", {"planner"}),
    ("launch", {"launch"}),
    ("cli", {"cli"}),
]
# Outside the layers: the plugin root (`register()`, above everything but the CLI that calls it,
# imports only inside functions) and the scaffolding that tests, benchmarks and chaos share (may import anything;
# nothing in the runtime imports it).
TOP = {""}
SCAFFOLDING = {"testing"}
RANK = {comp: i for i, (_, comps) in enumerate(LAYERS) for comp in comps}


@dataclass(frozen=True)
class Import:
    src: str
    dst: str
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for folder, _, files in os.walk(PACKAGE, followlinks=True):  # `patches` is a link
        for name in files:
            if name.endswith(".py"):
                path = Path(folder) / name
                found[module_name(path)] = path
    return dict(sorted(found.items()))


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(node: ast.AST, src: str, is_pkg: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = src.split(".") if is_pkg else src.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" for a in node.names] + [base]


def imports() -> list[Import]:
    """Every import of a vllm_disagg module, but those under `if TYPE_CHECKING:`."""
    known = modules()
    out: list[Import] = []

    def visit(node: ast.AST, src: str, is_pkg: bool, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names = _targets(child, src, is_pkg)
                dsts = {_resolve(n, known) for n in names if n.startswith("vllm_disagg")} - {None, src}
                # `from pkg import module` names the module; `from pkg import name` names the package
                own = {d for d in dsts if any(n == d for n in names[:-1])}
                for dst in own or dsts:
                    out.append(Import(src, dst, child.lineno, nested))
            visit(child, src, is_pkg, nested)

    for name, path in known.items():
        visit(ast.parse(path.read_text()), name, path.name == "__init__.py", False)
    return out


def component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected module groups (Tarjan), each a cycle of imports."""
    graph = defaultdict(set)
    for e in edges:
        graph[e.src].add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def violation(e: Import) -> str | None:
    src, dst = component(e.src), component(e.dst)
    where = f"{e.src}:{e.line} imports {e.dst}"
    if dst in SCAFFOLDING and src not in SCAFFOLDING:
        return f"{where}: the runtime never imports vllm_disagg.testing"
    if src in SCAFFOLDING or src == dst:
        return None
    if src in TOP:
        return f"{where} at module level: vllm_disagg/__init__.py runs on every import" if not e.in_function else None
    if dst in TOP:
        return None if src == "cli" else f"{where}: only the CLI, above every layer, may import the plugin root"
    for comp in (src, dst):
        if comp not in RANK:
            return f"{where}: place `{comp}` in a layer (tests/unit/test_layers.py LAYERS, docs/design/layers.md)"
    if RANK[dst] > RANK[src]:
        return f"{where}: {src} ({LAYERS[RANK[src]][0]}) is below {dst} ({LAYERS[RANK[dst]][0]})"
    if RANK[dst] == RANK[src] and LAYERS[RANK[src]][0] != "base":
        return f"{where}: {src} and {dst} share a layer and may not import each other"
    return None


def test_imports_go_one_way():
    bad = [v for v in map(violation, imports()) if v]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    found = cycles(imports())
    assert not found, "\n".join(" <-> ".join(group) for group in found)


def test_every_component_has_a_layer():
    comps = {component(m) for m in modules()}
    assert comps <= set(RANK) | TOP | SCAFFOLDING, comps - set(RANK) - TOP - SCAFFOLDING


def figures() -> dict:
    edges = imports()
    statements = {(e.src, e.line) for e in edges}
    in_function = {(e.src, e.line) for e in edges if e.in_function}
    comp_edges = [Import(component(e.src), component(e.dst), 0, e.in_function) for e in edges
                  if component(e.src) != component(e.dst) and "" not in (component(e.src), component(e.dst))]
    return {
        "modules": len(modules()),
        "import_statements": len(statements),
        "inside_functions": len(in_function),
        "module_cycles": cycles(edges),
        "folder_cycles": cycles(comp_edges),
        "violations": [v for v in map(violation, edges) if v],
    }


if __name__ == "__main__":
    for key, value in figures().items():
        print(f"{key}: {value if not isinstance(value, list) else len(value)}")
        if isinstance(value, list):
            for item in value:
                print("   ", item)
