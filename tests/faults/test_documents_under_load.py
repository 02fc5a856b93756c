"""Documents written, replaced and deleted while 16 clients ask (issue 32, "Proven under load").

One stack (``openbook up``, real processes on 127.0.0.1) for the module. One writer thread
performs ``OPERATIONS`` document operations (puts of new documents, replaces, deletes; many
through ``documents:batch``) on the active index and on a second one created ``like`` it, while
16 clients ask ``/answer`` back to back (dense, bm25 and hybrid; cache on and off).

Every document's text carries a made-up token word no other text has, and a replace gives it a
new one, so a passage's text says which write it comes from. The test holds:

* no request fails: every ``/answer`` and every write is a 200 (bm25 questions of the clients
  always hold words of the base corpus, so they always match a passage);
* read your writes: after each acknowledged write, a bm25 question for the written tokens,
  started after the ack, returns their passages (a third of these questions were also asked,
  and cached, just before the write), and a GET of the document returns its text; a deleted
  document's GET is a 404;
* no deleted passage served: no answer whose request started after a delete or replace was
  acknowledged holds a passage with the removed text's token;
* the final listing of each index is the model of the acknowledged writes.

No timing thresholds: the load only has to overlap the writes.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest
from faultkit import FACT_QUESTIONS, Load, Reply, describe_all, post

pytestmark = pytest.mark.e2e

CLIENTS = 16
# Document operations in all: each document of a batch is one.
OPERATIONS = 1000
SECOND_INDEX = "docload"
INDEXES = ("facts-a", SECOND_INDEX)
# Documents a writer keeps in each index at least, so a dense question always has passages.
MIN_DOCUMENTS = 8
# A made-up word: letters around a serial number; bm25s lowercases and splits on non-word chars.
TOKEN = re.compile(r"\bqz\d{5}x\b")


@dataclass
class Write:
    """One acknowledged write call: what it did, when it was sent and answered."""

    index: str
    puts: dict[str, str]  # doc id -> its new text
    deletes: list[str]
    sent: float
    acked: float
    version: int


@dataclass
class Model:
    """The acknowledged state of the documents the writer wrote, and when tokens left it.

    The writer thread mutates it; the clients only read ``recent`` (a list they copy a slice of).
    """

    texts: dict[str, dict[str, str]] = field(default_factory=lambda: {i: {} for i in INDEXES})
    removed: dict[str, float] = field(default_factory=dict)  # token -> ack of its removal
    recent: list[str] = field(default_factory=list)  # tokens written, latest last
    writes: list[Write] = field(default_factory=list)
    serial: int = 0

    def token(self) -> str:
        self.serial += 1
        return f"qz{self.serial:05d}x"

    def text(self, token: str) -> str:
        return f"The {token} ledger keeps record {self.serial} of the archive."

    def acknowledge(self, write: Write) -> None:
        documents = self.texts[write.index]
        for doc_id in write.deletes:
            self.removed[_token(documents.pop(doc_id))] = write.acked
        for doc_id, text in write.puts.items():
            if doc_id in documents:
                self.removed[_token(documents[doc_id])] = write.acked
            documents[doc_id] = text
            self.recent.append(_token(text))
        self.writes.append(write)


def _token(text: str) -> str:
    match = TOKEN.search(text)
    assert match, text
    return match.group(0)


@pytest.fixture(scope="module")
def stack(start_stack):
    return start_stack()


class Writer:
    """The writer thread's operations and checks; every failure is collected, not raised."""

    def __init__(self, stack, model: Model, seed: int) -> None:
        self.stack = stack
        self.model = model
        self.random = random.Random(seed)
        self.http = httpx.Client(timeout=120, headers=stack.auth)
        self.operations = 0
        self.checked = 0  # acknowledged document writes checked by a read after their ack
        self.failures: list[str] = []
        self.checks: list[Reply] = []  # the read-your-writes answers (judged like the others)
        self._next_id = 0

    def fresh_id(self) -> str:
        self._next_id += 1
        return f"ld-{self._next_id:04d}"

    def run(self, operations: int) -> None:
        try:
            while self.operations < operations:
                self.step(operations - self.operations)
        except Exception as exc:  # noqa: BLE001 - reported by the test, with the others
            self.failures.append(f"writer stopped: {exc!r}")
        finally:
            self.http.close()

    def step(self, left: int) -> None:
        index = self.random.choice(INDEXES)
        documents = self.model.texts[index]
        roll = self.random.random()
        if roll < 0.15:  # a batch of new documents and replaces
            size = min(left, self.random.randint(15, 35))
            replaced = self.random.sample(sorted(documents), min(len(documents), size // 3))
            ids = replaced + [self.fresh_id() for _ in range(size - len(replaced))]
            puts = {doc_id: self.model.text(self.model.token()) for doc_id in ids}
            self.put_batch(index, puts)
        elif roll < 0.35 or len(documents) <= MIN_DOCUMENTS:  # one new document
            self.put_one(index, self.fresh_id(), self.model.text(self.model.token()))
        elif roll < 0.55:  # one replace
            doc_id = self.random.choice(sorted(documents))
            self.put_one(index, doc_id, self.model.text(self.model.token()))
        else:
            self.delete_one(index, self.random.choice(sorted(documents)))

    def put_one(self, index: str, doc_id: str, text: str) -> None:
        url = f"{self.stack.url}/indexes/{index}/documents/{doc_id}"
        body = {"title": "Ledger", "text": text}
        self.write(index, {doc_id: text}, [], lambda: self.http.put(url, json=body))

    def put_batch(self, index: str, puts: dict[str, str]) -> None:
        url = f"{self.stack.url}/indexes/{index}/documents:batch"
        body = {"documents": [{"id": i, "title": "Ledger", "text": t} for i, t in puts.items()]}
        self.write(index, puts, [], lambda: self.http.post(url, json=body))

    def delete_one(self, index: str, doc_id: str) -> None:
        url = f"{self.stack.url}/indexes/{index}/documents/{doc_id}"
        self.write(index, {}, [doc_id], lambda: self.http.delete(url))

    def write(
        self,
        index: str,
        puts: dict[str, str],
        deletes: list[str],
        send: Callable[[], httpx.Response],
    ) -> None:
        """Send one write and, for every batch and half of the single writes (reads under load
        take time), read it back after its ack."""
        documents = self.model.texts[index]
        removed = [_token(documents[d]) for d in [*deletes, *puts] if d in documents]
        untouched = sorted(set(documents) - set(puts) - set(deletes))
        # A live token in the question too, so that it always matches a passage.
        anchor = [_token(documents[self.random.choice(untouched)])] if untouched else []
        sampled = self.random.sample(sorted(puts), min(4, len(puts)))
        words = [*(_token(puts[d]) for d in sampled), *removed[:4], *anchor]
        checked = len(puts) > 1 or self.random.random() < 0.5
        # A third of the checks also ask their question before the write, with the cache on:
        # a cache entry that outlived the write would then be served after it.
        cached_before = checked and bool(removed or anchor) and self.random.random() < 1 / 3
        if cached_before:
            self.checks.append(self.ask(index, words, use_cache=True))
        sent = time.monotonic()
        reply = send()
        acked = time.monotonic()
        self.operations += len(puts) + len(deletes)
        if reply.status_code != 200:
            self.failures.append(f"write {reply.status_code}: {reply.text[:300]}")
            return
        write = Write(index, puts, deletes, sent, acked, reply.json()["version"])
        self.model.acknowledge(write)
        if checked:
            use_cache = cached_before or self.random.random() < 0.5
            self.check(write, sampled, words, use_cache)

    def ask(self, index: str, words: list[str], use_cache: bool) -> Reply:
        body = {
            "question": " ".join(words),
            "index": index,
            "retrieval": "bm25",
            "k": len(words) + 2,
            "use_cache": use_cache,
        }
        return post(self.http, f"{self.stack.url}/answer", body)

    def check(self, write: Write, sampled: list[str], words: list[str], use_cache: bool) -> None:
        """Read your writes: GETs and a bm25 question for the written and removed tokens, sent
        after the ack, see this write: each sampled passage is in the question's top k."""
        base = f"{self.stack.url}/indexes/{write.index}/documents"
        for doc_id in sampled:
            got = self.http.get(f"{base}/{doc_id}")
            if got.status_code != 200 or got.json()["text"] != write.puts[doc_id]:
                self.failures.append(f"GET {doc_id} after put: {got.status_code} {got.text[:200]}")
        for doc_id in write.deletes:
            got = self.http.get(f"{base}/{doc_id}")
            if got.status_code != 404:
                self.failures.append(f"GET {doc_id} after delete: {got.status_code}")
        reply = self.ask(write.index, words, use_cache)
        self.checks.append(reply)
        if reply.status != 200:
            return  # counted with the failed requests
        if reply.body["index_version"] < write.version:
            self.failures.append(f"{reply.describe()}: version below {write.version}")
        served = {p["id"]: p["text"] for p in reply.body["passages"]}
        for doc_id in sampled:
            token = _token(write.puts[doc_id])
            if token not in served.get(f"{doc_id}#0", ""):
                self.failures.append(
                    f"{write.index}/{doc_id} ({token}) not served after its ack: "
                    f"{sorted(served)} at version {reply.body['index_version']}"
                )
        self.checked += len(sampled) + len(write.deletes)


def _question(model: Model, rng: random.Random) -> dict:
    """A client's question: a base question or none, plus tokens written lately (some of them
    since deleted or replaced, so a stale passage would show up in its answer)."""
    recent = model.recent[-60:]
    tokens = rng.sample(recent, min(len(recent), rng.randint(1, 3)))
    repeated = rng.random() < 0.3
    if repeated:  # the same few questions, asked by many clients: the cache answers some
        tokens = recent[-1:]
    mode = rng.choice(["dense", "bm25", "hybrid"])
    index = rng.choice(INDEXES)
    if index == "facts-a" or mode == "dense":
        # bm25 and hybrid on facts-a: the fact question's words always match a passage. The
        # second index holds only ledger documents, any of which may be gone: dense there.
        question = f"{rng.choice(FACT_QUESTIONS[:4])} {' '.join(tokens)}"
    else:
        mode = "dense"
        question = " ".join(tokens)
    return {
        "question": question,
        "index": index,
        "retrieval": mode,
        "k": 3 if repeated else rng.randint(2, 6),
        "use_cache": rng.random() < 0.5,
    }


def _listing(stack, index: str) -> set[str]:
    ids: set[str] = set()
    cursor = ""
    while True:
        page = httpx.get(
            f"{stack.url}/indexes/{index}/documents",
            params={"cursor": cursor, "limit": 1000},
            timeout=60,
        )
        assert page.status_code == 200, page.text
        ids.update(page.json()["ids"])
        cursor = page.json()["next_cursor"]
        if not cursor:
            return ids


def test_1000_document_writes_under_16_clients_fail_nothing_and_serve_nothing_stale(stack):
    created = httpx.post(
        f"{stack.url}/indexes",
        json={"name": SECOND_INDEX, "like": "facts-a"},
        headers=stack.auth,
        timeout=120,
    )
    assert created.status_code == 201, created.text
    model = Model()
    writer = Writer(stack, model, seed=32)
    # Both indexes hold ledger documents before the clients ask (a dense question on an empty
    # index has nothing to answer from); these writes count among the operations.
    for index in INDEXES:
        writer.put_batch(index, {writer.fresh_id(): model.text(model.token())
                                 for _ in range(MIN_DOCUMENTS * 2)})  # fmt: skip
    base_ids = _listing(stack, "facts-a") - set(model.texts["facts-a"])
    assert writer.failures == []

    rngs = [random.Random(client) for client in range(CLIENTS)]
    with Load(stack.url, CLIENTS, lambda client, n: _question(model, rngs[client])) as load:
        thread = threading.Thread(target=writer.run, args=(OPERATIONS,), daemon=True)
        thread.start()
        thread.join()
    replies = load.snapshot() + writer.checks

    failed = [r for r in replies if r.status != 200]
    assert not failed, f"{len(failed)} of {len(replies)} failed:\n{describe_all(failed)}"
    assert writer.failures == [], "\n".join(writer.failures[:20])
    assert writer.operations >= OPERATIONS
    assert writer.checked >= 200
    # No passage whose text an acknowledged write had removed before the request started.
    stale = [
        f"{r.describe()}: {p['id']} holds {token}, removed {r.started - model.removed[token]:.2f}s "
        "before the request"
        for r in replies
        for p in r.body["passages"]
        for token in TOKEN.findall(p["text"])
        if model.removed.get(token, r.started) < r.started
    ]
    assert not stale, "\n".join(stale[:10])
    # The load overlapped the writes: answers came from both indexes, computed and cached.
    assert {r.body["index"] for r in load.snapshot()} == set(INDEXES)
    assert {r.body["cached"] for r in load.snapshot()} == {True, False}

    assert _listing(stack, "facts-a") == base_ids | set(model.texts["facts-a"])
    assert _listing(stack, SECOND_INDEX) == set(model.texts[SECOND_INDEX])
    for index in INDEXES:
        for doc_id, text in model.texts[index].items():
            got = httpx.get(f"{stack.url}/indexes/{index}/documents/{doc_id}", timeout=30)
            assert got.status_code == 200 and got.json()["text"] == text, (doc_id, got.text)
