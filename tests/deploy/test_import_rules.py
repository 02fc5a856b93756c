"""What `docs/architecture.md` says each package may import is what the code imports.

The table under "## Who imports whom" names, for every package of the core library and every
service, the other packages it imports. The test reads every module's imports with `ast` (at
the top and inside functions alike) and compares: an import the table does not allow is a
layering break; a permission the code no longer uses is a stale document. Either way one of the
two must change, deliberately.

Every module belongs to a package of the table: a module of ``openbook/<name>/`` to
``openbook.<name>``, a service's to the service. The modules loose at the top of ``openbook/``
are the package ``openbook``, and only those of :data:`TOP_LEVEL_MODULES` may be there (leaves
every package may import, and the build's stub generator): a new module goes into the package
whose job it is, or a new package gets a row in the table. No two packages may import each other,
directly or through others: the table allows no cycle, and neither does the code.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("openbook_gateway", "openbook_retriever", "openbook_generator", "openbook_trainer")
CORE = "openbook"
GENERATED = {"v1"}  # the gRPC stubs the build writes: part of the core

# The only modules at the top of openbook/ (issue 44: the rest are in packages of one job each).
TOP_LEVEL_MODULES = {
    "__init__": "the package's docstring",
    "errors": "the typed errors that cross service boundaries: a leaf every package may import",
    "types": "plain data types (Passage) shared by every service: a leaf every package may import",
    "codegen": "writes openbook/v1's stubs; setup.py runs it by path before openbook is installed",
}


def _subpackages(root: Path = ROOT) -> set[str]:
    return {
        p.parent.name
        for p in (root / "openbook").glob("*/__init__.py")
        if p.parent.name not in GENERATED
    }


def _package_of_module(module: str, subpackages: set[str]) -> str | None:
    """``openbook.rag.engine`` → ``openbook.rag``; ``openbook.errors`` → ``openbook``;
    ``openbook_gateway.app`` → ``openbook_gateway``; anything else (a library) → None."""
    parts = module.split(".")
    if parts[0] == CORE:
        return f"{CORE}.{parts[1]}" if len(parts) > 1 and parts[1] in subpackages else CORE
    if parts[0] in SERVICES or parts[0] in ("openbook_cli", "openbook_deploy"):
        return parts[0]
    return None


def _package_of_file(path: Path, subpackages: set[str], root: Path = ROOT) -> str:
    rel = path.relative_to(root)
    if rel.parts[0] == "services":
        return rel.parts[2]
    if rel.parts[0] == "cli":
        return "openbook_cli"
    if rel.parts[0] == "deploy":
        return "openbook_deploy"
    return _package_of_module(".".join(rel.with_suffix("").parts), subpackages) or CORE


def _sources(root: Path = ROOT) -> list[Path]:
    files = [
        *(root / "openbook").rglob("*.py"),
        *(root / "services").glob("*/openbook_*/**/*.py"),
        *(root / "cli" / "openbook_cli").rglob("*.py"),
        *(root / "deploy" / "openbook_deploy").rglob("*.py"),
    ]
    return [p for p in files if not set(p.relative_to(root).parts) & GENERATED]


def imported_packages(root: Path = ROOT) -> dict[str, set[str]]:
    """The openbook packages each package imports (itself excluded)."""
    subpackages = _subpackages(root)
    graph: dict[str, set[str]] = defaultdict(set)
    for path in _sources(root):
        package = _package_of_file(path, subpackages, root)
        graph[package]  # a package that imports nothing of ours is still listed
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from openbook import rag` imports the package openbook.rag
                modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for module in modules:
                target = _package_of_module(module, subpackages)
                if target is not None and target != package:
                    graph[package].add(target)
    return dict(graph)


def documented_rules(root: Path = ROOT) -> dict[str, set[str]]:
    """The table of docs/architecture.md's "Who imports whom": first column the package, second
    the packages it may import (backticked), or "—" for none."""
    text = (root / "docs" / "architecture.md").read_text()
    section = text.split("## Who imports whom", 1)[1].split("\n## ", 1)[0]
    rules: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        package = re.findall(r"`([\w.]+)`", cells[0])[0]
        rules[package] = set(re.findall(r"`([\w.]+)`", cells[1]))
    return rules


def loose_modules(root: Path = ROOT) -> list[str]:
    """The modules at the top of ``openbook/`` that :data:`TOP_LEVEL_MODULES` does not name."""
    return sorted(
        p.stem for p in (root / "openbook").glob("*.py") if p.stem not in TOP_LEVEL_MODULES
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of packages that import each other, directly or through others (the strongly
    connected components of more than one package, Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def violations(root: Path = ROOT) -> dict[str, object]:
    """Everything the rules forbid in the tree at ``root``, by rule; empty when it keeps them."""
    rules = documented_rules(root)
    actual = imported_packages(root)
    found: dict[str, object] = {
        "packages missing from the table": sorted(set(actual) - set(rules)),
        "packages in the table that do not exist": sorted(set(rules) - set(actual)),
        "imports the table does not allow": {
            p: sorted(actual[p] - rules.get(p, set()))
            for p in sorted(actual)
            if actual[p] - rules.get(p, set())
        },
        "permissions the code no longer uses": {
            p: sorted(rules[p] - actual.get(p, set()))
            for p in sorted(rules)
            if rules[p] - actual.get(p, set())
        },
        "cycles the table allows": cycles(rules),
        "cycles in the code": cycles(actual),
        "modules loose at the top of openbook/": loose_modules(root),
    }
    return {rule: what for rule, what in found.items() if what}


def test_the_table_names_every_package():
    rules = documented_rules()
    actual = imported_packages()
    assert set(rules) == set(actual), "packages missing from or extra in the table"


def test_every_import_is_allowed_and_every_permission_is_used():
    rules = documented_rules()
    actual = imported_packages()
    not_allowed = {p: sorted(actual[p] - rules.get(p, set())) for p in actual}
    unused = {p: sorted(rules[p] - actual.get(p, set())) for p in rules}
    assert not {p: v for p, v in not_allowed.items() if v}, "imports the table does not allow"
    assert not {p: v for p, v in unused.items() if v}, "permissions the code no longer uses"


def test_no_package_imports_itself_through_others():
    """Neither the table nor the code has a cycle: the packages are layers (issue 44 found one
    between the top of openbook/ and openbook.serving, through the health probe)."""
    assert cycles(documented_rules()) == [], "the table allows a cycle"
    assert cycles(imported_packages()) == [], "the code has a cycle"


def test_nothing_is_loose_at_the_top_of_openbook():
    """A module belongs to the package whose job it is (docs/architecture.md, "The core's
    packages"); only the allowed leaves sit at the top of openbook/."""
    assert loose_modules() == [], "modules at the top of openbook/ outside TOP_LEVEL_MODULES"
    assert set(TOP_LEVEL_MODULES) <= {p.stem for p in (ROOT / "openbook").glob("*.py")}, (
        "TOP_LEVEL_MODULES names a module that is gone: drop it from the allow-list"
    )


def test_the_top_level_modules_import_nothing_of_openbook():
    """The top's modules are leaves: every package may import them because they import none."""
    assert documented_rules()[CORE] == set()
    assert imported_packages()[CORE] == set()


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


TABLE = """# Architecture

## Who imports whom

| package | imports |
|---|---|
| `openbook` | — |
| `openbook.a` | `openbook` |
| `openbook.b` | `openbook`, `openbook.a` |

## Next
"""


def test_the_checker_passes_a_tree_that_keeps_the_rules(tmp_path):
    _write(
        tmp_path,
        {
            "docs/architecture.md": TABLE,
            "openbook/__init__.py": "",
            "openbook/errors.py": "",
            "openbook/a/__init__.py": "from openbook.errors import x\n",
            "openbook/b/__init__.py": "",
            "openbook/b/m.py": "from openbook import errors\ndef f():\n    import openbook.a.y\n",
        },
    )
    assert violations(tmp_path) == {}


def test_the_checker_finds_each_kind_of_break(tmp_path):
    """A loose module, an import the table does not allow and the cycle it makes, a cycle the
    table allows, a package the table does not name: each is reported under its rule."""
    table = TABLE.replace(
        "| `openbook.a` | `openbook` |", "| `openbook.a` | `openbook`, `openbook.b` |"
    )
    _write(
        tmp_path,
        {
            "docs/architecture.md": table,
            "openbook/__init__.py": "",
            "openbook/errors.py": "",
            "openbook/stray.py": "",  # loose at the top, and not an allowed leaf
            "openbook/a/__init__.py": "",
            "openbook/a/m.py": "def f():\n    from openbook.b import m\n",  # a -> b, in a function
            "openbook/b/__init__.py": "from openbook.a import m\n",  # b -> a
            "openbook/c/__init__.py": "import openbook.errors\n",  # not in the table
        },
    )
    found = violations(tmp_path)
    assert found == {
        "packages missing from the table": ["openbook.c"],
        "imports the table does not allow": {"openbook.c": ["openbook"]},
        "permissions the code no longer uses": {
            "openbook.a": ["openbook"],
            "openbook.b": ["openbook"],
        },
        "cycles the table allows": [["openbook.a", "openbook.b"]],
        "cycles in the code": [["openbook.a", "openbook.b"]],
        "modules loose at the top of openbook/": ["stray"],
    }
    # a module at the top that imports a package importing the top (issue 44's health probe and
    # openbook.serving): one more cycle, through openbook
    _write(
        tmp_path,
        {
            "openbook/errors.py": "from openbook.a import m\n",
            "openbook/a/n.py": "import openbook\n",
        },
    )
    assert violations(tmp_path)["cycles in the code"] == [["openbook", "openbook.a", "openbook.b"]]


# The gateway's transports (issue 44): each turns its wire format into typed requests and calls
# the service layer; none calls another's handlers. A module belongs to the first transport
# whose prefix its name starts with (module names relative to ``openbook_gateway``).
GATEWAY = ROOT / "services" / "gateway" / "openbook_gateway"
TRANSPORTS = {
    "mcp": ("mcp_tools", "routes.mcp"),
    "v1": ("routes.openai", "openai_", "responses_format", "stored_responses"),
    "rest": ("routes",),
}
SERVICE_LAYER = ("operations", "answering")


def _gateway_module(path: Path) -> str:
    parts = path.relative_to(GATEWAY).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    # "openai_" is a prefix of module names; "routes" a package and its modules
    return any(
        module == p or module.startswith(p if p.endswith("_") else p + ".") for p in prefixes
    )


def _transport_of(module: str) -> str | None:
    return next((name for name, prefixes in TRANSPORTS.items() if _in(module, prefixes)), None)


def gateway_imports() -> dict[str, set[str]]:
    """Each gateway module and the gateway modules it imports (``openbook_gateway.`` cut)."""
    graph: dict[str, set[str]] = {}
    for path in GATEWAY.rglob("*.py"):
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name.startswith("openbook_gateway."):
                    imported.add(name.removeprefix("openbook_gateway."))
        graph[_gateway_module(path)] = imported
    return graph


def test_transports_meet_only_in_the_service_layer():
    """No transport (REST routes, ``/v1``, MCP) imports another's modules, and the service
    layer (``operations``, ``answering``) imports none: MCP tools and ``/v1`` routes reach
    documents, indexes and answers through the service layer, never through a REST handler."""
    graph = gateway_imports()
    assert _transport_of("mcp_tools") == "mcp"
    assert _transport_of("routes.documents") == "rest"
    assert _transport_of("openai_format") == "v1"
    crossings = {}
    for module, imported in graph.items():
        own = _transport_of(module)
        if own is None and not _in(module, SERVICE_LAYER):
            continue  # the app, the door, the clients: they may wire transports together
        # own is None for the service layer: any transport's module is foreign to it
        foreign = sorted(name for name in imported if _transport_of(name) not in (None, own))
        if foreign:
            crossings[module] = foreign
    assert not crossings, f"a transport (or the service layer) imports another: {crossings}"
