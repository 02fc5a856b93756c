"""The open-domain QA experiment on tiny models: every system runs, results resume."""

import dataclasses
import json

from openbook.index import build_index
from openbook.index.spec import BuildOptions, IndexSpec
from openbook_testkit.index import QUESTIONS, fact_rows, write_jsonl
from openbook_testkit.rag import make_tiny_bart
from openbook_trainer.experiments.open_qa import OpenQAConfig, markdown, plot_em_by_k, run_open_qa
from openbook_trainer.experiments.report import write_section


def test_open_qa_runs_every_system_and_resumes(tmp_path):
    root = tmp_path / "indexes"
    source = write_jsonl(tmp_path / "facts.jsonl", fact_rows())
    build_index([source], root / "dense", IndexSpec(name="dense"), BuildOptions(progress=False))
    build_index(
        [source],
        root / "sparse",
        IndexSpec(name="sparse", index_type="bm25"),
        BuildOptions(progress=False),
    )
    texts = {row["id"]: row["text"] for row in fact_rows()}
    questions = write_jsonl(
        tmp_path / "questions.jsonl",
        [
            {"id": pid, "question": q, "answers": [texts[pid].split()[0]]}
            for pid, q in QUESTIONS.items()
        ],
    )
    config = OpenQAConfig(
        index_root=root,
        generator=make_tiny_bart(tmp_path / "bart"),
        questions=questions,
        dense_index="dense",
        bm25_index="sparse",
        n=4,
        ks=(1, 3),
        k=3,
        max_new_tokens=4,
    )
    result = run_open_qa(config, tmp_path / "out")
    assert set(result.scores) == {s.name for s in config.systems()}
    assert result.retrieval["dense"][3] >= result.retrieval["dense"][1]
    log = tmp_path / "out" / "open_qa_predictions.jsonl"
    lines = log.read_text().splitlines()
    assert len(lines) == 4 * len(config.systems())
    again = run_open_qa(config, tmp_path / "out")  # everything is read back, nothing redone
    assert again.scores == result.scores
    assert log.read_text().splitlines() == lines
    plot_em_by_k(result, config.ks, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert "RAG-Sequence thorough k=3" in markdown(result)
    # MiniLM's index scales cosines by 20 (its manifest's score_scale); BM25 is unscaled
    assert "softmax over 20 x dense inner product, bm25 score." in markdown(result)
    assert json.loads(json.dumps(result.scores))

    # A sharper document prior is a different system: predicted anew, never read back from
    # the others (closed book uses no retrieval and is reused).
    scaled = dataclasses.replace(config, prior_scale=20.0)
    run_open_qa(scaled, tmp_path / "out")
    assert len(log.read_text().splitlines()) == len(lines) + 4 * (len(config.systems()) - 1)
    table = markdown(run_open_qa(scaled, tmp_path / "out"))
    assert "softmax over 400 x dense inner product, 20 x bm25 score." in table


def test_report_sections_are_replaced_in_place(tmp_path):
    report = tmp_path / "results.md"
    write_section(report, "a", "A", "first", "cmd a")
    write_section(report, "b", "B", "second", "cmd b")
    write_section(report, "a", "A", "updated", "cmd a")
    text = report.read_text()
    assert "updated" in text and "first" not in text and "second" in text
    assert text.index("## A") < text.index("## B")


def test_qa_command_refuses_a_non_positive_prior_scale(tmp_path):
    from typer.testing import CliRunner

    from openbook_cli.app import app

    result = CliRunner().invoke(
        app, ["experiments", "qa", "--prior-scale", "0", "--out", str(tmp_path)]
    )
    assert result.exit_code == 2
    assert "--prior-scale" in result.output and "greater than 0" in result.output
