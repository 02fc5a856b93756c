"""Tiny, randomly initialised generator directories for tests (built offline in well under a
second).

Used by this package's tests, the end-to-end tests and the trainer tests::

    from openbook_testkit.rag import make_tiny_bart, make_tiny_rag_checkpoint, make_tiny_causal_lm
    gen = RagGenerator.load(make_tiny_bart(tmp_path / "bart"))

Weights are initialised with a large std so next-token distributions are peaked: near-uniform
distributions would make greedy/beam decisions hinge on float rounding.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from openbook.types import Passage
from openbook_trainer.experiments.synthetic import BART_SPECIALS, small_bart_config, word_tokenizer

CORPUS = [
    "Paris is the capital and most populous city of France.",
    "The Eiffel Tower is a wrought-iron lattice tower in Paris.",
    "William Shakespeare wrote Hamlet, Macbeth and King Lear.",
    "The quick brown fox jumps over the lazy dog.",
    "Who wrote Hamlet? What is the capital of France? When was the tower built?",
    "Title: Passage: Question: Answer: / //",
    "Mount Everest is the highest mountain above sea level, in the Himalayas.",
]
TEXTS = [
    "Paris is the capital of France.",
    "Shakespeare wrote Hamlet.",
    "The quick brown fox jumps over the lazy dog.",
    "Mount Everest is the highest mountain.",
    "The Eiffel Tower is in Paris.",
]
QUESTION = "What is the capital of France?"


def make_passages(k: int, seed: int = 0) -> list[Passage]:
    """k short passages with random retrieval scores (deterministic in ``seed``)."""
    rnd = random.Random(seed)
    return [
        Passage(str(i), f'"Title {i}"', TEXTS[(i + seed) % len(TEXTS)], score=rnd.gauss(0.0, 1.5))
        for i in range(k)
    ]


def strip_trailing(ids: Sequence[int], token: int) -> list[int]:
    """``ids`` without trailing ``token`` (transformers pads finished sequences)."""
    out = list(ids)
    while out and out[-1] == token:
        out.pop()
    return out


def _train_byte_bpe(vocab_size: int, specials: list[str]) -> tuple[dict[str, int], list[tuple]]:
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        CORPUS * 2,
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=specials,
        show_progress=False,
    )
    model = json.loads(bpe._tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def _bpe_bart_tokenizer():
    from transformers import BartTokenizer

    vocab, merges = _train_byte_bpe(300, BART_SPECIALS)
    return BartTokenizer(vocab=vocab, merges=merges)


def _scale_init(model: torch.nn.Module, std: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "norm" in name.lower() or "layernorm" in name.lower():
                continue
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def make_tiny_bart(
    directory: str | Path,
    *,
    seed: int = 0,
    words: Sequence[str] | None = None,
    d_model: int = 16,
    layers: int = 1,
    generation: dict | None = None,
) -> Path:
    """Save a tiny random ``BartForConditionalGeneration`` + tokenizer (facebook/bart-large layout).

    words: build a whitespace word-level vocabulary of these words (plus BART's five specials)
    instead of the default ~300-token byte-level BPE. generation: extra generation-config fields
    (e.g. ``{"forced_bos_token_id": 0}``) saved in ``generation_config.json``.
    """
    from transformers import BartForConditionalGeneration, GenerationConfig

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(words) if words is not None else _bpe_bart_tokenizer()
    config = small_bart_config(len(tokenizer), d_model=d_model, layers=layers)
    if generation and "forced_eos_token_id" in generation:
        config.forced_eos_token_id = generation["forced_eos_token_id"]
    torch.manual_seed(seed)
    model = BartForConditionalGeneration(config)
    _scale_init(model, 0.5, seed)
    with torch.no_grad():
        # real BART never emits padding; keep the random model from doing so either
        model.final_logits_bias[0, config.pad_token_id] = -30.0
    model.generation_config = GenerationConfig(
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=1,
        decoder_start_token_id=2,
        **(generation or {}),
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_tiny_rag_checkpoint(
    directory: str | Path, *, seed: int = 0, n_docs: int = 5, cls: str = "token"
) -> Path:
    """Save a tiny ``RagTokenForGeneration`` (or ``cls="sequence"``) checkpoint + ``RagTokenizer``.

    The generator is :func:`make_tiny_bart`'s model; the question encoder a tiny random DPR encoder.
    """
    import tempfile

    from transformers import (
        BartForConditionalGeneration,
        BertTokenizer,
        DPRConfig,
        DPRQuestionEncoder,
        RagConfig,
        RagSequenceForGeneration,
        RagTokenForGeneration,
        RagTokenizer,
    )

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        bart_dir = make_tiny_bart(Path(tmp) / "bart", seed=seed)
        generator = BartForConditionalGeneration.from_pretrained(bart_dir)
        from transformers import AutoTokenizer

        gen_tok = AutoTokenizer.from_pretrained(bart_dir)
        words = sorted({w.strip(".,?/").lower() for line in CORPUS for w in line.split()} - {""})
        vocab_file = Path(tmp) / "vocab.txt"
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        vocab_file.write_text("\n".join([*specials, *words, ".", ",", "?", "/"]))
        # an uncased vocabulary, as DPR's: the generator reads the question lower-cased
        # (positional: transformers 5 names the argument ``vocab``, 4.x ``vocab_file``)
        q_tok = BertTokenizer(str(vocab_file), do_lower_case=True, model_max_length=512)
        q_cfg = DPRConfig(
            vocab_size=len(q_tok),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
        torch.manual_seed(seed)
        question_encoder = DPRQuestionEncoder(q_cfg)
        g = generator.config
        rag_cfg = RagConfig.from_question_encoder_generator_configs(
            q_cfg,
            g,
            n_docs=n_docs,
            bos_token_id=g.bos_token_id,
            eos_token_id=g.eos_token_id,
            pad_token_id=g.pad_token_id,
            decoder_start_token_id=g.decoder_start_token_id,
            vocab_size=g.vocab_size,
        )
        model_cls = RagTokenForGeneration if cls == "token" else RagSequenceForGeneration
        model = model_cls(rag_cfg, question_encoder=question_encoder, generator=generator)
        model.save_pretrained(out)
        RagTokenizer(question_encoder=q_tok, generator=gen_tok).save_pretrained(out)
    return out


PROMPT = {
    "prefix": "Answer the question from the passage.\nTitle: Paris\nPassage: Paris is the capital "
    "of France.\nQuestion: What is the capital of France?\nAnswer: Paris\n\n",
    "passage_template": "Title: {title}\nPassage: {text}\nQuestion: {question}\nAnswer:",
    "stop": ["\n"],
    "answer_prefix": " ",
}


def make_tiny_causal_lm(
    directory: str | Path,
    *,
    seed: int = 0,
    arch: str = "gemma3",
    prompt: dict | None = None,
    sliding_window: int = 24,
) -> Path:
    """Save a tiny random causal LM (``arch`` "gemma3" or "llama") in safetensors, a byte-level BPE
    tokenizer (pad 0, eos 1, bos 2 as in Gemma) and an ``openbook_prompt.json``. Gemma's
    ``sliding_window`` is kept shorter than the prompts so sliding-window attention is exercised.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab, merges = _train_byte_bpe(300, specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(seed)
    if arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        layer_types = ["sliding_attention", "full_attention"]
        config = Gemma3TextConfig(**common, sliding_window=sliding_window, layer_types=layer_types)
        model = Gemma3ForCausalLM(config)
    elif arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(f"arch must be 'gemma3' or 'llama', got {arch!r}")
    _scale_init(model, 0.5, seed)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "openbook_prompt.json").write_text(json.dumps(prompt or PROMPT, indent=1))
    return out


def make_tiny_adapter(base: Path, out: Path, seed: int = 0) -> Path:
    """A LoRA adapter of the model at ``base`` (rank 2) with random non-zero updates, so that it
    changes answers, saved at ``out`` as training saves one (openbook/rag/adapters.py)."""
    from openbook.rag import RagGenerator
    from openbook.rag.adapters import LoraSpec, attach_lora, base_identity, save_adapter

    generator = RagGenerator.load(base, dtype="float32")
    peft_model = attach_lora(generator.model, LoraSpec(rank=2, alpha=4.0))
    randomize_lora(generator.model, seed)
    save_adapter(peft_model, out, base_identity(base), str(base))
    return Path(out)


def randomize_lora(model: torch.nn.Module, seed: int) -> None:
    """Give LoRA's B matrices (zero at the start) random values."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
