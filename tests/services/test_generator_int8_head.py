"""OPENBOOK_GENERATOR_LM_HEAD=int8 through the generator service: replies are the library's
answers with the int8 head (openbook/rag/backends/int8_head.py), a reloaded checkpoint decodes
with it too, and a setting or a model that cannot have it is refused at start."""

from __future__ import annotations

import pytest
from checkpoints_kit import tiny_adapter_checkpoint
from generator_kit import generate_request
from pydantic import ValidationError

from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag.backends.int8_head import Int8Head
from openbook_generator.model_setup import ModelSetup
from openbook_generator.servicer import GeneratorServicer
from openbook_generator.settings import GeneratorSettings
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_bart, make_tiny_causal_lm
from openbook_testkit.stack import generator_service


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_causal_lm(tmp_path_factory.mktemp("int8") / "gemma3")


def test_replies_are_the_librarys_answers_with_the_int8_head(model, tmp_path, redis_server):
    library = RagGenerator.load(model, device="cpu")
    library.backend.quantize_head()
    with generator_service(model, tmp_path, redis_server.url, lm_head="int8") as (
        settings,
        servicer,
        stub,
    ):
        assert settings.lm_head == "int8"
        assert isinstance(servicer.generator.backend.model.get_output_embeddings(), Int8Head)
        for seed in range(3):
            passages = make_passages(3, seed=seed)
            want = library.generate(QUESTION, passages, DecodingOptions(max_new_tokens=8))
            reply = stub.Generate(generate_request(passages, max_new_tokens=8), timeout=60)
            got = reply.hypotheses[0]
            assert [t.token for t in got.tokens] == want.hypotheses[0].tokens
            assert got.log_prob == pytest.approx(want.hypotheses[0].log_prob, abs=1e-4)


def test_a_reloaded_checkpoint_decodes_with_the_int8_head_too(model, tmp_path):
    tiny_adapter_checkpoint(tmp_path / "checkpoints", 1, model)
    servicer = GeneratorServicer(
        RagGenerator.load(model, device="cpu"),
        checkpoint_root=tmp_path / "checkpoints",
        base_model=model,
        model_setup=ModelSetup(int8_head=True),
    )
    try:
        assert servicer.load_checkpoint("step-000001") == "step-000001"
        head = servicer.generator.backend.model.get_output_embeddings()
        assert isinstance(head, Int8Head)
    finally:
        servicer.close()


def test_an_unknown_head_precision_is_refused_naming_the_setting(monkeypatch):
    monkeypatch.setenv("OPENBOOK_GENERATOR_LM_HEAD", "int4")
    with pytest.raises(ValidationError, match="lm_head"):
        GeneratorSettings()


def test_a_model_that_cannot_have_it_is_refused_at_start(tmp_path):
    bart = make_tiny_bart(tmp_path / "bart")
    with pytest.raises(ValueError, match="keeps its LM head"):
        GeneratorServicer(RagGenerator.load(bart), model_setup=ModelSetup(int8_head=True))
