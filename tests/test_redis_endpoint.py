"""Where a service or command finds Redis with nothing set, and the one line it gets when
Redis cannot be reached (openbook.config.redis_endpoint, CommonSettings)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openbook.config.redis_endpoint import RedisEndpoint, record_path, write_record
from openbook.config.settings import CommonSettings
from openbook_testkit.stack import REPO_ROOT, free_port


def _record(var: Path, port: int) -> Path:
    path = record_path(var)
    write_record(
        path,
        RedisEndpoint(
            url=f"redis://127.0.0.1:{port}/0",
            username="openbook",
            password_file=str(var / "secrets" / "redis-password"),
            server_key_file=str(var / "secrets" / "server-key"),
        ),
    )
    return path


def test_explicit_url_then_the_record_then_the_port_then_6379(tmp_path, monkeypatch):
    for name in (
        "OPENBOOK_REDIS_URL",
        "OPENBOOK_REDIS_PORT",
        "OPENBOOK_REDIS_PASSWORD_FILE",
        "OPENBOOK_SERVER_KEY_FILE",  # the suite's Redis fixture sets it for its services
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENBOOK_VAR_DIR", str(tmp_path))
    assert CommonSettings().redis_url == "redis://127.0.0.1:6379/0"  # nothing recorded
    monkeypatch.setenv("OPENBOOK_REDIS_PORT", "7001")
    assert CommonSettings().redis_url == "redis://127.0.0.1:7001/0"
    monkeypatch.delenv("OPENBOOK_REDIS_PORT")

    _record(tmp_path, 6401)
    recorded = CommonSettings()
    assert recorded.redis_url == "redis://127.0.0.1:6401/0"
    assert "recorded by openbook up" in recorded.redis_source
    assert recorded.redis_password_file == tmp_path / "secrets" / "redis-password"
    assert recorded.server_key_file == tmp_path / "secrets" / "server-key"
    # What is set explicitly wins over the record, field by field.
    monkeypatch.setenv("OPENBOOK_REDIS_PASSWORD_FILE", "/elsewhere/pw")
    assert CommonSettings().redis_password_file == Path("/elsewhere/pw")
    monkeypatch.setenv("OPENBOOK_REDIS_PORT", "6401")  # the recorded port: the record
    assert CommonSettings().server_key_file == tmp_path / "secrets" / "server-key"
    monkeypatch.setenv("OPENBOOK_REDIS_PORT", "7001")  # another Redis: not the record's
    other = CommonSettings()
    assert other.redis_url == "redis://127.0.0.1:7001/0"
    assert other.redis_source == "OPENBOOK_REDIS_PORT"
    monkeypatch.setenv("OPENBOOK_REDIS_URL", "redis://10.0.0.9:6379/2")
    explicit = CommonSettings()
    assert explicit.redis_url == "redis://10.0.0.9:6379/2"
    assert explicit.redis_source == "OPENBOOK_REDIS_URL"


def test_unreachable_redis_is_one_line_naming_it_and_the_variable(tmp_path, monkeypatch, caplog):
    port = free_port()  # nothing listens there
    url = f"redis://openbook:s3cret@127.0.0.1:{port}/0"
    settings = CommonSettings(redis_url=url)
    problem = settings.redis_problem()
    assert problem is not None and not problem.bad_url
    assert f"redis://openbook:***@127.0.0.1:{port}/0 (OPENBOOK_REDIS_URL)" in problem.message
    assert "is unreachable" in problem.message
    assert "set OPENBOOK_REDIS_URL" in problem.message and "OPENBOOK_REDIS_PORT" in problem.message
    assert "s3cret" not in problem.message
    # A service says it once at start and serves on without Redis (as when it goes later).
    with caplog.at_level(logging.WARNING):
        settings.check_redis("openbook-test")
    assert problem.message in caplog.text and "serving without Redis" in caplog.text
    # No Redis URL at all: the service refuses to start, with the same kind of line.
    with pytest.raises(SystemExit) as exited:
        CommonSettings(redis_url="http://127.0.0.1:1/").check_redis("openbook-test")
    assert exited.value.code == 2

    # Found through openbook up's record: the message names the record and asks about it.
    for name in ("OPENBOOK_REDIS_URL", "OPENBOOK_REDIS_PORT", "OPENBOOK_REDIS_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENBOOK_VAR_DIR", str(tmp_path))
    record = _record(tmp_path, port)
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "redis-password").write_text("pw\n")
    from_record = CommonSettings().redis_problem()
    assert from_record is not None
    assert f"recorded by openbook up in {record}" in from_record.message
    assert "is `openbook up` running?" in from_record.message


def _without_redis_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENBOOK_REDIS_")}
    return {**env, **extra}


def test_cli_says_where_redis_is_unreachable_without_a_traceback(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = _without_redis_env(OPENBOOK_REDIS_URL=url, OPENBOOK_VAR_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "openbook_cli", "redis"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert f"openbook redis: Redis at {url} (OPENBOOK_REDIS_URL) is unreachable" in done.stderr
    assert "set OPENBOOK_REDIS_URL" in done.stderr


def test_a_service_starts_with_one_line_naming_an_unreachable_redis(tmp_path):
    # The gateway's own command (what compose and `openbook serve gateway` run).
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = _without_redis_env(
        OPENBOOK_REDIS_URL=url,
        OPENBOOK_VAR_DIR=str(tmp_path),
        OPENBOOK_GATEWAY_PORT=str(free_port()),
        OPENBOOK_GATEWAY_RETRIEVER_ADDR=f"127.0.0.1:{free_port()}",
        OPENBOOK_GATEWAY_GENERATOR_ADDR=f"127.0.0.1:{free_port()}",
    )
    log = tmp_path / "gateway.log"
    with open(log, "w") as out:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "openbook_cli", "serve", "gateway"],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while "serving without Redis" not in log.read_text() and gateway.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
        assert f"Redis at {url} (OPENBOOK_REDIS_URL) is unreachable" in text
        assert "set OPENBOOK_REDIS_URL" in text
        assert "Traceback" not in text
    finally:
        gateway.terminate()
        gateway.wait(30)
