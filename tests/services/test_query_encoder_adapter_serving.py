"""The retriever serves a query encoder's LoRA adapter: configured at start
(OPENBOOK_RETRIEVER_QUERY_ENCODER_ADAPTER, merged into the base it names, or into
OPENBOOK_RETRIEVER_QUERY_ENCODER), or in a trained checkpoint (ReloadModel). It searches the
indexes of its base's lineage exactly as the merged encoder does; an adapter that is missing or
was trained on another encoder is skipped with a warning, and the indexes' own encoders serve."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from openbook.index import load_encoder
from openbook.index.encoders import encoder_weights_dir, load_adapted_encoder
from openbook.rag import RagGenerator
from openbook.rag.adapters import ADAPTER_FILE, LoraSpec, attach_lora, base_identity, save_adapter
from openbook.rag.checkpoint import TrainedAdapter
from openbook.serving.grpc_server import bearer_metadata
from openbook.storage.artifacts import public_name
from openbook.v1 import common_pb2, retriever_pb2
from openbook_retriever.server import configured_query_encoder
from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.index import QUESTIONS, assert_same_hits, reply_hits, searched_hits
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import build_fact_indexes, retriever_service
from openbook_trainer.checkpoints import write_checkpoint

TOKEN = "qe-adapter-admin-token"
ADMIN = bearer_metadata(TOKEN)
ASK = list(QUESTIONS.values())[:4]
MINILM = "all-MiniLM-L6-v2"


def _trained_lora(seed: int):
    """A MiniLM with a LoRA adapter whose B is not zero (as after training): (peft model,
    encoder)."""
    encoder = load_encoder(MINILM, cached=False)
    peft_model = attach_lora(encoder.model, LoraSpec(rank=4, alpha=8.0, dropout=0.0))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in encoder.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    encoder.model.eval()
    return peft_model, encoder


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qe-adapter")
    root = tmp / "indexes"
    build_fact_indexes(root)  # facts-a, facts-b: MiniLM
    base_id = base_identity(encoder_weights_dir(MINILM))
    peft_model, _ = _trained_lora(0)
    adapter = tmp / "minilm-lora"
    save_adapter(peft_model, adapter, base_id, MINILM)
    wrong = tmp / "wrong-base"
    save_adapter(peft_model, wrong, "0" * 64, MINILM)
    ckpt_peft, _ = _trained_lora(1)
    bart = make_tiny_bart(tmp / "bart")
    ckpt = write_checkpoint(
        tmp / "checkpoints",
        1,
        query_encoder=None,
        query_encoder_adapter=TrainedAdapter(ckpt_peft, base_id),
        generator=RagGenerator.load(bart).backend,
        base_generator=str(bart),
        base_query_encoder=MINILM,
        index={"name": "facts-a"},
        data_sha256="0" * 64,
        generator_source=bart,
    )
    return {"tmp": tmp, "root": root, "adapter": adapter, "wrong": wrong, "ckpt": ckpt}


def _settings(world, redis_url, **kw) -> RetrieverSettings:
    return RetrieverSettings(
        host="127.0.0.1",
        port=0,
        index_root=world["root"],
        default_index="facts-a",
        redis_url=redis_url,
        admin_token=TOKEN,
        checkpoint_dir=world["tmp"] / "checkpoints",
        load_latest_checkpoint=False,
        **kw,
    )


@pytest.fixture
def retriever(world, redis_url):
    settings = _settings(world, redis_url, query_encoder_adapter=world["adapter"])
    with retriever_service(settings) as (stub, _, servicer):
        yield stub, servicer


def _search(servicer, index: str, encoder):
    return searched_hits(servicer, index, ASK, 3, encoder)


def test_the_configured_adapter_searches_its_lineage(retriever, world):
    stub, servicer = retriever
    adapted = load_adapted_encoder(world["adapter"])
    plain = load_encoder(MINILM)
    assert np.abs(adapted.encode(ASK) - plain.encode(ASK)).max() > 1e-3
    for name in ("facts-a", "facts-b"):  # both MiniLM indexes: the adapter's base lineage
        reply = stub.Retrieve(retriever_pb2.RetrieveRequest(queries=ASK, k=3, index=name))
        # by name, not by path (issue 42): the adapter directory's name and a digest
        assert reply.model_version == public_name(str(world["adapter"].resolve()))
        assert reply.model_version.startswith("minilm-lora-") and "/" not in reply.model_version
        assert_same_hits(reply, _search(servicer, name, adapted))
    assert reply_hits(reply)[1] != _search(servicer, "facts-b", plain)[1]


def test_a_checkpoint_holding_a_query_encoder_adapter_reloads(retriever, world):
    stub, servicer = retriever
    info = stub.ReloadModel(common_pb2.ReloadModelRequest(path="step-000001"), metadata=ADMIN)
    assert info.model_version == "step-000001"
    from openbook.index.checkpoint import load_query_encoder

    trained = load_query_encoder(world["ckpt"])
    reply = stub.Retrieve(retriever_pb2.RetrieveRequest(queries=ASK, k=3))
    assert reply.model_version == "step-000001"
    assert_same_hits(reply, _search(servicer, "facts-a", trained))


def test_a_missing_or_foreign_adapter_is_skipped_with_a_warning(world, redis_url, caplog):
    caplog.set_level(logging.WARNING)
    missing = _settings(world, redis_url, query_encoder_adapter=world["tmp"] / "nowhere")
    assert configured_query_encoder(missing) is None
    assert "not found" in caplog.text
    caplog.clear()
    foreign = _settings(world, redis_url, query_encoder_adapter=world["wrong"])
    assert configured_query_encoder(foreign) is None
    assert "trained on base model" in caplog.text
    # with a configured base: that base serves alone
    with_base = _settings(
        world, redis_url, query_encoder=MINILM, query_encoder_adapter=world["wrong"]
    )
    assert configured_query_encoder(with_base) is load_encoder(MINILM)
    # an empty setting means no adapter (compose's way to turn it off)
    assert _settings(world, redis_url, query_encoder_adapter="").query_encoder_adapter is None


def test_the_adapter_applies_onto_the_configured_base(world, redis_url):
    both = _settings(world, redis_url, query_encoder=MINILM, query_encoder_adapter=world["adapter"])
    encoder = configured_query_encoder(both)
    assert encoder is not None and encoder.name == str(world["adapter"].resolve())
    np.testing.assert_allclose(
        encoder.encode(ASK), load_adapted_encoder(world["adapter"]).encode(ASK), atol=1e-6
    )
    meta = json.loads((world["adapter"] / ADAPTER_FILE).read_text())
    assert meta["base_model"] == MINILM
