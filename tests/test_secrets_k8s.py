"""``openbook-secrets k8s-ensure`` against a fake Kubernetes API server (issue 29).

The fake is a real HTTP server on a free port that answers ``POST
/api/v1/namespaces/<ns>/secrets`` the way the API server does (201, 409 AlreadyExists, 403
Forbidden) and records what it was sent; the command runs as the Job runs it, with a
service-account folder of token and namespace files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from openbook.security.secrets import ACL_FILE, PASSWORD_FILE, SERVER_KEY_FILE, acl_text
from openbook_deploy.secrets import main

TOKEN = "sa-token-123"


@dataclass
class FakeApi:
    """What the fake answers (``status``) and what it got (``requests``)."""

    url: str
    status: int = 201
    requests: list[dict] = field(default_factory=list)


@pytest.fixture()
def api() -> Iterator[FakeApi]:
    fake = FakeApi(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = int(self.headers.get("Content-Length", "0"))
            fake.requests.append(
                {
                    "path": self.path,
                    "authorization": self.headers.get("Authorization"),
                    "content_type": self.headers.get("Content-Type"),
                    "body": json.loads(self.rfile.read(length)),
                }
            )
            reasons = {
                201: ("Success", ""),
                409: ("AlreadyExists", 'secrets "openbook-redis" already exists'),
                403: (
                    "Forbidden",
                    'secrets is forbidden: User "system:serviceaccount:openbook:default" '
                    'cannot create resource "secrets"',
                ),
            }
            reason, message = reasons[fake.status]
            status = {"kind": "Status", "reason": reason, "message": message}
            payload = json.dumps(status).encode()
            self.send_response(fake.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def service_account(tmp_path) -> Path:
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(TOKEN)
    (sa / "namespace").write_text("openbook-test")
    return sa


def _ensure(api: FakeApi, sa: Path) -> list[str]:
    return ["k8s-ensure", "--service-account-dir", str(sa), "--api-url", api.url]


def test_first_start_creates_the_secret_with_the_three_files(api, service_account, capsys):
    assert main(_ensure(api, service_account)) == 0
    (req,) = api.requests
    assert req["path"] == "/api/v1/namespaces/openbook-test/secrets"
    assert req["authorization"] == f"Bearer {TOKEN}"
    assert req["content_type"] == "application/json"
    body = req["body"]
    assert body["kind"] == "Secret" and body["apiVersion"] == "v1"
    assert body["metadata"]["name"] == "openbook-redis"
    assert body["metadata"]["namespace"] == "openbook-test"
    data = body["stringData"]
    assert set(data) == {PASSWORD_FILE, ACL_FILE, SERVER_KEY_FILE}
    password = data[PASSWORD_FILE].strip()
    assert len(password) >= 40 and password != data[SERVER_KEY_FILE].strip()
    assert data[ACL_FILE] == acl_text(password)  # exactly what `init` writes
    out = capsys.readouterr()
    assert "created" in out.out
    assert password not in out.out + out.err  # no secret printed


def test_an_existing_secret_is_left_alone(api, service_account, capsys):
    api.status = 409
    assert main(_ensure(api, service_account)) == 0
    assert len(api.requests) == 1  # one create attempt, no update or delete
    assert "exists, left as it is" in capsys.readouterr().out


def test_forbidden_fails_with_a_message_naming_rbac(api, service_account, capsys):
    api.status = 403
    assert main(_ensure(api, service_account)) == 1
    err = capsys.readouterr().err
    assert "HTTP 403" in err and "RBAC" in err and "create" in err
    assert "cannot create resource" in err  # the API server's own reason


def test_unreachable_api_and_missing_service_account_fail_clearly(tmp_path, capsys):
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "namespace").write_text("openbook")
    args = ["k8s-ensure", "--service-account-dir", str(sa), "--api-url", "http://127.0.0.1:9"]
    assert main(args) == 1
    assert "service account token" in capsys.readouterr().err
    (sa / "token").write_text(TOKEN)
    assert main(args) == 1
    assert "cannot reach the Kubernetes API" in capsys.readouterr().err


def test_without_an_api_url_it_needs_the_pods_environment(service_account, monkeypatch, capsys):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["k8s-ensure", "--service-account-dir", str(service_account)]) == 1
    assert "KUBERNETES_SERVICE_HOST" in capsys.readouterr().err


def test_the_installed_command_runs_it(api, service_account):
    """The console script the Job's container runs, as a process."""
    out = subprocess.run(
        [str(Path(sys.executable).parent / "openbook-secrets"), *_ensure(api, service_account)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "Secret openbook-test/openbook-redis created" in out.stdout
    assert len(api.requests) == 1
