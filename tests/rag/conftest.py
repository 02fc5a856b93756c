"""Shared fixtures: tiny generator directories and transformers reference models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from openbook.rag import RagGenerator
from openbook.types import Passage
from openbook_testkit.rag import make_tiny_bart, make_tiny_causal_lm

torch.set_num_threads(1)


class Dirs:
    """Builds tiny model directories on first use, once per session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[tuple, Path] = {}

    def bart(self, seed: int = 0, **kw) -> Path:
        key = ("bart", seed, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in self._cache:
            self._cache[key] = make_tiny_bart(
                self.root / f"bart{len(self._cache)}", seed=seed, **kw
            )
        return self._cache[key]

    def causal(self, arch: str = "gemma3", seed: int = 0, **kw) -> Path:
        key = ("causal", arch, seed, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in self._cache:
            self._cache[key] = make_tiny_causal_lm(
                self.root / f"causal{len(self._cache)}", seed=seed, arch=arch, **kw
            )
        return self._cache[key]


@pytest.fixture(scope="session")
def dirs(tmp_path_factory) -> Dirs:
    return Dirs(tmp_path_factory.mktemp("rag_models"))


_generators: dict[Path, RagGenerator] = {}


@pytest.fixture(scope="session")
def load():
    def _load(path: Path) -> RagGenerator:
        if path not in _generators:
            _generators[path] = RagGenerator.load(path, device="cpu")
        return _generators[path]

    return _load


class Reference:
    """transformers' RagToken/RagSequenceForGeneration over the BART weights of ``bart_dir``."""

    def __init__(self, bart_dir: Path, gen: RagGenerator) -> None:
        from transformers import BartForConditionalGeneration

        self.gen = gen
        self.bart = BartForConditionalGeneration.from_pretrained(bart_dir).eval()
        self._models: dict[tuple, torch.nn.Module] = {}

    def model(self, kind: str, k: int, **rag_kwargs):
        from transformers import (
            DPRConfig,
            DPRQuestionEncoder,
            RagConfig,
            RagSequenceForGeneration,
            RagTokenForGeneration,
        )

        key = (kind, k, tuple(sorted(rag_kwargs.items())))
        if key in self._models:
            return self._models[key]
        c = self.bart.config
        q = DPRConfig(
            vocab_size=30,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
        cfg = RagConfig.from_question_encoder_generator_configs(
            q,
            c,
            n_docs=k,
            bos_token_id=c.bos_token_id,
            eos_token_id=c.eos_token_id,
            pad_token_id=c.pad_token_id,
            decoder_start_token_id=c.decoder_start_token_id,
            vocab_size=c.vocab_size,
            **rag_kwargs,
        )
        cls = RagTokenForGeneration if kind == "token" else RagSequenceForGeneration
        m = cls(cfg, question_encoder=DPRQuestionEncoder(q), generator=self.bart).eval()
        _mask_padding_in_generator(m)
        self._models[key] = m
        return m

    def context(self, question: str, passages: list[Passage]):
        ids, mask = self.gen.backend._tokenize_inputs([(question, p) for p in passages])
        scores = torch.tensor([[p.score for p in passages]], dtype=torch.float32)
        return ids, mask, scores


def _mask_padding_in_generator(rag_model) -> None:
    """RagSequenceForGeneration.generate calls the generator with ``attention_mask=None``.
    transformers 4.x then inferred the mask from padding; 5.x no longer does so for encoder-decoders
    and attends to the padding of shorter passages. Restore the intended (4.x, original RAG)
    behaviour.
    """
    gen = rag_model.rag.generator
    orig = type(gen).generate
    pad = gen.config.pad_token_id

    def generate(input_ids=None, attention_mask=None, **kw):
        if attention_mask is None and input_ids is not None:
            attention_mask = input_ids.ne(pad).long()
        return orig(gen, input_ids, attention_mask=attention_mask, **kw)

    gen.generate = generate


@pytest.fixture(scope="session")
def reference_for():
    cache: dict[Path, Reference] = {}

    def _ref(bart_dir: Path, gen: RagGenerator) -> Reference:
        if bart_dir not in cache:
            cache[bart_dir] = Reference(bart_dir, gen)
        return cache[bart_dir]

    return _ref
