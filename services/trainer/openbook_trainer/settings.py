"""The jobs' settings (demo preparation, experiments): ``OPENBOOK_TRAINER_*``, plus the
deployment's shared paths. Training itself is configured by its YAML file and flags
(:mod:`openbook_trainer.config`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import field_validator
from pydantic_settings import SettingsConfigDict

from openbook.config.settings import CommonSettings, shared

PREPARE_PARTS = ("indexes", "models")


class TrainerSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="OPENBOOK_TRAINER_")

    index_root: Path = shared(Path("var/indexes"), "OPENBOOK_INDEX_ROOT")
    models_dir: Path = shared(Path("var/models"), "OPENBOOK_MODELS_DIR")
    # The demo data; None: the repository's data/ (a checkout or an editable install), else ./data.
    data_dir: Path | None = shared(None, "OPENBOOK_DATA_DIR")
    # What `demo prepare` (the init step) prepares: "indexes,models", "indexes", "models" or
    # "none".
    prepare: str = "indexes,models"
    # Which demo indexes `demo prepare` builds: comma-separated names, "" for all of them. The
    # init step builds the one the retriever serves first (the stack answers as soon as it and
    # the model are ready); init-more builds the rest while the stack serves. A name that is
    # no demo index (a deployment serving its own) prepares nothing.
    prepare_indexes: str = ""
    # torch/OpenMP threads of training (openbook/runtime/compute_threads.py). 0: sized to the CPU
    # the process gets, shared by torchrun's processes on the node; an explicit OMP_NUM_THREADS
    # also fixes it (torchrun sets OMP_NUM_THREADS=1 itself when it starts several processes
    # and the environment has none).
    compute_threads: int = shared(0, "OPENBOOK_COMPUTE_THREADS", ge=0)

    @field_validator("prepare")
    @classmethod
    def _known_parts(cls, value: str) -> str:
        parts = {p.strip() for p in value.split(",")} - {"", "none"}
        unknown = parts - set(PREPARE_PARTS)
        if unknown:
            raise ValueError(
                f"unknown part(s) {', '.join(sorted(unknown))}; use indexes, models or none"
            )
        return value

    def prepares(self, part: str) -> bool:
        return part in {p.strip() for p in self.prepare.split(",")}

    def index_names(self) -> list[str] | None:
        """The demo indexes to prepare (``prepare_indexes``): None for all."""
        names = [n.strip() for n in self.prepare_indexes.split(",") if n.strip()]
        return names or None
