"""LoRA adapters (Hu et al. 2021) of a generator or a query encoder, through ``peft``: attach
for training, save only what changed, load onto the base model they were trained from.

An adapter directory is ``peft``'s own format (``adapter_config.json`` +
``adapter_model.safetensors``, loadable by ``peft.PeftModel.from_pretrained`` anywhere), plus
``openbook_adapter.json``: the identity of its base model. The identity is a sha256 over the
base's ``config.json`` and weight files, so an adapter is never applied to another model, nor to
the same architecture with other weights (a fine-tuned variant): :class:`AdapterMismatch` says
which base it needs.

Serving merges the adapter into the base weights once, at load (W + B·A·alpha/r): decoding then
costs exactly what the base model costs. Training keeps the LoRA layers separate: the base
weights are frozen, only A and B learn. A query encoder's adapter is loaded through
:func:`openbook.index.load_encoder` (an adapter directory names its base encoder), so the
retriever serves it like any encoder.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from openbook.errors import InvalidArgument
from openbook.rag.errors import ModelLoadError

ADAPTER_FILE = "openbook_adapter.json"
PEFT_CONFIG = "adapter_config.json"
# Files whose bytes make a base model what it is (config and weights; never the tokenizer).
_IDENTITY_SUFFIXES = (".safetensors", ".bin")
_IDENTITY_FILES = ("config.json",)
MAX_RANK = 256
MAX_ALPHA = 4096.0


class AdapterMismatch(ModelLoadError):
    """An adapter trained on another base model than the one it is applied to."""


@dataclass(frozen=True)
class LoraSpec:
    """What a LoRA adapter adapts: rank r, scale alpha (updates are scaled by alpha / r),
    dropout on the adapter's input, and the modules it wraps (None: every linear layer but the
    output projection, peft's "all-linear")."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:
            raise InvalidArgument(f"lora rank must be in [1, {MAX_RANK}], got {self.rank}")
        if not 0 < self.alpha <= MAX_ALPHA:
            raise InvalidArgument(f"lora alpha must be in (0, {MAX_ALPHA:g}], got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise InvalidArgument(f"lora dropout must be in [0, 1), got {self.dropout}")
        if self.targets is not None and not self.targets:
            raise InvalidArgument("lora targets: name at least one module, or leave it unset")

    def peft_config(self, model: Any) -> Any:
        from peft import LoraConfig, TaskType

        if getattr(model.config, "is_encoder_decoder", False):
            task = TaskType.SEQ_2_SEQ_LM
        elif model.get_output_embeddings() is not None:
            task = TaskType.CAUSAL_LM
        else:  # an encoder without an LM head: a query encoder
            task = TaskType.FEATURE_EXTRACTION
        return LoraConfig(
            r=self.rank,
            # peft annotates lora_alpha as int but only divides by it: a float scale is exact
            lora_alpha=cast(int, self.alpha),
            lora_dropout=self.dropout,
            target_modules=list(self.targets) if self.targets else "all-linear",
            task_type=task,
        )


def base_identity(model_dir: Path) -> str:
    """sha256 over the base model's config and weight files (names and bytes)."""
    model_dir = Path(model_dir)
    files = sorted(
        p
        for p in model_dir.iterdir()
        if p.is_file() and (p.name in _IDENTITY_FILES or p.name.endswith(_IDENTITY_SUFFIXES))
    )
    if not any(p.name.endswith(_IDENTITY_SUFFIXES) for p in files):
        raise ModelLoadError(f"{model_dir}: no weights file to identify the base model by")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def attach_lora(model: Any, spec: LoraSpec) -> Any:
    """Wrap ``model``'s linear layers with trainable LoRA layers, in place (the model object
    stays the one its backend holds); freezes every base weight. Returns the ``PeftModel``
    that saves the adapter."""
    from peft import get_peft_model

    with _peft_quietly():
        return get_peft_model(model, spec.peft_config(model))


def save_adapter(peft_model: Any, out: Path, base_id: str, base_name: str) -> None:
    """The adapter only (a few MB), in peft's format, with its base model's identity."""
    out = Path(out)
    peft_model.save_pretrained(out, safe_serialization=True)
    meta = {"base_identity": base_id, "base_model": base_name}
    (out / ADAPTER_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def adapter_base(adapter_dir: Path) -> dict[str, str]:
    """``openbook_adapter.json``: the identity (and name) of the base the adapter needs."""
    path = Path(adapter_dir) / ADAPTER_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{adapter_dir}: {ADAPTER_FILE} unreadable ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("base_identity"), str):
        raise ModelLoadError(f"{adapter_dir}: {ADAPTER_FILE} names no base_identity")
    return meta


def check_base(adapter_dir: Path, base_dir: Path) -> None:
    """Raise :class:`AdapterMismatch` unless ``base_dir`` is the model the adapter was trained
    on."""
    meta = adapter_base(adapter_dir)
    found = base_identity(base_dir)
    if found != meta["base_identity"]:
        raise AdapterMismatch(
            f"adapter {adapter_dir} was trained on base model {meta.get('base_model', '?')!r} "
            f"(identity {meta['base_identity'][:12]}), not on {str(base_dir)!r} (identity "
            f"{found[:12]}): load it onto the model it was trained from"
        )


def load_trainable(model: Any, adapter_dir: Path) -> Any:
    """``model`` with the adapter's LoRA layers attached, unmerged and trainable (to resume
    training). Returns the ``PeftModel``."""
    from peft import PeftModel

    with _peft_quietly():
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)


def merged(model: Any, adapter_dir: Path) -> Any:
    """``model`` with the adapter merged into its weights and the LoRA layers removed: the same
    architecture, as fast as the base."""
    from peft import PeftModel

    with _peft_quietly():
        return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


@contextmanager
def _peft_quietly() -> Iterator[None]:
    """peft reads transformers' deprecated ``is_gradient_checkpointing`` whenever it wraps a
    model, and transformers warns about it on every service's start: a FutureWarning about
    peft's code, which nothing here can act on, in the first lines a user reads."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield
