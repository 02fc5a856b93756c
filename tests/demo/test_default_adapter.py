"""`openbook demo prepare` installs the shipped adapter next to the model it applies to, once,
and never onto another model."""

from __future__ import annotations

import shutil

from openbook_testkit.rag import make_tiny_adapter, make_tiny_causal_lm
from openbook_testkit.stack import REPO_ROOT
from openbook_trainer.demo.models import DEFAULT_ADAPTER, install_default_adapter


def _shipped_for(tmp_path, base):
    """A data dir whose shipped adapter was trained on ``base`` (the tiny model stands in)."""
    data = tmp_path / "data"
    make_tiny_adapter(base, data / "adapters" / DEFAULT_ADAPTER)
    return data


def test_the_adapter_is_installed_once_onto_its_base(tmp_path):
    base = make_tiny_causal_lm(tmp_path / "lm", arch="llama")
    data = _shipped_for(tmp_path, base)
    out = tmp_path / "models" / "lm-lora"
    assert install_default_adapter(data, base, out, progress=False)
    assert {p.name for p in out.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "openbook_adapter.json",
    }
    assert not install_default_adapter(data, base, out, progress=False)  # already there

    other = make_tiny_causal_lm(tmp_path / "other", arch="gemma3")
    shutil.rmtree(out)
    assert not install_default_adapter(data, other, out, progress=False)
    assert not out.exists()
    assert not install_default_adapter(tmp_path / "empty", base, out, progress=False)


def test_the_repository_ships_the_default_adapter():
    shipped = REPO_ROOT / "data" / "adapters" / DEFAULT_ADAPTER
    assert (shipped / "adapter_model.safetensors").stat().st_size < 20 * 2**20
    assert (shipped / "openbook_adapter.json").is_file()
