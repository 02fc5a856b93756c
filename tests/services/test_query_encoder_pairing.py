"""Each index owns its query encoder: an override (OPENBOOK_RETRIEVER_QUERY_ENCODER, a checkpoint's
query encoder) searches only the indexes of its lineage and dimension; every other index keeps
its own manifest's query encoder, and a query is never encoded by a mismatched one."""

from __future__ import annotations

import json

import grpc
import pytest
import torch

from openbook.index import Manifest, build_index, load_encoder
from openbook.index.checkpoint import load_query_encoder
from openbook.index.pairing import checkpoint_override, configured_override
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.rag import RagGenerator
from openbook.serving.grpc_server import bearer_metadata
from openbook.storage.artifacts import public_name
from openbook.v1 import common_pb2, retriever_pb2
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.index import (
    QUESTIONS,
    assert_same_hits,
    make_tiny_dpr_encoders,
    reply_hits,
    searched_hits,
    write_facts,
)
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import build_fact_indexes, retriever_service
from openbook_trainer.checkpoints import write_checkpoint

TOKEN = "pairing-admin-token"
ADMIN = bearer_metadata(TOKEN)
ASK = list(QUESTIONS.values())[:4]
MISSING_Q = "/nonexistent/query-encoder"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """facts-a / facts-b (MiniLM, 384-d), dpr-32 (a tiny DPR pair, 32-d), orphan (MiniLM
    documents, its query encoder gone), an override (another tiny DPR question encoder) and a
    checkpoint whose (perturbed MiniLM) query encoder was trained against facts-a."""
    tmp = tmp_path_factory.mktemp("pairing")
    root = tmp / "indexes"
    build_fact_indexes(root)
    facts = write_facts(tmp / "facts.jsonl")
    ctx, q = make_tiny_dpr_encoders(tmp / "dpr", hidden_size=32)
    _, q2 = make_tiny_dpr_encoders(tmp / "dpr-other", hidden_size=32, seed=7)
    build_index(
        [facts],
        root / "dpr-32",
        IndexSpec(name="dpr-32", encoder=str(ctx), query_encoder=str(q)),
        BuildOptions(progress=False),
    )
    build_index([facts], root / "orphan", IndexSpec(name="orphan"), BuildOptions(progress=False))
    mf = root / "orphan" / "manifest.json"
    mf.write_text(json.dumps({**json.loads(mf.read_text()), "query_encoder": MISSING_Q}))

    bart = make_tiny_bart(tmp / "bart")
    enc = load_encoder("all-MiniLM-L6-v2", cached=False)
    torch.manual_seed(0)
    with torch.no_grad():  # fine-tuned: not the same vectors as the packaged MiniLM
        for p in enc.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ckpt = write_checkpoint(
        tmp / "checkpoints",
        1,
        query_encoder=enc,
        generator=RagGenerator.load(bart).backend,
        base_generator=str(bart),
        base_query_encoder="all-MiniLM-L6-v2",
        index={"name": "facts-a"},
        data_sha256="0" * 64,
        generator_source=bart,
    )
    return {"tmp": tmp, "root": root, "q": q, "q2": q2, "ckpt": ckpt}


@pytest.fixture
def retriever(world, redis_url):
    settings = RetrieverSettings(
        host="127.0.0.1",
        port=0,
        index_root=world["root"],
        default_index="facts-a",
        query_encoder=str(world["q2"]),  # pairs with dpr-32 only
        redis_url=redis_url,
        admin_token=TOKEN,
        checkpoint_dir=world["tmp"] / "checkpoints",
        load_latest_checkpoint=False,
    )
    with retriever_service(settings) as (stub, _, servicer):
        yield stub, servicer


def retrieve(stub, index: str = ""):
    return stub.Retrieve(retriever_pb2.RetrieveRequest(queries=ASK, k=3, index=index))


def expected(servicer, index: str, encoder):
    """What searching ``index`` with ``encoder`` directly gives: (ids, scores) per query."""
    return searched_hits(servicer, index, ASK, 3, encoder)


def test_each_index_is_searched_by_its_paired_encoder(retriever, world):
    stub, servicer = retriever
    minilm = load_encoder("all-MiniLM-L6-v2")
    override = load_encoder(str(world["q2"]))
    own_dpr = load_encoder(str(world["q"]))

    a = retrieve(stub)  # active facts-a: 384-d MiniLM, the 32-d override does not pair with it
    assert a.index == "facts-a" and a.model_version == "index-default"
    assert_same_hits(a, expected(servicer, "facts-a", minilm))

    d = retrieve(stub, "dpr-32")  # a DPR context-encoder index: the DPR override pairs with it
    assert d.index == "dpr-32" and d.model_version == public_name(override.name)
    assert_same_hits(d, expected(servicer, "dpr-32", override))
    assert reply_hits(d)[1] != expected(servicer, "dpr-32", own_dpr)[1]  # not its own encoder's


def test_swap_to_an_index_the_override_pairs_with(retriever, world):
    stub, servicer = retriever
    stub.SwapIndex(retriever_pb2.SwapIndexRequest(name="dpr-32"), metadata=ADMIN)
    d = retrieve(stub)
    assert d.index == "dpr-32"
    assert_same_hits(d, expected(servicer, "dpr-32", load_encoder(str(world["q2"]))))
    stub.SwapIndex(retriever_pb2.SwapIndexRequest(name="facts-a"), metadata=ADMIN)
    assert_same_hits(
        retrieve(stub), expected(servicer, "facts-a", load_encoder("all-MiniLM-L6-v2"))
    )


def test_swap_refused_when_neither_override_nor_own_encoder_pairs(retriever, world):
    stub, servicer = retriever
    before = retrieve(stub)
    with pytest.raises(grpc.RpcError) as err:
        stub.SwapIndex(retriever_pb2.SwapIndexRequest(name="orphan"), metadata=ADMIN)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details()
    for part in ("'orphan'", str(world["q2"].resolve()), MISSING_Q, "dim 32", "index dim 384"):
        assert part in details, details
    # the current index keeps serving, unchanged
    listed = stub.ListIndexes(retriever_pb2.ListIndexesRequest())
    assert listed.active == "facts-a"
    after = retrieve(stub)
    assert after.index == "facts-a" and reply_hits(after) == reply_hits(before)
    assert servicer.shared.get() == "facts-a"


def test_checkpoint_against_another_index_is_refused(retriever, world):
    stub, servicer = retriever
    stub.SwapIndex(retriever_pb2.SwapIndexRequest(name="dpr-32"), metadata=ADMIN)
    with pytest.raises(grpc.RpcError) as err:
        stub.ReloadModel(common_pb2.ReloadModelRequest(path="step-000001"), metadata=ADMIN)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details()
    for part in ("step-000001", "'facts-a'", "'dpr-32'", "dim 384", "index dim 32"):
        assert part in details, details
    d = retrieve(stub)  # the configured override keeps serving dpr-32
    assert d.index == "dpr-32" and d.model_version == public_name(
        load_encoder(str(world["q2"])).name
    )
    assert_same_hits(d, expected(servicer, "dpr-32", load_encoder(str(world["q2"]))))


def test_checkpoint_applies_to_its_lineage_only(retriever, world):
    stub, servicer = retriever
    info = stub.ReloadModel(
        common_pb2.ReloadModelRequest(path="step-000001"), metadata=ADMIN
    )  # facts-a (what it was trained against) is active
    assert info.model_version == "step-000001"
    trained = load_query_encoder(world["ckpt"])
    for name in ("facts-a", "facts-b"):  # both built with MiniLM: the checkpoint's lineage
        reply = retrieve(stub, name)
        assert reply.model_version == "step-000001"
        assert_same_hits(reply, expected(servicer, name, trained))
    assert (
        reply_hits(retrieve(stub))[1]
        != expected(servicer, "facts-a", load_encoder("all-MiniLM-L6-v2"))[1]
    )
    # dpr-32 (32-d DPR) goes back to its own query encoder: the checkpoint replaced the override
    d = retrieve(stub, "dpr-32")
    assert d.model_version == "index-default"
    assert_same_hits(d, expected(servicer, "dpr-32", load_encoder(str(world["q"]))))
    # and a swap to it is accepted, since its own encoder searches it
    stub.SwapIndex(retriever_pb2.SwapIndexRequest(name="dpr-32"), metadata=ADMIN)
    assert retrieve(stub).index == "dpr-32"


def manifest(encoder: str, query_encoder: str, dim: int) -> Manifest:
    return Manifest("x", encoder, query_encoder, dim, 1, "flat")


def test_pairing_rules(world):
    q2 = load_encoder(str(world["q2"]))  # a 32-d DPR question encoder
    ov = configured_override(q2, str(world["q2"]))
    assert ov.fits(manifest("/models/facebook/dpr-ctx_encoder-multiset-base", "/m/q", 32))
    assert ov.fits(manifest("/some/doc", str(world["q2"]), 32))  # named as query encoder
    assert not ov.fits(manifest("/models/facebook/dpr-ctx_encoder-multiset-base", "/m/q", 768))
    assert not ov.fits(manifest("/some/doc", "/some/q", 32))  # another lineage
    assert not ov.fits(Manifest("x", None, None, 0, 1, "bm25"))

    trained = load_query_encoder(world["ckpt"])
    ck = checkpoint_override(trained, "step-000001", "all-MiniLM-L6-v2", None)
    assert ck.fits(manifest("all-MiniLM-L6-v2", "all-MiniLM-L6-v2", 384))
    assert ck.fits(manifest("sentence-transformers/all-MiniLM-L6-v2", "/q", 384))
    assert not ck.fits(manifest("/other-384-d-encoder", "/other-384-d-encoder", 384))
    problem = ck.problem(manifest("/ctx", "/q", 32), "dpr")
    assert "'dpr'" in problem and "dim 384 != index dim 32" in problem
