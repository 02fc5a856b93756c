"""The trust experiment (openbook_trainer/experiments/trust.py) end to end on tiny models: the
split by article, recall of every retrieval mode with intervals, the fusion's k-fold over
articles, readers with EM intervals and confidence measures, pictures, and resuming."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from openbook.index import build_index
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.rag.packed_weights import Packing
from openbook_testkit.index import FACTS, QUESTIONS, write_facts
from openbook_testkit.rag import make_tiny_causal_lm
from openbook_trainer.experiments import trust
from openbook_trainer.experiments.records import ResultLog


def _questions(path: Path) -> Path:
    """The facts' questions, each its own 'article' (the passage title), answered by a word of
    its passage; enough articles for 2 development ones and 2 folds."""
    by_id = {pid: (title, text) for pid, title, text in FACTS}
    rows = []
    for n, (pid, question) in enumerate(sorted(QUESTIONS.items())):
        title, text = by_id[pid]
        rows.append(
            {
                "id": f"q{n:03d}",
                "question": question,
                "answers": [title.split()[0]],
                "title": title,
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trust_measures_and_resumes(tmp_path: Path, monkeypatch) -> None:
    facts = write_facts(tmp_path / "facts.jsonl")
    build_index(
        [facts],
        tmp_path / "indexes" / "facts",
        IndexSpec(name="facts"),
        BuildOptions(progress=False),
    )
    generator = make_tiny_causal_lm(tmp_path / "gen")
    config = trust.TrustConfig(
        questions=_questions(tmp_path / "questions.jsonl"),
        index_root=tmp_path / "indexes",
        generator=generator,
        out=tmp_path / "out",
        systems=[
            trust.ReaderSystem("few-shot, dense", None, None, "dense"),
            trust.ReaderSystem(
                "few-shot, hybrid", None, None, "hybrid", compare_with="few-shot, dense"
            ),
            trust.ReaderSystem(
                "few-shot, dense, int8 head",
                None,
                None,
                "dense",
                compare_with="few-shot, dense",
                lm_head="int8",
            ),
            trust.ReaderSystem(
                "few-shot, dense, not packed",
                None,
                None,
                "dense",
                compare_with="few-shot, dense",
                packing=Packing.OFF,
            ),
        ],
        index="facts",
        dev_articles=2,
        folds=2,
        k=2,
        recall_ks=(1, 2),
        max_new_tokens=3,
        batch_size=2,
        dtype="float32",
    )
    result, rows = trust.run_trust(config)

    dev_titles = set(result.dev_articles)
    assert len(dev_titles) == 2
    assert result.questions == len(rows["few-shot, dense"]) > 0
    assert {r["title"] for r in rows["few-shot, dense"]} <= dev_titles
    for table in (result.recall, result.recall_kfold):
        for by_k in table.values():
            for iv in by_k.values():
                assert 0 <= iv["low"] <= iv["mean"] <= iv["high"] <= 1
    assert "bm25" in result.recall and any(k.startswith("hybrid") for k in result.recall)
    assert set(result.recall_gain) == {"1", "2"}
    # k-fold: every question of every article measured once, each fold fitted without it
    assert sum(f["questions"] for f in result.fusion_folds) == len(QUESTIONS)
    assert len(result.fusion_folds) == 2
    dense, hybrid, int8, unpacked = (result.readers[s.name] for s in config.systems)
    assert "em_vs_baseline" not in dense and "em_vs_baseline" in hybrid
    # compared question by question with the system it names, too
    assert "em_vs_other" not in dense and hybrid["em_vs_other"]["versus"] == "few-shot, dense"
    assert hybrid["em_vs_other"]["mean"] == hybrid["em_vs_baseline"]["mean"]
    # the int8 head's answers, logged apart from the same model's, and how many are the same
    assert 0 <= int8["em_vs_other"]["identical"] <= 1
    same = sum(
        a["answer"] == b["answer"]
        for a, b in zip(rows["few-shot, dense, int8 head"], rows["few-shot, dense"], strict=True)
    )
    assert int8["em_vs_other"]["identical"] == same / result.questions
    # (and every answer of this forced precision logged apart from what auto would serve)
    assert any(
        "+int8-rescored-head+float32|" in key
        for key in ResultLog(config.out / "predictions.jsonl").done
    )
    # not packed: the model's own products, logged apart; on a tiny model the same answers
    assert unpacked["em_vs_other"]["identical"] == 1.0
    assert any(
        "+packed-off+float32|" in key for key in ResultLog(config.out / "predictions.jsonl").done
    )
    for m in (dense, hybrid, dense["calibrated"], hybrid["calibrated"]):
        assert 0 <= m["ece"] <= 1
        assert set(m["em_at_coverage"]) == {"1.0", "0.8", "0.6", "0.5"}
        assert sum(b["count"] for b in m["reliability"]) == result.questions
    for r in rows["few-shot, hybrid"]:
        assert 0 <= trust.confidence_of(r) <= 1
        assert 0 <= r["calibrated_confidence"] <= 1

    pictures = trust.plot_confidence(result, tmp_path)
    coverage = trust.plot_coverage(result, rows.__getitem__, tmp_path)
    assert pictures["reliability"].read_bytes()[:4] == b"\x89PNG"
    assert coverage is not None and coverage.read_bytes()[:4] == b"\x89PNG"
    text = trust.markdown(result, {"reliability": "x.png"})
    assert "hybrid − the better single view" in text and "| few-shot, hybrid |" in text
    assert "| few-shot, hybrid | calibrated |" in text
    assert "Paired difference of few-shot, hybrid to few-shot, dense: EM" in text
    assert "the same answer on" in text

    # A rerun answers nothing again: every prediction is in the log.
    logged = len(ResultLog(config.out / "predictions.jsonl").done)
    monkeypatch.setattr(
        "openbook.rag.RagGenerator.load",
        lambda *a, **k: (_ for _ in ()).throw(AssertionError("generated again")),
    )
    again, _ = trust.run_trust(config)
    assert json.dumps(again.readers, sort_keys=True) == json.dumps(result.readers, sort_keys=True)
    assert len(ResultLog(config.out / "predictions.jsonl").done) == logged


def test_the_calibration_is_cross_fitted_by_article_and_saved(tmp_path: Path) -> None:
    """Each article's answers are scored by a calibration fitted on the other articles; the one
    fitted on all is saved to ship. Synthetic answers: right ones have a higher log_prob."""
    from openbook.rag.confidence import LogisticCalibration, load_calibration

    rows, features = [], []
    for n in range(120):
        right = n % 3 == 0
        rows.append({"title": f"article {n % 4}", "em": float(right)})
        lp = -0.5 - (n % 7) * 0.1 if right else -3.0 - (n % 5) * 0.4
        features.append(
            {
                "log_prob": lp,
                "mean_log_prob": lp / 3,
                "max_prior": 0.5,
                "answer_in_top_passage": float(right),
                "prior_with_answer": 0.5 * right,
                "cut_by_length": 0.0,
                "posterior_with_answer": 0.7 * right,
                "question_near_answer": 0.5,
            }
        )
    conf = trust.cross_fitted_confidence(features, rows)
    assert trust.auroc(conf, [r["em"] for r in rows]) > 0.95
    system = trust.ReaderSystem("Few-shot, hybrid", None, None, "hybrid")
    path = trust.save_calibration(system, features, rows, tmp_path)
    assert path == tmp_path / "calibration" / "few-shot--hybrid" / "confidence_calibration.json"
    shipped = load_calibration(path.parent)
    assert isinstance(shipped, LogisticCalibration)
    assert shipped.fitted_on["questions"] == 120
    # all wrong: nothing to fit, the base rate, nothing saved
    wrong = [{**r, "em": 0.0} for r in rows]
    assert set(trust.cross_fitted_confidence(features, wrong)) == {0.0}
    assert trust.save_calibration(system, features, wrong, tmp_path / "none") is None


def test_a_candidate_without_adapters_is_refused_before_any_work(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from openbook_trainer.experiments.cli import app

    candidate = tmp_path / "candidate"
    (candidate / "gemma-3-270m-squad").mkdir(parents=True)
    (candidate / "gemma-3-270m-squad" / "adapter_config.json").write_text("{}")
    res = CliRunner().invoke(
        app, ["trust", "--candidate", str(candidate), "--out", str(tmp_path / "out")]
    )
    assert res.exit_code == 2, res.output
    # the error box wraps long paths: read its words without the frame
    words = "".join(c for c in res.output if c.isalnum() or c in "-:")
    assert "--candidate" in words and "noadapterminilm-squad-query" in words
    assert not (tmp_path / "out").exists()  # nothing ran


def test_an_unknown_precision_is_refused_before_any_work(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from openbook_trainer.experiments.cli import app

    res = CliRunner().invoke(app, ["trust", "--dtype", "fp8", "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "--dtype" in res.output and "float32" in res.output
    assert not (tmp_path / "out").exists()


def test_decoder_signals_of_a_logged_answer() -> None:
    row = {
        "token_log_probs": [-0.1, -80.0, -0.3],
        "token_doc_posteriors": [[0.5, 0.3, 0.2], [0.7, 0.2, 0.1]],
    }
    assert trust.logged_posterior(row) == [0.7, 0.2, 0.1]  # the posterior after the last token
    signals = trust.decoder_signals(row)
    assert signals["min_token_log_prob"] == trust.LOG_PROB_FLOOR  # floored, like log_prob
    assert signals["first_token_log_prob"] == -0.1
    assert signals["posterior_entropy"] == pytest.approx(
        -sum(p * math.log(p) for p in (0.7, 0.2, 0.1))
    )
    # an answer logged before the signals were (or an empty one): floor and zero
    assert trust.logged_posterior({}) is None
    assert trust.decoder_signals({}) == {
        "min_token_log_prob": trust.LOG_PROB_FLOOR,
        "first_token_log_prob": trust.LOG_PROB_FLOOR,
        "posterior_entropy": 0.0,
    }


def test_the_signal_ablation_finds_a_signal_the_features_lack() -> None:
    """Right answers differ from wrong ones only by their weakest token: the calibration's
    features alone rank at chance, with that signal nearly perfectly; cross-fitting by article
    is the calibration's own (one fit per held-out article)."""
    from openbook.rag.confidence import DEFAULT_FEATURES, calibrate_row
    from openbook_trainer.calibration import fit_logistic_calibration

    rng = np.random.default_rng(0)
    rows, features = [], []
    for n in range(200):
        right = n % 2 == 0
        rows.append({"title": f"article {n % 5}", "em": float(right)})
        features.append(
            {
                **{name: float(rng.normal()) for name in DEFAULT_FEATURES},
                "min_token_log_prob": (-0.5 if right else -4.0) + float(rng.normal()) * 0.3,
                "first_token_log_prob": float(rng.normal()),
                "posterior_entropy": float(rng.random()),
            }
        )
    ablation = trust.signal_ablation(features, rows)
    assert ablation["calibration's features"]["auroc"]["mean"] < 0.65
    assert ablation["without posterior_with_answer"]["auroc"]["mean"] < 0.65
    assert ablation["without question_near_answer"]["auroc"]["mean"] < 0.65
    assert ablation["+ min_token_log_prob"]["auroc"]["mean"] > 0.95
    assert ablation["+ all three"]["auroc"]["mean"] > 0.9
    gain = ablation["+ min_token_log_prob"]["vs_features"]  # paired, on the same answers
    assert gain["low"] > 0.2 and gain["mean"] == pytest.approx(
        ablation["+ min_token_log_prob"]["auroc"]["mean"]
        - ablation["calibration's features"]["auroc"]["mean"]
    )
    assert ablation["calibration's features"]["vs_features"]["mean"] == 0.0
    # the cross-fitted confidence is the shipped calibration's, fitted without the article
    conf = trust.cross_fitted_confidence(features, rows)
    held = [i for i, r in enumerate(rows) if r["title"] == "article 0"]
    rest = [i for i, r in enumerate(rows) if r["title"] != "article 0"]
    fitted = fit_logistic_calibration([features[i] for i in rest], [rows[i]["em"] for i in rest])
    for i in held:
        assert conf[i] == pytest.approx(calibrate_row(fitted, features[i]), abs=1e-9)


def test_unpacked_weights_are_judged_against_the_shipped_default(tmp_path: Path) -> None:
    plain = trust.default_systems(tmp_path)
    systems = trust.default_systems(tmp_path, int8_head=True, unpacked=True)
    assert systems[: len(plain)] == plain
    added = systems[-1]
    assert (added.packing, added.lm_head, added.compare_with) == (
        Packing.OFF,
        "model",
        trust.SHIPPED,
    )
    shipped = next(s for s in plain if s.name == trust.SHIPPED)
    assert (added.generator_adapter, added.query_encoder_adapter, added.retrieval) == (
        shipped.generator_adapter,
        shipped.query_encoder_adapter,
        shipped.retrieval,
    )


def test_the_int8_head_is_judged_against_the_shipped_default(tmp_path: Path) -> None:
    plain = trust.default_systems(tmp_path)
    systems = trust.default_systems(tmp_path, int8_head=True)
    assert systems[:-1] == plain
    added = systems[-1]
    assert (added.lm_head, added.compare_with) == ("int8", trust.SHIPPED)
    shipped = next(s for s in plain if s.name == trust.SHIPPED)
    assert (added.generator_adapter, added.query_encoder_adapter, added.retrieval) == (
        shipped.generator_adapter,
        shipped.query_encoder_adapter,
        shipped.retrieval,
    )
