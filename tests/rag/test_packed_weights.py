"""Linear weights packed once for oneDNN (openbook/rag/packed_weights.py): a packed product is
bitwise the nn.Linear's; a bf16 causal model decodes exactly the same answers packed (every
search, drafted or not: ids, log-probabilities, passage posteriors); unpacking gives the same
weights back, the tied head re-tied to its embedding; an adapter merges into a packed model;
a float32 model packs too, to rounding, unless only bf16 is asked for; BART is left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag.backends.int8_head import Int8Head
from openbook.rag.packed_weights import (
    PackedLinear,
    Packing,
    pack_linears,
    packs,
    unpack_linears,
)
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_adapter

bf16_packs = pytest.mark.skipif(
    not packs(nn.Linear(2, 2, dtype=torch.bfloat16)),
    reason="oneDNN runs no bf16 products on this CPU: nothing is packed here",
)

QUESTIONS = (QUESTION, "Who wrote Hamlet?", "Where is the tower?")
SEARCHES = (
    ("rag-token", 1, 0),
    ("rag-token", 1, 4),
    ("rag-token", 3, 0),
    ("rag-sequence-fast", 1, 0),
    ("rag-sequence-fast", 1, 4),
    ("rag-sequence-thorough", 1, 0),
    ("rag-sequence-thorough", 3, 0),
)


@bf16_packs
@pytest.mark.parametrize("shape", [(37, 53), (1, 1), (300, 16), (2048, 640)])
def test_a_packed_product_is_bitwise_the_linears(shape):
    torch.manual_seed(0)
    out_features, in_features = shape
    linear = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    packed = PackedLinear(linear)
    _same_products(packed, linear, in_features)
    assert torch.equal(packed.unpacked().weight, linear.weight)


def _same_products(packed: PackedLinear, linear: nn.Linear, in_features: int) -> None:
    for rows in ((1, in_features), (5, in_features), (3, 17, in_features), (0, in_features)):
        x = torch.randn(rows, dtype=torch.bfloat16)
        assert torch.equal(packed(x), linear(x)), rows
    # a strided input (a transposed batch) too
    x = torch.randn(7, 5, in_features, dtype=torch.bfloat16).transpose(0, 1)
    assert torch.equal(packed(x), linear(x))


@bf16_packs
def test_a_linear_with_a_bias_is_left_alone():
    model = nn.Sequential(nn.Linear(4, 4, bias=True), nn.Linear(4, 2, bias=False))
    model.to(torch.bfloat16)
    assert pack_linears(model) == 1
    assert type(model[0]) is nn.Linear and isinstance(model[1], PackedLinear)
    with pytest.raises(ValueError, match="no bias"):
        PackedLinear(model[0])


def test_float32_weights_are_packed_unless_only_bf16_is_asked_for():
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False))
    assert not packs(model, Packing.BF16)
    assert pack_linears(model, Packing.BF16) == 0
    assert pack_linears(model, Packing.OFF) == 0
    assert all(type(m) is nn.Linear for m in model)
    if not torch.backends.mkldnn.is_available():
        assert not packs(model)
        return
    plain = [m.weight.detach().clone() for m in model]
    x = torch.randn(5, 4)
    want = model(x)
    assert packs(model)
    assert pack_linears(model) == 2
    # oneDNN's float32 product, not MKL's: the same to float32 rounding, not bitwise
    torch.testing.assert_close(model(x), want)
    assert unpack_linears(model) == 2
    assert all(torch.equal(m.weight, w) for m, w in zip(model, plain, strict=True))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_packed_float32_model_decodes_the_same_to_rounding(dirs, kind):
    path = dirs.causal(kind)
    plain = RagGenerator.load(path, device="cpu", dtype="float32")
    packed = RagGenerator.load(path, device="cpu", dtype="float32")
    assert not packed.pack_weights(Packing.BF16)  # MKL's float32 products kept
    assert packed.pack_weights()
    for got, want in zip(_answers(packed), _answers(plain), strict=True):
        for a, b in zip(got.hypotheses, want.hypotheses, strict=True):
            assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)


def _bf16(path) -> RagGenerator:
    return RagGenerator.load(path, device="cpu", dtype="bfloat16")


def _answers(gen: RagGenerator):
    passages = make_passages(3, seed=1)
    out = []
    for mode, beams, draft in SEARCHES:
        gen.set_draft_tokens(draft)
        options = DecodingOptions(mode=mode, num_beams=beams, max_new_tokens=8)
        out += [gen.generate(q, passages, options) for q in QUESTIONS]
    gen.set_draft_tokens(0)
    return out


@bf16_packs
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_packed_bf16_model_gives_bitwise_the_same_answers(dirs, kind):
    path = dirs.causal(kind)
    plain, packed = _bf16(path), _bf16(path)
    assert packed.pack_weights()
    model = packed.backend.model
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert packed.backend._own_head  # the engine's head is the packed one, as the model's
    for got, want in zip(_answers(packed), _answers(plain), strict=True):
        assert [h.token_ids for h in got.hypotheses] == [h.token_ids for h in want.hypotheses]
        assert [h.log_prob for h in got.hypotheses] == [h.log_prob for h in want.hypotheses]
        assert [h.token_log_probs for h in got.hypotheses] == [
            h.token_log_probs for h in want.hypotheses
        ]
        assert [h.doc_posterior for h in got.hypotheses] == [
            h.doc_posterior for h in want.hypotheses
        ]
        assert [h.token_doc_posteriors for h in got.hypotheses] == [
            h.token_doc_posteriors for h in want.hypotheses
        ]


@bf16_packs
def test_unpacking_gives_the_same_weights_back_and_the_head_tied_again(dirs):
    gen = _bf16(dirs.causal("gemma3"))
    model = gen.backend.model
    embedding = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embedding  # tied
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert gen.pack_weights()
    assert not gen.pack_weights()  # nothing left to pack
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.shared is embedding
    assert "lm_head.shared" not in model.state_dict()
    assert gen.backend.unpack_weights()
    assert model.get_output_embeddings().weight is embedding
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert not unpack_linears(model)


@bf16_packs
def test_an_adapter_merges_into_a_packed_model(dirs, tmp_path):
    base = dirs.causal("gemma3")
    adapter = make_tiny_adapter(base, tmp_path / "adapter")
    plain, packed = _bf16(base), _bf16(base)
    packed.pack_weights()
    plain.apply_adapter(adapter, base)
    packed.apply_adapter(adapter, base)
    assert isinstance(packed.backend.model.get_output_embeddings(), PackedLinear)
    assert packed.weights_packed and not plain.weights_packed
    options = DecodingOptions(max_new_tokens=8)
    passages = make_passages(3, seed=2)
    for question in QUESTIONS:
        got = packed.generate(question, passages, options)
        want = plain.generate(question, passages, options)
        assert got.hypotheses[0].token_ids == want.hypotheses[0].token_ids
        assert got.hypotheses[0].log_prob == want.hypotheses[0].log_prob


@bf16_packs
def test_the_int8_head_is_made_from_a_packed_models_plain_head(dirs):
    gen = _bf16(dirs.causal("gemma3"))
    gen.pack_weights()
    gen.backend.quantize_head()
    assert isinstance(gen.backend.model.get_output_embeddings(), Int8Head)
    got = gen.generate(QUESTION, make_passages(3, seed=1), DecodingOptions(max_new_tokens=8))
    assert got.hypotheses[0].token_ids


def test_bart_is_not_packed(dirs):
    gen = RagGenerator.load(dirs.bart(0), device="cpu", dtype="bfloat16")
    assert not gen.pack_weights()
    assert not gen.weights_packed
