"""No code outside `openbook/rag/backends/` asks which model family a backend is.

Each family states its memory model and its capabilities on the backend itself
(`GeneratorBackend.memory_model`, `input_lengths`, `measuring_twin`, `prompted`, `answer_prefix`,
`stop_strings`, `joins_running`, ...: `openbook/rag/backends/base.py`), so adding a family
changes nothing outside `backends/`. The test reads every module of the library, the services
and the CLI with `ast` and fails on an `isinstance` / `issubclass` against a concrete family
class (one defined in `backends/` that derives from `GeneratorBackend`), or a `type(x) is` /
`==` comparison with one.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ROOT / "openbook" / "rag" / "backends"


def family_classes() -> set[str]:
    """Names of the classes in `backends/` that derive (transitively) from GeneratorBackend."""
    bases: dict[str, set[str]] = {}
    for path in BACKENDS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names = set()
                for base in node.bases:
                    if isinstance(base, ast.Subscript):  # GeneratorBackend[X, Y]
                        base = base.value
                    if isinstance(base, ast.Name):
                        names.add(base.id)
                    elif isinstance(base, ast.Attribute):
                        names.add(base.attr)
                bases[node.name] = names
    families: set[str] = set()
    grew = True
    while grew:
        grew = False
        for name, parents in bases.items():
            if name not in families and parents & (families | {"GeneratorBackend"}):
                families.add(name)
                grew = True
    return families


def _sources() -> list[Path]:
    files = [
        *(ROOT / "openbook").rglob("*.py"),
        *(ROOT / "services").glob("*/openbook_*/**/*.py"),
        *(ROOT / "cli" / "openbook_cli").rglob("*.py"),
    ]
    return [p for p in files if BACKENDS not in p.parents and "v1" not in p.parts]


def _names(node: ast.expr) -> set[str]:
    """Class names an isinstance's second argument names (a name, an attribute, a tuple or a
    union of them)."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Tuple):
        return set().union(*(_names(e) for e in node.elts))
    if isinstance(node, ast.BinOp):
        return _names(node.left) | _names(node.right)
    return set()


def family_checks() -> list[str]:
    families = family_classes()
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named: set[str] = set()
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"isinstance", "issubclass"}
                and len(node.args) == 2
            ):
                named = _names(node.args[1])
            elif isinstance(node, ast.Compare) and any(
                isinstance(op, ast.Is | ast.IsNot | ast.Eq | ast.NotEq) for op in node.ops
            ):
                for side in [node.left, *node.comparators]:
                    named |= _names(side) if not isinstance(side, ast.Call) else set()
            hit = named & families
            if hit:
                rel = path.relative_to(ROOT)
                found.append(f"{rel}:{node.lineno}: {', '.join(sorted(hit))}")
    return found


def test_the_families_are_found():
    # the scan means nothing if it finds no family to look for
    assert {"CausalBackend", "Seq2SeqBackend", "BartBackend"} <= family_classes()


def test_no_isinstance_on_a_model_family_outside_the_backends():
    found = family_checks()
    assert not found, (
        "code outside openbook/rag/backends/ tests a backend's family; state what it needs on "
        "the backend instead (openbook/rag/backends/base.py):\n  " + "\n  ".join(found)
    )
