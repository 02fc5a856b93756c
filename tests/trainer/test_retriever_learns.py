"""The paper's claim at toy scale: the retriever learns which passage holds the answer from the
answers alone (no passage labels), by minimising the RAG marginal NLL through p(z|x).

The full-size run (docs/training.md) is ``python -m openbook_trainer.experiments.retriever_learns``.
"""

from __future__ import annotations

from openbook_trainer.experiments.retriever_learns import run


def test_query_encoder_learns_from_answers_alone(tmp_path):
    r = run(
        tmp_path,
        n_entities=8,
        k=4,
        steps=150,
        pretrain_steps=1500,
        lr_query_encoder=2e-3,
        variants=("qenc_only",),
    )
    assert r["reader_pretraining"]["copy_accuracy"] >= 0.8  # the generator can read
    frozen, trained = r["frozen"], r["qenc_only"]
    # chance: recall@1 1/8, gold p(z|x) = 1/4 (uniform over k) x 1/2 (chance the gold is retrieved)
    assert frozen["recall@1"] <= 25 and frozen["gold_p"] < 0.2
    # (holds for seeds 0 and 1: 12.5 -> 100 and 0 -> 50 recall@1)
    assert trained["recall@1"] >= frozen["recall@1"] + 25, r
    assert trained["gold_p"] >= frozen["gold_p"] + 0.2, r
