"""The matmul prompt attention (openbook/rag/attention.py): transformers' sdpa results from two
matrix products, for grouped-query heads, additive and boolean masks, soft-capping and any query
chunking; chosen for reduced-precision models on the CPU only; counted by the memory model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from openbook.rag import DecodingOptions, RagGenerator, attention
from openbook.rag.attention import matmul_attention_forward, use_matmul_attention
from openbook.rag.memory import RequestShape, memory_model
from openbook_testkit.rag import QUESTION, make_passages


class _Layer(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.eval()


def _inputs(batch=3, heads=4, kv_heads=1, q=7, past=5, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = past + q
    query = torch.randn(batch, heads, q, dim, generator=g)
    key = torch.randn(batch, kv_heads, s, dim, generator=g)
    value = torch.randn(batch, kv_heads, s, dim, generator=g)
    # causal over the new positions, and left padding: row r's first r slots are masked
    allowed = torch.ones(batch, 1, q, s, dtype=torch.bool)
    allowed[..., past:] = torch.tril(torch.ones(q, q, dtype=torch.bool))
    for r in range(batch):
        allowed[r, ..., :r] = False
    return query, key, value, allowed


def _additive(allowed: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 1), (4, 2), (2, 2)])
@pytest.mark.parametrize("boolean", [False, True])
@pytest.mark.parametrize("max_score_bytes", [1, 3 * 4 * 12 * 4 * 2, 2**24])
def test_equals_sdpa_for_any_grouping_mask_and_chunking(
    monkeypatch, heads, kv_heads, boolean, max_score_bytes
):
    """float32 inputs: the same attention as transformers' sdpa, whether the queries go in one
    chunk, two at a time or one at a time."""
    monkeypatch.setattr(attention, "MAX_SCORE_BYTES", max_score_bytes)
    query, key, value, allowed = _inputs(heads=heads, kv_heads=kv_heads)
    mask = allowed if boolean else _additive(allowed)
    layer = _Layer(heads // kv_heads)
    ours, _ = matmul_attention_forward(layer, query, key, value, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.3)
    assert ours.shape == ref.shape == (3, 7, heads, 8)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_soft_capping_is_applied_to_the_scores():
    """Gemma 2's attention soft-capping (sdpa refuses it): tanh(s / cap) * cap before the mask."""
    query, key, value, allowed = _inputs(heads=2, kv_heads=1)
    cap = 0.5
    ours, _ = matmul_attention_forward(
        _Layer(2), query, key, value, _additive(allowed), scaling=1.0, softcap=cap
    )
    scores = query @ torch.repeat_interleave(key, 2, dim=1).transpose(-1, -2)
    scores = torch.tanh(scores / cap) * cap + _additive(allowed)
    ref = torch.softmax(scores, -1) @ torch.repeat_interleave(value, 2, dim=1)
    torch.testing.assert_close(ours, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_one_query_position_or_no_mask_goes_to_sdpa():
    """Decoding steps (one query position) and unmasked calls are sdpa's, bit for bit."""
    layer = _Layer(4)
    query, key, value, allowed = _inputs(q=1, past=6)
    mask = _additive(allowed)
    assert torch.equal(
        matmul_attention_forward(layer, query, key, value, mask)[0],
        sdpa_attention_forward(layer, query, key, value, mask)[0],
    )
    query, key, value, _ = _inputs(q=5, past=0)
    assert torch.equal(
        matmul_attention_forward(layer, query, key, value, None)[0],
        sdpa_attention_forward(layer, query, key, value, None)[0],
    )


def test_chosen_for_reduced_precision_on_the_cpu_only(dirs):
    """float32 keeps sdpa (exactness against transformers); bf16 on the CPU switches."""
    path = dirs.causal("gemma3")
    fp32 = RagGenerator.load(path, device="cpu", dtype="float32")
    assert fp32.model.config._attn_implementation == "sdpa"
    assert not use_matmul_attention(fp32.model)
    bf16 = RagGenerator.load(path, device="cpu", dtype="bfloat16")
    assert bf16.model.config._attn_implementation == attention.NAME


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_bf16_prefill_agrees_with_sdpa_in_bf16(dirs, arch):
    """The same bf16 model with either attention: first-token distributions within bf16
    rounding, and greedy RAG-Token decoding runs end to end."""
    path = dirs.causal(arch)
    ours = RagGenerator.load(path, device="cpu", dtype="bfloat16")
    ref = RagGenerator.load(path, device="cpu", dtype="bfloat16")
    ref.model.set_attn_implementation("sdpa")
    passages = make_passages(3, 2)
    for i, p in enumerate(passages):  # different lengths: left padding in the prefill
        p.text = p.text + " Paris" * (4 * i)
    with torch.inference_mode():
        a = ours.backend.encode([(QUESTION, passages)], 3).first_logprobs
        b = ref.backend.encode([(QUESTION, passages)], 3).first_logprobs
    assert (a.exp() - b.exp()).abs().max() < 0.02
    result = ours.generate(QUESTION, passages, DecodingOptions(max_new_tokens=6))
    assert result.hypotheses[0].token_ids


def test_the_memory_model_counts_the_float32_scores_within_the_chunk_bound(dirs):
    gen = RagGenerator.load(dirs.causal("gemma3"), device="cpu", dtype="bfloat16")
    ours = memory_model(gen.backend)
    heads = gen.model.config.num_attention_heads
    assert ours.score_bytes_per_pair == heads * attention.MATMUL_SCORE_BYTES
    assert ours.score_bytes_cap == attention.MAX_SCORE_BYTES * attention.MATMUL_SCORE_BYTES // 4
    # a prompt long enough to pass the cap: the scores stop growing there, the rest does not
    shape = RequestShape(passages=100, beams=1, prompt_tokens=4000, new_tokens=8)
    longer = replace(shape, prompt_tokens=8000)
    uncapped = replace(ours, score_bytes_cap=0)
    assert ours.batch_bytes([shape]) < uncapped.batch_bytes([shape])
    growth = ours.batch_bytes([longer]) - ours.batch_bytes([shape])
    assert 0 < growth < uncapped.batch_bytes([longer]) - uncapped.batch_bytes([shape])
    gen.model.set_attn_implementation("sdpa")
    assert memory_model(gen.backend).score_bytes_cap == 0
