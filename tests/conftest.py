"""Fixtures shared by the whole suite: a private Redis per session."""

from __future__ import annotations

import pytest
import torch

from openbook_testkit.stack import RedisServer

# Two cores on CI: more threads than that only adds contention.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    redis_server.client().flushall()
    return redis_server.url
