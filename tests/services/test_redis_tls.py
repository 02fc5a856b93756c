"""TLS is one setting away: a ``rediss://`` URL and the CA file, and every client of openbook
(the services' sync client, the gateway's answer cache) speaks TLS to a Redis that serves it,
authenticated and sealed as without TLS."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from openbook.config.settings import CommonSettings
from openbook.security.sealing import load_sealer
from openbook.security.secrets import init
from openbook.state.shared_state import ActiveIndexStore, redis_client
from openbook_gateway.cache import AnswerCache
from openbook_testkit.stack import free_port

pytestmark = pytest.mark.skipif(
    not (shutil.which("openssl") and shutil.which("redis-server")), reason="needs openssl"
)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(d: Path) -> None:
    """A CA, and a certificate for 127.0.0.1 that it signed."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=openbook test CA", "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", "redis.key", "-out", "redis.csr", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "redis.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "redis.crt",
             cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    _certificates(d)
    files = init(d / "secrets")
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(d / "redis.crt"), "--tls-key-file", str(d / "redis.key"),
         "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(d), "--aclfile", str(files.acl)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    settings = CommonSettings(
        redis_url=f"rediss://127.0.0.1:{port}/0",
        redis_password_file=files.password,
        redis_tls_ca_file=d / "ca.crt",
        server_key_file=files.server_key,
    )
    client = redis_client(settings.redis_options())
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield settings
    proc.terminate()
    proc.wait(10)


def test_the_services_client_speaks_tls_with_the_ca_setting(tls_redis):
    client = redis_client(tls_redis.redis_options())
    store = ActiveIndexStore(client, load_sealer(tls_redis.server_key_file))
    assert store.set("facts-b") is True
    assert store.get() == "facts-b"


def test_the_gateways_cache_speaks_tls_too(tls_redis):
    async def round_trip() -> dict | None:
        cache = AnswerCache(tls_redis.redis_options(), 60, load_sealer(tls_redis.server_key_file))
        try:
            await cache.put("facts-a", {"question": "q"}, {"answer": "a"})
            return await cache.get("facts-a", {"question": "q"})
        finally:
            await cache.close()

    assert asyncio.run(round_trip()) == {"answer": "a"}


def test_without_the_ca_or_without_tls_nothing_gets_through(tls_redis):
    unverified = tls_redis.model_copy(update={"redis_tls_ca_file": None})
    with pytest.raises(redis.ConnectionError):
        redis_client(unverified.redis_options()).ping()  # self-signed CA: not trusted
    plain = tls_redis.model_copy(
        update={"redis_url": tls_redis.redis_url.replace("rediss", "redis")}
    )
    with pytest.raises(redis.ConnectionError):
        redis_client(plain.redis_options()).ping()
