"""The `milvus` role of docker-compose.yml (issue 41): Milvus standalone in compose, Milvus
Lite's own server under `openbook up`, only when the index engine is milvus.

* The default stack (the files engine) neither runs nor waits for it; with
  ``OPENBOOK_INDEX_ENGINE=milvus`` `openbook up` runs it before the retriever, as
  ``milvus-lite server`` on loopback over ``<var>/milvus/lite``, and the retriever's URI
  points there.
* A real run: `openbook up` starts that server, finds it healthy (``openbook-health
  --milvus``), and a client of the retriever's URI creates and reads a collection in it.
* The retriever refuses to start on a Milvus token file it cannot read, naming the variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from openbook_cli.launcher import ComposeProject, active_profiles, local_stack
from openbook_testkit.stack import REPO_ROOT, free_port

pytest.importorskip("milvus_lite")

MILVUS_PORT = "19530"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBOOK_", "COMPOSE_"))}
    return {**env, "OPENBOOK_VAR_DIR": str(tmp_path / "var"), **extra}


def test_the_default_stack_runs_no_milvus(tmp_path: Path) -> None:
    project = ComposeProject(REPO_ROOT / "docker-compose.yml", _env(tmp_path))
    order = project.resolve_order(None)
    assert "milvus" not in order and "retriever" in order
    retriever = project.services["retriever"]
    assert retriever.env["OPENBOOK_INDEX_ENGINE"] == "files"
    assert retriever.env["OPENBOOK_MILVUS_TOKEN_FILE"] == ""
    # Named, it runs (compose's rule for a profiled service), as any profile turned on.
    assert "milvus" in project.resolve_order(["milvus"])
    assert active_profiles({"COMPOSE_PROFILES": "milvus, train"}) == {"milvus", "train"}


def test_the_milvus_engine_runs_milvus_lite_server_before_the_retriever(tmp_path: Path) -> None:
    env = _env(tmp_path, OPENBOOK_INDEX_ENGINE="milvus")
    project = ComposeProject(REPO_ROOT / "docker-compose.yml", env)
    order = project.resolve_order(None)
    assert order.index("milvus") < order.index("retriever")
    milvus = project.services["milvus"]
    data = str(tmp_path / "var" / "milvus" / "lite")
    assert milvus.argv == [
        *("milvus-lite", "server", "--data-dir", data),
        *("--host", "127.0.0.1", "--port", MILVUS_PORT),
    ]
    assert milvus.healthcheck == ["openbook-health", "--milvus", f"127.0.0.1:{MILVUS_PORT}"]
    assert milvus.external  # the official image in compose: one already running is reused
    retriever = project.services["retriever"]
    assert retriever.depends_on["milvus"] == "service_healthy"
    assert retriever.env["OPENBOOK_INDEX_ENGINE"] == "milvus"
    assert retriever.env["OPENBOOK_MILVUS_URI"] == f"http://127.0.0.1:{MILVUS_PORT}"


def test_openbook_up_serves_milvus_lite_to_the_retriever_uri(tmp_path: Path) -> None:
    from pymilvus import DataType, MilvusClient

    port = str(free_port())
    compose = tmp_path / "docker-compose.yml"  # the repository's, on a port of this test's
    compose.write_text((REPO_ROOT / "docker-compose.yml").read_text().replace(MILVUS_PORT, port))
    env = _env(tmp_path, OPENBOOK_INDEX_ENGINE="milvus")
    stack = local_stack(compose, ["milvus"], env)
    try:
        stack.start()  # returns once the server answers openbook-health --milvus
        uri = stack.project.services["retriever"].env["OPENBOOK_MILVUS_URI"]
        assert uri == f"http://127.0.0.1:{port}"
        client = MilvusClient(uri=uri, timeout=30)
        schema = MilvusClient.create_schema(auto_id=False)
        schema.add_field("id", DataType.INT64, is_primary=True)
        schema.add_field("v", DataType.FLOAT_VECTOR, dim=2)
        index = client.prepare_index_params()
        index.add_index(field_name="v", index_type="FLAT", metric_type="IP")
        client.create_collection("up", schema=schema, index_params=index)
        client.insert("up", [{"id": 1, "v": [1.0, 0.0]}])
        found = client.query("up", filter="id == 1", output_fields=["id"])
        assert [r["id"] for r in found] == [1]
        client.close()
        assert (tmp_path / "var" / "milvus" / "lite").is_dir()  # the data under var/
        health = [sys.executable, "-m", "openbook.serving.health", "--milvus", f"127.0.0.1:{port}"]
        assert subprocess.run(health, timeout=60).returncode == 0
    finally:
        stack.stop()
    health = [sys.executable, "-m", "openbook.serving.health", "--milvus", f"127.0.0.1:{port}"]
    assert subprocess.run(health, timeout=60).returncode == 1  # stopped: unhealthy


def test_the_retriever_refuses_a_token_file_it_cannot_read(tmp_path: Path) -> None:
    missing = tmp_path / "milvus-token"
    env = _env(
        tmp_path,
        OPENBOOK_INDEX_ENGINE="milvus",
        OPENBOOK_MILVUS_URI=str(tmp_path / "m.db"),
        OPENBOOK_MILVUS_TOKEN_FILE=str(missing),
    )
    command = [sys.executable, "-m", "openbook_retriever"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Milvus token (OPENBOOK_MILVUS_TOKEN_FILE) file" in result.stderr
    assert str(missing) in result.stderr
