"""The architecture holds: only the parallel package talks to accelerate and torch.distributed."""

from __future__ import annotations

import ast
from pathlib import Path

import scaletrain

PACKAGE = Path(scaletrain.__file__).parent
FORBIDDEN = ("accelerate", "torch.distributed", "torch.nn.parallel")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_only_the_parallel_package_imports_accelerate_or_torch_distributed():
    offenders = {str(p.relative_to(PACKAGE)): sorted(n for n in _imports(p) if n.startswith(FORBIDDEN))
                 for p in PACKAGE.rglob("*.py") if "parallel" not in p.relative_to(PACKAGE).parts}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert any(n.startswith("accelerate") for n in _imports(PACKAGE / "parallel" / "runtime.py"))
