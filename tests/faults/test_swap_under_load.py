"""Index swaps under load, corrupt index / checkpoint refused, request ids across services.

One stack (``openbook up``, real processes on 127.0.0.1) for the whole module.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from faultkit import (
    FACT_QUESTIONS,
    Load,
    ask,
    describe_all,
    metrics,
    passages_match_label,
    sample,
)

pytestmark = pytest.mark.e2e

LOAD_SECONDS = 30
CLIENTS = 16


@pytest.fixture(scope="module")
def stack(start_stack):
    return start_stack()


def _swap(stack, index: str, **kwargs) -> httpx.Response:
    return httpx.post(
        f"{stack.url}/admin/swap-index",
        json={"index": index},
        headers=stack.auth,
        timeout=60,
        **kwargs,
    )


class SwapLog:
    """Swaps as the test saw them: ``(sent, answered, target)``; facts-a before the first."""

    def __init__(self) -> None:
        self.swaps: list[tuple[float, float, str]] = []

    def possible(self, started: float, ended: float) -> set[str]:
        """Indexes that may have been active at some moment of ``[started, ended]``."""
        active = "facts-a"
        for _sent, answered, target in self.swaps:
            if answered <= started:
                active = target
        overlapping = {t for sent, answered, t in self.swaps if sent < ended and answered > started}
        return {active} | overlapping


def test_swapping_back_and_forth_under_16_clients_fails_no_request(stack):
    # A few questions asked over and over: most answers come from the cache, so the test
    # covers cached answers across swaps as much as computed ones.
    def body(client: int, n: int) -> dict:
        return {"question": FACT_QUESTIONS[(client + n) % len(FACT_QUESTIONS)], "k": 2 + n % 2}

    log = SwapLog()
    swap_errors: list[str] = []
    done = threading.Event()

    def swapper() -> None:
        target = "facts-b"
        while not done.is_set():
            sent = time.monotonic()
            reply = _swap(stack, target)
            log.swaps.append((sent, time.monotonic(), target))
            if reply.status_code != 200:
                swap_errors.append(f"{reply.status_code}: {reply.text}")
            target = "facts-a" if target == "facts-b" else "facts-b"
            done.wait(0.3)  # pacing between swaps, not synchronisation

    with Load(stack.url, CLIENTS, body) as load:
        thread = threading.Thread(target=swapper, daemon=True)
        thread.start()
        done.wait(LOAD_SECONDS)
        done.set()
        thread.join(60)
    _swap(stack, "facts-a")  # leave facts-a active for the rest of the module

    replies = load.snapshot()
    failed = [r for r in replies if r.status != 200]
    assert not failed, f"{len(failed)} of {len(replies)} failed:\n{describe_all(failed)}"
    assert swap_errors == []
    mislabelled = [r for r in replies if not passages_match_label(r.body)]
    assert not mislabelled, describe_all(mislabelled)
    # Never an answer (cached or computed) from an index that was not active meanwhile: a
    # cache keyed without the index would hand out facts-a answers long after the swap.
    stale = [r for r in replies if r.body["index"] not in log.possible(r.started, r.ended)]
    assert not stale, describe_all(stale)
    assert len(log.swaps) >= 20
    by_index = {(r.body["index"], r.body["cached"]) for r in replies}
    assert by_index == {(i, c) for i in ("facts-a", "facts-b") for c in (True, False)}


def _corrupt_copy(src: Path, dst: Path, name: str) -> None:
    """A copy of index ``src`` named ``name`` whose vectors file no longer matches its hash."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["name"] = name
    (dst / "manifest.json").write_text(json.dumps(manifest))
    vectors = dst / "vectors.npy"
    data = bytearray(vectors.read_bytes())
    data[-8:] = bytes(8)  # same size, different bytes
    vectors.write_bytes(bytes(data))


def test_corrupt_index_is_refused_and_the_old_one_keeps_serving(stack):
    indexes = stack.var / "indexes"
    _corrupt_copy(indexes / "facts-b", indexes / "facts-corrupt", "facts-corrupt")
    (indexes / "facts-empty").mkdir()
    (indexes / "facts-empty" / "manifest.json").write_text("{not json")

    for name in ("facts-corrupt", "facts-empty"):
        reply = _swap(stack, name)
        assert reply.status_code == 422, reply.text
        detail = reply.json()["detail"]
        assert name in detail or "manifest" in detail, detail
        if name == "facts-corrupt":
            assert "checksum mismatch" in detail

    listed = httpx.get(f"{stack.url}/indexes", timeout=30).json()
    assert listed["active"] == "facts-a"
    answer = ask(stack.url, "Who wrote Hamlet?", k=2, use_cache=False)
    assert answer.status == 200, answer.describe()
    assert answer.body["index"] == "facts-a"
    assert answer.body["passages"][0]["id"] == "p21"


def _tiny_checkpoint(root: Path, model_dir: Path) -> Path:
    from transformers import AutoTokenizer, BartForConditionalGeneration

    from openbook_trainer.checkpoints import write_checkpoint

    model = BartForConditionalGeneration.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return write_checkpoint(
        root,
        1,
        query_encoder=None,
        generator=(model, tokenizer),
        base_generator=str(model_dir),
        base_query_encoder=None,
        index={"name": "facts-a", "checksum": ""},
        data_sha256="",
    )


def test_corrupt_checkpoint_is_refused_and_the_old_model_keeps_serving(stack):
    before = ask(stack.url, "Who discovered penicillin?", use_cache=False)
    assert before.status == 200, before.describe()
    # Reloads only take checkpoints inside the stack's checkpoint dir; the `latest` pointer is
    # put back so that a restarted service does not pick the corrupt one up as latest.
    from openbook.storage.checkpoint import LATEST

    model = stack.var / "models" / "tiny-bart"
    root = stack.var / "checkpoints"
    latest = root / LATEST
    pointed = latest.read_text() if latest.exists() else None
    checkpoint = _tiny_checkpoint(root, model)
    if pointed is None:
        latest.unlink()
    else:
        latest.write_text(pointed)
    weights = next((checkpoint / "generator").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))

    reply = httpx.post(
        f"{stack.url}/admin/reload-model",
        json={"checkpoint": checkpoint.name},
        headers=stack.auth,
        timeout=120,
    )
    assert reply.status_code == 422, reply.text
    assert "corrupt" in reply.json()["detail"] and weights.name in reply.json()["detail"]

    after = ask(stack.url, "Who discovered penicillin?", use_cache=False)
    assert after.status == 200, after.describe()
    assert after.body["model_version"] == before.body["model_version"]
    assert after.body["retriever_version"] == before.body["retriever_version"]


def test_one_request_id_reaches_gateway_retriever_and_generator_logs(stack):
    request_id = f"trace-{time.monotonic_ns()}"
    reply = httpx.post(
        f"{stack.url}/answer",
        json={"question": "What is the highest mountain on Earth?", "use_cache": False},
        headers={"x-request-id": request_id},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["request_id"] == request_id == reply.headers["x-request-id"]

    def logged_by() -> set[str]:
        services = set()
        for line in stack.log_path.read_text(errors="replace").splitlines():
            service, sep, payload = line.partition(" | ")
            if not sep or not payload.startswith("{"):
                continue
            try:
                entry = json.loads(payload)
            except ValueError:
                continue
            if entry.get("request_id") == request_id:
                services.add(service.strip())
        return services

    deadline = time.monotonic() + 30  # log lines pass through the launcher's pipe
    while logged_by() != {"gateway", "retriever", "generator"} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert logged_by() == {"gateway", "retriever", "generator"}


def test_admin_token_is_never_logged(stack):
    wrong = httpx.post(
        f"{stack.url}/admin/swap-index",
        json={"index": "facts-a"},
        headers={"Authorization": "Bearer not-the-token"},
        timeout=30,
    )
    assert wrong.status_code == 401
    assert _swap(stack, "facts-a").status_code == 200
    log = stack.log_path.read_text(errors="replace")
    assert "/admin/swap-index" in log  # the calls were logged ...
    assert stack.admin_token not in log  # ... without the token
    assert "not-the-token" not in log


def test_metrics_cover_stages_batches_queues_cache_and_what_is_served(stack):
    for _ in range(2):  # a miss, then a hit
        assert ask(stack.url, "Who created the Python programming language?").status == 200
    gateway = metrics(f"{stack.url}/metrics")
    for stage in ("cache", "retrieve", "generate"):
        assert sample(gateway, "openbook_gateway_stage_seconds_count", stage=stage) > 0
    assert sample(gateway, "openbook_gateway_cache_total", outcome="hit") > 0
    assert 0 < sample(gateway, "openbook_gateway_cache_hit_ratio") <= 1
    assert sample(gateway, "openbook_active_index_info", index="facts-a") == 1
    assert sample(gateway, "openbook_gateway_model_info", service="generator") == 1

    for service, port in (("retriever", "rmetrics"), ("generator", "gmetrics")):
        samples = metrics(f"http://127.0.0.1:{stack.ports[port]}/metrics")
        method = "Retrieve" if service == "retriever" else "Generate"
        assert sample(samples, "openbook_rpc_total", service=service, method=method) > 0
        assert sample(samples, "openbook_rpc_seconds_count", service=service, method=method) > 0
        assert sample(samples, "openbook_batch_size_count", service=service) > 0
        assert ("openbook_queue_depth", frozenset({("service", service)})) in samples
        assert sample(samples, "openbook_serving_info", service=service, kind="model") == 1
    retriever = metrics(f"http://127.0.0.1:{stack.ports['rmetrics']}/metrics")
    assert sample(retriever, "openbook_serving_info", kind="index", name="facts-a") == 1
