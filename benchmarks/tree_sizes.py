"""Files and lines per package of a tree's ``zeroray/runtime/`` (or another package), and its largest
classes and functions, each measured as ``end_lineno - lineno + 1`` of its AST node (docstring and
comments included). A class counts with its bases from the same package (a mixin's lines are the
class's: ``class A(B, C)`` is A's lines plus B's and C's, each with its own bases), so splitting a
class into mixins does not make it smaller here. docs/architecture.md ("Inside runtime/") quotes it.

    python benchmarks/tree_sizes.py                    # this tree's zeroray/runtime
    python benchmarks/tree_sizes.py /other/tree zeroray/engine
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import Dict, List, Tuple


def measure(root: Path, package: str) -> Tuple[Dict[str, Tuple[int, int]], List[Tuple[int, str, str]]]:
    """Per subpackage (``(top)`` for the package's own modules): (files, lines); and every class and
    function as (lines, "Class" or "Function", "path:name")."""
    base = root / package
    per: Dict[str, Tuple[int, int]] = {}
    items: List[Tuple[int, str, str]] = []
    classes: Dict[str, List[Tuple[int, List[str], str]]] = {}  # name -> (own lines, base names, where)
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        key = str(rel.parent) if str(rel.parent) != "." else "(top)"
        text = path.read_text()
        files, lines = per.get(key, (0, 0))
        per[key] = (files + 1, lines + len(text.splitlines()))
        for node in ast.walk(ast.parse(text)):
            size = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, (ast.Name, ast.Attribute))]
                classes.setdefault(node.name, []).append((size, bases, f"{rel}:{node.name}"))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                items.append((size, "Function", f"{rel}:{node.name}"))

    def with_bases(name: str, seen: frozenset) -> int:
        """A class's lines and its package bases' (a name defined twice in the package counts its largest)."""
        if name not in classes or name in seen:
            return 0
        return max(size + sum(with_bases(b, seen | {name}) for b in bases) for size, bases, _ in classes[name])

    for name, defs in classes.items():
        for size, bases, where in defs:
            total = size + sum(with_bases(b, frozenset({name})) for b in bases)
            items.append((total, "Class", where + (f" ({size} own)" if total != size else "")))
    return per, items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("package", nargs="?", default="zeroray/runtime")
    parser.add_argument("--top", type=int, default=6)
    args = parser.parse_args()
    per, items = measure(Path(args.root), args.package)
    for key, (files, lines) in per.items():
        print(f"  {key:14s} {files:3d} files {lines:5d} lines")
    print(f"  {'total':14s} {sum(f for f, _ in per.values()):3d} files {sum(n for _, n in per.values()):5d} lines")
    for kind in ("Class", "Function"):
        largest = sorted((i for i in items if i[1] == kind), reverse=True)[:args.top]
        print(f"  largest {kind.lower()}es:" if kind == "Class" else "  largest functions:",
              ", ".join(f"{n} {name}" for n, _, name in largest))


if __name__ == "__main__":
    main()
