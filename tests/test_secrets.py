"""openbook-secrets (openbook.security.secrets, the command in openbook_deploy.secrets), the
settings that read its files, and sealing (openbook.security.sealing)."""

from __future__ import annotations

import json
import logging
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from openbook.config.settings import CommonSettings
from openbook.security.sealing import RateLimitedLog, Sealer, load_sealer
from openbook.security.secrets import ACL_RULES, SecretFiles, acl_text, init
from openbook_deploy.secrets import k8s_secret


def _contents(files: SecretFiles) -> dict[str, str]:
    return {p.name: p.read_text() for p in (files.password, files.acl, files.server_key)}


def test_init_makes_private_secrets_once_and_never_rotates_them(tmp_path):
    files = init(tmp_path / "secrets")
    assert stat.S_IMODE(files.dir.stat().st_mode) == 0o700
    for path in (files.password, files.acl, files.server_key):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    first = _contents(files)
    password = files.password.read_text().strip()
    assert len(password) >= 40 and password != files.server_key.read_text().strip()
    assert password not in first["redis-users.acl"]  # its SHA-256 only
    assert first["redis-users.acl"] == acl_text(password)
    assert "user default off" in first["redis-users.acl"]
    init(files.dir)  # a restart
    assert _contents(files) == first
    files.acl.unlink()  # the ACL follows the password, which never moves
    init(files.dir)
    assert _contents(files) == first
    assert sorted(p.name for p in files.dir.iterdir()) == sorted(first)  # no temporary left


def test_concurrent_first_starts_agree_on_one_password(tmp_path):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _contents(init(tmp_path / "s")), range(16)))
    assert all(r == results[0] for r in results)


def test_the_command_line_makes_them_and_prints_no_secret(tmp_path):
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "openbook-secrets"),
            "init",
            "--dir",
            str(tmp_path / "s"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    password = (tmp_path / "s" / "redis-password").read_text().strip()
    assert password not in out.stdout + out.stderr
    assert "secrets ready" in out.stdout


def test_the_k8s_secret_holds_the_same_files(tmp_path):
    files = init(tmp_path / "s")
    secret = k8s_secret(files.dir)
    assert secret["metadata"]["name"] == "openbook-redis"
    assert secret["stringData"] == _contents(files)
    assert k8s_secret(files.dir) == secret  # again: the same values


def test_acl_is_least_privilege():
    assert "-@dangerous" in ACL_RULES and "~openbook:*" in ACL_RULES and "&openbook:*" in ACL_RULES


def test_settings_read_the_password_file_or_name_it(tmp_path, monkeypatch):
    files = init(tmp_path / "s")
    options = CommonSettings(redis_password_file=files.password).redis_options()
    assert options.username == "openbook"
    assert options.password == files.password.read_text().strip()
    assert options.password not in repr(options)
    assert CommonSettings().redis_options().password is None  # the URL's own credentials
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="OPENBOOK_REDIS_PASSWORD_FILE.*nope"):
        CommonSettings(redis_password_file=missing).redis_options()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        CommonSettings(redis_password_file=empty).redis_options()
    tls = CommonSettings(redis_url="rediss://h:6380/0", redis_tls_ca_file=tmp_path / "ca.pem")
    assert tls.redis_options().client_kwargs()["ssl_ca_certs"] == str(tmp_path / "ca.pem")


@pytest.mark.parametrize("service", ["gateway", "retriever", "generator"])
def test_a_service_with_an_unreadable_secret_exits_naming_it(tmp_path, service):
    env = {
        "PATH": str(Path(sys.executable).parent),
        "OPENBOOK_REDIS_PASSWORD_FILE": str(tmp_path / "missing-password"),
    }
    proc = subprocess.run(
        [str(Path(sys.executable).parent / f"openbook-{service}")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "OPENBOOK_REDIS_PASSWORD_FILE" in proc.stderr and "missing-password" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- sealing -------------------------------------------------------------------------------


def test_a_sealed_value_opens_only_under_its_key_and_with_its_mac(tmp_path):
    sealer = load_sealer(init(tmp_path / "s").server_key)
    sealed = sealer.seal("openbook:answer:1", "payload")
    assert sealer.open("openbook:answer:1", sealed) == "payload"
    assert sealer.open("openbook:answer:1", sealed.encode()) == "payload"
    assert sealer.open("openbook:answer:2", sealed) is None  # moved
    altered = json.dumps({**json.loads(sealed), "v": "payload!"})
    assert sealer.open("openbook:answer:1", altered) is None
    for forged in ("payload", "{}", '{"v": "x"}', '{"v": 1, "mac": 2}', "[1]", "\xff"):
        assert sealer.open("openbook:answer:1", forged) is None, forged
    assert sealer.open("openbook:answer:1", None) is None
    other = Sealer(b"another deployment's key")
    assert other.open("openbook:answer:1", sealed) is None


def test_rejections_are_logged_rate_limited(caplog):
    limited = RateLimitedLog(logging.getLogger("test.sealing"), every_s=3600)
    with caplog.at_level(logging.WARNING, logger="test.sealing"):
        logged = [limited.warning("rejected %s", i) for i in range(50)]
    assert logged.count(True) == 1 and len(caplog.records) == 1
    limited.every_s = 0  # the next line counts what was held back
    with caplog.at_level(logging.WARNING, logger="test.sealing"):
        limited.warning("rejected again")
    assert "49 more" in caplog.records[-1].getMessage()
