"""No function in jobs/runners/ or jobs/worker/ runs past 80 lines (issue 27): a longer one is split
along its seams, so each piece can be read, and named, on its own."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 80


def _long_functions(folder: Path, root: Path = REPO) -> list[str]:
    """`path:line name (N lines)` for each def or async def under `folder` that spans over MAX_LINES."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = node.end_lineno - node.lineno + 1
                if span > MAX_LINES:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({span} lines)")
    return found


def test_no_function_in_the_runners_or_the_worker_is_over_80_lines() -> None:
    for folder in ("jobs/runners", "jobs/worker"):
        assert any((REPO / folder).rglob("*.py")), folder  # the walk sees the code it guards
    long = _long_functions(REPO / "jobs" / "runners") + _long_functions(REPO / "jobs" / "worker")
    assert long == [], "split these along their seams:\n" + "\n".join(long)


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES - 1))
    (tmp_path / "m.py").write_text(f"class C:\n    async def fits(self):\n{body}\n\n"
                                   f"    def too_long(self):\n{body}\n        return 0\n")
    assert _long_functions(tmp_path, tmp_path) == [f"m.py:{MAX_LINES + 3} too_long ({MAX_LINES + 1} lines)"]
