"""Fixtures shared by the whole suite: a private Redis per session."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile

import pytest
import redis
import torch

from openbook_testkit.stack import RedisServer

# Two cores on CI: more threads than that only adds contention.
torch.set_num_threads(min(2, torch.get_num_threads()))

# Exactness tests compare answers and scores in float32: every generator service the suite
# starts (in process or through `openbook up`, which inherits this environment) loads its
# weights in float32, even on a CPU with native bf16, where the service's "auto" would pick
# bf16. A test of the precision policy itself passes its own dtype.
os.environ.setdefault("OPENBOOK_GENERATOR_DTYPE", "float32")

# Settings without OPENBOOK_REDIS_URL use the Redis that `openbook up` recorded under
# OPENBOOK_VAR_DIR (openbook.config.redis_endpoint): the suite must never find a developer's running
# stack in ./var, so its own var/ is an empty folder (a stack a test starts names its own).
_VAR = tempfile.mkdtemp(prefix="openbook-tests-var-")
atexit.register(shutil.rmtree, _VAR, ignore_errors=True)
os.environ["OPENBOOK_VAR_DIR"] = _VAR


# The worker's Redis, once a test has asked for it (redis_server).
_STARTED_REDIS: list[RedisServer] = []


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    # Every service the suite builds (in process, or a process inheriting this environment)
    # seals and verifies with the same server key, as one deployment's services do.
    os.environ["OPENBOOK_SERVER_KEY_FILE"] = str(server.secrets.server_key)
    _STARTED_REDIS.append(server)
    yield server
    _STARTED_REDIS.remove(server)
    server.stop()


@pytest.fixture(scope="module", autouse=True)
def _each_module_starts_from_an_empty_redis():
    """A module's services start from an empty Redis. The worker's Redis outlives modules and
    every service seals with the worker's one key, so without this a module's retriever would
    follow the active index another module swapped to (sealed, so genuine) and start on it.
    Safe under ``--dist loadfile``: a worker runs one module at a time, and module fixtures
    (the services) end with their module."""
    for server in _STARTED_REDIS:
        with contextlib.suppress(redis.ConnectionError):  # a module may have stopped it
            server.flush()
    yield


@pytest.fixture
def redis_url(redis_server) -> str:
    redis_server.flush()
    return redis_server.url
