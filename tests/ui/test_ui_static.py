"""The page's files are served from the package, with a strict CSP and nothing from elsewhere."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from openbook_gateway.app import create_app
from openbook_gateway.routes.pages import STATIC_DIR
from openbook_gateway.settings import GatewaySettings


@pytest.fixture(scope="module")
def client():
    # No `with`: the lifespan (gRPC/Redis clients) is not needed to serve files.
    return TestClient(create_app(GatewaySettings()))


def test_page_and_its_assets_are_served(client):
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    refs = re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text)
    assert {"/static/app.js", "/static/app.css", "/static/favicon.svg"} <= set(refs)
    for ref in refs:
        asset = client.get(ref)
        assert asset.status_code == 200, ref
        assert asset.content == (STATIC_DIR / ref.removeprefix("/static/")).read_bytes()
    assert client.get("/static/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/static/app.css").headers["content-type"].startswith("text/css")


@pytest.mark.parametrize(
    "path", ["/static/nope.js", "/static/..%2Fui.py", "/static/%2E%2E/app.py", "/static/index.html"]
)
def test_only_the_packaged_assets_are_served(client, path):
    assert client.get(path).status_code == 404


def test_page_loads_nothing_from_the_network():
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"(?:src|href|url)\s*[=(]\s*[\"']?(?:https?:)?//", text), path.name
        assert "@import" not in text and "@font-face" not in text, path.name


def test_script_never_parses_strings_as_html_or_code():
    js = (STATIC_DIR / "app.js").read_text()
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
    ):
        assert sink not in js, sink


def test_every_form_control_has_a_label():
    html = (STATIC_DIR / "index.html").read_text()
    ids = re.findall(r'<(?:input|select|textarea)\b[^>]*\bid="([^"]+)"', html)
    assert ids
    labelled = set(re.findall(r'<label[^>]*\bfor="([^"]+)"', html))
    assert set(ids) <= labelled
    assert 'aria-live="polite"' in html.split('id="answer"')[1].split(">")[0]
