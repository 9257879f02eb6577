"""The README and docs/ name only zeroray paths and modules that exist.

A file that moves (as the flat modules moved into subpackages) leaves its old path in the prose;
this finds it. Three spellings are checked: ``zeroray/fetch/unit.py``, ``fetch/unit.py`` (a path
inside the package, as the architecture page writes them) and ``zeroray.fetch.unit`` (a module,
or a name defined in one, such as ``zeroray.worker_context``).
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
SUBPACKAGES = sorted(p.parent.name for p in (ROOT / "zeroray").glob("*/__init__.py"))
PACKAGE_PATH = re.compile(r"(?<![\w/.])zeroray/[\w/.]*\w/?")
INNER_PATH = re.compile(rf"(?<![\w/.-])(?:{'|'.join(SUBPACKAGES)})/(?:\w+\.py\b|(?!\w))")
MODULE = re.compile(r"(?<![\w/.])zeroray(?:\.\w+)+")


def _module_exists(dotted: str) -> bool:
    """Each part a subpackage or module, until one that must be a name in the last module found."""
    here = ROOT / "zeroray"
    for part in dotted.split(".")[1:]:
        if (here / part).is_dir():
            here = here / part
        elif (here / f"{part}.py").is_file():
            here = here / f"{part}.py"
        else:
            text = (here / "__init__.py" if here.is_dir() else here).read_text()
            return re.search(rf"\b{re.escape(part)}\b", text) is not None
    return True


def stale_mentions(paths=DOCS) -> list:
    stale = []
    for doc in paths:
        for n, line in enumerate(doc.read_text().replace("\\_", "_").splitlines(), 1):
            named = [m.group(0) for m in PACKAGE_PATH.finditer(line) if not (ROOT / m.group(0)).exists()]
            named += [m.group(0) for m in INNER_PATH.finditer(line) if not (ROOT / "zeroray" / m.group(0)).exists()]
            named += [m.group(0) for m in MODULE.finditer(line) if not _module_exists(m.group(0))]
            where = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
            stale += [f"{where}:{n}: {name}" for name in named]
    return stale


def test_docs_name_only_paths_that_exist():
    assert stale_mentions() == []


def test_a_moved_file_is_found(tmp_path):
    doc = tmp_path / "old.md"
    doc.write_text("The coordinator (`zeroray/fetch.py`, `arena.py`) and `layout/fetch.py`; zeroray.memory_report.\n"
                   "Still here: `zeroray/fetch/trace.py`, `layout/arena.py`, `comm/`, zeroray.worker_context().\n")
    found = [line.split(": ", 1)[1] for line in stale_mentions([doc])]
    assert found == ["zeroray/fetch.py", "layout/fetch.py", "zeroray.memory_report"]
