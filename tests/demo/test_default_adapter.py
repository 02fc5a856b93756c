"""`openbook demo prepare` installs the shipped adapters (the generator's and the query
encoder's) under the models directory, once, and never onto another model."""

from __future__ import annotations

import shutil

from openbook_testkit.rag import make_tiny_adapter, make_tiny_causal_lm
from openbook_testkit.stack import REPO_ROOT
from openbook_trainer.demo.models import (
    DEFAULT_ADAPTER,
    DEFAULT_QUERY_ADAPTER,
    install_shipped_adapter,
)


def _shipped_for(tmp_path, base):
    """A shipped adapter trained on ``base`` (the tiny model stands in)."""
    source = tmp_path / "data" / "adapters" / DEFAULT_ADAPTER
    make_tiny_adapter(base, source)
    return source


def test_the_adapter_is_installed_once_onto_its_base(tmp_path):
    base = make_tiny_causal_lm(tmp_path / "lm", arch="llama")
    source = _shipped_for(tmp_path, base)
    out = tmp_path / "models" / "lm-lora"
    assert install_shipped_adapter(source, base, out, progress=False)
    assert {p.name for p in out.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "openbook_adapter.json",
    }
    assert not install_shipped_adapter(source, base, out, progress=False)  # already there

    other = make_tiny_causal_lm(tmp_path / "other", arch="gemma3")
    shutil.rmtree(out)
    assert not install_shipped_adapter(source, other, out, progress=False)
    assert not out.exists()
    assert not install_shipped_adapter(tmp_path / "empty", base, out, progress=False)


def test_a_shipped_calibration_is_installed_with_its_adapter(tmp_path):
    from openbook.rag.confidence import CALIBRATION_FILE, LogisticCalibration, load_calibration

    base = make_tiny_causal_lm(tmp_path / "lm", arch="llama")
    source = _shipped_for(tmp_path, base)
    out = tmp_path / "models" / "lm-lora"
    assert install_shipped_adapter(source, base, out, progress=False)
    assert not (out / CALIBRATION_FILE).exists()
    calibration = LogisticCalibration(("log_prob",), (0.5,), -1.0)
    calibration.save(source)
    assert install_shipped_adapter(source, base, out, progress=False)  # a new file: again
    assert load_calibration(out) == calibration
    assert not install_shipped_adapter(source, base, out, progress=False)
    (source / CALIBRATION_FILE).unlink()  # withdrawn: the installed one goes too
    assert install_shipped_adapter(source, base, out, progress=False)
    assert not (out / CALIBRATION_FILE).exists()


def test_the_repository_ships_the_default_adapters():
    shipped = REPO_ROOT / "data" / "adapters" / DEFAULT_ADAPTER
    assert (shipped / "adapter_model.safetensors").stat().st_size < 20 * 2**20
    assert (shipped / "openbook_adapter.json").is_file()
    query = REPO_ROOT / "data" / "adapters" / DEFAULT_QUERY_ADAPTER
    assert (query / "adapter_model.safetensors").stat().st_size < 4 * 2**20  # 2.6 MiB


def test_the_shipped_query_encoder_adapter_installs_onto_the_packaged_minilm(tmp_path):
    from openbook.index import load_encoder
    from openbook.index.encoders import DEFAULT_ENCODER, encoder_weights_dir

    source = REPO_ROOT / "data" / "adapters" / DEFAULT_QUERY_ADAPTER
    out = tmp_path / "models" / "q-lora"
    assert install_shipped_adapter(source, encoder_weights_dir(DEFAULT_ENCODER), out)
    encoder = load_encoder(str(out), cached=False)  # merged into the packaged MiniLM
    assert encoder.dim == 384 and encoder.name == str(out.resolve())
