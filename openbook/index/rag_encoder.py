"""The question encoder half of a RAG checkpoint directory.

A directory written by ``RagTokenForGeneration`` / ``RagSequenceForGeneration.save_pretrained``
plus ``RagTokenizer.save_pretrained`` (the facebook/rag-token-nq layout) holds:

* ``config.json`` with ``model_type: rag`` and ``question_encoder`` / ``generator`` sub-configs,
* the weights of both halves in one file (``model.safetensors``, ``pytorch_model.bin`` or a
  sharded ``*.index.json``); the question encoder's tensors under ``rag.question_encoder.``,
* ``question_encoder_tokenizer/`` and ``generator_tokenizer/``.

The generator library (:mod:`openbook.rag.loading`) reads the generator half; this module reads
the question encoder half, so one directory serves both the retriever and the generator.
Only DPR question encoders are supported: RAG scores passages with the question encoder's first
output, which is the pooled vector only for DPR.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from openbook.errors import InvalidArgument

if TYPE_CHECKING:  # transformers is imported when the encoder loads
    from transformers import DPRQuestionEncoder

RAG_QUESTION_ENCODER_PREFIX = "rag.question_encoder."
QUESTION_TOKENIZER_DIR = "question_encoder_tokenizer"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model")


def _weight_shards(root: Path) -> list[Path]:
    for name in WEIGHT_FILES:
        weights = root / name
        if not weights.exists():
            continue
        if not name.endswith(".index.json"):
            return [weights]
        try:
            index = json.loads(weights.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"corrupt file {weights}: {e}") from None
        shards = sorted(
            {
                root / f
                for key, f in index.get("weight_map", {}).items()
                if key.startswith(RAG_QUESTION_ENCODER_PREFIX)
            }
        )
        for shard in shards:
            if not shard.exists():
                raise InvalidArgument(f"missing weights shard {shard} (listed in {weights})")
        return shards
    raise InvalidArgument(
        f"missing weights in RAG directory {root}: expected one of {', '.join(WEIGHT_FILES)}"
    )


def _question_encoder_state(root: Path) -> dict[str, torch.Tensor]:
    """The ``rag.question_encoder.*`` tensors, prefix stripped (reads only those tensors from a
    safetensors file; the generator's weights are not materialised)."""
    state: dict[str, torch.Tensor] = {}
    n = len(RAG_QUESTION_ENCODER_PREFIX)
    for shard in _weight_shards(root):
        try:
            if shard.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(shard), framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        if key.startswith(RAG_QUESTION_ENCODER_PREFIX):
                            state[key[n:]] = f.get_tensor(key)
            else:
                full = torch.load(str(shard), map_location="cpu", weights_only=True, mmap=True)
                for key, value in full.items():
                    if key.startswith(RAG_QUESTION_ENCODER_PREFIX):
                        state[key[n:]] = value.clone()
                del full
        except Exception as e:  # noqa: BLE001 - any decoding failure means the file is unusable
            raise InvalidArgument(f"corrupt weights file {shard}: {e}") from None
    if not state:
        raise InvalidArgument(
            f"missing question encoder weights in {root}: no '{RAG_QUESTION_ENCODER_PREFIX}*' "
            f"tensors in {', '.join(s.name for s in _weight_shards(root))}"
        )
    return state


def load_rag_question_encoder(root: Path, config: dict[str, Any]) -> tuple[DPRQuestionEncoder, Any]:
    """``(DPRQuestionEncoder, question-encoder tokenizer)`` of RAG directory ``root``.

    Raises ``ValueError`` naming the missing/corrupt file or folder.
    """
    from transformers import AutoTokenizer, DPRConfig, DPRQuestionEncoder

    root = Path(root)
    q_cfg = config.get("question_encoder")
    if not isinstance(q_cfg, dict) or "model_type" not in q_cfg:
        raise InvalidArgument(
            f"corrupt file {root / 'config.json'}: RAG config without a question_encoder"
        )
    if q_cfg["model_type"] != "dpr":
        raise InvalidArgument(
            f"{root / 'config.json'}: question encoder type {q_cfg['model_type']!r} is not "
            f"supported (only 'dpr')"
        )
    tok_dir = root / QUESTION_TOKENIZER_DIR
    if not tok_dir.is_dir():
        raise InvalidArgument(f"missing tokenizer directory {tok_dir} in RAG directory {root}")
    if not any((tok_dir / f).exists() for f in TOKENIZER_FILES):
        raise InvalidArgument(
            f"missing tokenizer files in {tok_dir}: expected one of {', '.join(TOKENIZER_FILES)}"
        )
    state = _question_encoder_state(root)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise InvalidArgument(f"cannot load tokenizer from {tok_dir}: {e}") from None
    fields = {k: v for k, v in q_cfg.items() if k not in ("model_type", "transformers_version")}
    try:
        model = DPRQuestionEncoder(DPRConfig(**fields))
    except Exception as e:  # noqa: BLE001
        raise InvalidArgument(
            f"corrupt file {root / 'config.json'}: bad question_encoder: {e}"
        ) from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    unexpected = [k for k in unexpected if not k.endswith("position_ids")]
    if missing or unexpected:
        raise InvalidArgument(
            f"corrupt weights in {root}: question encoder tensors do not match its config "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.eval()
    return model, tokenizer
