"""Two retriever replicas sharing one index directory behind two gateways, one Redis (issue 32,
"Replicas"): the processes compose runs (``openbook-retriever``, ``openbook-gateway``), each
gateway pointed at its own replica, so every request through a gateway reaches that replica.

* Read-your-writes: writes alternate between the gateways (so between the replicas), and a
  read through the *other* gateway, started after the ack, serves each acknowledged write; a
  deleted document's passages are never served after its delete is acknowledged.
* ``kill -9`` of the replica that last wrote loses no acknowledged write: the other replica
  serves all of them and takes the next write (the kernel dropped the dead one's lock). (That
  a restarted replica replays the log is ``test_documents_end_to_end``'s.)
* Hot swap under writes: writes to both indexes while ``POST /admin/swap-index`` swaps between
  them neither fail nor get lost, and a swap to an index serves its latest version.
* An index directory removed out of band (not through the API) raises its cache epoch: no
  gateway answers from its cached answers again.

Tiny random generator: the tests check where passages come from, not what the answer says.
Compaction runs along (a low threshold), so replicas also see each other's new bases.

Every test runs on both index engines (issue 41): ``files`` (one index directory the replicas
share) and ``milvus`` (the indexes copied into one ``milvus-lite server``, the role `openbook
up` runs for compose's ``milvus`` service, which both replicas talk to as they would to a
cluster; an index "removed out of band" is dropped from Milvus by another client).
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from openbook.index.engine import EngineKind
from openbook.security.sealing import default_sealer
from openbook.state.redis_protocol import INDEX_STATE_KEY, open_index_state
from openbook_testkit.milvus import copy_to_milvus, lite_server
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import (
    RetrieverProcess,
    build_fact_indexes,
    gateway_process,
    retriever_processes,
)

pytestmark = pytest.mark.e2e

TOKEN = "replicas-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Replicas:
    retrievers: list[RetrieverProcess]
    gateways: list[str]  # gateways[i] talks to retrievers[i]
    index_root: Path
    redis: Any  # a client of the one Redis
    milvus_uri: str | None = None  # the engine's server (None: the files engine)

    def remove_out_of_band(self, index: str) -> None:
        """Remove ``index`` as an operator would, not through the API: its directory
        (``rm -rf``), or its collections in Milvus through another client."""
        if self.milvus_uri is None:
            shutil.rmtree(self.index_root / index)
            return
        drop = (
            "import sys; from openbook.index.milvus_engine import MilvusEngine; "
            "e = MilvusEngine(sys.argv[1]); e.drop(sys.argv[2]); e.close()"
        )
        command = [sys.executable, "-c", drop, self.milvus_uri, index]
        subprocess.run(command, check=True, timeout=120)  # another program's client


@pytest.fixture(scope="module", params=[EngineKind.FILES, EngineKind.MILVUS])
def replicas(request, tmp_path_factory, redis_server) -> Iterator[Replicas]:
    from openbook_generator.server import build as build_generator
    from openbook_generator.settings import GeneratorSettings

    engine = request.param
    if engine is EngineKind.MILVUS:
        pytest.importorskip("milvus_lite")
    redis_server.flush()
    work = tmp_path_factory.mktemp(f"replicas-{engine}")
    build_fact_indexes(work / "indexes")
    generator, servicer = build_generator(
        GeneratorSettings(
            host="127.0.0.1",
            port=0,
            model=make_tiny_bart(work / "models" / "tiny-bart"),
            redis_url=redis_server.url,
            checkpoint_dir=work / "checkpoints",
            admin_token=TOKEN,
        )
    )
    generator.set_serving(True)
    generator.start()
    common = {
        "OPENBOOK_REDIS_URL": redis_server.url,
        "OPENBOOK_ADMIN_TOKEN": TOKEN,
        "OPENBOOK_CHECKPOINT_DIR": str(work / "checkpoints"),
    }
    retriever_env = {
        **common,
        "OPENBOOK_INDEX_ROOT": str(work / "indexes"),
        "OPENBOOK_RETRIEVER_DEFAULT_INDEX": "facts-a",
        # Low: replicas compact while the others write and read.
        "OPENBOOK_RETRIEVER_COMPACT_PASSAGES": "4",
        "OPENBOOK_INDEX_ENGINE": str(engine),
    }
    try:
        with ExitStack() as stack:
            milvus_uri = None
            if engine is EngineKind.MILVUS:
                server = stack.enter_context(lite_server(work / "milvus"))
                milvus_uri = server.uri
                copy_to_milvus(work / "indexes", milvus_uri, "facts-a", "facts-b")
                retriever_env["OPENBOOK_MILVUS_URI"] = milvus_uri
                # The retrievers hold no index state on their disk.
                retriever_env["OPENBOOK_INDEX_ROOT"] = str(work / "no-indexes-here")
            retrievers = stack.enter_context(
                retriever_processes([work / "retriever-0", work / "retriever-1"], retriever_env)
            )
            gateways = []
            for i, retriever in enumerate(retrievers):
                gateway_dir = work / f"gateway-{i}"
                gateway_dir.mkdir()
                env = {
                    **common,
                    "OPENBOOK_GATEWAY_RETRIEVER_ADDR": retriever.addr,
                    "OPENBOOK_GATEWAY_GENERATOR_ADDR": f"127.0.0.1:{generator.port}",
                }
                gateways.append(stack.enter_context(gateway_process(gateway_dir, env)))
            yield Replicas(
                retrievers, gateways, work / "indexes", redis_server.client(), milvus_uri
            )
            if milvus_uri is not None:
                assert not (work / "no-indexes-here").exists()
    finally:
        generator.stop(0)
        servicer.close()


def _put(gateway: str, index: str, doc_id: str, text: str) -> int:
    reply = httpx.put(
        f"{gateway}/indexes/{index}/documents/{doc_id}",
        json={"title": "Ledger", "text": text},
        headers=AUTH,
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    return int(reply.json()["version"])


def _delete(gateway: str, index: str, doc_id: str) -> int:
    reply = httpx.delete(f"{gateway}/indexes/{index}/documents/{doc_id}", headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    return int(reply.json()["version"])


def _ask(gateway: str, question: str, index: str | None = None) -> dict:
    body = {"question": question, "k": 3, "retrieval": "bm25", "max_new_tokens": 2}
    if index is not None:
        body["index"] = index
    reply = httpx.post(f"{gateway}/answer", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _passages(answer: dict) -> list[str]:
    return [p["id"] for p in answer["passages"]]


def _text(token: str) -> str:
    return f"The {token} ledger keeps its record in the archive."


def _listing(gateway: str, index: str) -> list[str]:
    reply = httpx.get(f"{gateway}/indexes/{index}/documents", params={"limit": 1000}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["ids"]


def test_a_hot_swap_under_writes_loses_no_write(replicas: Replicas) -> None:
    gw = replicas.gateways
    acked: dict[str, dict[str, int]] = {"facts-a": {}, "facts-b": {}}
    lock = threading.Lock()  # acked is written by the writer thread, copied here
    failures: list[str] = []
    done = threading.Event()
    serial = itertools.count()

    def write() -> None:
        with httpx.Client(timeout=120, headers=AUTH) as client:
            while not done.is_set():
                n = next(serial)
                index = ("facts-a", "facts-b")[n % 2]
                doc_id = f"swap-{n}"
                reply = client.put(
                    f"{gw[n % 2]}/indexes/{index}/documents/{doc_id}",
                    json={"title": "Swap", "text": _text(f"qs{n:03d}x")},
                )
                if reply.status_code != 200:
                    failures.append(f"{index}/{doc_id}: {reply.status_code} {reply.text}")
                    continue
                with lock:
                    acked[index][doc_id] = int(reply.json()["version"])

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for target in ("facts-b", "facts-a", "facts-b"):
            while len(acked["facts-a"]) + len(acked["facts-b"]) < 4 and not failures:
                time.sleep(0.05)  # writes are flowing when the swap comes
            with lock:
                seen = dict(acked[target])
            reply = httpx.post(
                f"{gw[0]}/admin/swap-index", json={"index": target}, headers=AUTH, timeout=120
            )
            assert reply.status_code == 200, reply.text
            # A swap to an index serves its latest version: every write acknowledged
            # before the swap is in the first answer from it.
            answer = _ask(gw[0], "Which ledger is qs000x?")
            assert answer["index"] == target
            assert answer["index_version"] >= max(seen.values(), default=0)
    finally:
        done.set()
        writer.join(120)
    assert failures == []
    for index, docs in acked.items():
        listing = set(_listing(gw[1], index))
        assert set(docs) <= listing, sorted(set(docs) - listing)
        for doc_id in list(docs)[-2:]:
            token = f"qs{int(doc_id.split('-')[1]):03d}x"
            answer = _ask(gw[1], f"Which ledger is {token}?", index=index)
            assert _passages(answer)[0] == f"{doc_id}#0", answer


def test_an_index_removed_out_of_band_never_answers_from_the_cache(replicas: Replicas) -> None:
    gw = replicas.gateways
    created = httpx.post(
        f"{gw[0]}/indexes", json={"name": "scratch", "like": "facts-a"}, headers=AUTH, timeout=60
    )
    assert created.status_code == 201, created.text
    _put(gw[0], "scratch", "note", _text("qzscratchx"))
    question = "Which ledger is qzscratchx?"
    assert _ask(gw[1], question, index="scratch")["cached"] is False
    assert _ask(gw[1], question, index="scratch")["cached"] is True

    def epoch() -> str | None:
        raw = replicas.redis.hget(INDEX_STATE_KEY, "scratch")
        state = open_index_state(default_sealer(), "scratch", raw)
        return state["epoch"] if state is not None else None

    before = epoch()
    assert before is not None
    replicas.remove_out_of_band("scratch")  # an operator's rm -rf or drop, not the API
    deadline = time.monotonic() + 60  # the retrievers' watch looks every 2 s
    while epoch() == before:
        logs = "\n".join(r.log_tail() for r in replicas.retrievers)
        assert time.monotonic() < deadline, f"no epoch raised:\n{logs}"
        time.sleep(0.1)
    for gateway in gw:
        body = {"question": question, "k": 3, "retrieval": "bm25", "max_new_tokens": 2}
        gone = httpx.post(f"{gateway}/answer", json={**body, "index": "scratch"}, timeout=60)
        # Not the cached 200: the retrievers say it is gone (/answer's 422 for an unknown
        # index; "was removed" from a replica that held it loaded when it went).
        assert gone.status_code == 422, gone.text
        assert "unknown index" in gone.text or "was removed" in gone.text, gone.text


def test_writes_through_either_replica_are_read_through_the_other(replicas: Replicas) -> None:
    gw = replicas.gateways
    acked: dict[str, str] = {}  # doc id -> token of its acknowledged text
    last_version = 0
    for i in range(8):
        writer, reader = gw[i % 2], gw[(i + 1) % 2]
        doc_id = f"ledger-{i % 5}"  # some are replaced
        token = f"qz{i:03d}x"
        version = _put(writer, "facts-a", doc_id, _text(token))
        assert version > last_version  # one sequence across both replicas
        last_version = version
        replaced = acked.get(doc_id)
        acked[doc_id] = token
        answer = _ask(reader, f"Which ledger is {token}?", index="facts-a")
        assert answer["index_version"] >= version
        assert _passages(answer)[0] == f"{doc_id}#0", answer
        if replaced is not None:  # the old text is never served after the replace's ack
            old = _ask(reader, f"Which ledger is {replaced}?", index="facts-a")
            assert all(replaced not in p["text"] for p in old["passages"]), old
        got = httpx.get(f"{reader}/indexes/facts-a/documents/{doc_id}", timeout=60)
        assert got.status_code == 200 and token in got.json()["text"]

    deleted = "ledger-1"
    _delete(gw[0], "facts-a", deleted)
    gone = acked.pop(deleted)
    answer = _ask(gw[1], f"Which ledger is {gone}?", index="facts-a")
    assert all(gone not in p["text"] for p in answer["passages"]), answer
    missing = httpx.get(f"{gw[1]}/indexes/facts-a/documents/{deleted}", timeout=60)
    assert missing.status_code == 404

    # kill -9 of the replica that wrote last: the other serves every acknowledged write.
    last = _put(gw[1], "facts-a", "ledger-last", _text("qzlastx"))
    acked["ledger-last"] = "qzlastx"
    replicas.retrievers[1].kill()  # the module's last test: it stays down
    listing = _listing(gw[0], "facts-a")
    assert set(acked) <= set(listing) and deleted not in listing
    for doc_id, token in acked.items():
        assert (
            _passages(_ask(gw[0], f"Which ledger is {token}?", index="facts-a"))[0] == f"{doc_id}#0"
        )
    assert _put(gw[0], "facts-a", "ledger-after", _text("qzafterx")) == last + 1
