"""openbook up: compose parsing, translation to the host, and a real run of small processes."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import yaml

from openbook.config.redis_endpoint import port_of, read_record, record_path
from openbook_cli.launcher import (
    Backoff,
    ComposeProject,
    LaunchError,
    Stack,
    interpolate,
    local_stack,
)
from openbook_testkit.stack import REPO_ROOT, compose_with_redis_default, foreign_redis, free_port


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
    assert gateway.argv == ["openbook-gateway"]
    assert gateway.env["OPENBOOK_GATEWAY_RETRIEVER_ADDR"] == "127.0.0.1:8051"
    assert gateway.env["OPENBOOK_GATEWAY_GENERATOR_ADDR"] == "127.0.0.1:8052"
    assert gateway.env["OPENBOOK_REDIS_URL"] == "redis://127.0.0.1:6379/0"
    assert gateway.env["OPENBOOK_GATEWAY_PORT"] == "9999"
    assert gateway.healthcheck[-1] == "http://127.0.0.1:9999/readyz"
    generator = project.services["generator"]
    assert generator.env["OPENBOOK_GENERATOR_MODEL"] == str(tmp_path / "models" / "tiny")
    assert generator.env["OPENBOOK_INDEX_ROOT"] == str(tmp_path / "indexes")
    assert generator.env["OPENBOOK_DATA_DIR"] == str(REPO_ROOT / "data")
    order = project.resolve_order(None)
    assert order.index("redis") < order.index("retriever") < order.index("gateway")
    assert order.index("init") < order.index("retriever")
    # The generator waits for its model and adapter only, and starts before the retriever,
    # so that it loads while init still builds the index (docs/benchmarks.md, "First answer").
    assert set(project.services["generator"].depends_on) == {"init-models"}
    assert order.index("init-models") < order.index("generator") < order.index("retriever")
    assert {"init", "init-models"} <= set(project.services["retriever"].depends_on)
    assert project.services["init"].argv[-1] == "--skip-models"
    assert project.services["init-models"].argv[-1] == "--skip-indexes"
    assert "trainer" not in order  # behind a profile
    assert "trainer" in project.resolve_order(["trainer"])


def test_openbook_commands_are_found_beside_this_python_when_not_on_path():
    # What compose runs (openbook-retriever, openbook-health, ...) is installed with openbook:
    # `openbook up` finds it even when its folder is not on PATH (an unactivated venv).
    from openbook_cli.launcher import _resolve

    bin_dir = Path(sys.executable).parent
    env = {"PATH": "/nonexistent"}
    installed = [c for c in ("openbook-retriever", "openbook-health") if (bin_dir / c).exists()]
    assert installed, f"openbook's commands are not installed in {bin_dir}"
    for command in installed:
        assert _resolve([command, "--x"], env, "s") == [str(bin_dir / command), "--x"]
    with pytest.raises(LaunchError, match="not found on PATH"):
        _resolve(["python-no-such-command"], env, "s")


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
        [sys.executable, "-m", "openbook_cli", "up", "-f", str(compose)],
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


def test_local_processes_bind_loopback_where_containers_bind_every_interface(tmp_path):
    # In a container 0.0.0.0 is the container's own network and compose publishes only the
    # gateway; on the host it would be every interface: openbook up binds loopback.
    env = {"PATH": os.environ["PATH"], "OPENBOOK_VAR_DIR": str(tmp_path)}
    project = ComposeProject(REPO_ROOT / "docker-compose.yml", env)
    for name in ("gateway", "retriever", "generator"):
        assert project.services[name].env[f"OPENBOOK_{name.upper()}_HOST"] == "127.0.0.1"
    redis = project.services["redis"].argv
    assert redis[redis.index("--bind") + 1] == "127.0.0.1"
    for spec in project.services.values():
        assert "0.0.0.0" not in spec.argv, spec.name
        assert "0.0.0.0" not in spec.env.values(), spec.name
    # Only the exact wildcard address is rewritten, never a URL or a path containing it.
    assert project.translate("http://0.0.0.0.example/", []) == "http://0.0.0.0.example/"


def test_backoff_grows_exponentially_to_a_cap_and_resets():
    backoff = Backoff(initial_s=0.5, factor=2.0, max_s=4.0, reset_after_s=30.0)
    assert [backoff.next_delay() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert not backoff.should_reset(up_for_s=29.0)  # not up long enough
    assert backoff.should_reset(up_for_s=30.0)
    backoff.reset()
    assert not backoff.should_reset(up_for_s=300.0)  # nothing to forget
    assert backoff.next_delay() == 0.5


def _crash_loop_compose(tmp_path: Path, starts: Path) -> Path:
    doc = {
        "services": {
            "crash": {
                "build": ".",
                "command": ["/bin/sh", "-c", f"date +%s.%N >> {starts}; exit 3"],
                "restart": "on-failure",
            }
        }
    }
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_crash_looping_service_is_restarted_with_growing_capped_delays(tmp_path):
    import threading

    starts = tmp_path / "starts"
    backoff = Backoff(initial_s=0.1, factor=4.0, max_s=0.5, reset_after_s=60.0)
    stack = Stack(
        ComposeProject(_crash_loop_compose(tmp_path, starts), dict(os.environ)),
        backoff=backoff,
        poll_s=0.02,
    )
    supervisor = threading.Thread(target=stack.supervise, daemon=True)
    try:
        stack.start()
        supervisor.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if starts.exists() and len(starts.read_text().split()) >= 6:
                break
            time.sleep(0.05)
    finally:
        stack.stop()
        supervisor.join(10)
    times = [float(t) for t in starts.read_text().split()]
    assert len(times) >= 6, times
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)][:5]
    expected = [0.1, 0.4, 0.5, 0.5, 0.5]  # 0.1 * 4**n, capped at 0.5 (uncapped: 1.6, 6.4)
    slack = 0.6  # process start and polling on a busy machine; smaller than any uncapped step
    for gap, delay in zip(gaps, expected, strict=True):
        assert delay - 0.01 <= gap <= delay + slack, (gaps, expected)
    assert stack.processes["crash"].backoff.failures >= 5  # never reset: never healthy


def test_backoff_is_forgotten_once_a_service_stays_healthy(tmp_path):
    import threading

    compose = tmp_path / "compose.yml"
    service = {
        "build": ".",
        "command": ["/bin/sh", "-c", "exec sleep 600"],
        "healthcheck": {"test": ["CMD", "true"], "interval": "100ms", "retries": 50},
        "restart": "unless-stopped",
    }
    compose.write_text(yaml.safe_dump({"services": {"steady": service}}))
    backoff = Backoff(initial_s=0.1, factor=10.0, max_s=600.0, reset_after_s=0.5)
    stack = Stack(ComposeProject(compose, dict(os.environ)), backoff=backoff, poll_s=0.02)
    supervisor = threading.Thread(target=stack.supervise, daemon=True)
    try:
        stack.start()
        proc = stack.processes["steady"]
        proc.backoff.failures = 3  # as after three crashes: the next delay would be 100 s
        supervisor.start()
        deadline = time.monotonic() + 30
        while proc.backoff.failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.backoff.failures == 0, "backoff not reset after a healthy stretch"
        old = proc.popen
        os.killpg(old.pid, signal.SIGKILL)
        old.wait()
        while proc.popen is old and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.popen is not old, "not restarted after the first (short) delay"
    finally:
        stack.stop()
        supervisor.join(10)


def _redis_stack(tmp_path: Path, port: int) -> Stack:
    """docker-compose.yml's secrets step and Redis, run by `openbook up` on ``port``."""
    env = {
        **os.environ,
        "OPENBOOK_VAR_DIR": str(tmp_path / "var"),
        "OPENBOOK_REDIS_PORT": str(port),
    }
    return local_stack(REPO_ROOT / "docker-compose.yml", ["redis"], env)


def test_openbook_up_runs_redis_with_the_secrets_it_makes_on_first_start(tmp_path, capsys):
    import stat

    import redis

    port = free_port()
    stack = _redis_stack(tmp_path, port)
    try:
        stack.start()
        secrets = tmp_path / "var" / "secrets"
        password = (secrets / "redis-password").read_text().strip()
        for name in ("redis-password", "redis-users.acl", "server-key"):
            assert stat.S_IMODE((secrets / name).stat().st_mode) == 0o600, name
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        assert redis.Redis(port=port, username="openbook", password=password).ping()
        # A second `openbook up` (the same secrets, never rotated) reuses this Redis.
        again = _redis_stack(tmp_path, port)
        again.start()
        assert "redis" not in again.processes
        assert "redis already running, reusing it" in capsys.readouterr().out
        assert (secrets / "redis-password").read_text().strip() == password
    finally:
        stack.stop()


def test_openbook_up_never_reuses_a_redis_without_the_password(tmp_path):
    # Someone else's Redis on the port, without openbook's ACL user and password.
    port = free_port()
    other = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
    )
    try:
        import redis

        for _ in range(100):
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        stack = _redis_stack(tmp_path, port)
        try:
            with pytest.raises(LaunchError, match="without this deployment's ACL user"):
                stack.start()
        finally:
            stack.stop()
    finally:
        other.terminate()
        other.wait(10)


def _unset_redis_env(**extra: str) -> dict[str, str]:
    """This environment without anything that says where Redis is (or where var/ is)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OPENBOOK_REDIS_") and k not in ("OPENBOOK_VAR_DIR",)
    }
    return {**env, **extra}


def _openbook_redis(cwd: Path) -> subprocess.CompletedProcess:
    """`openbook redis` run from ``cwd`` with no Redis variable and no OPENBOOK_VAR_DIR."""
    return subprocess.run(
        [sys.executable, "-m", "openbook_cli", "redis"],
        cwd=cwd,
        env=_unset_redis_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_openbook_up_moves_off_a_default_port_another_redis_holds(tmp_path, capsys):
    import redis

    taken = free_port()
    compose = compose_with_redis_default(tmp_path, taken)  # compose's default: `taken`
    var = tmp_path / "var"
    env = _unset_redis_env(OPENBOOK_VAR_DIR=str(var))
    with foreign_redis(taken) as foreign:
        stack = local_stack(compose, ["redis"], env)
        try:
            stack.start()
            out = capsys.readouterr().out
            assert re.search(rf"port\(s\) {taken}(, \d+)* held by another program", out), out
            record = read_record(record_path(var))
            assert record is not None, out
            port = port_of(record.url)
            assert port is not None and port != taken
            password = (var / "secrets" / "redis-password").read_text().strip()
            assert record.password_file == str(var / "secrets" / "redis-password")
            ours = redis.Redis(port=port, username="openbook", password=password)
            assert ours.execute_command("ACL", "WHOAMI") == b"openbook"
            # The services were given that endpoint (compose's URL, on the chosen port).
            gateway = stack.project.services["gateway"]
            assert gateway.env["OPENBOOK_REDIS_URL"] == f"redis://127.0.0.1:{port}/0"
            # A command run here with no variable at all finds the stack's Redis.
            found = _openbook_redis(tmp_path)
            assert found.returncode == 0, found.stderr
            assert f"redis://127.0.0.1:{port}/0" in found.stdout
            assert "answers as user openbook" in found.stdout
            # The next `openbook up` takes the recorded port again and reuses its Redis.
            again = local_stack(compose, ["redis"], env)
            again.start()
            assert "redis" not in again.processes
            assert "redis already running, reusing it" in capsys.readouterr().out
            assert again.project.env["OPENBOOK_REDIS_PORT"] == str(port)
            # The other Redis: never written to, still nobody's but its owner's.
            assert foreign.dbsize() == 0
            assert foreign.ping()
        finally:
            stack.stop()


def test_openbook_up_with_nothing_set_comes_up_whatever_holds_6379(tmp_path):
    # The real case: compose's default 6379, which the machine's own Redis (or anything) may
    # hold, or not. Nothing but var/ is set.
    import redis

    from openbook_cli.launcher import _port_free

    held_before = not _port_free(6379)
    var = tmp_path / "var"
    stack = local_stack(
        REPO_ROOT / "docker-compose.yml", ["redis"], _unset_redis_env(OPENBOOK_VAR_DIR=str(var))
    )
    try:
        stack.start()
        record = read_record(record_path(var))
        assert record is not None
        port = port_of(record.url)
        assert port is not None
        if held_before:  # not ours (a fresh var/ has no Redis yet): left alone
            assert port != 6379
        password = (var / "secrets" / "redis-password").read_text().strip()
        ours = redis.Redis(port=port, username="openbook", password=password)
        assert ours.execute_command("ACL", "WHOAMI") == b"openbook"
        found = _openbook_redis(tmp_path)
        assert found.returncode == 0, found.stderr
        assert f":{port}/0" in found.stdout
    finally:
        stack.stop()
