"""Every benchmark's one command still starts: its imports resolve (the test kit and the
benchmarks are development-only packages, tests/ and bench/, that scripts/install.sh installs;
no benchmark edits sys.path) and it parses its arguments. The benchmarks themselves run outside
CI (docs/benchmarks.md), except the streaming load benchmark, once on the tiny stack for a few
seconds (it is the client of the streaming API that its numbers rest on), and the training step
benchmark on the synthetic task's tiny models (~20 s; it drives torchrun)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# every script under bench/ that runs as a command
SCRIPTS = sorted(
    str(p.relative_to(ROOT))
    for p in ROOT.glob("bench/*/*.py")
    if 'if __name__ == "__main__"' in p.read_text()
)


def test_every_benchmark_is_found():
    assert {"bench/generator/engine.py", "bench/generator/llamacpp.py"} <= set(SCRIPTS)


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict[str, dict]:
    """Every script's ``--help``: exit code, stdout, stderr (tests/bench_help_driver.py runs
    them all in one fresh process, each as ``python SCRIPT --help`` would)."""
    results = tmp_path_factory.mktemp("bench-help") / "helps.json"
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "bench_help_driver.py"), str(results), *SCRIPTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return json.loads(results.read_text())


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_starts(script, helps):
    result = helps[script]
    assert result["code"] == 0, result["stderr"]
    assert result["stdout"].startswith("usage:")


@pytest.mark.e2e
def test_load_stream_bench_runs_tiny(tmp_path):
    """bench/load/stream.py end to end on the tiny stack: both modes answered at two levels."""
    out = subprocess.run(
        [
            sys.executable,
            "bench/load/stream.py",
            "--clients",
            "1",
            "2",
            "--seconds",
            "2",
            "--json",
            str(tmp_path / "stream.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "TTFT / non-stream p50" in out.stdout
    levels = json.loads((tmp_path / "stream.json").read_text())["levels"]
    assert [lv["clients"] for lv in levels] == [1, 2]
    for lv in levels:
        assert lv["pairs"] > 0 and lv["errors"] == 0
        stream = lv["stream"]
        assert 0 < stream["ttft_p50_ms"] <= stream["p50_ms"]
        # tiny BART, RAG-Token greedy: one token event per generated token
        assert lv["streams_token_per_event"] == lv["pairs"]


def test_train_step_bench_runs_tiny(tmp_path):
    """bench/train/step.py on the synthetic task's tiny models: one process and torchrun x2,
    every step timed from the train log, the 2-process run related to the 1-process one."""
    out = subprocess.run(
        [
            sys.executable,
            "bench/train/step.py",
            "--shapes",
            "tiny",
            "--precision",
            "fp32",
            "--steps",
            "4",
            "--work",
            str(tmp_path / "work"),
            "--json",
            str(tmp_path / "step.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "| precision | processes x threads |" in out.stdout
    runs = json.loads((tmp_path / "step.json").read_text())["runs"]
    assert [r["nproc"] for r in runs] == [1, 2]
    for r in runs:
        assert r["status"] == "ok" and r["steps_logged"] == 4
        assert r["step_s"] > 0 and len(r["step_times_s"]) == 3
        assert r["peak_rss_gib"] > 0
    assert runs[0]["speedup_vs_1proc"] == 1.0 and runs[1]["speedup_vs_1proc"] > 0


def test_documents_bench_runs_smoke(tmp_path):
    """bench/index/documents.py --smoke: every part at tiny sizes (the services in process,
    MiniLM; ~15 s), each ratio measured against its reference in the same run."""
    out = subprocess.run(
        [
            sys.executable,
            "bench/index/documents.py",
            "--smoke",
            "--demo",
            str(tmp_path / "no-demo-index"),
            "--json",
            str(tmp_path / "documents.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "ingestion: API" in out.stdout
    report = json.loads((tmp_path / "documents.json").read_text())
    ingestion = report["ingestion"]
    assert ingestion["rounds"][0]["api_passages"] == ingestion["rounds"][0]["build_passages"] > 0
    assert ingestion["api_over_build"] > 0 and isinstance(ingestion["met"], bool)
    latency = report["latency"]
    assert latency["segment_passages"] == report["sizes"]["segment"]
    for mode in ("dense", "bm25"):
        assert latency["segment_over_compacted_p50"][mode] > 0
    (synthetic,) = report["compaction"]["synthetic"]
    sizes = report["sizes"]
    assert synthetic["passages"] == sizes["n"][0] + sizes["compact_segment"]
    assert synthetic["peak_rss_gib"] >= synthetic["open_rss_gib"] > 0
    assert report["compaction"]["demo"].startswith("not run")
