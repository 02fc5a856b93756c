"""A live index's durability: every acknowledged write survives kill -9 (and a compaction
cut short), an unacknowledged one is wholly there or wholly absent, a torn log record is
dropped, writes during a compaction are kept, a batch is all or nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from openbook.index import wal as wal_module
from openbook.index.documents import Document
from openbook.index.live import DocumentNotFound, LiveIndex, LiveOptions
from openbook.index.request import SearchRequest
from openbook.index.wal import PutOp, WalRecord, encode_record
from openbook.index.writer_lock import COMPACTION_LOCK_FILE, WRITER_LOCK_FILE
from openbook_testkit.live import make_live_index, random_document

TESTS = Path(__file__).resolve().parents[1]

# Writes until killed; prints each write's intent before it and its acknowledgement after.
_WRITER = """
import json, sys
from pathlib import Path
import numpy as np
from openbook.index.live import LiveIndex, LiveOptions
from openbook_testkit.live import random_document

path, seed = Path(sys.argv[1]), int(sys.argv[2])
live = LiveIndex(path, LiveOptions(verify=False))
rng = np.random.default_rng(seed)
print(json.dumps({"ready": live.version}), flush=True)
for i in range(1, 10_000):
    if i % 5 == 0:
        doc_id = f"s{seed}-{i - 1}"
        print(json.dumps({"try": "delete", "ids": [doc_id]}), flush=True)
        r = live.delete(doc_id)
        print(json.dumps({"ack": "delete", "ids": [doc_id], "version": r.version}), flush=True)
        continue
    docs = [random_document(rng, f"s{seed}-{i}" + ("" if j == 0 else f"-{j}")) for j in
            range(3 if i % 4 == 0 else 1)]
    print(json.dumps({"try": "put", "docs": [d.to_dict() for d in docs]}), flush=True)
    r = live.put_many(docs)
    print(json.dumps({"ack": "put", "docs": [d.to_dict() for d in docs],
                      "version": r.version}), flush=True)
    if i % 9 == 0:
        print(json.dumps({"compacting": live.version}), flush=True)
        live.compact()
"""


def _kill_after(
    proc: subprocess.Popen, acks: int, rng: np.random.Generator, *, mid_compaction: bool
) -> list[dict]:
    """Kill -9 ``proc`` at a random moment after ``acks`` acknowledgements (and, with
    ``mid_compaction``, once a compaction has started); every line it printed."""
    assert proc.stdout is not None
    lines = []
    seen = 0
    while seen < acks or (mid_compaction and "compacting" not in lines[-1]):
        line = proc.stdout.readline()
        assert line, "the writer exited early"
        lines.append(json.loads(line))
        seen += "ack" in lines[-1]
    time.sleep(float(rng.uniform(0, 0.5 if mid_compaction else 0.3)))
    os.kill(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    lines += [json.loads(x) for x in out.splitlines() if x.strip()]
    return lines


def test_acknowledged_writes_survive_kill_9(dpr_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    make_live_index(tmp_path, "flat", dpr_dirs, passages=60).close()
    path = tmp_path / "live"
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    rng = np.random.default_rng(0)
    state: dict[str, Document | None] = {}  # acknowledged: doc -> content (None: deleted)
    for round_ in range(4):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(path), str(round_)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        lines = _kill_after(proc, int(rng.integers(3, 14)), rng, mid_compaction=round_ % 2 == 1)
        pending: dict | None = None
        last_version = lines[0]["ready"]
        for line in lines[1:]:
            if "compacting" in line:
                continue
            if "try" in line:
                pending = line
                continue
            pending = None
            last_version = line["version"]
            if line["ack"] == "put":
                state.update({d["id"]: Document.from_dict(d) for d in line["docs"]})
            else:
                state.update(dict.fromkeys(line["ids"]))
        # A delete in flight when killed may have landed (wholly there): its id is checked
        # below, with the other outcome of an unacknowledged write, not as acknowledged state.
        in_flight = set(pending["ids"]) if pending is not None and "ids" in pending else set()
        with LiveIndex(path) as live:
            for doc_id, doc in state.items():
                if doc_id in in_flight:
                    continue
                if doc is None:
                    with pytest.raises(DocumentNotFound):
                        live.get(doc_id)
                else:
                    assert live.get(doc_id).document == doc
            # The write in flight when killed: wholly there or wholly absent.
            if pending is not None and pending["try"] == "put":
                ids = [d["id"] for d in pending["docs"]]
                present = [_has(live, i) for i in ids]
                assert all(present) or not any(present), present
                if all(present):
                    assert live.version == last_version + 1
                    state.update({d["id"]: Document.from_dict(d) for d in pending["docs"]})
            elif pending is not None:
                doc_id = pending["ids"][0]
                if not _has(live, doc_id):
                    state[doc_id] = None
                elif state.get(doc_id) is not None:  # the delete did not land
                    assert live.get(doc_id).document == state[doc_id]
            assert live.version in (last_version, last_version + 1)
            # What a compaction cut short left behind is gone; one base remains.
            names = {p.name for p in path.iterdir()} - {
                "documents.sqlite-shm",
                "documents.sqlite-wal",
                WRITER_LOCK_FILE,  # the locks' files stay (flock: the kernel drops the lock)
                COMPACTION_LOCK_FILE,
            }
            assert names == {f"base-{live.base_version:012d}", "documents.sqlite", "wal.log"}
            # Served as stored: each live document's tag finds its last passage.
            alive = [d for d in state.values() if d is not None]
            tags = [f"tag{d.id.replace('-', '')}" for d in alive]
            for doc, hits in zip(
                alive, live.search(SearchRequest(tags, k=3, retrieval="bm25")), strict=True
            ):
                assert (
                    hits[0].id == doc.passages()[-1].id and hits[0].text == doc.passages()[-1].text
                )
            dead = [i for i, d in state.items() if d is None]
            served = {
                p.id
                for hits in live.search(SearchRequest(tags or ["tower"], k=10, retrieval="bm25"))
                for p in hits
            }
            assert not {p for p in served if p.rsplit("#", 1)[0] in dead}


def _has(live: LiveIndex, doc_id: str) -> bool:
    try:
        live.get(doc_id)
    except DocumentNotFound:
        return False
    return True


def test_a_torn_log_record_is_dropped_on_open(dpr_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    live = make_live_index(tmp_path, "bm25", None, passages=40)
    rng = np.random.default_rng(0)
    for i in range(3):
        live.put(random_document(rng, f"d{i}"))
    live.close()
    log = tmp_path / "live" / wal_module.WAL_FILE
    size = log.stat().st_size
    torn = encode_record(WalRecord(4, (PutOp(random_document(rng, "torn"), None),)))
    with open(log, "ab") as f:
        f.write(torn[: len(torn) // 2])  # the crash came mid-write
    with LiveIndex(tmp_path / "live") as again:
        assert again.version == 3 and log.stat().st_size == size
        with pytest.raises(DocumentNotFound):
            again.get("torn")
        assert again.put(random_document(rng, "next")).version == 4
    with LiveIndex(tmp_path / "live") as again:
        assert again.version == 4 and again.get("next").version == 4


def test_compaction_while_writing_loses_nothing(
    dpr_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    live = make_live_index(tmp_path, "flat", dpr_dirs, passages=60)
    rng = np.random.default_rng(5)
    docs = [random_document(rng, f"c{i}", words=int(rng.integers(5, 150))) for i in range(40)]
    acked: list[tuple[str, int]] = []
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for i, doc in enumerate(docs):
                acked.append((doc.id, live.put(doc).version))
                if i % 3 == 2:
                    victim = docs[i - 2].id
                    acked.append((f"-{victim}", live.delete(victim).version))
        except BaseException as e:  # surfaced below
            errors.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    compactions = []
    while writer.is_alive():
        if (result := live.compact()) is not None:
            compactions.append(result.version)
    writer.join()
    assert compactions  # at least one ran while the writer wrote
    # The loop's last compaction may have run after the last write (the thread was still
    # alive): then there is nothing left to fold and this one is None.
    if (final := live.compact()) is not None:
        compactions.append(final.version)
    assert not errors
    assert compactions[-1] == live.version  # everything folded
    assert (
        [v for _, v in acked] == list(range(1, len(acked) + 1)) == list(range(1, live.version + 1))
    )
    deleted = {name[1:] for name, _ in acked if name.startswith("-")}

    def check(index: LiveIndex) -> None:
        for doc in docs:
            if doc.id in deleted:
                with pytest.raises(DocumentNotFound):
                    index.get(doc.id)
            else:
                assert index.get(doc.id).document == doc
        tags = [f"tag{d.id}" for d in docs]
        for doc, hits in zip(
            docs, index.search(SearchRequest(tags, k=3, retrieval="bm25")), strict=True
        ):
            ids = [h.id for h in hits]
            if doc.id in deleted:
                assert not any(i.startswith(f"{doc.id}#") for i in ids)
            else:
                assert ids[0] == doc.passages()[-1].id
        assert len(index) == 60 + sum(len(d.passages()) for d in docs if d.id not in deleted)

    check(live)
    live.close()
    with LiveIndex(tmp_path / "live") as again:
        assert again.version == len(acked) and again.base_version == compactions[-1]
        check(again)


def test_a_batch_is_all_or_nothing(
    dpr_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = make_live_index(tmp_path, "flat", dpr_dirs, passages=60)
    rng = np.random.default_rng(2)
    batch = [random_document(rng, f"b{i}") for i in range(5)]
    log = tmp_path / "live" / wal_module.WAL_FILE
    served = live.search(SearchRequest(["tower", "tagb3"], k=5, retrieval="bm25"))

    def no_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(wal_module.os, "fsync", no_disk)
    with pytest.raises(OSError, match="No space"):
        live.put_many(batch)
    monkeypatch.undo()
    assert live.version == 0 and log.stat().st_size == 0
    assert live.search(SearchRequest(["tower", "tagb3"], k=5, retrieval="bm25")) == served
    assert not any(_has(live, d.id) for d in batch)
    live.close()
    with LiveIndex(tmp_path / "live", LiveOptions(verify=False)) as again:
        assert again.version == 0 and not any(_has(again, d.id) for d in batch)
        result = again.put_many(batch)
        assert result.version == 1 and list(result.passages) == [d.id for d in batch]
        for doc, hits in zip(
            batch,
            again.search(SearchRequest([f"tag{d.id}" for d in batch], k=1, retrieval="bm25")),
            strict=True,
        ):
            assert hits[0].id == doc.passages()[-1].id and again.get(doc.id).version == 1


@pytest.mark.parametrize(
    "crash_at",
    [
        "openbook.index.document_store.DocumentStore.set_base",  # base published, rows not
        "openbook.index.wal.WriteAheadLog.drop_through",  # switched, log not cut
        "openbook.index.live._remove_old_bases",  # log cut, old base still there
    ],
)
def test_a_compaction_cut_short_at_any_step_reopens_whole(
    crash_at: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = make_live_index(tmp_path, "bm25", None, passages=40)
    rng = np.random.default_rng(4)
    docs = [random_document(rng, f"k{i}") for i in range(4)]
    for doc in docs:
        live.put(doc)
    live.delete("k1")
    live.delete("w3")
    live.put(random_document(rng, "w5", words=12))

    class Crash(Exception):
        pass

    def crash(*args: object, **kwargs: object) -> None:
        raise Crash

    monkeypatch.setattr(crash_at, crash)
    with pytest.raises(Crash):
        live.compact()
    monkeypatch.undo()
    want = live.search(
        SearchRequest(["tower water", "tagk0", "tagw5", "tagk1"], k=5, retrieval="bm25")
    )
    live.close()
    with LiveIndex(tmp_path / "live") as again:
        assert again.version == 7 and len(again) == 40 - 1 + sum(
            len(d.passages()) for d in docs if d.id != "k1"
        )
        for doc_id in ("k1", "w3"):
            with pytest.raises(DocumentNotFound):
                again.get(doc_id)
        got = again.search(
            SearchRequest(["tower water", "tagk0", "tagw5", "tagk1"], k=5, retrieval="bm25")
        )
        assert [[p.id for p in hits] for hits in got][1:] == [
            [p.id for p in hits] for hits in want
        ][1:]
        assert got[3] == [] and "w3" not in {p.id for p in got[0]}
        assert again.compact() is None or again.version == 7
        again.put(random_document(rng, "later"))
    with LiveIndex(tmp_path / "live") as last:
        assert last.version == 8 and last.get("later").version == 8
