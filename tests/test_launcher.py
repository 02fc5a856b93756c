"""openbook up: compose parsing, translation to the host, and a real run of small processes."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import yaml

from openbook.launcher import ComposeProject, LaunchError, Stack, interpolate
from openbook.testing import REPO_ROOT, free_port


def test_interpolation_follows_compose_rules():
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d}", env) == "x"
    assert interpolate("${EMPTY:-d}", env) == "d"
    assert interpolate("${EMPTY-d}", env) == ""
    assert interpolate("${UNSET-d}/${UNSET:-e}", env) == "d/e"
    assert interpolate("$$HOME $SET", env) == "$HOME x"
    with pytest.raises(LaunchError, match="NEEDED"):
        interpolate("${NEEDED:?set it}", env)


def test_repo_compose_file_translates_to_local_processes(tmp_path):
    env = {
        "PATH": os.environ["PATH"],
        "OPENBOOK_VAR_DIR": str(tmp_path),
        "OPENBOOK_GATEWAY_PORT": "9999",
        "OPENBOOK_GENERATOR_MODEL": "/var/openbook/models/tiny",
    }
    project = ComposeProject(REPO_ROOT / "docker-compose.yml", env)
    gateway = project.services["gateway"]
    assert gateway.argv == ["openbook", "serve", "gateway"]
    assert gateway.env["OPENBOOK_RETRIEVER_ADDR"] == "127.0.0.1:50051"
    assert gateway.env["OPENBOOK_REDIS_URL"] == "redis://127.0.0.1:6379/0"
    assert gateway.env["OPENBOOK_GATEWAY_PORT"] == "9999"
    assert gateway.healthcheck[-1] == "http://127.0.0.1:9999/readyz"
    generator = project.services["generator"]
    assert generator.env["OPENBOOK_GENERATOR_MODEL"] == str(tmp_path / "models" / "tiny")
    assert generator.env["OPENBOOK_INDEX_ROOT"] == str(tmp_path / "indexes")
    assert generator.env["OPENBOOK_DATA_DIR"] == str(REPO_ROOT / "data")
    order = project.resolve_order(None)
    assert order.index("redis") < order.index("retriever") < order.index("gateway")
    assert order.index("init") < order.index("generator")
    assert "trainer" not in order  # behind a profile
    assert "trainer" in project.resolve_order(["trainer"])


def _write_compose(tmp_path, port):
    server = tmp_path / "server.py"
    server.write_text(
        textwrap.dedent(
            """
            import http.server, os, pathlib
            marker = pathlib.Path(os.environ["DATA"]) / "ready"
            class H(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    ok = marker.exists()
                    self.send_response(200 if ok else 503); self.end_headers()
                    self.wfile.write(os.environ["DATA"].encode())
                def log_message(self, *a): pass
            http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
            """
        )
    )
    doc = {
        "services": {
            "job": {
                "build": ".",
                "command": [
                    sys.executable,
                    "-c",
                    "import os, pathlib; pathlib.Path(os.environ['OUT']).write_text('1')",
                ],
                "environment": {"OUT": "/data/ready"},
                "volumes": [f"{tmp_path}/vol:/data"],
            },
            "web": {
                "build": ".",
                "command": f"{sys.executable} {server}",
                "environment": {"PORT": "${WEB_PORT}", "DATA": "/data"},
                "volumes": [f"{tmp_path}/vol:/data"],
                "depends_on": {"job": {"condition": "service_completed_successfully"}},
                "healthcheck": {
                    "test": [
                        "CMD",
                        sys.executable,
                        "-c",
                        f"import urllib.request; urllib.request.urlopen('http://web:{port}/')",
                    ],
                    "interval": "200ms",
                    "retries": 50,
                },
                "restart": "unless-stopped",
            },
        }
    }
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_stack_runs_jobs_waits_for_health_and_restarts(tmp_path):
    port = free_port()
    compose = _write_compose(tmp_path, port)
    stack = Stack(ComposeProject(compose, {**os.environ, "WEB_PORT": str(port)}))
    try:
        stack.start()  # job ran first (web is healthy only if its file exists)
        assert httpx.get(f"http://127.0.0.1:{port}/").text == str(tmp_path / "vol")
        web = stack.processes["web"].popen
        os.killpg(web.pid, signal.SIGKILL)
        web.wait()
        import threading

        supervisor = threading.Thread(target=stack.supervise, daemon=True)
        supervisor.start()
        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert stack.processes["web"].popen.pid != web.pid
    finally:
        stack.stop()


def test_openbook_up_cli_stops_everything_on_sigterm(tmp_path):
    port = free_port()
    compose = _write_compose(tmp_path, port)
    proc = subprocess.Popen(
        [sys.executable, "-m", "openbook", "up", "-f", str(compose)],
        env={**os.environ, "WEB_PORT": str(port)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for _ in range(200):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            pytest.fail("web never came up")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert "starting web" in out
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/", timeout=0.5)


def test_unknown_service_is_a_clear_error(tmp_path):
    compose = _write_compose(tmp_path, free_port())
    with pytest.raises(LaunchError, match="unknown service"):
        ComposeProject(compose, dict(os.environ)).resolve_order(["nope"])


def test_trainer_service_config_resolves_to_host_paths(tmp_path):
    from openbook_trainer.config import TrainConfig

    env = {"PATH": os.environ["PATH"], "OPENBOOK_VAR_DIR": str(tmp_path)}
    trainer = ComposeProject(REPO_ROOT / "docker-compose.yml", env).services["trainer"]
    config_path = trainer.argv[trainer.argv.index("--config") + 1]
    assert config_path == str(REPO_ROOT / "deploy" / "train" / "squad-demo.yaml")
    config = yaml.safe_load(Path(config_path).read_text())
    config = TrainConfig.model_validate(config)
    assert config.out == Path("/var/openbook/checkpoints")
    assert config.train_query_encoder and not config.train_generator


def test_volumes_never_leak_container_paths_to_the_host(tmp_path):
    compose = tmp_path / "compose.yml"
    service = {"build": ".", "command": "true", "environment": {"D": "/data/x"}}
    compose.write_text(yaml.safe_dump({"services": {"s": {**service, "volumes": ["cache:/data"]}}}))
    spec = ComposeProject(compose, {}).services["s"]
    assert spec.env["D"] == str(tmp_path / "var" / "volumes" / "cache" / "x")
    compose.write_text(
        yaml.safe_dump({"services": {"s": {**service, "volumes": ["rel/dir:/data"]}}})
    )
    with pytest.raises(LaunchError, match="must start with ./"):
        ComposeProject(compose, {})
