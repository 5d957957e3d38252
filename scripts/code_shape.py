"""The shape rules of docs/design.md, checked on a package directory (default: llamatron/):

- the import graph of its modules has no cycle (module-level imports, imports inside functions, and imports
  under `if TYPE_CHECKING:` too: a cycle made only for type checking is still two modules that need each other);
- function-local imports of the package's own modules: at most --max-local (8);
- no file over --max-file-lines (600) lines, no function over --max-function-lines (80).

Prints each violation and a last line `cycles N local M long-files F long-functions G`; exits 1 on any.
Usage: python scripts/code_shape.py [PACKAGE_DIR]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package directory `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: dict) -> list[str]:
    """The package's modules an import statement names (`from . import x` names module x when it is one)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = module.split(".") if is_package else module.split(".")[:-1]
            here = here[: len(here) - node.level + 1]
            base = ".".join(here + ([node.module] if node.module else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    return [n for n in names if n in known]


def import_edges(known: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> modules it imports, the function-local intra-package imports as 'file:line')."""
    edges: dict[str, set[str]] = {m: set() for m in known}
    local: list[str] = []
    for module, path in known.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and _targets(node, module, is_package, known):
                    local.append(f"{path}:{node.lineno}")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                # A package's __init__ importing its own submodules is how packages work, not a cycle.
                edges[module].update(
                    t
                    for t in _targets(node, module, is_package, known)
                    if t != module and not module.startswith(t + ".")
                )
    return edges, sorted(set(local))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def long_definitions(known: dict[str, Path], max_file: int, max_function: int) -> tuple[list[str], list[str]]:
    files, functions = [], []
    for path in known.values():
        text = path.read_text()
        if text.count("\n") > max_file:
            files.append(f"{path}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > max_function:
                    functions.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return files, functions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default=str(Path(__file__).resolve().parent.parent / "llamatron"))
    parser.add_argument("--max-local", type=int, default=8)
    parser.add_argument("--max-file-lines", type=int, default=600)
    parser.add_argument("--max-function-lines", type=int, default=80)
    args = parser.parse_args(argv)
    known = module_names(Path(args.package).resolve())
    edges, local = import_edges(known)
    found = cycles(edges)
    files, functions = long_definitions(known, args.max_file_lines, args.max_function_lines)
    for component in found:
        print("cycle:", " ".join(component))
    for where in local:
        print("function-local import:", where)
    for line in files + functions:
        print("too long:", line)
    print(f"cycles {len(found)} local {len(local)} long-files {len(files)} long-functions {len(functions)}")
    bad = found or len(local) > args.max_local or files or functions
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
