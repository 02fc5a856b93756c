"""Training runs killed and resumed: the shared steps of the trainer's resume tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class Boom(Exception):
    """What :func:`crash_at`'s step hook raises: a run killed mid-training."""


def crash_at(cfg, step: int) -> None:
    """Train ``cfg`` (an ``openbook_trainer.config.TrainConfig``) and kill the run when it
    reaches ``step``; the checkpoints saved before stay on disk."""
    import pytest

    from openbook_trainer.loop import train

    def hook(at: int, loss: float) -> None:
        if at == step:
            raise Boom

    with pytest.raises(Boom):
        train(cfg, on_step=hook)


def assert_same_tensors(a: Path, b: Path, parts: Sequence[str]) -> None:
    """Every safetensors file ``parts`` (relative paths) holds the same tensors, bit for bit,
    under checkpoint directories ``a`` and ``b``."""
    import torch
    from safetensors.torch import load_file

    for part in parts:
        x, y = load_file(a / part), load_file(b / part)
        assert x.keys() == y.keys(), part
        assert all(torch.equal(x[k], y[k]) for k in x), part
