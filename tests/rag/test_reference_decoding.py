"""Generated token ids equal transformers' RagTokenForGeneration / RagSequenceForGeneration."""

from __future__ import annotations

import pytest
import torch

from openbook.rag import DecodingOptions
from openbook.rag.engine import DecodingEngine
from openbook_testkit.rag import QUESTION, make_passages, strip_trailing

SEEDS = (0, 1, 2)


def _reference_ids(ref, mode, k, passages, opts, **generation):
    ids, mask, scores = ref.context(QUESTION, passages)
    kind = "token" if mode == "rag-token" else "sequence"
    model = ref.model(kind, k)
    # RagTokenForGeneration.generate never converts max_new_tokens into max_length (it skips
    # generate()'s length preparation), so it takes max_length = decoder start + new tokens.
    length = (
        {"max_length": opts.max_new_tokens + 1}
        if kind == "token"
        else {"max_new_tokens": opts.max_new_tokens}
    )
    with torch.no_grad():
        out = model.generate(
            context_input_ids=ids,
            context_attention_mask=mask,
            doc_scores=scores,
            n_docs=k,
            num_beams=opts.num_beams,
            num_return_sequences=opts.num_return_sequences,
            min_new_tokens=opts.min_new_tokens,
            length_penalty=opts.length_penalty,
            **length,
            **generation,
        )
    pad = ref.bart.config.pad_token_id
    return [strip_trailing(row.tolist()[1:], pad) for row in out]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", (1, 3, 5))
@pytest.mark.parametrize("num_beams", (1, 2, 4))
@pytest.mark.parametrize("mode", ("rag-token", "rag-sequence-thorough"))
def test_token_ids_match_transformers(dirs, load, reference_for, seed, k, num_beams, mode):
    bart = dirs.bart(seed)
    gen = load(bart)
    ref = reference_for(bart, gen)
    passages = make_passages(k, seed)
    lp = (1.0, 0.5, 2.0)[(seed + k) % 3]
    opts = DecodingOptions(
        mode=mode,
        num_beams=num_beams,
        max_new_tokens=8,
        min_new_tokens=seed % 2 * 3,
        length_penalty=lp,
        num_return_sequences=min(num_beams, 2),
    )
    ours = [h.token_ids for h in gen.generate(QUESTION, passages, opts).hypotheses]
    assert ours == _reference_ids(ref, mode, k, passages, opts)


GENERATION = {
    "forced_bos_token_id": 0,
    "forced_eos_token_id": 2,
    "no_repeat_ngram_size": 2,
    "early_stopping": True,
}


@pytest.mark.parametrize("num_beams", (1, 4))
@pytest.mark.parametrize("mode", ("rag-token", "rag-sequence-thorough"))
def test_model_generation_config_is_honoured(dirs, load, reference_for, num_beams, mode):
    """forced BOS/EOS, n-gram blocking and early stopping from the checkpoint, as bart-large has."""
    # transformers refuses to save early_stopping without beams; bart-large also ships num_beams=4
    bart = dirs.bart(3, generation={**GENERATION, "num_beams": 4})
    gen = load(bart)
    assert gen.generation["forced_bos_token_id"] == 0
    ref = reference_for(bart, gen)
    for k in (2, 4):
        passages = make_passages(k, k)
        opts = DecodingOptions(
            mode=mode, num_beams=num_beams, max_new_tokens=10, num_return_sequences=num_beams
        )
        ours = [h.token_ids for h in gen.generate(QUESTION, passages, opts).hypotheses]
        assert all(t[0] == 0 for t in ours)  # forced BOS
        assert ours == _reference_ids(ref, mode, k, passages, opts, **GENERATION)


def test_longer_generation_and_full_nbest(dirs, load, reference_for):
    bart = dirs.bart(4, d_model=32, layers=2)
    gen = load(bart)
    ref = reference_for(bart, gen)
    passages = make_passages(3, 7)
    for mode in ("rag-token", "rag-sequence-thorough"):
        opts = DecodingOptions(mode=mode, num_beams=4, max_new_tokens=20, num_return_sequences=4)
        ours = [h.token_ids for h in gen.generate(QUESTION, passages, opts).hypotheses]
        assert ours == _reference_ids(ref, mode, 3, passages, opts)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", (1, 3))
@pytest.mark.parametrize("mode", ("rag-token", "rag-sequence-thorough"))
def test_drafted_greedy_ids_match_transformers(
    dirs, load, reference_for, seed, k, mode, monkeypatch
):
    """Passage-drafted decoding (openbook/rag/drafting.py) on the tiny RAG checkpoints: the
    passages' draft sources hold transformers' own answer, so drafts are taken, and the ids
    are still transformers'."""
    bart = dirs.bart(seed)
    gen = load(bart)
    ref = reference_for(bart, gen)
    passages = make_passages(k, seed)
    opts = DecodingOptions(mode=mode, max_new_tokens=10)
    want = _reference_ids(ref, mode, k, passages, opts)
    own = type(gen.backend).draft_sources
    monkeypatch.setattr(
        gen.backend, "draft_sources", lambda q, ps: [i + want[0] for i in own(gen.backend, q, ps)]
    )
    accepted = []
    advance_drafted = DecodingEngine._advance_drafted

    def counting(self: DecodingEngine, drafts: list[list[int]]) -> None:
        before = self.accepted_tokens
        advance_drafted(self, drafts)
        accepted.append(self.accepted_tokens - before)

    monkeypatch.setattr(DecodingEngine, "_advance_drafted", counting)
    gen.set_draft_tokens(8)
    try:
        ours = [h.token_ids for h in gen.generate(QUESTION, passages, opts).hypotheses]
    finally:
        gen.set_draft_tokens(0)
    assert ours == want
    assert sum(accepted) > 0
