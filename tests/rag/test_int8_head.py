"""The LM head in int8 (openbook/rag/backends/int8_head.py): the weight-only product is that of
its dequantized weights, within the stated bound of the original ones; the dynamic one (float32
on x86) within its stated bound too, and a row's logits do not depend on the rows batched with
it; a causal model decodes with it everywhere (prefix, steps, drafted steps, scores) exactly as
with a full-precision head of those dequantized weights; what cannot run it is refused."""

from __future__ import annotations

import pytest
import torch

from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag.backends.int8_head import Int8Head, Int8Product
from openbook_testkit.rag import QUESTION, make_passages

QUESTIONS = (QUESTION, "Who wrote Hamlet?", "Where is the tower?")
MODES = ("rag-token", "rag-sequence-fast", "rag-sequence-thorough")


def test_the_product_is_the_dequantized_weights_within_the_bound_of_the_original():
    torch.manual_seed(0)
    weight = torch.randn(5_000, 64) * 0.05
    weight[7] = 0  # an all-zero row: codes 0, logits 0
    head = Int8Head(weight, Int8Product.WEIGHT_ONLY)
    hidden = torch.randn(3, 4, 64)
    logits = head(hidden)
    assert logits.shape == (3, 4, 5_000) and logits.dtype == torch.float32
    assert head.weight_int8.dtype == torch.int8 and head.scales.shape == (5_000,)
    torch.testing.assert_close(logits, hidden @ head.dequantized().T, rtol=1e-5, atol=1e-5)
    assert torch.all(logits[..., 7] == 0)
    # |W - scale * Q| <= scale / 2 per entry, so a logit is off by at most scale/2 * sum |h|
    bound = 0.5 * head.scales[None, None, :] * hidden.abs().sum(-1, keepdim=True)
    assert torch.all((logits - hidden @ weight.T).abs() <= bound + 1e-6)


x86 = pytest.mark.skipif(
    torch.backends.quantized.engine not in ("x86", "fbgemm"), reason="fbgemm is x86's"
)


@x86
def test_the_dynamic_product_is_within_its_bound_and_independent_of_the_batch():
    torch.manual_seed(0)
    weight = torch.randn(5_000, 64) * 0.05
    weight[7] = 0
    head = Int8Head(weight)
    assert head.product is Int8Product.DYNAMIC  # float32 on x86: fbgemm's
    hidden = torch.randn(3, 4, 64) * 3
    hidden[1, 2] = 0  # an all-zero row: logits 0
    logits = head(hidden)
    assert logits.shape == (3, 4, 5_000) and logits.dtype == torch.float32
    assert torch.all(logits[..., 7] == 0) and torch.all(logits[1, 2] == 0)
    # weights: scale/2 * sum |h| (as weight-only); activations: one step of 2/127 of the row's
    # largest magnitude per entry, times the dequantized row's magnitudes
    dequantized = head.dequantized()
    magnitude = hidden.abs().amax(-1, keepdim=True)
    bound = 0.5 * head.scales * hidden.abs().sum(-1, keepdim=True) + (
        magnitude * 2 / 127 * dequantized.abs().sum(-1)
    )
    assert torch.all((logits - hidden @ weight.T).abs() <= bound + 1e-5)
    # the same row alone, or batched with others of any size, gets the same logits, bit for bit
    flat = hidden.reshape(-1, 64)
    for row in range(len(flat)):
        assert torch.equal(head(flat[row : row + 1])[0], logits.reshape(-1, 5_000)[row])
    assert torch.equal(head(flat * torch.tensor(100.0))[0], head(flat[:1] * 100.0)[0])


def test_the_product_follows_the_models_precision():
    assert Int8Product.for_dtype(torch.bfloat16) is Int8Product.WEIGHT_ONLY
    assert Int8Product.for_dtype(torch.float16) is Int8Product.WEIGHT_ONLY
    want = (
        Int8Product.DYNAMIC
        if torch.backends.quantized.engine in ("x86", "fbgemm")
        else Int8Product.WEIGHT_ONLY
    )
    assert Int8Product.for_dtype(torch.float32) is want


def test_bf16_hidden_states_get_bf16_logits():
    weight = (torch.randn(1_000, 32) * 0.05).to(torch.bfloat16)
    head = Int8Head(weight)
    hidden = torch.randn(2, 32, dtype=torch.bfloat16)
    logits = head(hidden)
    assert logits.dtype == torch.bfloat16
    want = hidden.float() @ head.dequantized().T
    torch.testing.assert_close(logits.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("shape", "device", "says"),
    [((100, 24), "cpu", "multiple of 16"), ((4, 4, 16), "cpu", "(vocab, width)")],
)
def test_what_torchs_kernel_cannot_run_is_refused(shape, device, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        Int8Head(torch.zeros(shape, device=device))


def _dequantized_reference(path) -> RagGenerator:
    """The model with a full-precision head holding the int8 head's dequantized weights."""
    gen = RagGenerator.load(path, device="cpu")
    model = gen.backend.model
    head = Int8Head(model.get_output_embeddings().weight, Int8Product.WEIGHT_ONLY)
    vocab, width = head.weight_int8.shape
    linear = torch.nn.Linear(width, vocab, bias=False)
    linear.weight = torch.nn.Parameter(head.dequantized(), requires_grad=False)
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(linear)
    gen.backend.refresh()
    return gen


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_causal_model_decodes_with_the_int8_head_everywhere(dirs, kind):
    path = dirs.causal(kind)
    quantized = RagGenerator.load(path, device="cpu")
    embedding = quantized.backend.model.get_input_embeddings().weight.detach().clone()
    vocab = quantized.backend.vocab_size
    quantized.backend.quantize_head(Int8Product.WEIGHT_ONLY)
    quantized.backend.quantize_head(Int8Product.WEIGHT_ONLY)  # twice is once
    assert isinstance(quantized.backend.model.get_output_embeddings(), Int8Head)
    assert quantized.backend.vocab_size == vocab
    assert quantized.backend._own_head  # the head the engine applies is the model's own
    # the input embedding (tied to the head before) keeps its full-precision rows
    assert torch.equal(quantized.backend.model.get_input_embeddings().weight, embedding)
    reference = _dequantized_reference(path)
    passages = make_passages(3, seed=1)
    for mode in MODES:
        for draft in (0, 4):
            if draft and mode == "rag-sequence-thorough":
                continue
            quantized.set_draft_tokens(draft)
            options = DecodingOptions(mode=mode, max_new_tokens=8)
            for question in QUESTIONS:
                got = quantized.generate(question, passages, options)
                want = reference.generate(question, passages, options)
                assert [h.token_ids for h in got.hypotheses] == [
                    h.token_ids for h in want.hypotheses
                ], (mode, draft, question)
                for a, b in zip(got.hypotheses, want.hypotheses, strict=True):
                    assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)
                assert got.doc_prior == pytest.approx(want.doc_prior, abs=1e-6)
    quantized.set_draft_tokens(0)


def test_bart_keeps_its_head_and_says_so(dirs):
    gen = RagGenerator.load(dirs.bart(0), device="cpu")
    with pytest.raises(ValueError, match="keeps its LM head"):
        gen.backend.quantize_head()


@x86
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_a_float32_model_decodes_with_the_dynamic_head_by_default(dirs, kind):
    gen = RagGenerator.load(dirs.causal(kind), device="cpu")
    float_head = RagGenerator.load(dirs.causal(kind), device="cpu")
    gen.backend.quantize_head()
    head = gen.backend.model.get_output_embeddings()
    assert isinstance(head, Int8Head) and head.product is Int8Product.DYNAMIC
    passages = make_passages(3, seed=1)
    for mode in MODES:
        options = DecodingOptions(mode=mode, max_new_tokens=8)
        got = gen.generate(QUESTION, passages, options)
        want = float_head.generate(QUESTION, passages, options)
        assert got.hypotheses and all(len(h.token_ids) for h in got.hypotheses)
        assert got.doc_prior == pytest.approx(want.doc_prior, abs=1e-6)  # the head is not in it
        assert all(h.log_prob <= 0 for h in got.hypotheses)
