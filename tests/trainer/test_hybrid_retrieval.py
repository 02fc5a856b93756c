"""Training through the hybrid prior: the fused score s = w_d·q·d + w_b·bm25 carries the
gradient to the query encoder through its dense part, and the loop uses it by default on an
index with both views."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from openbook.index import load_encoder, open_index
from openbook.index.request import SearchRequest
from openbook_trainer.experiments.synthetic import SyntheticTask
from openbook_trainer.retrieval import DenseRetrieval, HybridRetrieval, make_retrieval

QUESTIONS = ["what is the code of e1 ?", "what is the code of e5 ?"]


def test_hybrid_scores_carry_the_dense_gradient(task: SyntheticTask, hybrid_index: Path) -> None:
    with open_index(hybrid_index) as index:
        enc = load_encoder(str(task.query_encoder), role="query", cached=False)
        enc.model.eval()  # no dropout: the scores below are compared with a search
        # a DPR-encoded index trains as it serves: dense by default (the paper's), hybrid asked
        assert isinstance(make_retrieval(index, enc, 3), DenseRetrieval)
        retrieval = make_retrieval(index, enc, 3, "hybrid")
        assert isinstance(retrieval, HybridRetrieval)
        hits, scores = retrieval.retrieve_with_scores(QUESTIONS, grad=True)
        assert scores.shape == (2, 3) and scores.requires_grad
        # The same passages and scores as the services' hybrid search.
        want = index.search(SearchRequest(QUESTIONS, k=3, retrieval="hybrid"), encoder=enc)
        assert [[p.id for p in h] for h in hits] == [[p.id for p in h] for h in want]
        np.testing.assert_allclose(
            scores.detach().numpy(), [[p.score for p in h] for h in want], rtol=1e-4, atol=1e-4
        )
        # s = 2·(D @ q) + 0.5·b: ds/dq = 2·D, the BM25 part is a constant.
        q = enc.encode_tensor(QUESTIONS).float().detach().requires_grad_(True)
        docs = torch.from_numpy(np.stack([np.stack([p.vector for p in h]) for h in hits]))
        dense = torch.bmm(docs, q.unsqueeze(2)).squeeze(2)
        bm25 = (scores.detach() - 2.0 * dense.detach()) / 0.5
        assert (bm25 >= -1e-4).all() and (bm25 > 0).any()  # real BM25 scores, not zeros
        (2.0 * dense).sum().backward()
        np.testing.assert_allclose(q.grad.numpy(), 2.0 * docs.sum(1).numpy(), rtol=1e-5)

        enc.model.zero_grad()
        scores.sum().backward()
        grads = [p.grad for p in enc.model.parameters() if p.grad is not None]
        assert grads and any(float(g.abs().sum()) > 0 for g in grads)  # reaches the encoder

        # Explicit modes: dense as before; bm25 cannot train an encoder.
        assert isinstance(make_retrieval(index, enc, 3, "dense"), DenseRetrieval)
        with pytest.raises(ValueError, match="^retrieval: bm25 cannot train"):
            make_retrieval(index, enc, 3, "bm25")
        assert [p.id for p in retrieval.search(QUESTIONS)[0]] == [p.id for p in want[0]]
    with open_index(task.index) as dense_only:
        assert isinstance(make_retrieval(dense_only, enc, 3), DenseRetrieval)
        with pytest.raises(ValueError, match="^retrieval: index 'synthetic' has no hybrid"):
            make_retrieval(dense_only, enc, 3, "hybrid")


def test_training_loop_uses_the_hybrid_prior(make_cfg, hybrid_index: Path) -> None:
    from openbook_trainer.config import ConfigError
    from openbook_trainer.loop import Trainer

    # the synthetic index is DPR-encoded, whose default is dense: hybrid is asked for
    trainer = Trainer(make_cfg(index=hybrid_index, steps=3, dev=None, retrieval="hybrid"))
    losses: list[float] = []
    try:
        assert isinstance(trainer.retrieval, HybridRetrieval)
        result = trainer.run(lambda step, loss: losses.append(loss))
    finally:
        trainer.index.close()
    assert result.step == 3 and len(losses) == 3 and all(np.isfinite(losses))
    dense = Trainer(
        make_cfg(index=hybrid_index, retrieval="dense", dev=None, out=hybrid_index.parent / "c2")
    )
    try:
        assert isinstance(dense.retrieval, DenseRetrieval)
    finally:
        dense.index.close()
    with pytest.raises(ConfigError, match="retrieval: index 'synthetic' has no hybrid"):
        Trainer(make_cfg(retrieval="hybrid", out=hybrid_index.parent / "c3"))


def test_train_cli_retrieval_flag(task: SyntheticTask, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from openbook_trainer.cli import app

    args = ["--train", str(task.train), "--index", str(task.index)]
    args += ["--generator", str(task.generator), "--out", str(tmp_path / "ck"), "--steps", "1"]
    res = CliRunner().invoke(app, [*args, "--retrieval", "hybrid"])
    assert res.exit_code == 1, res.output  # a setup error: found on opening the index
    assert "retrieval: index 'synthetic' has no hybrid retrieval" in res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(app, [*args, "--retrieval", "sparse"])
    assert res.exit_code == 2 and "sparse" in res.output
