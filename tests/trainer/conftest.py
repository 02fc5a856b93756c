from __future__ import annotations

from pathlib import Path

import pytest
import torch

from openbook.index import Fusion, build_index, open_index, store_fusion
from openbook.index.spec import BuildOptions, IndexSpec
from openbook_trainer.config import TrainConfig
from openbook_trainer.experiments.synthetic import SyntheticTask, make_task


@pytest.fixture(autouse=True)
def _one_thread():
    # Runs beside other suites on 2 shared cores: extra threads only spin.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def task(tmp_path_factory: pytest.TempPathFactory) -> SyntheticTask:
    """8 entities, tiny random DPR encoders (32-d, dropout on), flat index, tiny BART (~1 s)."""
    return make_task(tmp_path_factory.mktemp("synthetic"), n_entities=8, dropout=0.1)


@pytest.fixture
def make_cfg(task: SyntheticTask, tmp_path: Path):
    def make(**kw) -> TrainConfig:
        base = dict(
            train=task.train,
            dev=task.dev,
            index=task.index,
            generator=task.generator,
            out=tmp_path / "ckpt",
            k=3,
            steps=4,
            batch_size=4,
            lr_generator=1e-3,
            lr_query_encoder=1e-3,
            progress=False,
            eval_max_new_tokens=4,
        )
        base.update(kw)
        return TrainConfig(**base)

    return make


@pytest.fixture()
def hybrid_index(task: SyntheticTask, tmp_path: Path) -> Path:
    """The synthetic task's passages indexed with both views (its own index is dense only)."""
    m = open_index(task.index).manifest
    out = tmp_path / "hybrid"
    build_index(
        [task.passages],
        out,
        IndexSpec(name="synthetic-hybrid", encoder=m.encoder or "", query_encoder=m.query_encoder),
        BuildOptions(progress=False),
    )
    # A fitted-looking fusion whose weights differ from the default (1, 1 for DPR's scale 1).
    store_fusion(out, Fusion(2.0, 0.5, 4, {"questions": 1, "source": "t", "sha256": None}, -1.0))
    return out
