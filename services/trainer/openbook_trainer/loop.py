"""The RAG fine-tuning loop (Lewis et al. 2020, §2.4).

Per micro-batch of B (input x, target y) pairs:

    q = E_q(x)                                    (B, d)      trainable query encoder
    z_1..z_k = MIPS(q, index)                                 fixed index, current q
    D = stored vectors of z                       (B, k, d)   frozen document encoder
    doc_scores = c · D @ q                        (B, k)      p(z|x) = softmax_k(doc_scores)
    logits = G(x, z, y)                           (B*k, T, V) teacher-forced generator
    loss = mean_B  -log p(y|x)                    RAG-Sequence or RAG-Token marginal NLL

c is the index's score_scale (1 for DPR-style inner products, 20 for cosine encoders).
The NLL reaches the query encoder only through p(z|x): passages under which the generator finds
y likely gain prior mass. No retrieval supervision is used.

Under ``torchrun`` the same loop is data parallel (openbook_trainer/distributed.py): every rank
takes its part of each global micro-batch, retrieves for it from its own copy of the index, and
DDP averages the gradients; rank 0 alone logs and writes checkpoints. Training results do not
depend on the number of processes, up to float rounding.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from tqdm.auto import tqdm

from openbook.index import Encoder, LoadedIndex, load_encoder, open_index
from openbook.index.checkpoint import load_query_encoder
from openbook.index.encoders import encoder_id, encoder_weights_dir
from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag.adapters import (
    adapter_base,
    attach_lora,
    base_identity,
    check_base,
    load_trainable,
)
from openbook.rag.checkpoint import TrainedAdapter, load_generator
from openbook.rag.loading import cpu_has_native_bf16
from openbook.runtime.compute_threads import ComputeThreads, ComputeThreadsOptions
from openbook.storage.artifacts import clean_stale_partials, sha256_file
from openbook.storage.checkpoint import (
    CheckpointError,
    generator_adapter_dir,
    latest_checkpoint,
    query_encoder_adapter_dir,
    read_manifest,
    trainer_state_path,
    verify_checkpoint,
)
from openbook_trainer.checkpoints import load_trainer_state, write_checkpoint
from openbook_trainer.config import ConfigError, TrainConfig
from openbook_trainer.data import (
    TrainPair,
    batch_at,
    batches_per_epoch,
    read_examples,
    training_pairs,
)
from openbook_trainer.distributed import World, rank_device, world_from_env
from openbook_trainer.evaluation.runner import predict_local, score_predictions
from openbook_trainer.retrieval import make_retrieval
from openbook_trainer.settings import TrainerSettings

log = logging.getLogger("openbook.trainer")
TRAIN_LOG = "train_log.jsonl"

StepHook = Callable[[int, float], None]


@dataclass
class TrainResult:
    step: int
    loss: float  # mean training loss of the last optimizer step
    metrics: dict[str, float] = field(default_factory=dict)  # last dev metrics
    checkpoint: Path | None = None


def train(
    cfg: TrainConfig, *, on_step: StepHook | None = None, compute: ComputeThreads | None = None
) -> TrainResult:
    """Train to ``cfg.steps`` (or ``cfg.epochs``), resuming from ``cfg.out/latest`` if allowed.

    ``on_step(step, loss)`` runs after every optimizer step, before evaluation and saving.
    ``compute`` (the CLI's :func:`training_threads`) sizes the torch threads of this thread,
    which runs every step, at start and between steps; None leaves the caller's setting.
    """
    world = world_from_env(cfg.device, cfg.dist_timeout)
    previous = torch.get_num_threads()
    try:
        if compute is not None:
            compute.apply()
        trainer = Trainer(cfg, world)
        trainer.compute = compute
        try:
            result = trainer.run(on_step)
            # Every rank is done before any tears its process group down: a rank that leaves
            # while another still evaluates or saves closes gloo's connections under it.
            world.barrier()
            return result
        finally:
            trainer.index.close()
            # DDP's reducer and ZeRO's optimizer hold the process group; dropped here so that
            # world.close() destroys it now, not at interpreter exit, where a gloo thread still
            # joinable aborts the process ("terminate called without an active exception").
            del trainer
            gc.collect()
    finally:
        if compute is not None:
            torch.set_num_threads(previous)
        world.close()


def training_threads() -> ComputeThreads:
    """The training process's compute threads: OPENBOOK_COMPUTE_THREADS (or OMP_NUM_THREADS),
    else the CPU budget divided among torchrun's processes on this node (LOCAL_WORLD_SIZE),
    re-read between steps. An automatic size may change during a run (a neighbour took a
    core), and with it the order of some floating-point sums: a run that must resume
    bit-identically fixes the size with the setting."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    setting = TrainerSettings().compute_threads
    return ComputeThreads(ComputeThreadsOptions(setting=setting, share=local))


class Trainer:
    # sized by train() on the thread that runs the steps; None: torch's default, untouched
    compute: ComputeThreads | None = None

    def __init__(self, cfg: TrainConfig, world: World | None = None) -> None:
        self.cfg = cfg
        self.world = world or World()
        _seed_everything(cfg.seed)
        self.device = _pick_device(rank_device(self.world, cfg.device))
        self.amp_dtype = _pick_amp_dtype(cfg.precision, self.device)

        self.index = _open_dense_index(cfg)
        try:
            self._setup()
        except BaseException:
            self.index.close()
            raise

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        cfg = self.cfg
        examples = read_examples(cfg.train)
        self.pairs = training_pairs(examples, cfg.answers)
        self.dev = read_examples(cfg.dev, limit=cfg.eval_max_examples) if cfg.dev else []
        self.data_sha256 = sha256_file(cfg.train)
        per_epoch = batches_per_epoch(len(self.pairs), cfg.batch_size)
        if cfg.steps is not None:
            self.total_steps = cfg.steps
        else:
            assert cfg.epochs is not None
            self.total_steps = max(1, math.ceil(cfg.epochs * per_epoch / cfg.grad_accum))

        world = self.world
        # Ranks that trained on different files or indexes would average meaningless gradients.
        world.agree("the training data (sha256)", self.data_sha256)
        world.agree("the index (checksum)", self.index.manifest.checksum)
        # Rank 0 alone looks at the checkpoint root (and clears what killed writers left); the
        # others start from what it found, or fail with the same error.
        resume_from = world.from_main(self._resume_point)
        self.base_generator = str(Path(cfg.generator).resolve())
        base_q = (
            cfg.query_encoder or self.index.manifest.query_encoder or self.index.manifest.encoder
        )
        assert base_q is not None
        self.base_query_encoder: str | None = encoder_id(base_q)
        # float32 master weights; autocast provides the reduced precision on CUDA.
        dev = str(self.device)
        lora, q_lora = cfg.lora, cfg.query_encoder_lora
        self.peft_model = None  # the LoRA-wrapped generator when only an adapter trains
        self.base_id = ""
        self.q_peft_model = None  # the same for the query encoder
        self.q_base_id = ""
        encoder = None
        if resume_from is not None:
            m = read_manifest(resume_from)
            self.base_generator, self.base_query_encoder = m.base_generator, m.base_query_encoder
            adapter = generator_adapter_dir(resume_from)
            _same_adapter_use(resume_from, "generator", adapter, lora)
            if adapter is None:
                # _resume_point verified the checkpoint
                self.generator = load_generator(
                    resume_from, device=dev, dtype="float32", verify=False
                )
            else:
                self.generator = RagGenerator.load(Path(cfg.generator), device=dev, dtype="float32")
                check_base(adapter, Path(cfg.generator))
                self.base_id = adapter_base(adapter)["base_identity"]
                self.peft_model = load_trainable(self.generator.model, adapter)
            q_adapter = query_encoder_adapter_dir(resume_from)
            _same_adapter_use(resume_from, "query encoder", q_adapter, q_lora)
            if q_adapter is None:
                encoder = load_query_encoder(resume_from, device=dev, verify=False)
            else:
                q_base = self.base_query_encoder
                assert q_base is not None  # save_query_encoder records an adapter's base
                encoder = _load_query_encoder(q_base, self.device)
                check_base(q_adapter, encoder_weights_dir(q_base))
                self.q_base_id = adapter_base(q_adapter)["base_identity"]
                self.q_peft_model = load_trainable(encoder.model, q_adapter)
        else:
            self.generator = RagGenerator.load(Path(cfg.generator), device=dev, dtype="float32")
            if lora is not None:
                self.base_id = base_identity(Path(cfg.generator))
                self.peft_model = attach_lora(self.generator.model, lora)
        self.encoder = encoder or _load_query_encoder(base_q, self.device)
        if resume_from is None and q_lora is not None:
            try:
                self.q_base_id = base_identity(encoder_weights_dir(base_q))
            except ValueError as e:
                raise ConfigError(
                    f"query-encoder-adapter lora: the base query encoder {base_q!r} must be a "
                    f"model directory (or the MiniLM alias): {e}"
                ) from None
            self.q_peft_model = attach_lora(self.encoder.model, q_lora)
        try:
            self.retrieval = make_retrieval(self.index, self.encoder, cfg.k, cfg.retrieval)
        except ValueError as e:  # "retrieval: ..." naming the index and its views
            raise ConfigError(str(e)) from None
        self.trained = [
            name
            for name, on in (
                ("query_encoder", cfg.train_query_encoder),
                ("generator", cfg.train_generator),
            )
            if on
        ]
        self._set_trainable()
        self.ddp = self._data_parallel()

        self.optimizer = self._make_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.scaler = torch.amp.GradScaler(
            self.device.type, enabled=self.amp_dtype == torch.float16
        )
        self.step = 0
        self.cursor = 0  # micro-batches consumed since the start of the run
        self.metrics: dict[str, float] = {}
        if resume_from is not None:
            self._restore(resume_from)
        elif world.distributed:
            # Dropout masks must differ between ranks (the models are already identical:
            # DDP broadcast rank 0's weights). Restored runs restore each rank's own state.
            _seed_everything(cfg.seed + world.rank)

    def _resume_point(self) -> Path | None:
        cfg = self.cfg
        # A run killed mid-save left its partial .tmp- directory behind: clear those before
        # resuming or saving, but never a live writer's (another trainer may share this root).
        clean_stale_partials(cfg.out)
        if not cfg.resume:
            return None
        ckpt = latest_checkpoint(cfg.out)
        if ckpt is None:
            return None
        manifest = verify_checkpoint(ckpt)
        if manifest.data_sha256 != self.data_sha256:
            raise ConfigError(
                f"{ckpt} was trained on different data (sha256 {manifest.data_sha256[:12]} != "
                f"{self.data_sha256[:12]} of {cfg.train}); use --no-resume or another --out"
            )
        if manifest.index.get("checksum") != self.index.manifest.checksum:
            raise ConfigError(
                f"{ckpt} was trained against index {manifest.index.get('name')!r}, not this "
                f"{self.index.name!r}; use --no-resume or another --out"
            )
        if trainer_state_path(ckpt) is None:
            raise CheckpointError(f"{ckpt} has no trainer state to resume from")
        return ckpt

    def _set_trainable(self) -> None:
        cfg = self.cfg
        if self.q_peft_model is None:  # as below: peft froze the base and not the adapter
            self.encoder.model.requires_grad_(cfg.train_query_encoder)
        if self.peft_model is None:  # with an adapter, peft froze the base and not the adapter
            self.generator.model.requires_grad_(cfg.train_generator)
        self._train_mode()

    def _train_mode(self) -> None:
        # Frozen parts stay in eval mode: no dropout noise in what they contribute.
        self.encoder.model.train(self.cfg.train_query_encoder)
        self.generator.model.train(self.cfg.train_generator)

    def _param_groups(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        groups = []
        if cfg.train_query_encoder:
            params = [p for p in self.encoder.model.parameters() if p.requires_grad]
            groups.append({"params": params, "lr": cfg.lr_query_encoder, "name": "query_encoder"})
        if cfg.train_generator:
            params = [p for p in self.generator.model.parameters() if p.requires_grad]
            groups.append({"params": params, "lr": cfg.lr_generator, "name": "generator"})
        return groups

    def _data_parallel(self) -> torch.nn.parallel.DistributedDataParallel | None:
        """DDP over both models (only what requires grad is synchronised), or None alone."""
        if not self.world.distributed:
            return None
        on_cuda = self.device.type == "cuda"
        return torch.nn.parallel.DistributedDataParallel(
            _RagLoss(self),
            device_ids=[self.device] if on_cuda else None,
            # Parameters the objective never reaches (a BERT pooler behind mean pooling) must
            # not stall the gradient reduction. (static_graph=True, which would find them once
            # instead of at every step, fails with no_sync in torch 2.13.)
            find_unused_parameters=True,
            # Gradients live in DDP's communication buckets: no second copy of them.
            gradient_as_bucket_view=True,
        )

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """AdamW; with ``shard_optimizer`` under torchrun, ZeRO-1: every rank keeps the Adam
        moments of 1/world of the parameters (for generators whose optimizer state does not
        fit one device), and the updated weights are broadcast after each step."""
        cfg = self.cfg
        if cfg.shard_optimizer and self.world.distributed:
            return ZeroRedundancyOptimizer(
                self._param_groups(),
                optimizer_class=torch.optim.AdamW,
                weight_decay=cfg.weight_decay,
            )
        return torch.optim.AdamW(self._param_groups(), weight_decay=cfg.weight_decay)

    def _lr_factor(self, step: int) -> float:
        """Linear warm-up, then linear decay to 0 at the last step (as RAG's fine-tuning)."""
        warm = self.cfg.warmup_steps
        if step < warm:
            return (step + 1) / warm
        return max(0.0, (self.total_steps - step) / max(1, self.total_steps - warm))

    # ------------------------------------------------------------------ loop

    def run(self, on_step: StepHook | None = None) -> TrainResult:
        cfg = self.cfg
        ckpt: Path | None = None
        loss = float("nan")
        if self.step >= self.total_steps:
            log.info("already at step %d of %d; nothing to do", self.step, self.total_steps)
            return TrainResult(self.step, loss, self.metrics, latest_checkpoint(cfg.out))
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            desc="train",
            unit="step",
            disable=not (cfg.progress and self.world.is_main),
            dynamic_ncols=True,
        )
        ema: float | None = None
        try:
            while self.step < self.total_steps:
                if self.compute is not None:
                    self.compute.maybe_resize()  # a neighbour took (or gave back) a core
                loss = self.optimizer_step()
                self.step += 1
                ema = loss if ema is None else 0.9 * ema + 0.1 * loss
                bar.update(1)
                bar.set_postfix(loss=f"{ema:.4f}")
                self._log({"step": self.step, "loss": loss})
                if on_step is not None:
                    on_step(self.step, loss)
                last = self.step == self.total_steps
                if (cfg.eval_every and self.step % cfg.eval_every == 0) or last:
                    self.metrics = {"train_loss": ema, **self.evaluate()}
                    self._log({"step": self.step, **self.metrics})
                    if self.world.is_main:
                        bar.write(f"step {self.step}: " + _fmt(self.metrics))
                if (cfg.save_every and self.step % cfg.save_every == 0) or last:
                    ckpt = self.save()
        finally:
            bar.close()
        return TrainResult(self.step, loss, self.metrics, ckpt)

    def optimizer_step(self) -> float:
        """grad_accum micro-batches, then one (clipped, scaled) AdamW update; returns mean loss.

        Each micro-batch's loss is its mean NLL over the *global* micro-batch, whichever part of
        it this rank computed; gradients are averaged across ranks at the last micro-batch.
        """
        cfg = self.cfg
        total = 0.0  # this rank's share of the summed micro-batch means
        for j in range(cfg.grad_accum):
            batch = batch_at(self.pairs, self.cursor, cfg.batch_size, cfg.seed)
            self.cursor += 1
            rows, counted = self.world.part(batch)
            weight = self.world.loss_weight(len(batch)) / cfg.grad_accum if counted else 0.0
            last = j == cfg.grad_accum - 1
            sync = contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync()
            with sync:
                nll = self._summed_nll(rows)
                self.scaler.scale(nll * weight).backward()
            if counted:
                total += float(nll.detach()) / len(batch)
        total = self.world.sum(total)
        self.scaler.unscale_(self.optimizer)
        if cfg.max_grad_norm > 0:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / cfg.grad_accum

    def _summed_nll(self, batch: list[TrainPair]) -> torch.Tensor:
        """Sum over ``batch`` of -log p(y|x); under torchrun through DDP, whose forward pass
        readies the gradient reduction of the backward pass that follows."""
        if self.ddp is not None and torch.is_grad_enabled():
            return self.ddp(batch)
        return self.summed_nll(batch)

    def summed_nll(self, batch: list[TrainPair]) -> torch.Tensor:
        """Sum over the batch of -log p(y|x) (marginalised over the k retrieved passages)."""
        cfg = self.cfg
        questions = [p.question for p in batch]
        targets = [p.target for p in batch]
        with self._autocast():
            passages, doc_scores = self.retrieval.retrieve_with_scores(
                questions, grad=cfg.train_query_encoder
            )
            nll = self.generator.loss(
                questions,
                passages,
                doc_scores,
                targets,
                cfg.mode,
                epsilon=cfg.label_smoothing,
                reduce_loss=True,
                exclude_bos_score=cfg.exclude_bos_score,
            )
        return nll

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        """Dev loss, task metrics (EM/F1, BLEU/ROUGE-L or accuracy) and recall@1/k.

        Under torchrun every rank evaluates every world_size-th example; the losses are summed
        and the predictions gathered, so every rank scores the whole dev set.
        """
        if not self.dev:
            return {}
        cfg, world = self.cfg, self.world
        mine = self.dev[world.rank :: world.world_size]
        self.encoder.model.eval()
        self.generator.model.eval()
        self.generator.refresh()
        try:
            with torch.no_grad():
                dev_pairs = training_pairs(mine, "first")
                loss = sum(
                    float(self.summed_nll(dev_pairs[i : i + cfg.batch_size]))
                    for i in range(0, len(dev_pairs), cfg.batch_size)
                )
            options = DecodingOptions(
                mode=cfg.eval_decoding,
                num_beams=cfg.eval_num_beams,
                max_new_tokens=cfg.eval_max_new_tokens,
            )
            preds = predict_local(
                mine,
                retrieve=self.retrieval.search,
                generator=self.generator,
                options=options,
                batch_size=cfg.batch_size,
            )
        finally:
            self._train_mode()
        per_rank = world.gather(preds)
        # rank r predicted examples r, r + world_size, ...: back in the dev set's order
        ordered = [
            per_rank[i % world.world_size][i // world.world_size] for i in range(len(self.dev))
        ]
        scores = score_predictions(cfg.task, self.dev, ordered, cfg.k)
        out = {"dev_loss": world.sum(loss) / len(self.dev)}
        out.update({f"dev_{k}": v for k, v in scores.items() if k != "n"})
        return out

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> Path:
        """Write a checkpoint (rank 0; every rank takes part in gathering its state and waits
        for it to be in place) and return its path."""
        cfg, world = self.cfg, self.world
        # An explicitly chosen query encoder must travel with the checkpoint even when frozen,
        # or the serving retriever would fall back to the index's own encoder.
        save_q = cfg.train_query_encoder or cfg.query_encoder is not None
        rng_by_rank = world.gather(_rng_state())
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            self.optimizer.consolidate_state_dict(to=0)  # a collective: every rank
        path = world.from_main(lambda: self._write(save_q, rng_by_rank))
        log.info("saved %s", path)
        return path

    def _write(self, save_q: bool, rng_by_rank: list[dict[str, Any]]) -> Path:
        cfg = self.cfg
        return write_checkpoint(
            cfg.out,
            self.step,
            query_encoder=self.encoder if save_q else None,
            query_encoder_adapter=(
                None
                if self.q_peft_model is None
                else TrainedAdapter(self.q_peft_model, self.q_base_id)
            ),
            generator=self.generator,
            generator_adapter=(
                None if self.peft_model is None else TrainedAdapter(self.peft_model, self.base_id)
            ),
            base_generator=self.base_generator,
            base_query_encoder=self.base_query_encoder,
            index={"name": self.index.name, "checksum": self.index.manifest.checksum},
            data_sha256=self.data_sha256,
            metrics=self.metrics,
            trained=self.trained,
            config=cfg.model_dump(mode="json"),
            trainer_state=self._trainer_state(rng_by_rank),
            generator_source=Path(cfg.generator),
            keep_last=cfg.keep_last,
        )

    def _trainer_state(self, rng_by_rank: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "step": self.step,
            "cursor": self.cursor,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng_by_rank[0],
            # every rank's generators: dropout on rank r continues where it stopped
            "rng_by_rank": rng_by_rank,
            "world_size": self.world.world_size,
            "metrics": dict(self.metrics),
        }

    def _restore(self, ckpt: Path) -> None:
        path = trainer_state_path(ckpt)
        state = load_trainer_state(ckpt)
        # Checkpoints from before distributed training have no world_size: one process.
        saved_world = int(state.get("world_size", 1))
        if saved_world != self.world.world_size:
            raise ConfigError(
                f"{ckpt} was written by a run of {saved_world} process(es) and this run has "
                f"{self.world.world_size}: resume with the same torchrun --nnodes x "
                "--nproc_per_node, or start anew with --no-resume or another --out"
            )
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.scaler.load_state_dict(state["scaler"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(
                f"{path}: cannot restore the optimizer ({e}); the trained parts or model sizes "
                f"differ from this configuration, use --no-resume or another --out"
            ) from None
        self.step = int(state["step"])
        self.cursor = int(state["cursor"])
        self.metrics = dict(state.get("metrics", {}))
        rng = state.get("rng_by_rank", [state["rng"]])[self.world.rank]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        log.info("resumed from %s at step %d", ckpt, self.step)

    def _log(self, row: dict[str, Any]) -> None:
        """Append ``row`` to the train log with the wall-clock time it was written (``time``,
        seconds since the epoch): step times read from the log (bench/train/step.py) do not
        depend on when a reader happens to see the row."""
        if not self.world.is_main:
            return
        self.cfg.out.mkdir(parents=True, exist_ok=True)
        with open(self.cfg.out / TRAIN_LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps({**row, "time": time.time()}) + "\n")


# ---------------------------------------------------------------------- helpers


class _RagLoss(torch.nn.Module):
    """The query encoder and the generator as one module whose forward is the summed NLL of a
    batch of pairs: the unit DDP wraps (its parameters are both models' parameters)."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__()
        self.query_encoder = trainer.encoder.model
        self.generator = trainer.generator.model
        self._summed_nll = trainer.summed_nll

    def forward(self, batch: list[TrainPair]) -> torch.Tensor:
        return self._summed_nll(batch)


def _rng_state() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _pick_device(name: str | None) -> torch.device:
    if name:
        dev = torch.device(name)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _pick_amp_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype; weights and optimizer state stay float32 (mixed precision). On the CPU,
    bf16 where the processor computes it natively (AVX512-BF16, AMX-BF16), else float32."""
    if precision == "fp32":
        return None
    if device.type != "cuda":
        native = cpu_has_native_bf16()
        if precision == "fp16" or (precision == "bf16" and not native):
            raise ConfigError(
                f"precision {precision!r} needs a CUDA device"
                + (" (or, for bf16, a CPU with native bf16)" if precision == "bf16" else "")
            )
        return torch.bfloat16 if native else None
    if precision == "fp16":
        return torch.float16
    if precision == "bf16" or torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


def _open_dense_index(cfg: TrainConfig) -> LoadedIndex:
    # Re-hashing a Wikipedia-sized index takes minutes; sizes and shapes are still checked.
    index = open_index(cfg.index, verify=False)
    if not index.dense:
        index.close()
        raise ConfigError(f"index {index.name!r} is bm25; training needs a dense index")
    if cfg.k > index.manifest.count:
        index.close()
        raise ConfigError(f"k={cfg.k} exceeds the {index.manifest.count} passages of the index")
    return index


def _same_adapter_use(ckpt: Path, part: str, saved: Path | None, configured: Any) -> None:
    """A run resumes with an adapter of ``part`` exactly when its checkpoint holds one."""
    if (saved is not None) != (configured is not None):
        raise ConfigError(
            f"{ckpt} was trained {'with' if saved else 'without'} a {part} adapter and this "
            f"run is configured {'with' if configured else 'without'} one; use --no-resume or "
            "another --out"
        )


def _load_query_encoder(name: str, device: torch.device) -> Encoder:
    enc = load_encoder(name, role="query", cached=False)
    enc.to(device)
    return enc
