"""The gateway's layout: every route is a named module-level handler in
``openbook_gateway.routes``, ``app.py`` only assembles, and nothing but ``get_services`` reads
``request.app.state`` (handlers get the services as a dependency)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from fastapi.routing import APIRoute
from starlette.routing import BaseRoute

import openbook_gateway
from openbook_gateway.app import create_app
from openbook_gateway.settings import GatewaySettings

PACKAGE = Path(openbook_gateway.__file__).parent
ROUTE_MODULES = "openbook_gateway.routes."


def _api_routes(routes: list[BaseRoute]) -> list[APIRoute]:
    """Every APIRoute of an app, those of included routers too (FastAPI may keep an included
    router as one route that holds its own)."""
    out: list[APIRoute] = []
    for route in routes:
        if isinstance(route, APIRoute):
            out.append(route)
        router = getattr(route, "original_router", None)
        if router is not None:
            out.extend(_api_routes(router.routes))
    return out


def test_every_route_is_a_named_handler_in_a_routes_module():
    routes = _api_routes(create_app(GatewaySettings()).routes)
    paths = {route.path for route in routes}
    assert {"/answer", "/v1/chat/completions", "/admin/swap-index", "/readyz", "/"} <= paths
    for route in routes:
        endpoint = route.endpoint
        assert "<locals>" not in endpoint.__qualname__, f"{route.path}: a closure"
        assert endpoint.__module__.startswith(ROUTE_MODULES), (route.path, endpoint.__module__)
        # importable by name, as a test or a reader finds it
        module = importlib.import_module(endpoint.__module__)
        assert getattr(module, endpoint.__qualname__) is endpoint


def test_app_py_declares_no_routes():
    tree = ast.parse((PACKAGE / "app.py").read_text())
    decorators = [
        ast.unparse(decorator)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for decorator in node.decorator_list
    ]
    assert not [d for d in decorators if d.startswith(("app.", "router."))], decorators


def test_only_get_services_reads_request_app_state():
    readers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                isinstance(inner, ast.Attribute)
                and ast.unparse(inner).startswith("request.app.state")
                for inner in ast.walk(node)
            ):
                readers.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert readers == ["services.py:get_services"]
