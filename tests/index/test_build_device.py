"""``openbook index build --device``: where the document encoder runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from openbook.index import build_index, load_encoder
from openbook.index.spec import BuildOptions, IndexSpec
from openbook_cli.app import app


def test_explicit_cpu_gives_the_default_build(facts_jsonl: Path, facts_index_dir: Path, tmp_path):
    build_index(
        [facts_jsonl],
        tmp_path / "cpu",
        IndexSpec(name="facts"),
        BuildOptions(device="cpu", progress=False),
    )
    np.testing.assert_array_equal(
        np.load(tmp_path / "cpu" / "vectors.npy"), np.load(facts_index_dir / "vectors.npy")
    )


@pytest.mark.parametrize(
    ("device", "reason"),
    [("mps", "expected cpu or cuda"), ("no-such-device", "no-such-device")]
    + ([] if torch.cuda.is_available() else [("cuda", "CUDA is not available")]),
)
def test_unusable_device_is_refused_before_anything_is_written(
    facts_jsonl: Path, tmp_path, device: str, reason: str
):
    out = tmp_path / "idx"
    with pytest.raises(ValueError, match=reason):
        build_index(
            [facts_jsonl], out, IndexSpec(name="facts"), BuildOptions(device=device, progress=False)
        )
    assert not out.exists()
    reply = CliRunner().invoke(
        app,
        [
            "index",
            "build",
            "-p",
            str(facts_jsonl),
            "--name",
            "f",
            "--out",
            str(out),
            "--device",
            device,
        ],
    )
    assert reply.exit_code != 0 and reason in reply.output and "Traceback" not in reply.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_build_matches_cpu_and_leaves_the_shared_encoder_on_cpu(
    facts_jsonl: Path, facts_index_dir: Path, tmp_path
):
    cpu = np.load(facts_index_dir / "vectors.npy")
    spec = IndexSpec(name="facts")
    build_index(
        [facts_jsonl],
        tmp_path / "fp32",
        spec,
        BuildOptions(device="cuda", precision="float32", progress=False),
    )
    np.testing.assert_allclose(np.load(tmp_path / "fp32" / "vectors.npy"), cpu, atol=1e-4)
    # The default on CUDA is half precision (bfloat16 or float16): same directions.
    build_index([facts_jsonl], tmp_path / "auto", spec, BuildOptions(device="cuda", progress=False))
    half = np.load(tmp_path / "auto" / "vectors.npy")
    assert ((half * cpu).sum(1) / np.linalg.norm(half, axis=1)).min() > 0.999
    assert load_encoder("all-MiniLM-L6-v2").device.type == "cpu"
