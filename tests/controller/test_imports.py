"""The controller is pure Python and sits above the engine: no torch, engine, lanes, serve or
kvcache imports (checked on the source, so the answer does not depend on other packages)."""

import ast
from pathlib import Path

import verifypd.controller

FORBIDDEN = ("torch", "triton", "verifypd.engine", "verifypd.lanes", "verifypd.serve")
FORBIDDEN += ("verifypd.kvcache", "verifypd.kernels", "aiohttp")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_controller_imports_only_pure_python_and_config():
    package_dir = Path(verifypd.controller.__file__).parent
    sources = sorted(package_dir.glob("*.py"))
    assert len(sources) >= 4
    for path in sources:
        for name in _imported_modules(path):
            assert not name.startswith(FORBIDDEN), (path.name, name)
