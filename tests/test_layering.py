"""Layers point down only (DESIGN.md, STYLE.md): serve -> lanes -> controller and engine ->
kvcache/kernels -> config. Checked on the source with ``ast``; imports inside functions and
under ``if TYPE_CHECKING:`` count too (a type-only import that points up is still a tangle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "verifypd"

# package -> the verifypd packages and top-level modules it must never import
FORBIDDEN = {
    "engine": ("controller", "lanes", "serve", "llm"),
    "kvcache": ("engine", "controller", "lanes", "serve", "llm"),
    "kernels": ("engine", "controller", "lanes", "serve", "llm"),
    "controller": ("engine", "lanes", "serve", "llm", "kvcache", "kernels"),
    "lanes": ("serve", "llm"),
}


def imported_modules(source: str) -> set[str]:
    """Every module ``source`` imports (``from verifypd import lanes`` names verifypd.lanes)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(root: Path, package: str) -> list[tuple[str, str]]:
    """(file, module) for each import in ``root/package`` of a module it must not import."""
    banned = tuple(f"verifypd.{name}" for name in FORBIDDEN[package])
    found = []
    for path in sorted((root / package).rglob("*.py")):
        for name in sorted(imported_modules(path.read_text())):
            if any(name == b or name.startswith(b + ".") for b in banned):
                found.append((str(path.relative_to(root)), name))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down_only(package: str) -> None:
    assert any((PACKAGE / package).glob("*.py"))  # the check reads real files
    assert violations(PACKAGE, package) == []


@pytest.mark.parametrize(
    "line",
    [
        "from verifypd.controller import build_policy",
        "import verifypd.lanes.dispatcher",
        "from verifypd import serve",
        "from verifypd.controller.goodput import GoodputPolicy",
    ],
)
def test_an_upward_import_in_the_engine_is_caught(tmp_path: Path, line: str) -> None:
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "ok.py").write_text("from verifypd.config import EngineConfig\n")
    indented = "\n".join("    " + part for part in line.split("\n"))
    (engine / "bad.py").write_text(f"def f():\n{indented}\n")  # inside a function counts too
    found = violations(tmp_path, "engine")
    assert found and all(path == "engine/bad.py" for path, _ in found)
