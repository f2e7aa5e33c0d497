"""The runtime's layout in figures (issue 52): files per subpackage, the largest
class in lines, import cycles among the runtime's modules (function-level imports
included), private names imported across files, and assignments to ``__class__``.

    python tools/runtime_layout.py          # prints the figures
    python tools/runtime_layout.py --check  # exits 1 on a cycle or a private import

``tests/test_layout.py`` runs the check."""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

RUNTIME = Path(__file__).resolve().parent.parent / "python" / "fsdp_rs" / "runtime"
PREFIX = "fsdp_rs.runtime"


def modules() -> dict[str, Path]:
    """Dotted name of every runtime module -> its file."""
    out = {}
    for path in sorted(RUNTIME.rglob("*.py")):
        rel = path.relative_to(RUNTIME).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join([PREFIX, *parts])] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, str]]:
    """(module, name) for each name this file imports from a runtime module; a
    module imported whole gives name ''."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in known:
                    found.append((sub, ""))
                elif node.module in known:
                    found.append((node.module, a.name))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def largest_classes(known: dict[str, Path], n: int = 3) -> list[tuple[int, str]]:
    sizes = []
    for mod, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                sizes.append((node.end_lineno - node.lineno + 1, f"{mod}.{node.name}"))
    return sorted(sizes, reverse=True)[:n]


def class_assignments(known: dict[str, Path]) -> list[str]:
    out = []
    for mod, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets):
                out.append(f"{mod}:{node.lineno}")
    return out


def main() -> int:
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    private = []
    for mod, path in known.items():
        for target, name in imports(path, known):
            if target != mod:
                graph[mod].add(target)
            if name.startswith("_") and target != mod:
                private.append(f"{mod} imports {target}.{name}")
    # a package's __init__ is imported by its submodules' imports: not an edge to count
    found = cycles(graph)
    per_folder = Counter(
        str(p.parent.relative_to(RUNTIME)) for p in known.values() if p.name != "__init__.py"
    )
    print("files per folder:", dict(sorted(per_folder.items())))
    print("largest classes (lines):", largest_classes(known))
    print("import cycles:", len(found), *found, sep="\n  ")
    print("private names imported across files:", len(private), *private, sep="\n  ")
    print("__class__ assignments:", class_assignments(known))
    return 1 if "--check" in sys.argv and (found or private) else 0


if __name__ == "__main__":
    sys.exit(main())
