"""Architecture figures for issue 25: import cycles, mixins left, what a trainer adapter imports.

Prints, for the packages ``stability``, ``detectors`` and ``replay``:

* **import cycles** -- the strongly connected components of the module import graph (grimp,
  which import-linter installs); every import counts (module level, inside functions, and
  ``TYPE_CHECKING`` ones: all three are read as a newcomer reads them), and the same count
  without the ``TYPE_CHECKING`` imports;
* **mixins** -- classes named ``*Mixin`` and classes that are the base of exactly one class of
  the project without being built anywhere themselves (one-consumer mixins);
* **trainer adapters** -- the project modules each adapter of
  :mod:`stability.adapters.protocol` imports (what a new adapter has to read);
* **longest functions** -- the ten longest functions and methods of ``stability/``: their
  lines from ``def`` to the last line, and the same without the docstring (the code).

Run from the repository root: ``python tools/arch_metrics.py``.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import grimp

PACKAGES = ("stability", "detectors", "replay")
ADAPTERS = ("stability.adapters.hf", "stability.adapters.lightning")


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components (Tarjan) of size > 1 of the module graph, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.find_modules_directly_imported_by(v)):
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

    sys.setrecursionlimit(10_000)
    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return sorted(out)


def classes(root: Path) -> tuple[dict[str, list[str]], set[str], dict[str, str]]:
    """``(subclasses by base name, names called anywhere, where each class is defined)``."""
    subs: dict[str, list[str]] = defaultdict(list)
    called: set[str] = set()
    where: dict[str, str] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    where[node.name] = str(path.relative_to(root))
                    for b in node.bases:
                        name = b.id if isinstance(b, ast.Name) else (
                            b.attr if isinstance(b, ast.Attribute) else None)
                        if name is not None:
                            subs[name].append(node.name)
                elif isinstance(node, ast.Call):
                    f = node.func
                    if isinstance(f, ast.Name):
                        called.add(f.id)
                    elif isinstance(f, ast.Attribute):
                        called.add(f.attr)
    return subs, called, where


def mixins(root: Path) -> list[str]:
    """``*Mixin`` classes and project classes that are the base of exactly one class and are
    never built themselves."""
    subs, called, where = classes(root)
    out = []
    for name, file in sorted(where.items(), key=lambda kv: (kv[1], kv[0])):
        children = subs.get(name, [])
        if name.endswith("Mixin") or (len(children) == 1 and name not in called):
            out.append(f"{file}: {name} -> {', '.join(children) or '-'}")
    return out


def longest_functions(root: Path, n: int = 10) -> list[tuple[int, int, str]]:
    """The ``n`` longest functions of ``stability/``: (lines, code lines, ``file::qualname``).

    Lines run from the ``def`` (decorators excluded) to the function's last line; code lines
    leave out the docstring.  Nested functions count inside their parent and on their own.
    """
    out: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str, file: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", file)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = (child.end_lineno or child.lineno) - child.lineno + 1
                doc = child.body[0] if child.body else None
                if (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                        and isinstance(doc.value.value, str)):
                    span_doc = (doc.end_lineno or doc.lineno) - doc.lineno + 1
                else:
                    span_doc = 0
                out.append((span, span - span_doc, f"{file}::{prefix}{child.name}"))
                visit(child, f"{prefix}{child.name}.", file)

    for path in sorted((root / "stability").rglob("*.py")):
        visit(ast.parse(path.read_text()), "", str(path.relative_to(root)))
    return sorted(out, reverse=True)[:n]


def main() -> None:
    root = Path.cwd()
    sys.path.insert(0, str(root))
    # no cache: grimp's cache gave the graph without TYPE_CHECKING imports of an older tree
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    typed = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    every, runtime = cycles(graph), cycles(typed)
    print(f"modules: {len(graph.modules)}")
    print(f"import cycles (all imports): {len(every)}")
    for c in every:
        print("   ", " <-> ".join(c))
    print(f"import cycles (without TYPE_CHECKING imports): {len(runtime)}")
    found = mixins(root)
    print(f"mixins / one-consumer bases: {len(found)}")
    for m in found:
        print("   ", m)
    for mod in ADAPTERS:
        deps = sorted(d for d in graph.find_modules_directly_imported_by(mod)
                      if d.split(".")[0] in PACKAGES)
        print(f"{mod} imports {len(deps)} project modules: {', '.join(deps)}")
    print("longest functions in stability/ (lines, code lines without the docstring):")
    for span, code, name in longest_functions(root):
        print(f"    {span:4d} {code:4d}  {name}")


if __name__ == "__main__":
    main()
