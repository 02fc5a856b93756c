from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from openbook.index.cli import app

runner = CliRunner()


def test_build_info_search(facts_jsonl: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli_idx"
    r = runner.invoke(
        app,
        [
            "build",
            "--passages",
            str(facts_jsonl),
            "--name",
            "facts",
            "--out",
            str(out),
            "--type",
            "bm25",
            "--no-progress",
            "--score-scale",
            "0.5",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "built index 'facts' (bm25, 30 passages" in r.output

    r = runner.invoke(app, ["info", str(out), "--verify"])
    assert r.exit_code == 0, r.output
    manifest = json.loads(r.stdout)
    assert manifest["name"] == "facts" and manifest["count"] == 30
    assert manifest["score_scale"] == 0.5

    r = runner.invoke(app, ["search", str(out), "Who wrote Hamlet?", "-k", "1"])
    assert r.exit_code == 0 and "p21" in r.output


def test_dense_build_with_dpr(dpr_dirs: tuple[Path, Path], facts_jsonl: Path, tmp_path: Path):
    out = tmp_path / "dense"
    r = runner.invoke(
        app,
        [
            "build",
            "-p",
            str(facts_jsonl),
            "--name",
            "d",
            "--out",
            str(out),
            "--encoder",
            str(dpr_dirs[0]),
            "--query-encoder",
            str(dpr_dirs[1]),
            "--type",
            "hnsw",
            "--format",
            "jsonl",
            "--batch-size",
            "8",
            "--no-progress",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["dim"] == 32


def test_ivfpq_with_an_hnsw_coarse_quantizer(
    dpr_dirs: tuple[Path, Path], facts_jsonl: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ivf-hnsw"
    encoders = ["--encoder", str(dpr_dirs[0]), "--query-encoder", str(dpr_dirs[1])]
    r = runner.invoke(
        app,
        [
            "build",
            "-p",
            str(facts_jsonl),
            "--name",
            "ivf",
            "--out",
            str(out),
            *encoders,
            "--type",
            "ivfpq",
            "--nlist",
            "2",
            "--pq-m",
            "4",
            "--nprobe",
            "2",
            "--coarse-quantizer",
            "hnsw",
            "--hnsw-m",
            "8",
            "--ef-search",
            "16",
            "--batch-size",
            "8",
            "--no-progress",
        ],
    )
    assert r.exit_code == 0, r.output
    params = json.loads((out / "manifest.json").read_text())["index_params"]
    assert (params["coarse_quantizer"], params["hnsw_m"], params["ef_search"]) == ("hnsw", 8, 16)
    r = runner.invoke(app, ["search", str(out), "Who wrote Hamlet?", "-k", "3"])
    assert r.exit_code == 0, r.output


def test_bad_arguments_exit_nonzero_without_traceback(facts_jsonl: Path, tmp_path: Path) -> None:
    build = ["build", "-p", str(facts_jsonl), "--name", "x", "--out", str(tmp_path / "x")]
    cases = [
        (
            [
                "build",
                "-p",
                str(tmp_path / "missing.jsonl"),
                "--name",
                "x",
                "--out",
                str(tmp_path / "x"),
            ],
            "no such file",
        ),
        (
            [*build, "--encoder", "facebook/dpr-ctx_encoder-single-nq-base"],
            "not a local directory",
        ),
        (
            [*build, "--score-scale", "-3"],
            "score_scale must be a positive number",
        ),
        (
            [*build, "--type", "lsh"],
            "Invalid value",
        ),
        (
            [*build, "--type", "hnsw", "--coarse-quantizer", "hnsw"],
            "coarse_quantizer: 'hnsw' is an ivfpq option",
        ),
        (["info", str(tmp_path / "nothing")], "index directory not found"),
        (["info", str(tmp_path)], "manifest.json missing"),
    ]
    for args, msg in cases:
        r = runner.invoke(app, args)
        assert r.exit_code != 0, args
        assert msg in r.output, (args, r.output)
        assert "Traceback" not in r.output
        assert r.exception is None or isinstance(r.exception, SystemExit)
