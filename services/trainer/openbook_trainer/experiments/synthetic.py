"""A synthetic task where exactly one passage makes each target likely.

Entity ``e<i>`` has a code word ``c<i>`` that appears in one passage only::

    passage p<i>:  title "e<i>", text "the code of e<i> is c<i> ."
    question:      "what is the code of e<i> ?"        target: "c<i>"

Nothing tells the retriever which passage is the right one except the answer, so p(z|x) for
the gold passage can only rise through the RAG marginal likelihood. Models are tiny and random
(word-level vocabularies, so every word is one token); building everything takes ~1 s on CPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from openbook.index import BuildOptions, IndexSpec, build_index

_SPECIAL_BERT = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_FILLER = ["the", "code", "of", "is", "what", "?", "."]


@dataclass
class SyntheticTask:
    root: Path
    passages: Path
    train: Path
    dev: Path
    index: Path
    query_encoder: Path
    generator: Path
    n_entities: int


def passage_row(i: int) -> dict[str, str]:
    return {"id": f"p{i}", "title": f"e{i}", "text": f"the code of e{i} is c{i} ."}


def example_row(i: int) -> dict[str, object]:
    return {
        "id": f"q{i}",
        "question": f"what is the code of e{i} ?",
        "answers": [f"c{i}"],
        "gold_ids": [f"p{i}"],
    }


def words(n: int) -> list[str]:
    return _FILLER + [f"e{i}" for i in range(n)] + [f"c{i}" for i in range(n)]


def make_task(
    root: Path,
    *,
    n_entities: int = 24,
    dev_entities: list[int] | None = None,
    hidden_size: int = 32,
    bart_d_model: int = 32,
    bart_layers: int = 1,
    seed: int = 0,
    generator_words: int | None = None,
    dropout: float = 0.0,
) -> SyntheticTask:
    """Write passages, train/dev JSONL, tiny DPR encoders, a flat index and a tiny BART.

    The training set asks about every entity (the retriever has to learn *which* passage holds
    each answer, from the answers alone); ``dev_entities`` (default: all) are evaluated.
    ``generator_words`` sizes the generator's vocabulary (>= n_entities) so a generator built
    for a larger task can be reused. ``dropout`` is the DPR encoders' dropout (the index is
    encoded in eval mode; it matters for the query encoder in training).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    passages = write_jsonl(root / "passages.jsonl", (passage_row(i) for i in range(n_entities)))
    train = write_jsonl(root / "train.jsonl", (example_row(i) for i in range(n_entities)))
    dev_ids = range(n_entities) if dev_entities is None else dev_entities
    dev = write_jsonl(root / "dev.jsonl", (example_row(i) for i in dev_ids))

    vocab = words(max(n_entities, generator_words or 0))
    ctx_dir, q_dir = make_dpr_pair(
        root / "dpr", vocab, hidden_size=hidden_size, seed=seed, dropout=dropout
    )
    index = root / "index"
    if not (index / "manifest.json").is_file():
        build_index(
            [passages],
            index,
            IndexSpec(
                name="synthetic",
                encoder=str(ctx_dir),
                query_encoder=str(q_dir),
                # Dense only: the task is for the retriever to learn which passage holds each
                # answer from the answers alone, which a lexical view of the passages would
                # short-cut. (Hybrid training is tested on an index over the same passages.)
                bm25=False,
            ),
            BuildOptions(progress=False),
        )
    generator = root / "bart"
    if not (generator / "config.json").is_file():
        make_word_bart(generator, vocab, d_model=bart_d_model, layers=bart_layers, seed=seed)
    return SyntheticTask(root, passages, train, dev, index, q_dir, generator, n_entities)


def make_dpr_pair(
    out: Path, vocab: list[str], *, hidden_size: int, seed: int, dropout: float = 0.0
) -> tuple[Path, Path]:
    """Random tiny DPR context and question encoders sharing a word-level BERT vocabulary.

    Independent random initialisations: before training, q(x)·d(z) carries no information
    about which passage answers x.
    """
    from transformers import BertTokenizer, DPRConfig, DPRContextEncoder, DPRQuestionEncoder

    out = Path(out)
    cfg = DPRConfig(
        vocab_size=len(_SPECIAL_BERT) + len(vocab),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=64,
        # With BERT's usual 0.02 the random CLS vectors of all passages have cosine ~0.99999
        # and no retriever could tell them apart; 0.5 gives ~0.75, like a real encoder's spread.
        initializer_range=0.5,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    dirs = []
    for offset, (cls, sub) in enumerate(
        ((DPRContextEncoder, "ctx_encoder"), (DPRQuestionEncoder, "question_encoder"))
    ):
        d = out / sub
        dirs.append(d)
        if (d / "config.json").is_file():
            continue
        d.mkdir(parents=True, exist_ok=True)
        (d / "vocab.txt").write_text("\n".join(_SPECIAL_BERT + vocab) + "\n", encoding="utf-8")
        tok = BertTokenizer(str(d / "vocab.txt"), do_lower_case=True, model_max_length=64)
        torch.manual_seed(seed * 100 + offset)
        model = cls(cfg).eval()
        model.save_pretrained(d)
        tok.save_pretrained(d)
    return dirs[0], dirs[1]


BART_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # BART's ids 0..4


def word_tokenizer(vocab: Sequence[str]):
    """A BART-compatible fast tokenizer over whole words (BART's five specials, then
    ``vocab``): every word is one token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    ids = {token: i for i, token in enumerate(BART_SPECIALS)}
    for word in vocab:
        ids.setdefault(word, len(ids))
    word_level = Tokenizer(models.WordLevel(vocab=ids, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word_level.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=word_level,
        bos_token="<s>",
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        mask_token="<mask>",
    )


def small_bart_config(vocab_size: int, *, d_model: int, layers: int):
    """A BART configuration of the given width and depth, BART's special-token ids, no
    dropout, and no forced EOS (so config.json and generation_config.json agree: BartConfig
    defaults ``forced_eos_token_id=2``)."""
    from transformers import BartConfig

    config = BartConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model,
        max_position_embeddings=512,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    config.forced_eos_token_id = None
    return config


def make_word_bart(out: Path, vocab: list[str], *, d_model: int, layers: int, seed: int) -> Path:
    """A small BART, initialised as transformers does, over a whitespace word vocabulary.

    Whole-word tokens keep the task's answers single tokens, so what the experiment measures is
    whether the retriever learns which passage holds an answer, not the generator's spelling.
    """
    from transformers import BartForConditionalGeneration, GenerationConfig

    tokenizer = word_tokenizer(vocab)
    torch.manual_seed(seed)
    model = BartForConditionalGeneration(
        small_bart_config(len(tokenizer), d_model=d_model, layers=layers)
    )
    model.generation_config = GenerationConfig(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, decoder_start_token_id=2
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [
        json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line
    ]
