"""Imports of openbook's own modules sit at the top of the module, where they show the real
dependency graph, unless a heavy optional dependency must stay out of a process.

An import of ``openbook`` or an ``openbook_*`` package inside a function (or a method, at any
depth) is allowed only when the line right above it, or above the run of consecutive imports it
belongs to, is a one-line comment holding the marker ``why:`` and the reason, for example::

    def train_command(...):
        # why: torch stays out of `openbook --help`, which imports every command's module
        from openbook_trainer.loop import train

The test parses every module under ``openbook/``, ``services/`` and ``cli/`` (generated gRPC
stubs excepted) with :mod:`ast`; it imports nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("openbook", "services", "cli")
MARKER = "why:"


def _is_own(node: ast.Import | ast.ImportFrom) -> bool:
    """An import of openbook itself or of one of its packages (openbook_trainer, ...)."""
    if isinstance(node, ast.ImportFrom):
        names = [node.module or ""] if node.level == 0 else []
    else:
        names = [alias.name for alias in node.names]
    return any(n.split(".")[0].startswith("openbook") for n in names)


def _unexplained(path: Path) -> list[str]:
    """``path:line`` of every import of openbook's own modules inside a function that no
    ``why:`` comment explains."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    found: list[str] = []

    def visit_body(body: list[ast.stmt], in_function: bool) -> None:
        run_start: int | None = None  # first line of the current run of consecutive imports
        for stmt in body:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                run_start = stmt.lineno if run_start is None else run_start
                if in_function and _is_own(stmt):
                    above = lines[run_start - 2].strip() if run_start >= 2 else ""
                    if not (above.startswith("#") and MARKER in above):
                        found.append(f"{path.relative_to(ROOT)}:{stmt.lineno}")
                continue
            run_start = None
            inner = in_function or isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)
            for field in ("body", "orelse", "finalbody"):
                sub = getattr(stmt, field, None)
                if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                    visit_body(sub, inner)
            for handler in getattr(stmt, "handlers", []):
                visit_body(handler.body, inner)
            for case in getattr(stmt, "cases", []):
                visit_body(case.body, inner)

    visit_body(ast.parse(source, filename=str(path)).body, in_function=False)
    return found


def _modules() -> list[Path]:
    return sorted(
        p
        for folder in FOLDERS
        for p in (ROOT / folder).rglob("*.py")
        if "_pb2" not in p.name and ".venv" not in p.parts
    )


def test_the_modules_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert {"openbook/storage/checkpoint.py", "cli/openbook_cli/app.py"} <= names


def test_imports_inside_functions_say_why():
    offenders = [where for path in _modules() for where in _unexplained(path)]
    assert not offenders, (
        f"imports of openbook inside functions without a '# {MARKER} ...' comment above "
        f"(move them to the top of the module, or say why they stay): {offenders}"
    )
