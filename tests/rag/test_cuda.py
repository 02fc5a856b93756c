"""CUDA execution (skipped without a GPU): fp32 matches CPU, fp16/bf16 run end to end."""

from __future__ import annotations

import pytest
import torch

from openbook.rag import DecodingOptions, RagGenerator
from openbook_testkit.rag import QUESTION, make_passages

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MODES = ("rag-token", "rag-sequence-thorough", "rag-sequence-fast")


@pytest.mark.parametrize("kind", ("bart", "causal"))
def test_cuda_fp32_matches_cpu(dirs, load, kind):
    path = dirs.bart(0) if kind == "bart" else dirs.causal("gemma3")
    cpu = load(path)
    gpu = RagGenerator.load(path, device="cuda", dtype="float32")
    assert gpu.device.startswith("cuda")
    passages = make_passages(4, 1)
    for mode in MODES:
        opts = DecodingOptions(mode=mode, num_beams=3, max_new_tokens=6, num_return_sequences=2)
        a = cpu.generate(QUESTION, passages, opts).hypotheses
        b = gpu.generate(QUESTION, passages, opts).hypotheses
        assert [h.token_ids for h in a] == [h.token_ids for h in b]
        assert [h.log_prob for h in a] == pytest.approx([h.log_prob for h in b], abs=1e-3)


@pytest.mark.parametrize("kind", ("bart", "causal"))
def test_cuda_half_precision_default(dirs, kind):
    path = dirs.bart(0) if kind == "bart" else dirs.causal("gemma3")
    gen = RagGenerator.load(path)  # default on CUDA: bf16 (fp16 without bf16 support)
    assert gen.dtype in ("bfloat16", "float16")
    passages = make_passages(3, 2)
    for mode in MODES:
        res = gen.generate(QUESTION, passages, DecodingOptions(mode=mode, num_beams=2))
        assert res.hypotheses and all(h.log_prob == h.log_prob for h in res.hypotheses)
    scores = torch.tensor([[p.score for p in passages]], requires_grad=True)
    loss = gen.loss([QUESTION], [passages], scores, ["Paris"], "rag-token")
    loss.backward()
    assert torch.isfinite(scores.grad).all()
