"""The choices of the trainer's options, written once: :class:`~openbook_trainer.config.TrainConfig`
validates them, and ``openbook train`` and ``openbook eval`` offer them (typer reads a
``Literal`` as a choice). Nothing heavy is imported here: ``openbook --help`` imports every
command.
"""

from __future__ import annotations

from typing import Literal

Mode = Literal["rag-sequence", "rag-token"]
Retrieval = Literal["dense", "hybrid"]
Task = Literal["qa", "generation", "classification"]
Adapter = Literal["none", "lora"]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
# how ``openbook eval`` decodes, and what it fits a confidence calibration on
Decoding = Literal["rag-token", "rag-sequence-fast", "rag-sequence-thorough"]
CalibrationKind = Literal["logistic", "piecewise-linear"]
