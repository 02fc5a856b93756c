"""Unit tests of the small shared modules: logs, shared state, codegen, config, cache keys."""

import json
import logging
import os
import threading
import time

import pytest

from openbook.codegen import proto_files, stubs_are_stale
from openbook.observability.logs import JsonFormatter, request_id_var
from openbook.state.redis_protocol import answer_key
from openbook.state.shared_state import ActiveIndexStore, publish_model_version, redis_client
from openbook_gateway.settings import GatewaySettings
from openbook_generator.settings import GeneratorSettings
from openbook_testkit.stack import free_port


def test_json_log_lines_carry_the_request_id_and_fields():
    record = logging.LogRecord("svc", logging.INFO, __file__, 1, "hello %s", ("world",), None)
    record.fields = {"index": "wiki-2018"}
    token = request_id_var.set("req-123")
    try:
        line = json.loads(JsonFormatter().format(record))
    finally:
        request_id_var.reset(token)
    assert line["msg"] == "hello world"
    assert line["request_id"] == "req-123"
    assert line["index"] == "wiki-2018"
    assert line["level"] == "info"


def test_cache_key_depends_on_every_part():
    params = {"question": "q", "k": 5, "models": {"generator": "g1", "retriever": "r1"}}
    base = answer_key("wiki-2018", params)
    assert base == answer_key("wiki-2018", dict(reversed(params.items())))
    assert base != answer_key("wiki-2016", params)
    assert base != answer_key("wiki-2018", {**params, "k": 6})
    assert base != answer_key(
        "wiki-2018", {**params, "models": {"generator": "g2", "retriever": "r1"}}
    )


def test_shared_state_degrades_without_redis():
    store = ActiveIndexStore(redis_client(f"redis://127.0.0.1:{free_port()}/0", 0.2))
    assert store.get() is None
    assert store.set("wiki-2018") is False
    publish_model_version(store.client, "generator", "v1")  # logs, never raises


def test_watch_calls_back_on_announcements(redis_server):
    store = ActiveIndexStore(redis_server.client())
    seen = []
    stop = threading.Event()
    store.watch(lambda: seen.append(store.get()), stop, check_every_s=60)
    try:
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        store.set("wiki-2016")
        while "wiki-2016" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
    assert "wiki-2016" in seen


def test_stubs_regenerate_when_a_proto_changes(tmp_path):
    import shutil

    from openbook.codegen import PROTO_ROOT, generate

    proto_root = tmp_path / "proto"
    shutil.copytree(PROTO_ROOT, proto_root)
    out = tmp_path / "out"
    out.mkdir()
    assert stubs_are_stale(proto_root, out)
    generate(proto_root, out)
    assert not stubs_are_stale(proto_root, out)
    assert {p.stem for p in proto_files(proto_root)} == {"common", "generator", "retriever"}
    newer = time.time() + 10
    os.utime(proto_files(proto_root)[0], (newer, newer))
    assert stubs_are_stale(proto_root, out)


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("OPENBOOK_GATEWAY_PORT", "9123")
    monkeypatch.setenv("OPENBOOK_ADMIN_TOKEN", "t0k")
    settings = GatewaySettings()
    assert settings.port == 9123
    assert settings.admin_token.get_secret_value() == "t0k"
    assert "t0k" not in repr(settings)  # the token never shows up in logs of the settings
    monkeypatch.setenv("OPENBOOK_GENERATOR_MAX_BATCH_SIZE", "0")
    with pytest.raises(ValueError, match="max_batch_size"):
        GeneratorSettings()
