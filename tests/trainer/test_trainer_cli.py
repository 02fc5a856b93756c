from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from openbook.rag.confidence import (
    CALIBRATION_FILE,
    FEATURES,
    LogisticCalibration,
    calibrate_row,
    load_calibration,
)
from openbook.storage.checkpoint import latest_checkpoint
from openbook_trainer.cli import app as train_app
from openbook_trainer.config import ConfigError, TrainConfig
from openbook_trainer.evaluation.cli import app as eval_app

runner = CliRunner()


def _args(task, out, *extra: str) -> list[str]:
    return [
        "--train",
        str(task.train),
        "--dev",
        str(task.dev),
        "--index",
        str(task.index),
        "--generator",
        str(task.generator),
        "--out",
        str(out),
        "--k",
        "2",
        "--batch-size",
        "4",
        "--no-progress",
        *extra,
    ]


def test_train_then_eval_checkpoint(task, tmp_path):
    res = runner.invoke(
        train_app,
        _args(
            task,
            tmp_path / "ck",
            "--steps",
            "2",
            "--mode",
            "rag-sequence",
            "--lr-generator",
            "1e-3",
        ),
    )
    assert res.exit_code == 0, res.output
    assert "done at step 2" in res.output
    ckpt = latest_checkpoint(tmp_path / "ck")
    assert ckpt is not None and ckpt.name == "step-000002"

    out = tmp_path / "results.json"
    res = runner.invoke(
        eval_app,
        [
            "--data",
            str(task.dev),
            "--checkpoint",
            str(tmp_path / "ck"),
            "--index",
            str(task.index),
            "--k",
            "2",
            "--max-new-tokens",
            "3",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "| em " in res.output and "recall@2" in res.output and "step-000002" in res.output
    report = json.loads(out.read_text())
    assert report["model_versions"] == ["step-000002"]
    assert set(report["metrics"]) == {"em", "f1", "recall@1", "recall@2", "n"}
    assert report["metrics"]["n"] == 8 and len(report["predictions"]) == 8
    assert report["predictions"][0]["passage_ids"]
    assert all(0 <= row["raw_confidence"] <= 1 for row in report["predictions"])
    # every answer's confidence features are logged (what a logistic calibration reads)
    for row in report["predictions"]:
        features = row["confidence_features"]
        assert set(features) == set(FEATURES)
        assert math.exp(features["mean_log_prob"]) == pytest.approx(row["raw_confidence"])
        assert 0 < features["max_prior"] <= 1 and features["cut_by_length"] in (0.0, 1.0)


def test_train_bad_arguments_exit_cleanly(task, tmp_path):
    res = runner.invoke(train_app, _args(task, tmp_path / "ck", "--k", "0"))
    assert res.exit_code == 2
    assert "k: Input should be greater than or equal to 1" in res.output
    assert "Traceback" not in res.output

    res = runner.invoke(
        train_app, _args(task, tmp_path / "ck", "--freeze-query-encoder", "--freeze-generator")
    )
    assert res.exit_code == 2 and "nothing to train" in res.output

    res = runner.invoke(train_app, ["--train", str(task.train)])
    assert res.exit_code == 2 and "index: required" in res.output

    missing = tmp_path / "nope.jsonl"
    res = runner.invoke(
        train_app, _args(task, tmp_path / "ck", "--steps", "1") + ["--train", str(missing)]
    )
    assert res.exit_code == 1 and "nope.jsonl: file not found" in res.output
    assert "Traceback" not in res.output


def test_eval_bad_arguments(task, tmp_path):
    res = runner.invoke(eval_app, ["--data", str(task.dev)])
    assert res.exit_code == 2 and "exactly one of --url or --checkpoint" in res.output
    res = runner.invoke(
        eval_app,
        ["--data", str(task.dev), "--checkpoint", str(tmp_path), "--index", str(task.index)],
    )
    assert res.exit_code == 2 and "neither a checkpoint nor a root" in res.output
    res = runner.invoke(eval_app, ["--data", str(task.dev), "--url", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and "example q0" in res.output


def test_yaml_config_with_flag_overrides(task, tmp_path):
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(
        f"train: {task.train}\nindex: {task.index}\ngenerator: {task.generator}\n"
        f"out: {tmp_path}\nlr-generator: 1.0e-4\nepochs: 3\nk: 4\n"
    )
    cfg = TrainConfig.load(cfg_file, k=2, steps=10)
    assert (cfg.k, cfg.steps, cfg.epochs, cfg.lr_generator) == (2, 10, None, 1e-4)
    assert TrainConfig.load(cfg_file).epochs == 3
    cfg_file.write_text(cfg_file.read_text() + "bogus: 1\n")
    try:
        TrainConfig.load(cfg_file)
    except ConfigError as e:
        assert "bogus: unknown option" in str(e)
    else:
        raise AssertionError("unknown option accepted")


class _FakeGateway:
    """A stand-in ``POST /answer``: right answers (sure, written in their passage) for every
    entity but e0, which gets a wrong, unsure answer cut by max_new_tokens. ``old``: a reply
    without log_prob, finish_reason or priors (a gateway before confidence features)."""

    def __init__(self, old: bool = False) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Gateway(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.path == "/answer" and body["use_cache"] is False and body["k"] == 2
                entity = body["question"].split()[-2]  # "what is the code of e3 ?" -> e3
                answer = f"c{entity[1:]}" if entity != "e0" else "wrong"
                raw = 0.2 if entity == "e0" else 0.9  # sure of the right answers only
                # e1: withheld by the server's threshold; the model's answer is still scored
                abstained = entity == "e1"
                hypothesis = {"text": answer, "raw_confidence": raw, "confidence": raw}
                passages = [
                    {"id": f"p{entity[1:]}", "title": entity, "text": "t", "score": 1.0},
                    {"id": "q", "title": "q", "text": f"The code of {entity} is c{entity[1:]}."},
                ]
                if not old:
                    hypothesis["log_prob"] = -3.0 if entity == "e0" else -0.5
                    hypothesis["finish_reason"] = "length" if entity == "e0" else "stop"
                    passages[0]["prior"], passages[1]["prior"] = 0.75, 0.25
                    # RAG-Token's per-token posteriors: the last one is the answer's
                    hypothesis["tokens"] = [
                        {"token": "c", "posterior": [0.9, 0.1]},
                        {"token": answer, "posterior": [0.4, 0.6]},
                    ]
                data = json.dumps(
                    {
                        "answer": "" if abstained else answer,
                        "abstained": abstained,
                        "confidence": raw,
                        "hypotheses": [hypothesis],
                        "model_version": "step-000042",
                        "passages": passages,
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> _FakeGateway:
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()


def _eval_http(task, url: str, out, model, *extra: str):
    args = ["--data", str(task.dev), "--url", url, "--k", "2", "--out", str(out)]
    return runner.invoke(eval_app, [*args, "--fit-calibration", str(model), *extra])


def test_eval_against_http_answer(task, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    out = tmp_path / "http.json"
    with _FakeGateway() as gateway:
        res = _eval_http(task, gateway.url, out, model, "--calibration-kind", "piecewise-linear")
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    metrics = report["metrics"]
    assert metrics["em"] == 87.5 and metrics["recall@1"] == 100.0  # 7 of 8 right
    assert "model version: step-000042" in res.output
    assert sorted({row["raw_confidence"] for row in report["predictions"]}) == [0.2, 0.9]
    # the one wrong answer was the unsure one: the fitted map says so
    calibration = load_calibration(model)
    assert (calibration.x, calibration.y, calibration.fitted_on) == ((0.2, 0.9), (0.0, 1.0), 8)
    assert f"wrote {model / CALIBRATION_FILE}" in res.output


def test_eval_fits_a_logistic_calibration_on_the_answers_features(task, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    out = tmp_path / "http.json"
    with _FakeGateway() as gateway:
        res = _eval_http(task, gateway.url, out, model)  # logistic: the default
    assert res.exit_code == 0, res.output
    assert f"wrote {model / CALIBRATION_FILE}" in res.output
    rows = {r["id"]: r for r in json.loads(out.read_text())["predictions"]}
    features = [r["confidence_features"] for r in rows.values()]
    wrong = next(f for f in features if f["cut_by_length"] == 1.0)
    assert wrong == {
        "log_prob": -3.0,
        "mean_log_prob": pytest.approx(math.log(0.2)),
        "max_prior": 0.75,
        "answer_in_top_passage": 0.0,
        "prior_with_answer": 0.0,
        "cut_by_length": 1.0,
        "posterior_with_answer": 0.0,
        "question_near_answer": 0.0,
    }
    right = [f for f in features if f is not wrong]
    assert len(right) == 7
    for f in right:  # written in the second passage only ("The code of e3 is c3.")
        assert (f["answer_in_top_passage"], f["prior_with_answer"]) == (0.0, 0.25)
        assert f["posterior_with_answer"] == pytest.approx(0.6)  # its last token's posterior
        # "what is the code of e3 ?": both content words sit next to the answer
        assert f["question_near_answer"] == 1.0
        assert f["log_prob"] == -0.5 and f["mean_log_prob"] == pytest.approx(math.log(0.9))

    calibration = load_calibration(model)
    assert isinstance(calibration, LogisticCalibration)
    assert calibration.features == FEATURES
    provenance = calibration.fitted_on
    assert provenance["questions"] == 8 and provenance["target"] == gateway.url
    assert provenance["data"] == str(task.dev) and provenance["model_versions"] == ["step-000042"]
    # the logged rows are what the calibration reads: the wrong answer is the least sure
    assert calibrate_row(calibration, wrong) < min(calibrate_row(calibration, f) for f in right)

    # a gateway that reports no features cannot be fitted a logistic calibration
    with _FakeGateway(old=True) as old:
        res = _eval_http(task, old.url, out, model)
    assert res.exit_code == 2 and "no confidence features" in res.output
    assert "--calibration-kind piecewise-linear" in res.output


def test_train_a_lora_adapter_from_the_command_line(task, tmp_path):
    lora = ["--generator-adapter", "lora", "--lora-rank", "4", "--lora-target", "q_proj"]
    res = runner.invoke(train_app, _args(task, tmp_path / "ck", "--steps", "1", *lora))
    assert res.exit_code == 0, res.output
    ckpt = latest_checkpoint(tmp_path / "ck")
    config = json.loads((ckpt / "generator_adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_modules"] == ["q_proj"]
    res = runner.invoke(
        eval_app,
        [
            "--data",
            str(task.dev),
            "--checkpoint",
            str(ckpt),
            "--index",
            str(task.index),
            "--k",
            "2",
            "--max-new-tokens",
            "3",
        ],
    )
    assert res.exit_code == 0, res.output  # the adapter checkpoint loads onto its base

    res = runner.invoke(
        train_app, _args(task, tmp_path / "ck2", "--generator-adapter", "lora", "--lora-rank", "0")
    )
    assert res.exit_code == 2 and "lora-rank" in res.output


def test_train_sizes_its_compute_threads_and_the_setting_wins(task, tmp_path, monkeypatch, caplog):
    """The CLI sizes torch's threads of the thread that trains
    (openbook/runtime/compute_threads.py); OPENBOOK_COMPUTE_THREADS overrides the CPU budget; a bad
    value is an error naming it."""
    import logging

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("OPENBOOK_COMPUTE_THREADS", "1")
    with caplog.at_level(logging.INFO, logger="openbook.runtime.compute_threads"):
        res = runner.invoke(train_app, _args(task, tmp_path / "ck", "--steps", "1"))
    assert res.exit_code == 0, res.output
    assert "compute threads: 1 (OPENBOOK_COMPUTE_THREADS" in caplog.text

    monkeypatch.setenv("OPENBOOK_COMPUTE_THREADS", "many")
    res = runner.invoke(train_app, _args(task, tmp_path / "ck2", "--steps", "1"))
    assert res.exit_code == 2
    assert "OPENBOOK_COMPUTE_THREADS" in res.output


def test_torchrun_processes_on_a_node_share_its_cpus(monkeypatch):
    import torch

    from openbook_trainer.loop import training_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OPENBOOK_COMPUTE_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1024")  # more processes than CPUs: one each
    assert training_threads().target() == 1
    monkeypatch.setenv("OPENBOOK_COMPUTE_THREADS", "3")
    assert training_threads().target() == 3
    assert torch.get_num_threads() >= 1


def test_the_jobs_help_lists_each_command_by_the_name_it_answers_to(capsys):
    """The commands are imported when named (openbook_trainer.__main__): a one-command app's
    click command is named after its function, a group has no name; help must still list the
    names a user types."""
    from openbook_trainer.__main__ import COMMANDS, command_group

    group = command_group()
    ctx = group.make_context("openbook-trainer", [])
    for name in COMMANDS:
        assert group.get_command(ctx, name).name == name
    group.main(["--help"], prog_name="openbook-trainer", standalone_mode=False)
    shown = capsys.readouterr().out
    assert "-command" not in shown
    for name in COMMANDS:
        assert f" {name} " in shown
