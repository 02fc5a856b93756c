"""OPENBOOK_GENERATOR_PACKED_WEIGHTS through the generator service: a bf16 model is served with
its linear weights packed for oneDNN by default (openbook/rag/packed_weights.py) and its
replies are bitwise the library's plain-weight answers; a float32 model is packed too, unless
the setting says bf16 only; a reloaded checkpoint is packed too; the setting turns it off."""

from __future__ import annotations

import pytest
import torch
from checkpoints_kit import tiny_adapter_checkpoint
from generator_kit import generate_request
from pydantic import ValidationError
from torch import nn

from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag.packed_weights import PackedLinear, packs
from openbook_generator.servicer import GeneratorServicer
from openbook_generator.settings import GeneratorSettings
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_causal_lm
from openbook_testkit.stack import generator_service

bf16_packs = pytest.mark.skipif(
    not packs(nn.Linear(2, 2, dtype=torch.bfloat16)),
    reason="oneDNN runs no bf16 products on this CPU",
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_causal_lm(tmp_path_factory.mktemp("packed") / "gemma3")


def _packed(servicer: GeneratorServicer) -> bool:
    return isinstance(servicer.generator.backend.model.get_output_embeddings(), PackedLinear)


@bf16_packs
def test_replies_are_bitwise_the_plain_libraries_answers(model, tmp_path, redis_server):
    library = RagGenerator.load(model, device="cpu", dtype="bfloat16")
    with generator_service(model, tmp_path, redis_server.url, dtype="bfloat16") as (
        settings,
        servicer,
        stub,
    ):
        assert settings.packed_weights and _packed(servicer)
        for seed in range(3):
            passages = make_passages(3, seed=seed)
            want = library.generate(QUESTION, passages, DecodingOptions(max_new_tokens=8))
            reply = stub.Generate(generate_request(passages, max_new_tokens=8), timeout=60)
            got = reply.hypotheses[0]
            assert [t.token for t in got.tokens] == want.hypotheses[0].tokens
            assert got.log_prob == want.hypotheses[0].log_prob


@bf16_packs
def test_the_setting_turns_it_off(model, tmp_path, redis_server):
    with generator_service(
        model, tmp_path, redis_server.url, dtype="bfloat16", packed_weights="off"
    ) as (_, servicer, _stub):
        assert not _packed(servicer)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_a_float32_model_is_packed_unless_only_bf16_is_asked_for(model, tmp_path, redis_server):
    library = RagGenerator.load(model, device="cpu", dtype="float32")
    passages = make_passages(3, seed=0)
    want = library.generate(QUESTION, passages, DecodingOptions(max_new_tokens=8)).hypotheses[0]
    with generator_service(
        model, tmp_path, redis_server.url, dtype="float32", packed_weights="bf16"
    ) as (_, servicer, _stub):
        assert not _packed(servicer)
    with generator_service(model, tmp_path, redis_server.url, dtype="float32") as (
        _,
        servicer,
        stub,
    ):
        assert _packed(servicer)
        reply = stub.Generate(generate_request(passages, max_new_tokens=8), timeout=60)
        got = reply.hypotheses[0]
        # oneDNN's float32 products in place of MKL's: the same answer, to rounding
        assert [t.token for t in got.tokens] == want.tokens
        assert got.log_prob == pytest.approx(want.log_prob, abs=1e-4)


def test_an_unknown_packing_is_refused_naming_the_setting(monkeypatch):
    monkeypatch.setenv("OPENBOOK_GENERATOR_PACKED_WEIGHTS", "yes")
    with pytest.raises(ValidationError, match="packed_weights"):
        GeneratorSettings()


@bf16_packs
def test_a_reloaded_checkpoint_is_packed_too(model, tmp_path, redis_server):
    tiny_adapter_checkpoint(tmp_path / "checkpoints", 1, model)
    with generator_service(model, tmp_path, redis_server.url, dtype="bfloat16") as (
        _,
        servicer,
        _stub,
    ):
        assert servicer.load_checkpoint("step-000001") == "step-000001"
        assert _packed(servicer)
