"""OPENBOOK_GENERATOR_ADAPTER: the configured adapter is merged into the model at start (the
default stack's tuned generator); a missing one, or one trained on another model, leaves the
model serving alone with a warning; empty means none."""

from __future__ import annotations

import logging

from openbook.rag import DecodingOptions, RagGenerator
from openbook_generator.server import load_initial_generator
from openbook_generator.settings import GeneratorSettings
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_adapter, make_tiny_causal_lm


def _settings(tmp_path, model, adapter) -> GeneratorSettings:
    return GeneratorSettings(
        model=model, adapter=adapter, checkpoint_dir=tmp_path / "none", dtype="float32"
    )


def _log_prob(generator) -> float:
    options = DecodingOptions(max_new_tokens=5)
    return generator.generate(QUESTION, make_passages(3), options).hypotheses[0].log_prob


def test_the_configured_adapter_is_merged_at_start(tmp_path, caplog):
    base = make_tiny_causal_lm(tmp_path / "lm", arch="llama")
    adapter = make_tiny_adapter(base, tmp_path / "lm-lora")
    served = load_initial_generator(_settings(tmp_path, base, adapter))
    assert served.model_version.endswith("+lm-lora")
    expected = RagGenerator.load(base, dtype="float32")
    expected.apply_adapter(adapter, base)
    assert _log_prob(served) == _log_prob(expected) != _log_prob(RagGenerator.load(base))

    alone = load_initial_generator(_settings(tmp_path, base, ""))
    assert "+" not in alone.model_version

    with caplog.at_level(logging.WARNING):
        missing = load_initial_generator(_settings(tmp_path, base, tmp_path / "nope"))
    assert "+" not in missing.model_version and "not found" in caplog.text

    other = make_tiny_causal_lm(tmp_path / "other", arch="gemma3")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        mismatched = load_initial_generator(_settings(tmp_path, other, adapter))
    assert "+" not in mismatched.model_version and "trained on base model" in caplog.text
