"""``openbook train`` under torchrun (CPU, gloo): same results as one process, resumable after a
rank is killed, and clear failures instead of hangs.

Every run here is the real command line in fresh processes: ``torchrun --nproc_per_node 2 -m
openbook_trainer train ...`` against one process of ``python -m openbook_trainer train ...``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from openbook.storage.checkpoint import latest_checkpoint
from openbook_trainer.config import ConfigError, TrainConfig
from openbook_trainer.experiments.synthetic import SyntheticTask, make_task
from openbook_trainer.loop import train

WORKER = Path(__file__).with_name("ddp_worker.py")
# Generous: a hang guard, not a timing assertion (two processes start torch on shared cores).
RUN_TIMEOUT = 600


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> SyntheticTask:
    # No dropout, so one process and two can be compared weight for weight. Nine pairs with
    # batches of 4: every epoch ends in a one-row batch, which leaves a rank without rows.
    return make_task(tmp_path_factory.mktemp("ddp"), n_entities=9, dropout=0.0)


def _args(task: SyntheticTask, out: Path, *extra: str) -> list[str]:
    """The command line of one run: options in a YAML file (as users write them), flags on top."""
    config = out.parent / f"{out.name}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        yaml.safe_dump(
            {
                "train": str(task.train),
                "dev": str(task.dev),
                "index": str(task.index),
                "generator": str(task.generator),
                "k": 3,
                "batch_size": 4,
                "grad_accum": 2,
                "steps": 4,
                "warmup_steps": 1,
                "lr_generator": 1e-3,
                "lr_query_encoder": 1e-3,
                "eval_max_new_tokens": 4,
                "dist_timeout": 120,
            }
        )
    )
    return ["train", "--config", str(config), "--out", str(out), "--no-progress", *extra]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def _torchrun(nproc: int, *argv: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc),
        "--standalone",  # a local rendezvous on a free port
        *argv,
    ]  # fmt: skip


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        cmd, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _one_process(*argv: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "openbook_trainer", *argv])


def _two_processes(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(_torchrun(2, "-m", "openbook_trainer", *argv), check=check)


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for part in ("generator", "query_encoder"):
        for name, t in load_file(ckpt / part / "model.safetensors").items():
            out[f"{part}.{name}"] = t
    return out


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process_run(task, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "ckpt"
    _one_process(*_args(task, out))
    return out


@pytest.fixture(scope="module")
def two_process_run(task, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two") / "ckpt"
    _two_processes(*_args(task, out))
    return out


# The stated tolerance. The two runs sum the same float32 terms in another order (each rank
# sums half of a micro-batch, then DDP averages), so the first loss agrees exactly and later
# ones to ~2e-5 relative. Adam divides each coordinate's step by its gradient's magnitude, so
# coordinates whose gradient is at rounding-noise level (many in the query encoder, whose
# gradient only comes through p(z|x)) may step by up to lr either way: weights are compared
# by the size of their difference relative to how far training moved them (measured: 0.8% for
# the generator, 3.7% for the query encoder; two runs that disagreed would differ by ~100%).
LOSS_RTOL = 1e-4
WEIGHT_RTOL = 0.1


def _assert_same_training(one: Path, two: Path, initial: dict[str, dict[str, torch.Tensor]]):
    a, b = latest_checkpoint(one), latest_checkpoint(two)
    for part, start in initial.items():
        wa = load_file(a / part / "model.safetensors")
        wb = load_file(b / part / "model.safetensors")
        assert wa.keys() == wb.keys() == start.keys(), part
        diff = sum(float(((wa[n] - wb[n]) ** 2).sum()) for n in wa) ** 0.5
        moved = sum(float(((wa[n] - start[n]) ** 2).sum()) for n in wa) ** 0.5
        assert moved > 0.01, part  # training did move the weights
        assert diff <= WEIGHT_RTOL * moved, (part, diff, moved)


@pytest.fixture(scope="module")
def initial(task) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "generator": load_file(task.generator / "model.safetensors"),
        "query_encoder": load_file(task.query_encoder / "model.safetensors"),
    }


def test_two_processes_train_like_one(one_process_run, two_process_run, initial):
    one, two = _log(one_process_run), _log(two_process_run)
    losses_one = [r["loss"] for r in one if "loss" in r]
    losses_two = [r["loss"] for r in two if "loss" in r]
    assert len(losses_one) == len(losses_two) == 4
    assert losses_two[0] == pytest.approx(losses_one[0], rel=1e-6)  # same batch, same weights
    assert losses_two == pytest.approx(losses_one, rel=LOSS_RTOL)
    # dev metrics: every rank evaluated its part, gathered into one score of the whole set
    end_one, end_two = one[-1], two[-1]
    assert end_two["dev_loss"] == pytest.approx(end_one["dev_loss"], rel=LOSS_RTOL)
    for name in ("dev_em", "dev_f1", "dev_recall@1", "dev_recall@3"):
        assert end_two[name] == end_one[name], name
    _assert_same_training(one_process_run, two_process_run, initial)

    # one checkpoint, written once, with every rank's RNG state and the world size
    state = torch.load(latest_checkpoint(two_process_run) / "trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2 and len(state["rng_by_rank"]) == 2
    assert state["cursor"] == 8


def test_a_rank_killed_mid_run_resumes_to_the_same_weights(task, two_process_run, tmp_path):
    out = tmp_path / "ckpt"
    # rank 1 SIGKILLs itself after step 3 (checkpoints every step): torchrun stops rank 0 too
    killed = _run(
        _torchrun(2, str(WORKER), "--kill-rank", "1", "--kill-at-step", "3", "--",
                  *_args(task, out, "--save-every", "1")),
        check=False,
    )  # fmt: skip
    assert killed.returncode != 0, killed.stdout + killed.stderr
    assert latest_checkpoint(out) is not None
    assert latest_checkpoint(out).name in ("step-000002", "step-000003")

    _two_processes(*_args(task, out, "--save-every", "1"))
    assert latest_checkpoint(out).name == "step-000004"
    a = _weights(latest_checkpoint(two_process_run))
    b = _weights(latest_checkpoint(out))
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resuming_with_another_world_size_is_refused(task, two_process_run, tmp_path):
    # the finished two-process run, continued for more steps by one process
    cfg = TrainConfig(
        train=task.train,
        index=task.index,
        generator=task.generator,
        out=two_process_run,
        k=3,
        steps=4,
        batch_size=4,
        grad_accum=2,
        progress=False,
    )
    with pytest.raises(ConfigError, match=r"2 process\(es\).*this run has 1.*--nproc_per_node"):
        train(cfg.model_copy(update={"steps": 6}))


def test_a_dying_rank_fails_the_run_instead_of_hanging(task, tmp_path):
    # rank 0 dies at step 1; rank 1 is left waiting in a collective: torchrun must end the
    # job with an error naming the failed rank (a timeout guards against a hang)
    started = time.monotonic()
    proc = _run(
        _torchrun(2, str(WORKER), "--kill-rank", "0", "--kill-at-step", "1", "--",
                  *_args(task, tmp_path / "ckpt")),
        check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert time.monotonic() - started < RUN_TIMEOUT
    assert "rank" in (proc.stdout + proc.stderr).lower()
    assert str(signal.SIGKILL.value) in proc.stderr or "SIGKILL" in proc.stderr


def test_a_stalled_rank_times_out_the_others(task, tmp_path):
    # rank 1 stops (SIGSTOP) after step 1 without dying: rank 0's next collective fails after
    # --dist-timeout, and torchrun ends the job
    args = _args(task, tmp_path / "ckpt", "--dist-timeout", "5")
    proc = _run(
        _torchrun(2, str(WORKER), "--kill-rank", "1", "--kill-at-step", "1", "--stall", "--",
                  *args),
        check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "timed out" in out.lower() or "timeout" in out.lower(), out[-3000:]


def test_sharded_optimizer_state_trains_like_one_process(task, one_process_run, initial, tmp_path):
    out = tmp_path / "zero"
    _two_processes(*_args(task, out, "--shard-optimizer"))
    _assert_same_training(one_process_run, out, initial)
    # the checkpoint holds the whole optimizer state (consolidated on rank 0)
    state = torch.load(latest_checkpoint(out) / "trainer_state.pt", weights_only=True)
    one = torch.load(latest_checkpoint(one_process_run) / "trainer_state.pt", weights_only=True)
    assert len(state["optimizer"]["state"]) == len(one["optimizer"]["state"])


def test_torchrun_environment_errors_are_clear(monkeypatch):
    from openbook_trainer.distributed import DistributedError, rank_device, world_from_env

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DistributedError, match="LOCAL_RANK, MASTER_ADDR, MASTER_PORT unset"):
        world_from_env("cpu", 10)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(DistributedError, match="RANK=2 is outside WORLD_SIZE=2"):
        world_from_env("cpu", 10)

    from openbook_trainer.distributed import World

    with pytest.raises(DistributedError, match="use --device cuda"):
        rank_device(World(rank=1, world_size=2, local_rank=1), "cuda:1")
    assert rank_device(World(rank=1, world_size=2, local_rank=1), "cuda") == "cuda:1"
    assert rank_device(World(), "cuda:1") == "cuda:1"


def test_rows_are_dealt_to_ranks_and_weighted_as_one_batch():
    from openbook_trainer.distributed import World

    batch = list("abcde")
    parts = [World(r, 2, r).part(batch) for r in range(2)]
    assert parts == [(["a", "c", "e"], True), (["b", "d"], True)]
    # a rank left without rows runs one with weight 0
    assert World(2, 3, 2).part(["a", "b"]) == (["a"], False)
    # DDP averages over 2 ranks: each rank's sum x 2/5 averages to the mean over 5 rows
    assert World(0, 2, 0).loss_weight(5) == pytest.approx(2 / 5)


def test_a_lora_adapter_trains_under_torchrun_like_one_process(task, tmp_path):
    flags = ("--generator-adapter", "lora", "--lora-rank", "4", "--lora-dropout", "0")
    one, two = tmp_path / "one", tmp_path / "two"
    _one_process(*_args(task, one, *flags))
    _two_processes(*_args(task, two, *flags))
    a = load_file(latest_checkpoint(one) / "generator_adapter" / "adapter_model.safetensors")
    b = load_file(latest_checkpoint(two) / "generator_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    # LoRA's B matrices start at zero: their norm is how far training moved them
    lora_b = [n for n in a if "lora_B" in n]
    assert lora_b
    moved = sum(float((a[n] ** 2).sum()) for n in lora_b) ** 0.5
    diff = sum(float(((a[n] - b[n]) ** 2).sum()) for n in lora_b) ** 0.5
    assert moved > 0.01 and diff <= WEIGHT_RTOL * moved, (diff, moved)
