"""`openbook up` on a machine where Redis's default port is someone else's: the whole stack.

Another, password-less Redis holds the port compose defaults to (a copy of docker-compose.yml
whose default is a port this test owns, so the machine's real 6379 is never needed nor
touched). The stack must come up on a port of its own, answer questions with its cache in its
own Redis, leave the other Redis empty, and a command run from the checkout with no variable
set must find the stack's Redis.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest
import redis

from openbook.config.redis_endpoint import port_of, read_record, record_path
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import (
    LocalStack,
    build_fact_indexes,
    compose_with_redis_default,
    foreign_redis,
    free_port,
)

pytestmark = pytest.mark.e2e


def test_stack_comes_up_beside_a_foreign_redis_on_its_default_port(tmp_path):
    var = tmp_path / "var"
    build_fact_indexes(var / "indexes")
    make_tiny_bart(var / "models" / "tiny-bart")
    taken = free_port()
    with foreign_redis(taken) as foreign:
        stack = LocalStack(var)
        stack.compose_file = compose_with_redis_default(tmp_path, taken)
        del stack.env["OPENBOOK_REDIS_PORT"]  # nothing says where Redis goes
        try:
            stack.start()
            log = stack.log_tail(1_000_000)
            assert re.search(rf"port\(s\) {taken}(, \d+)* held by another program", log), log
            record = read_record(record_path(var))
            assert record is not None, log
            port = port_of(record.url)
            assert port is not None and port != taken
            stack.ports["redis"] = port

            question = {"question": "Who wrote Hamlet?", "k": 2}
            reply = httpx.post(f"{stack.url}/answer", json=question, timeout=60)
            assert reply.status_code == 200, reply.text
            again = httpx.post(f"{stack.url}/answer", json=question, timeout=60)
            assert again.json()["cached"] is True  # the answer cache works: Redis is reached
            assert list(stack.redis().scan_iter(match="openbook:*"))
            with pytest.raises(redis.AuthenticationError):
                stack.redis(password=False).ping()

            # A command run from the checkout (var/ beside it), no Redis variable set.
            env = {
                k: v
                for k, v in os.environ.items()
                if not k.startswith("OPENBOOK_REDIS_") and k != "OPENBOOK_VAR_DIR"
            }
            found = subprocess.run(
                [sys.executable, "-m", "openbook_cli", "redis"],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert found.returncode == 0, found.stderr
            assert f"redis://127.0.0.1:{port}/0" in found.stdout
            assert "recorded by openbook up" in found.stdout

            # The other Redis: not one openbook key, not one key at all.
            assert foreign.dbsize() == 0
        finally:
            stack.stop()
