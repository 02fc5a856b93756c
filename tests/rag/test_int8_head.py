"""The LM head in int8 (openbook/rag/backends/int8_head.py): the weight-only product is that of
its dequantized weights, within the stated bound of the original ones; the dynamic one (float32
on x86) within its stated bound too, and a row's logits do not depend on the rows batched with
it; the tokens near a row's best are scored again exactly, so greedy choices are the
full-precision head's; a causal model decodes with the int8 product everywhere (prefix, steps,
drafted steps, scores) exactly as with a full-precision head of those dequantized weights, and
with the rescoring gives the full-precision model's answers; what cannot run it is refused."""

from __future__ import annotations

import pytest
import torch

from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag.backends.int8_head import (
    Int8Head,
    Int8Product,
    _reaching,
    _row_best,
    has_int8_dot_products,
)
from openbook.rag.memory import RequestShape
from openbook_testkit.rag import QUESTION, make_passages

QUESTIONS = (QUESTION, "Who wrote Hamlet?", "Where is the tower?")
MODES = ("rag-token", "rag-sequence-fast", "rag-sequence-thorough")


def test_the_product_is_the_dequantized_weights_within_the_bound_of_the_original():
    torch.manual_seed(0)
    weight = torch.randn(5_000, 64) * 0.05
    weight[7] = 0  # an all-zero row: codes 0, logits 0
    head = Int8Head(weight, Int8Product.WEIGHT_ONLY)
    hidden = torch.randn(3, 4, 64)
    logits = head.approximate(hidden)
    assert logits.shape == (3, 4, 5_000) and logits.dtype == torch.float32
    assert head.weight_int8.dtype == torch.int8 and head.scales.shape == (5_000,)
    torch.testing.assert_close(logits, hidden @ head.dequantized().T, rtol=1e-5, atol=1e-5)
    assert torch.all(logits[..., 7] == 0)
    # |W - scale * Q| <= scale / 2 per entry, so a logit is off by at most scale/2 * sum |h|
    bound = 0.5 * head.scales[None, None, :] * hidden.abs().sum(-1, keepdim=True)
    assert torch.all((logits - hidden @ weight.T).abs() <= bound + 1e-6)
    # and the row's bound the rescoring uses holds for every logit of the row
    token_bound = head.error_bound(hidden.reshape(-1, 64)).reshape(3, 4, 5_000)
    assert torch.all((logits - hidden @ weight.T).abs() <= token_bound + 1e-5)


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
    logits = head.approximate(hidden)
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
    token_bound = head.error_bound(hidden.reshape(-1, 64)).reshape(3, 4, 5_000)
    assert torch.all((logits - hidden @ weight.T).abs() <= token_bound + 1e-5)
    # the same row alone, or batched with others of any size, gets the same logits, bit for bit
    flat = hidden.reshape(-1, 64)
    for row in range(len(flat)):
        assert torch.equal(head.approximate(flat[row : row + 1])[0], logits.reshape(-1, 5_000)[row])
    assert torch.equal(
        head.approximate(flat * torch.tensor(100.0))[0], head.approximate(flat[:1] * 100.0)[0]
    )


onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's product")


@onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_onednn_product_is_within_its_bound_and_independent_of_the_batch(dtype):
    torch.manual_seed(0)
    weight = torch.randn(5_000, 64) * 0.05
    weight[7] = 0
    head = Int8Head(weight.to(dtype), Int8Product.ONEDNN)
    hidden = torch.randn(3, 4, 64) * 3
    hidden[0, 1, 5] = 60.0  # a few entries far larger than the rest, as Gemma 3's final states
    hidden[1, 2] = 0  # an all-zero row: logits 0
    hidden = hidden.to(dtype)
    logits = head.approximate(hidden)
    assert logits.shape == (3, 4, 5_000) and logits.dtype == dtype
    assert torch.all(logits[..., 7] == 0) and torch.all(logits[1, 2] == 0)
    # the hidden states' two 7-bit pieces are within 1/(63*252) of their largest magnitude, so
    # the product is the dequantized weights' within that (and the output's rounding)
    flat = hidden.reshape(-1, 64).float()
    dequantized = hidden.float() @ head.dequantized().T
    magnitude = flat.abs().amax(1).reshape(3, 4, 1)
    l1 = head.dequantized().abs().sum(1)
    pieces = magnitude / (63 * 252) * l1
    # bf16 (unit roundoff 2^-8): the high piece's output at its own size (at most the logit's
    # plus the low piece's m |W~_v|_1 / 126), the sum and the scaling
    rounding = (
        0 if dtype == torch.float32 else 2**-8 * (3 * dequantized.abs() + magnitude * l1 / 126)
    )
    assert torch.all((logits.float() - dequantized).abs() <= pieces + rounding + 1e-5)
    # and within the bound the rescoring uses of the original weights' logits
    exact = hidden.float() @ weight.to(dtype).float().T
    token_bound = head.error_bound(flat).reshape(3, 4, 5_000)
    assert torch.all((logits.float() - exact).abs() <= token_bound + rounding + 1e-5)
    # the hidden states' share of it is small beside the weights' own
    weights_only = flat.norm(dim=1, keepdim=True) * head.error_norms.float()[None]
    assert float((token_bound.reshape(12, -1) - weights_only).max()) < 0.05 * float(
        weights_only.max()
    )
    # the same row alone, or batched with others of any size, gets the same logits, bit for bit
    rows = hidden.reshape(-1, 64)
    for row in range(len(rows)):
        alone = head.approximate(rows[row : row + 1])[0]
        assert torch.equal(alone, logits.reshape(-1, 5_000)[row])
    many = torch.cat([rows, torch.randn(40, 64, dtype=dtype)])
    assert torch.equal(head.approximate(many)[:12], logits.reshape(-1, 5_000))


def _peaked(vocab: int, width: int, rows: int, dtype: torch.dtype):
    """A head and hidden states whose logits have a few tokens near each row's best and a long
    tail far below (as a trained LM's do), and near-ties the int8 product alone gets wrong."""
    torch.manual_seed(3)
    weight = torch.randn(vocab, width) * 0.05
    hidden = torch.randn(rows, width)
    direction = hidden / hidden.norm(dim=1, keepdim=True)
    for r in range(rows):  # per row, 3 tokens within a fraction of a nat, well above the rest
        for j in range(3):
            weight[r * 3 + j] = 1.2 * direction[r] + 0.003 * torch.randn(width)
    return weight.to(dtype), (hidden * 8).to(dtype)


@pytest.mark.parametrize(
    ("dtype", "product"),
    [
        (torch.float32, Int8Product.WEIGHT_ONLY),
        (torch.bfloat16, Int8Product.WEIGHT_ONLY),
        pytest.param(torch.float32, Int8Product.ONEDNN, marks=onednn),
        pytest.param(torch.bfloat16, Int8Product.ONEDNN, marks=onednn),
    ],
)
@pytest.mark.parametrize("vocab", [20_000, 16 * 1024])  # row by row, and screened by blocks
def test_the_tokens_near_a_rows_best_are_scored_exactly(dtype, product, vocab):
    weight, hidden = _peaked(vocab, 64, 16, dtype)
    head = Int8Head(weight, product)
    exact = (hidden @ weight.T).float()
    got = head(hidden).float()
    approx = head.approximate(hidden).float()
    assert head.rescored_tokens and not head.full_steps  # rescored, not the fallback
    rounding = 0 if dtype == torch.float32 else 2**-7 * exact.abs()  # bf16: both products'
    bound = head.error_bound(hidden)
    assert torch.all((approx - exact).abs() <= bound + rounding + 1e-4)
    # every token within the margin of the row's exact best gets its exact logit
    near = exact >= exact.amax(1, keepdim=True) - head.margin
    tolerance = 0 if dtype == torch.float32 else 0.1  # bf16: one product's rounding
    assert torch.allclose(got[near], exact[near], atol=tolerance + 1e-4)
    assert torch.equal(got.argmax(1), exact.argmax(1))
    assert not torch.equal(approx.argmax(1), exact.argmax(1))  # the near-tie int8 got wrong
    # what is not rescored is the int8 product's, within its bound
    assert torch.all((got - exact).abs() <= bound + rounding + 1e-4)
    # a row alone gets the same exact logits where they matter
    alone = head(hidden[1:2]).float()[0]
    assert torch.allclose(alone[near[1]], got[1][near[1]], atol=tolerance + 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [8 * 1024, 8 * 1024 + 3])  # by blocks, and entry by entry
def test_the_blocked_screen_finds_what_a_full_comparison_finds(dtype, vocab):
    torch.manual_seed(0)
    values = torch.randn(6, vocab).to(dtype)
    values[2, 5000] = values[2, 7000] = 9.0  # a tie for the best: either index holds it
    values[3] = 0.5  # a flat row: every entry reaches its cut
    cut = torch.tensor([[2.5], [3.0], [8.0], [0.5], [100.0], [-100.0]])
    reached = values >= cut
    for limit in (values.shape[1], 1_000):  # no row past it; the flat row 3 past it
        rows, columns, over = _reaching(values, cut, limit)
        assert torch.equal(over, reached.sum(1) > limit)
        want_rows, want_columns = (reached & ~over[:, None]).nonzero(as_tuple=True)
        assert torch.equal(rows, want_rows) and torch.equal(columns, want_columns)
    assert over.tolist() == [False, False, False, True, False, True]  # rows 3 and 5 reach all
    top, best = _row_best(values)
    assert torch.equal(top[:, 0], values.float().amax(1))
    assert torch.equal(values.gather(1, best).float(), top)


def test_a_flat_row_is_scored_wholly_in_full_precision():
    torch.manual_seed(0)
    weight = torch.randn(2_000, 32) * 1e-3  # every logit within the margin of the best
    head = Int8Head(weight, Int8Product.WEIGHT_ONLY)
    hidden = torch.randn(2, 32)
    torch.testing.assert_close(head(hidden), hidden @ weight.T, rtol=1e-5, atol=1e-6)
    assert head.full_steps == 2


def test_without_a_margin_the_head_is_the_int8_product_alone():
    weight, hidden = _peaked(5_000, 32, 2, torch.float32)
    head = Int8Head(weight, Int8Product.WEIGHT_ONLY, margin=None)
    assert torch.equal(head(hidden), head.approximate(hidden))


def test_the_product_follows_the_models_precision():
    # oneDNN's int8 x int8 where the CPU has AMX or AVX512-VNNI (measured faster on both), else
    # weight-only
    half = Int8Product.ONEDNN if has_int8_dot_products() else Int8Product.WEIGHT_ONLY
    assert Int8Product.for_dtype(torch.bfloat16) is half
    assert Int8Product.for_dtype(torch.float16) is half
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
    logits = head.approximate(hidden)
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
    head = Int8Head(model.get_output_embeddings().weight, Int8Product.WEIGHT_ONLY, margin=None)
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
    quantized.backend.quantize_head(Int8Product.WEIGHT_ONLY, margin=None)
    quantized.backend.quantize_head(Int8Product.WEIGHT_ONLY, margin=None)  # twice is once
    assert isinstance(quantized.backend.model.get_output_embeddings(), Int8Head)
    assert quantized.backend.vocab_size == vocab
    assert quantized.backend._own_head  # the head the engine applies is the model's own
    # the input embedding (tied to the head before) keeps its full-precision rows
    assert torch.equal(quantized.backend.model.get_input_embeddings().weight, embedding)
    reference = _dequantized_reference(path)
    for got, want in _greedy_answers(quantized, reference):
        for a, b in zip(got.hypotheses, want.hypotheses, strict=True):
            assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)
        assert got.doc_prior == pytest.approx(want.doc_prior, abs=1e-6)


def _greedy_answers(quantized: RagGenerator, reference: RagGenerator):
    """Both generators' answers in every mode, drafted and not, for each of QUESTIONS; the
    token ids are asserted equal here, each pair yielded for the caller's own checks."""
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
                yield got, want
    quantized.set_draft_tokens(0)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize(
    "product", [Int8Product.WEIGHT_ONLY, pytest.param(Int8Product.ONEDNN, marks=onednn)]
)
def test_with_the_rescoring_a_causal_model_gives_the_full_precision_models_answers(
    dirs, kind, product
):
    """The default head (near-best tokens scored exactly): every greedy search's tokens are the
    full-precision model's, drafted or not, its log-probabilities within rounding."""
    path = dirs.causal(kind)
    quantized = RagGenerator.load(path, device="cpu")
    quantized.backend.quantize_head(product)
    head = quantized.backend.model.get_output_embeddings()
    assert isinstance(head, Int8Head) and head.margin is not None
    full = RagGenerator.load(path, device="cpu")
    for got, want in _greedy_answers(quantized, full):
        # the normalizer keeps the int8 product's tail: a random model's flat rows put much of
        # their mass there (a trained one's hold it in a few exact tokens)
        for a, b in zip(got.hypotheses, want.hypotheses, strict=True):
            assert a.log_prob == pytest.approx(b.log_prob, abs=1e-2)
    assert head.rescored_tokens + head.full_steps > 0


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
    assert head.margin is None  # its bound is too loose to certify a rescoring (int8_head.py)
    passages = make_passages(3, seed=1)
    for mode in MODES:
        options = DecodingOptions(mode=mode, max_new_tokens=8)
        got = gen.generate(QUESTION, passages, options)
        want = float_head.generate(QUESTION, passages, options)
        assert got.hypotheses and all(len(h.token_ids) for h in got.hypotheses)
        assert got.doc_prior == pytest.approx(want.doc_prior, abs=1e-6)  # the head is not in it
        assert all(h.log_prob <= 0 for h in got.hypotheses)


@pytest.mark.parametrize(
    "product", [Int8Product.WEIGHT_ONLY, pytest.param(Int8Product.ONEDNN, marks=onednn)]
)
def test_the_memory_model_counts_what_the_int8_head_holds_while_it_computes(dirs, product):
    gen = RagGenerator.load(dirs.causal("gemma3"), device="cpu")
    plain = gen.memory
    gen.backend.quantize_head(product)
    gen.set_draft_tokens(0)  # as the service's set-up does after the head: the model again
    head = gen.backend.model.get_output_embeddings()
    assert isinstance(head, Int8Head)
    assert gen.memory.head_logit_bytes == head.transient_bytes_per_logit > 0
    # the screen's mask and pairs, and oneDNN's float32 pieces beside them
    assert head.transient_bytes_per_logit == (14 if product is Int8Product.ONEDNN else 6)
    shape = [RequestShape(passages=5, beams=1, prompt_tokens=100, new_tokens=16)]
    extra = gen.memory.batch_bytes(shape) - plain.batch_bytes(shape)
    assert extra >= 5 * gen.backend.vocab_size * head.transient_bytes_per_logit
