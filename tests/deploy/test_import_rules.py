"""What `docs/architecture.md` says each package may import is what the code imports.

The table under "## Who imports whom" names, for every package of the core library and every
service, the other packages it imports. The test reads every module's imports with `ast` (at
the top and inside functions alike) and compares: an import the table does not allow is a
layering break; a permission the code no longer uses is a stale document. Either way one of the
two must change, deliberately.
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


def _subpackages() -> set[str]:
    return {
        p.parent.name
        for p in (ROOT / "openbook").glob("*/__init__.py")
        if p.parent.name not in GENERATED
    }


def _package_of_module(module: str, subpackages: set[str]) -> str | None:
    """``openbook.rag.engine`` → ``openbook.rag``; ``openbook.validation.limits`` → ``openbook``;
    ``openbook_gateway.app`` → ``openbook_gateway``; anything else (a library) → None."""
    parts = module.split(".")
    if parts[0] == CORE:
        return f"{CORE}.{parts[1]}" if len(parts) > 1 and parts[1] in subpackages else CORE
    if parts[0] in SERVICES or parts[0] in ("openbook_cli", "openbook_deploy"):
        return parts[0]
    return None


def _package_of_file(path: Path, subpackages: set[str]) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "services":
        return rel.parts[2]
    if rel.parts[0] == "cli":
        return "openbook_cli"
    if rel.parts[0] == "deploy":
        return "openbook_deploy"
    return _package_of_module(".".join(rel.with_suffix("").parts), subpackages) or CORE


def _sources() -> list[Path]:
    files = [
        *(ROOT / "openbook").rglob("*.py"),
        *(ROOT / "services").glob("*/openbook_*/**/*.py"),
        *(ROOT / "cli" / "openbook_cli").rglob("*.py"),
        *(ROOT / "deploy" / "openbook_deploy").rglob("*.py"),
    ]
    return [p for p in files if not set(p.relative_to(ROOT).parts) & GENERATED]


def imported_packages() -> dict[str, set[str]]:
    """The openbook packages each package imports (itself excluded)."""
    subpackages = _subpackages()
    graph: dict[str, set[str]] = defaultdict(set)
    for path in _sources():
        package = _package_of_file(path, subpackages)
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


def documented_rules() -> dict[str, set[str]]:
    """The table of docs/architecture.md's "Who imports whom": first column the package, second
    the packages it may import (backticked), or "—" for none."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Who imports whom", 1)[1].split("\n## ", 1)[0]
    rules: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        package = re.findall(r"`([\w.]+)`", cells[0])[0]
        rules[package] = set(re.findall(r"`([\w.]+)`", cells[1]))
    return rules


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
