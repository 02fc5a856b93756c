"""The precision policy: "auto" picks bf16 where the hardware computes it (CUDA, fp16 on a GPU
without bf16; a CPU with AVX512-BF16 / AMX-BF16), float32 elsewhere; the library default stays
float32 on the CPU; OPENBOOK_GENERATOR_DTYPE forces one; bf16 runs end to end on any CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from openbook.config.settings import PRECISIONS
from openbook.rag import DecodingOptions, RagGenerator, loading
from openbook.rag.loading import resolve_device_dtype
from openbook_generator.settings import GeneratorSettings
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_causal_lm


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Set whether the (pretended) CPU has native bf16 arithmetic."""

    def set_(native: bool) -> None:
        monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: native)

    return set_


@pytest.fixture
def cuda(monkeypatch):
    """Pretend a CUDA device is present, with or without bf16 support."""

    def set_(bf16: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)

    return set_


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> Path:
    return make_tiny_causal_lm(tmp_path_factory.mktemp("lm") / "gemma3", seed=5)


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_the_cpu_is_bf16_only_with_native_bf16(cpu_bf16, native, expected):
    cpu_bf16(native)
    assert resolve_device_dtype("cpu", "auto") == ("cpu", expected)
    assert resolve_device_dtype("cpu", " AUTO ") == ("cpu", expected)


@pytest.mark.parametrize(("bf16", "expected"), [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_on_cuda_is_bf16_else_fp16(cuda, cpu_bf16, bf16, expected):
    cuda(bf16)
    cpu_bf16(True)  # the CPU's capability does not matter on the GPU
    assert resolve_device_dtype(None, "auto") == ("cuda", expected)
    assert resolve_device_dtype("cuda:1", "auto") == ("cuda:1", expected)
    assert resolve_device_dtype(None, None) == ("cuda", expected)  # the library default too


def test_the_library_default_stays_float32_on_a_bf16_cpu(cpu_bf16):
    """Tests and training load with dtype=None: exact float32 whatever the CPU supports."""
    cpu_bf16(True)
    assert resolve_device_dtype("cpu", None) == ("cpu", torch.float32)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        ("half", torch.float16),
    ],
)
def test_a_named_dtype_is_forced(cpu_bf16, cuda, name, expected):
    cpu_bf16(True)
    assert resolve_device_dtype("cpu", name) == ("cpu", expected)
    cuda(True)
    assert resolve_device_dtype(None, name) == ("cuda", expected)


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="int8"):
        resolve_device_dtype("cpu", "int8")


def test_cpu_capability_comes_from_torch_or_proc_cpuinfo(monkeypatch, tmp_path):
    caps = {"avx2": True, "avx512_bf16": False, "amx_bf16": False}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps, raising=False)
    assert loading.cpu_has_native_bf16() is False
    caps["amx_bf16"] = True
    assert loading.cpu_has_native_bf16() is True

    def broken():
        raise RuntimeError("no cpuinfo")

    monkeypatch.setattr(torch.cpu, "get_capabilities", broken, raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(loading, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else Path(p))
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert loading.cpu_has_native_bf16() is False
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert loading.cpu_has_native_bf16() is True
    cpuinfo.unlink()
    assert loading.cpu_has_native_bf16() is False


def test_settings_accept_auto_and_the_dtype_names(monkeypatch):
    monkeypatch.delenv("OPENBOOK_GENERATOR_DTYPE", raising=False)
    assert GeneratorSettings.model_fields["dtype"].default in ("auto", "float32")
    assert GeneratorSettings(dtype="").dtype == GeneratorSettings.model_fields["dtype"].default
    assert GeneratorSettings(dtype="auto").dtype == "auto"
    assert GeneratorSettings(dtype="BF16").dtype == "bfloat16"
    assert GeneratorSettings(dtype="fp32").dtype == "float32"
    monkeypatch.setenv("OPENBOOK_GENERATOR_DTYPE", "float32")
    assert GeneratorSettings().dtype == "float32"
    # Every spelling the settings accept is one the loader accepts, and names the same dtype.
    for name, canonical in PRECISIONS.items():
        if name != "auto":
            assert resolve_device_dtype("cpu", name)[1] == getattr(torch, canonical)


def test_settings_refuse_an_unknown_dtype_naming_the_variable(monkeypatch):
    with pytest.raises(ValidationError, match="OPENBOOK_GENERATOR_DTYPE='int8'"):
        GeneratorSettings(dtype="int8")
    monkeypatch.setenv("OPENBOOK_GENERATOR_DTYPE", "float64")
    with pytest.raises(ValidationError, match="OPENBOOK_GENERATOR_DTYPE='float64'"):
        GeneratorSettings()


def test_the_suite_runs_the_generator_service_in_float32():
    """tests/conftest.py pins the services the suite starts to float32 (exactness tests),
    whatever the CPU they run on supports."""
    assert GeneratorSettings().dtype == "float32"


def test_bf16_generates_end_to_end_on_the_cpu(tiny_lm):
    """Emulated or native, bf16 weights decode on the CPU and the generator says so."""
    gen = RagGenerator.load(tiny_lm, device="cpu", dtype="bfloat16")
    assert gen.dtype == "bfloat16"
    assert all(p.dtype == torch.bfloat16 for p in gen.model.parameters())
    passages = make_passages(2, 0)
    for mode in ("rag-token", "rag-sequence-thorough"):
        options = DecodingOptions(mode=mode, num_beams=2, max_new_tokens=6)
        result = gen.generate(QUESTION, passages, options)
        assert result.hypotheses and result.hypotheses[0].token_ids
        assert all(torch.isfinite(torch.tensor(h.log_prob)) for h in result.hypotheses)


def test_the_service_loads_and_reports_the_policy_s_dtype(tiny_lm, tmp_path, cpu_bf16):
    """The generator service's "auto" follows the CPU; its Info RPC reports the loaded dtype."""
    from openbook_generator.server import load_initial_generator
    from openbook_generator.servicer import _model_info

    def info(dtype: str) -> str:
        settings = GeneratorSettings(
            model=tiny_lm, device="cpu", dtype=dtype, checkpoint_dir=tmp_path / "ckpt"
        )
        return _model_info(load_initial_generator(settings)).dtype

    cpu_bf16(True)
    assert info("auto") == "bfloat16"
    assert info("float32") == "float32"
    cpu_bf16(False)
    assert info("auto") == "float32"
    assert info("bf16") == "bfloat16"
