"""Sharded serving end to end: an index split by ``openbook index shard``, one retriever per
shard on loopback (each with ``OPENBOOK_INDEX_ROOT=<shard root>``, as in production), the real
gateway under uvicorn with ``OPENBOOK_GATEWAY_RETRIEVER_ADDR`` listing every shard, and an unsharded
setup beside it for reference.

The sharded gateway must answer with the unsharded one's passages (same ids, same order, same
scores); with a shard down it must answer 503 naming that shard, quickly, on ``/answer``,
``/indexes`` and ``/readyz``, and recover once the shard is back on its port.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from typer.testing import CliRunner

from openbook.index.cli import app as index_cli
from openbook.index.request import SearchRequest
from openbook.v1 import retriever_pb2, retriever_pb2_grpc
from openbook_gateway.settings import GatewaySettings
from openbook_generator.server import build as build_generator
from openbook_generator.settings import GeneratorSettings
from openbook_retriever.server import build as build_retriever
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import build_fact_indexes, serving_gateway

N_SHARDS = 2
RETRIEVE_TIMEOUT_S = 3.0
HEALTH_TIMEOUT_S = 0.5
QUESTIONS = [
    "When was the tower in Paris built?",
    "What is the highest mountain on Earth?",
    "Who created the Python programming language?",
    "Who was the first person to walk on the Moon?",
    "What is the largest animal that ever lived?",
    "Who discovered penicillin?",
    "What is the biggest planet in the solar system?",
    "Who wrote Hamlet?",
    "What do honey bees make from flowers?",
    "How many squares does a chess board have?",
    "Which river carries the most water?",
]
KS = (1, 3, 5, 8)
# Short answers: the passages are what is compared, the tiny random BART only has to run.
# Dense retrieval: shards must give the unsharded index's passages and scores exactly. (Hybrid
# merges may beat the unsharded top k, each shard fusing a candidate set of its own: see
# test_sharded_hybrid_merges_each_shards_fused_scores.)
ANSWER = {"use_cache": False, "max_new_tokens": 4, "decoding": "rag-token", "retrieval": "dense"}


class Retriever:
    """One in-process retriever (the production server's build) over ``index_root``."""

    def __init__(self, index_root: Path, redis_url: str, work: Path, port: int = 0) -> None:
        settings = RetrieverSettings(
            host="127.0.0.1",
            port=port,
            index_root=index_root,
            default_index="facts-a",
            redis_url=redis_url,
            checkpoint_dir=work / "checkpoints",  # empty: no trained checkpoint of the repo
        )
        self.service, _, self._stop_following = build_retriever(settings)
        self.service.set_serving(True)
        self.service.start()
        self.port = self.service.port
        self.running = True

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.running:
            self.running = False
            self._stop_following.set()
            self.service.stop(0)


@dataclass
class System:
    sharded_url: str
    unsharded_url: str
    shards: list[Retriever]
    unsharded: Retriever
    shard_root: Path
    redis_url: str
    work: Path
    gateway: Callable[[str, int], GatewaySettings]
    extra: list[Retriever] = field(default_factory=list)


def _split(indexes: Path, out_root: Path) -> None:
    """``openbook index shard`` for facts-a and facts-b, into one shard root per retriever."""
    runner = CliRunner()
    for name in ("facts-a", "facts-b"):
        out = out_root.parent / f"split-{name}"
        r = runner.invoke(
            index_cli,
            ["shard", str(indexes / name), "--shards", str(N_SHARDS), "--out-root", str(out)],
        )
        assert r.exit_code == 0, r.output
        assert r.stdout.split() == [str(out / f"shard-{i}" / name) for i in range(N_SHARDS)]
        for i in range(N_SHARDS):
            (out_root / f"shard-{i}").mkdir(parents=True, exist_ok=True)
            (out / f"shard-{i}" / name).rename(out_root / f"shard-{i}" / name)


@pytest.fixture(scope="module")
def system(tmp_path_factory, redis_server) -> Iterator[System]:
    work = tmp_path_factory.mktemp("sharded")
    indexes = work / "indexes"
    build_fact_indexes(indexes)
    shard_root = work / "shards"
    _split(indexes, shard_root)

    # The shards share one Redis database (the active index they follow), the unsharded
    # retriever another, so neither setup's state reaches the other.
    shards_redis, unsharded_redis = redis_server.url_for(5), redis_server.url_for(6)
    for db in (5, 6):
        redis_server.flush(db)

    started: list[Retriever] = []
    generator = generator_servicer = None
    try:
        unsharded = Retriever(indexes, unsharded_redis, work)
        started.append(unsharded)
        shards = []
        for i in range(N_SHARDS):
            shards.append(Retriever(shard_root / f"shard-{i}", shards_redis, work))
            started.append(shards[-1])
        generator, generator_servicer = build_generator(
            GeneratorSettings(
                host="127.0.0.1",
                port=0,
                model=make_tiny_bart(work / "models" / "tiny-bart"),
                checkpoint_dir=work / "checkpoints",
                redis_url=unsharded_redis,
            )
        )
        generator.set_serving(True)
        generator.start()

        def gateway(retriever_addr: str, redis_db: int) -> GatewaySettings:
            return GatewaySettings(
                retriever_addr=retriever_addr,
                generator_addr=f"127.0.0.1:{generator.port}",
                redis_url=redis_server.url_for(redis_db),
                retrieve_timeout_s=RETRIEVE_TIMEOUT_S,
                health_timeout_s=HEALTH_TIMEOUT_S,
            )

        sharded_addrs = ",".join(s.addr for s in shards)
        with (
            serving_gateway(gateway(sharded_addrs, 7)) as sharded_url,
            serving_gateway(gateway(unsharded.addr, 8)) as unsharded_url,
        ):
            system = System(
                sharded_url,
                unsharded_url,
                shards,
                unsharded,
                shard_root,
                shards_redis,
                work,
                gateway,
                extra=started,  # a shard restarted by a test is stopped with the rest
            )
            yield system
    finally:
        for retriever in started:
            retriever.stop()
        if generator is not None:
            generator.stop(0)
            generator_servicer.close()


def _answer(url: str, question: str, k: int) -> httpx.Response:
    return httpx.post(f"{url}/answer", json={"question": question, "k": k, **ANSWER}, timeout=60)


def _passages(reply: httpx.Response) -> tuple[list[str], list[float]]:
    assert reply.status_code == 200, reply.text
    passages = reply.json()["passages"]
    return [p["id"] for p in passages], [p["score"] for p in passages]


def test_shards_hold_the_index_split_in_two(system):
    counts = []
    for shard in system.shards:
        with grpc.insecure_channel(shard.addr) as channel:
            listed = retriever_pb2_grpc.RetrieverStub(channel).ListIndexes(
                retriever_pb2.ListIndexesRequest()
            )
        counts.append({i.name: i.count for i in listed.indexes})
    assert counts == [{"facts-a": 15, "facts-b": 15}] * N_SHARDS


@pytest.mark.parametrize("k", KS)
def test_sharded_answers_retrieve_what_the_unsharded_index_does(system, k):
    for question in QUESTIONS:
        sharded = _answer(system.sharded_url, question, k)
        unsharded = _answer(system.unsharded_url, question, k)
        got_ids, got_scores = _passages(sharded)
        want_ids, want_scores = _passages(unsharded)
        assert len(want_ids) == k
        assert got_ids == want_ids, question
        assert got_scores == pytest.approx(want_scores, abs=1e-5), question
        assert sharded.json()["index"] == unsharded.json()["index"] == "facts-a"
        assert sharded.json()["retriever_version"] == unsharded.json()["retriever_version"]


@pytest.mark.parametrize("k", KS)
def test_sharded_hybrid_merges_each_shards_fused_scores(system, k):
    """Hybrid over two shards: each shard fuses its own candidates with the parent's fitted
    weights, the gateway merges by fused score; the answer is that merge, and says hybrid."""
    from openbook.index import open_index
    from openbook_gateway.retrieval import merge_results

    shards = [
        open_index(system.shard_root / f"shard-{i}" / "facts-a", verify=False)
        for i in range(N_SHARDS)
    ]
    try:
        for shard in shards:
            assert shard.views == ("dense", "bm25")
            assert shard.default_retrieval == "hybrid"
        for question in QUESTIONS:
            body = {"question": question, "k": k, **ANSWER, "retrieval": "hybrid"}
            reply = httpx.post(f"{system.sharded_url}/answer", json=body, timeout=60)
            got_ids, got_scores = _passages(reply)
            assert reply.json()["retrieval"] == "hybrid"
            per_shard = [
                s.search(SearchRequest([question], k=k, retrieval="hybrid")) for s in shards
            ]
            want = merge_results(per_shard, k)[0]
            assert got_ids == [p.id for p in want], question
            assert got_scores == pytest.approx([p.score for p in want], abs=1e-4), question
            # 30 passages, 50 candidates per view: every shard's candidates are all its
            # passages, so the merge is the unsharded index's hybrid top k exactly
            whole = httpx.post(f"{system.unsharded_url}/answer", json=body, timeout=60)
            assert whole.json()["retrieval"] == "hybrid"
            want_ids, want_scores = _passages(whole)
            assert got_ids == want_ids, question
            assert got_scores == pytest.approx(want_scores, abs=1e-4), question
            # the default of a two-view index is hybrid on the shards too
            default = {key: value for key, value in body.items() if key != "retrieval"}
            again = httpx.post(f"{system.sharded_url}/answer", json=default, timeout=60)
            assert again.json()["retrieval"] == "hybrid"
            again_ids, again_scores = _passages(again)
            # the query may be encoded in another batch: the last float bits may differ
            assert again_ids == got_ids, question
            assert again_scores == pytest.approx(got_scores, abs=1e-4), question
    finally:
        for shard in shards:
            shard.close()


def test_top_hits_come_from_both_shards(system):
    # Shard 0 holds p00-p14, shard 1 p15-p29: the merge really takes from both.
    tops = {_passages(_answer(system.sharded_url, q, 1))[0][0] for q in QUESTIONS}
    assert any(int(t[1:]) < 15 for t in tops) and any(int(t[1:]) >= 15 for t in tops)


def test_indexes_and_readyz_of_the_sharded_gateway(system):
    sharded = httpx.get(f"{system.sharded_url}/indexes", timeout=10)
    unsharded = httpx.get(f"{system.unsharded_url}/indexes", timeout=10)
    assert sharded.status_code == 200, sharded.text
    assert sharded.json()["active"] == "facts-a"
    listed = {i["name"]: i for i in sharded.json()["indexes"]}
    reference = {i["name"]: i for i in unsharded.json()["indexes"]}
    assert set(listed) == set(reference) == {"facts-a", "facts-b"}
    for name in listed:  # counts add up over the shards
        assert listed[name]["count"] == reference[name]["count"] == 30
        assert listed[name]["dim"] == reference[name]["dim"]
        # every shard keeps both views of the parent index, and so its default
        assert listed[name]["views"] == reference[name]["views"] == ["dense", "bm25"]
        assert listed[name]["default_retrieval"] == "hybrid"
    ready = httpx.get(f"{system.sharded_url}/readyz", timeout=10)
    assert ready.status_code == 200, ready.text
    assert ready.json()["ready"] is True


def test_a_shard_down_is_503_naming_it_then_answers_come_back(system):
    down = system.shards[1]
    question = "Who wrote Hamlet?"
    want = _passages(_answer(system.unsharded_url, question, 5))
    ids, scores = _passages(_answer(system.sharded_url, question, 5))
    # the same passages; scores to float32 precision: two processes, whose compute-thread
    # counts (and so the query encoder's last bits) may differ (as after the restart below)
    assert ids == want[0] and scores == pytest.approx(want[1], rel=1e-5)
    down.stop()

    for _ in range(3):
        started = time.monotonic()
        reply = _answer(system.sharded_url, question, 5)
        elapsed = time.monotonic() - started
        assert reply.status_code == 503, reply.text
        assert f"retriever shard 1 ({down.addr}) unavailable" in reply.json()["detail"]
        assert system.shards[0].addr not in reply.json()["detail"]
        assert reply.headers.get("retry-after") == "1"
        assert elapsed < RETRIEVE_TIMEOUT_S + 2

    listed = httpx.get(f"{system.sharded_url}/indexes", timeout=10)
    assert listed.status_code == 503, listed.text
    assert f"retriever shard 1 ({down.addr}) unavailable" in listed.json()["detail"]

    started = time.monotonic()
    ready = httpx.get(f"{system.sharded_url}/readyz", timeout=10)
    assert time.monotonic() - started < HEALTH_TIMEOUT_S + 2
    assert ready.status_code == 503, ready.text
    body = ready.json()
    assert body["ready"] is False
    assert body["services"] == {"retriever": False, "generator": True}
    assert body["retriever_shards"] == {system.shards[0].addr: True, down.addr: False}
    # The unsharded setup is untouched.
    assert httpx.get(f"{system.unsharded_url}/readyz", timeout=10).status_code == 200

    # The shard restarts on the same port (as a pod behind its stable name would).
    restarted = Retriever(system.shard_root / "shard-1", system.redis_url, system.work, down.port)
    system.extra.append(restarted)
    assert restarted.addr == down.addr
    system.shards[1] = restarted
    deadline = time.monotonic() + 30
    while True:
        reply = _answer(system.sharded_url, question, 5)
        if reply.status_code == 200 or time.monotonic() > deadline:
            break
        assert reply.status_code == 503, reply.text
        time.sleep(0.2)
    # The same passages; scores to float32 precision: the restarted process may pick another
    # compute-thread count (openbook/runtime/compute_threads.py, from the CPUs free at its start),
    # and the query encoder's last bits depend on how its sums are split between threads.
    ids, scores = _passages(reply)
    assert ids == want[0]
    assert scores == pytest.approx(want[1], rel=1e-5)
    ready = httpx.get(f"{system.sharded_url}/readyz", timeout=10)
    assert ready.status_code == 200, ready.text
    assert all(ready.json()["retriever_shards"].values())
    assert httpx.get(f"{system.sharded_url}/indexes", timeout=10).status_code == 200


def test_a_hung_shard_is_504_naming_it_within_the_deadline(system):
    """A shard whose port accepts connections but never answers (a stalled process): the
    query ends at the retrieve deadline with a 504 naming that shard, never a hang."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # the kernel completes handshakes; nobody ever reads or writes
        hung_addr = f"127.0.0.1:{hung.getsockname()[1]}"
        settings = system.gateway(f"{system.shards[0].addr},{hung_addr}", 9)
        with serving_gateway(settings) as url:
            started = time.monotonic()
            reply = _answer(url, "Who wrote Hamlet?", 3)
            elapsed = time.monotonic() - started
            assert reply.status_code == 504, reply.text
            assert f"retriever shard 1 ({hung_addr})" in reply.json()["detail"]
            assert RETRIEVE_TIMEOUT_S - 0.5 < elapsed < RETRIEVE_TIMEOUT_S + 2
            ready = httpx.get(f"{url}/readyz", timeout=10)
            assert ready.status_code == 503
            assert ready.json()["retriever_shards"] == {
                system.shards[0].addr: True,
                hung_addr: False,
            }
