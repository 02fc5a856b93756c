"""ReloadModel loads only checkpoints inside the checkpoint root, in both services.

A path outside the root (absolute, ``../``, a symlink, a ``latest`` that leads out) is
INVALID_ARGUMENT with one fixed message, the same whether anything is there or not, so a
reload request cannot read or probe the file system outside the root. The model in service
stays the same after every refusal.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from checkpoints_kit import tiny_checkpoint
from fastapi.testclient import TestClient

from openbook.errors import status_for
from openbook.rag import RagGenerator
from openbook.storage.checkpoint import LATEST, CheckpointError, CheckpointPathError
from openbook.v1 import common_pb2
from openbook_gateway.app import create_app
from openbook_generator.servicer import GeneratorServicer
from openbook_generator.settings import GeneratorSettings
from openbook_retriever.registry import IndexRegistry
from openbook_retriever.servicer import RetrieverServicer
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import backends_serving, build_fact_indexes

TOKEN = "confinement-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Layout:
    tmp: Path
    root: Path  # the checkpoint root: step-000001 (latest), a hidden partial, links out
    outside: Path  # a valid checkpoint root beside it, never to be loaded
    bart: Path


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> Layout:
    tmp = tmp_path_factory.mktemp("confinement")
    bart = make_tiny_bart(tmp / "bart")
    root, outside = tmp / "checkpoints", tmp / "outside"
    good = tiny_checkpoint(root, 1, bart)
    tiny_checkpoint(outside, 5, bart)
    # A complete checkpoint under a partial's hidden name, as a writer killed just before its
    # rename leaves it.
    shutil.copytree(good, root / ".step-000002.tmp-abc-1-0123abcd")
    (root / "step-000007").symlink_to(outside / "step-000005")
    # A sub-root whose latest names a link out of the root.
    (root / "sub").mkdir()
    (root / "sub" / "step-000005").symlink_to(outside / "step-000005")
    (root / "sub" / LATEST).write_text("step-000005\n")
    return Layout(tmp, root, outside, bart)


OUTSIDE = {
    "absolute path to a valid checkpoint": lambda lay: str(lay.outside / "step-000005"),
    "absolute path to nothing": lambda lay: str(lay.tmp / "nowhere" / "step-000005"),
    "absolute path to a file": lambda lay: "/etc/passwd",
    "../ escape": lambda lay: "../outside/step-000005",
    "../ escape inside an absolute path": lambda lay: f"{lay.root}/../outside/step-000005",
    "../ escape to nothing": lambda lay: "../../../nowhere",
    "symlink out of the root": lambda lay: "step-000007",
    "latest leading out of the root": lambda lay: "sub",
}
# Names no client means to send: refused for what they hold, before any path is resolved.
CONTROL_CHARACTERS = {
    "step-000001\n": "control characters (U+000A at index 11)",
    "step-000001\x00": "NUL characters (U+0000 at index 11)",
    "\nstep-000001": "control characters (U+000A at index 0)",
    "step\x1b[31m-000001": "control characters (U+001B at index 4)",
    f"{LATEST}\r\n": "control characters (U+000D at index 6)",
}


def _servicers(layout: Layout):
    generator = GeneratorServicer(RagGenerator.load(layout.bart), checkpoint_root=layout.root)
    retriever = RetrieverServicer(
        IndexRegistry(layout.tmp / "no-indexes"), checkpoint_root=layout.root
    )
    return {"generator": generator, "retriever": retriever}


@pytest.fixture(scope="module")
def servicers(layout):
    servicers = _servicers(layout)
    yield servicers
    for servicer in servicers.values():
        servicer.close()


def _version(servicer) -> str:
    if isinstance(servicer, GeneratorServicer):
        return servicer.generator.model_version
    return servicer.model_version


def _reload(servicer, path: str) -> common_pb2.ModelInfo:
    return servicer.ReloadModel(common_pb2.ReloadModelRequest(path=path), None)


@pytest.mark.parametrize("service", ["generator", "retriever"])
def test_paths_outside_the_root_are_refused_alike(servicers, layout, service):
    servicer = servicers[service]
    before = _version(servicer)
    messages = set()
    for case, path in OUTSIDE.items():
        with pytest.raises(CheckpointPathError) as err:
            _reload(servicer, path(layout))
        assert status_for(err.value) == grpc.StatusCode.INVALID_ARGUMENT, case
        messages.add(str(err.value))
        assert _version(servicer) == before, case
    # One message for all: nothing about what is (or is not) out there, not even the path.
    assert len(messages) == 1, messages
    (message,) = messages
    assert "checkpoint root" in message
    for leak in ("outside", "nowhere", "passwd", "step-000005", str(layout.tmp)):
        assert leak not in message


@pytest.mark.parametrize("service", ["generator", "retriever"])
def test_names_with_control_characters_are_refused_naming_them(servicers, service):
    servicer = servicers[service]
    before = _version(servicer)
    for path, says in CONTROL_CHARACTERS.items():
        with pytest.raises(CheckpointPathError) as err:
            _reload(servicer, path)
        assert status_for(err.value) == grpc.StatusCode.INVALID_ARGUMENT, path
        assert str(err.value) == f"checkpoint must not contain {says}"
        assert _version(servicer) == before, path


@pytest.mark.parametrize("service", ["generator", "retriever"])
def test_partial_and_missing_versions_inside_the_root_are_refused(servicers, service):
    servicer = servicers[service]
    before = _version(servicer)
    with pytest.raises(CheckpointPathError, match="partial"):
        _reload(servicer, ".step-000002.tmp-abc-1-0123abcd")
    with pytest.raises(CheckpointError, match="'step-000099' not found in the checkpoint root"):
        _reload(servicer, "step-000099")
    assert status_for(CheckpointError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert _version(servicer) == before


@pytest.mark.parametrize("service", ["generator", "retriever"])
def test_versions_inside_the_root_load(layout, service):
    servicers = _servicers(layout)
    try:
        servicer = servicers[service]
        for path in ("step-000001", str(layout.root / "step-000001"), "", LATEST):
            assert _reload(servicer, path).model_version == "step-000001", path
    finally:
        for s in servicers.values():
            s.close()


def test_gateway_answers_422_without_revealing_the_outside(layout, redis_server):
    indexes = layout.tmp / "indexes"
    build_fact_indexes(indexes)
    common = {
        "host": "127.0.0.1",
        "port": 0,
        "redis_url": redis_server.url,
        "checkpoint_dir": layout.root,
        "load_latest_checkpoint": False,
        "admin_token": TOKEN,
    }
    retriever = RetrieverSettings(index_root=indexes, default_index="facts-a", **common)
    generator = GeneratorSettings(model=layout.bart, **common)
    with (
        backends_serving(retriever, generator) as backends,
        TestClient(create_app(backends.gateway_settings(redis_server.url))) as client,
    ):
        details = set()
        for path in (str(layout.outside / "step-000005"), "/nowhere", "../outside"):
            reply = client.post("/admin/reload-model", json={"checkpoint": path}, headers=AUTH)
            assert reply.status_code == 422, reply.text
            details.add(reply.json()["detail"])
        assert len(details) == 1 and "outside" not in details.pop()
        reply = client.post("/admin/reload-model", json={"checkpoint": "step-000001"}, headers=AUTH)
        assert reply.status_code == 200, reply.text
        versions = {k: reply.json()[k] for k in ("generator", "retriever")}
        assert versions == {"generator": "step-000001", "retriever": "step-000001"}
