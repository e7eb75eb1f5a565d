"""The stage cache: outputs kept in the store and reused by a worker with another disk; the local disk a bounded,
least-recently-used cache that never evicts an entry in use (across processes, by flock). Real SQLite database
with the real migrations, real local blob store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from artifacts.local import LocalBlobStore
from artifacts.paths import blob_path
from builder.stagecache import StageCache
from kiln import db
from kiln.tables import StageOutput
from tests.conftest import REPO

KEY_A, KEY_B, KEY_C = (f"sha256:{c * 64}" for c in "abc")


@pytest.fixture
def shared(tmp_path):
    """What every worker shares: one database, one store."""
    url = f"sqlite:///{tmp_path / 'kiln.db'}"
    db.upgrade(url)
    return db.session_factory(url), LocalBlobStore(tmp_path / "store")


def worker(tmp_path, shared, name: str, max_bytes: int = 1 << 30) -> StageCache:
    sessions, store = shared
    return StageCache(tmp_path / name / "cache", store, sessions, max_bytes=max_bytes)


def producer(calls: list, size: int = 1000, tag: str = "q"):
    def produce(out: Path) -> dict:
        calls.append(out)
        out.mkdir()
        (out / "weights.bin").write_bytes(os.urandom(size))
        (out / "sub").mkdir()
        (out / "sub" / "config.json").write_text(json.dumps({"tag": tag}))
        return {"tag": tag, "seconds": 1.5}
    return produce


def tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def files(path: Path) -> dict[str, bytes]:
    """The output's files, without the stage record each worker writes for itself."""
    return {k: v for k, v in tree(path).items() if k != ".complete"}


def test_an_output_made_on_one_worker_is_reused_by_a_worker_with_another_disk(tmp_path, shared):
    a, b = worker(tmp_path, shared, "a"), worker(tmp_path, shared, "b")
    calls: list = []
    made, record = a.get("quantize", KEY_A, producer(calls))
    assert record == {"tag": "q", "seconds": 1.5} and len(calls) == 1
    assert json.loads((made / ".complete").read_text()) == record

    fetched, record_b = b.get("quantize", KEY_A, producer(calls))
    assert len(calls) == 1 and record_b is None  # not produced again
    assert fetched.parent.parent == tmp_path / "b" / "cache" and files(fetched) == files(made)
    with shared[0]() as s:
        row = s.get(StageOutput, KEY_A)
    assert row.stage == "quantize" and shared[1].exists(row.digest)
    assert b.where("quantize", KEY_A) == "local" and worker(tmp_path, shared, "c").where("quantize", KEY_A) == "store"
    a.release(), b.release()


def test_the_stored_blob_holds_the_files_and_never_the_stage_record(tmp_path, shared):
    """The record (timings, this disk's bookkeeping) stays local: the blob, which for a compile output is the
    engine image's layer, is the output's files alone; a worker that fetches it writes its own record."""
    import io
    import tarfile

    a, b = worker(tmp_path, shared, "a"), worker(tmp_path, shared, "b")
    made, _ = a.get("compile", KEY_A, producer([]))
    with shared[0]() as s:
        digest = s.get(StageOutput, KEY_A).digest
    with tarfile.open(fileobj=io.BytesIO(shared[1].get_bytes(digest))) as tar:
        assert tar.getnames() == ["sub", "sub/config.json", "weights.bin"]
    fetched, record = b.get("compile", KEY_A, producer([]))
    assert record is None and json.loads((fetched / ".complete").read_text()) == {"fetched": digest}
    assert files(fetched) == files(made) and (made / ".complete").is_file()
    a.release(), b.release()


def test_a_corrupted_or_collected_stored_output_is_produced_again(tmp_path, shared):
    a = worker(tmp_path, shared, "a")
    calls: list = []
    a.get("compile", KEY_A, producer(calls))
    a.release()
    with shared[0]() as s:
        digest = s.get(StageOutput, KEY_A).digest
    blob = shared[1].root / blob_path(digest)
    blob.chmod(0o644)
    data = bytearray(blob.read_bytes())
    data[600] ^= 0xFF  # inside the first file's bytes: the tar still parses, the digest does not match
    blob.write_bytes(bytes(data))

    b = worker(tmp_path, shared, "b")
    path, record = b.get("compile", KEY_A, producer(calls))
    assert len(calls) == 2 and record is not None and (path / ".complete").is_file()
    assert not list((tmp_path / "b" / "cache" / "compile").glob(".staging-*"))
    b.release()

    shared[1].delete(digest)  # GC collected the blob after another worker read the row: a miss, not an error
    c = worker(tmp_path, shared, "c")
    c.get("compile", KEY_A, producer(calls))
    assert len(calls) == 3
    c.release()


def test_a_local_entry_the_store_does_not_know_is_stored_when_used(tmp_path, shared):
    a = worker(tmp_path, shared, "a")
    a.get("quantize", KEY_A, producer([]))
    a.release()
    with shared[0]() as s:
        s.delete(s.get(StageOutput, KEY_A))  # as GC does when no engine needs it
        s.commit()
    a.get("quantize", KEY_A, producer([]))  # a local hit
    a.release()
    with shared[0]() as s:
        assert s.get(StageOutput, KEY_A) is not None


def test_least_recently_used_entries_are_evicted_past_the_budget(tmp_path, shared):
    cache = worker(tmp_path, shared, "a", max_bytes=2500)
    pa, _ = cache.get("quantize", KEY_A, producer([]))
    pb, _ = cache.get("compile", KEY_B, producer([]))
    cache.release()
    old = time.time() - 100
    os.utime(pa, (old, old))
    os.utime(pb, (old + 10, old + 10))
    cache.get("quantize", KEY_A, producer([]))  # used again: now the most recent
    pc, _ = cache.get("quantize", KEY_C, producer([]))  # 3 × ~1 kB > 2.5 kB: one must go
    assert pa.is_dir() and not pb.exists() and pc.is_dir()  # B was least recently used
    cache.release()
    with shared[0]() as s:  # the store still has every output
        assert {r.key for r in s.scalars(select(StageOutput))} == {KEY_A, KEY_B, KEY_C}
    reused, record = cache.get("compile", KEY_B, producer(calls := []))
    assert record is None and not calls and reused == pb
    cache.release()


def test_an_entry_in_use_in_another_process_is_never_evicted(tmp_path, shared):
    """A build in another process holds entry A (a shared flock); eviction here skips it however old it is."""
    cache = worker(tmp_path, shared, "a", max_bytes=0)
    pa, _ = cache.get("quantize", KEY_A, producer([]))
    cache.release()
    assert not pa.exists()  # budget 0: nothing stays once unused
    holder = subprocess.Popen(
        [sys.executable, "-c", f"""
import sys
from artifacts.local import LocalBlobStore
from builder.stagecache import StageCache
from kiln import db
cache = StageCache({str(tmp_path / 'a' / 'cache')!r}, LocalBlobStore({str(tmp_path / 'store')!r}),
                   db.session_factory({f"sqlite:///{tmp_path / 'kiln.db'}"!r}), max_bytes=0)
path, record = cache.get("quantize", {KEY_A!r}, None)
print(path, record, flush=True)
sys.stdin.read()
cache.release()
"""], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline().split()
        assert line == [str(pa), "None"]  # fetched from the store and pinned by the other process
        os.utime(pa, (0, 0))
        cache.get("compile", KEY_B, producer([]))
        cache.release()
        assert cache.evict() == [] and pa.is_dir() and (pa / ".complete").is_file()
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0
    assert not pa.exists()  # released over there: evicted as its build ended


def test_a_dead_producers_staging_folder_is_swept_and_a_live_ones_kept(tmp_path, shared):
    cache = worker(tmp_path, shared, "a")
    seen = {}

    def produce(out: Path) -> dict:
        dead = out.parent.parent / ".staging-dead"
        (dead / "out").mkdir(parents=True)  # a kill -9 mid-quantize leaves this, unlocked
        cache.evict()  # runs while this producer's own staging folder is locked
        seen["live_kept"] = out.parent.is_dir()
        seen["dead_gone"] = not dead.exists()
        return producer([])(out)

    cache.get("quantize", KEY_A, produce)
    cache.release()
    assert seen == {"live_kept": True, "dead_gone": True}


def test_builds_needing_one_output_at_once_on_several_workers_produce_it_once(tmp_path, shared, monkeypatch):
    """A matrix's builds start together on three workers (threads here; each its own disk): one claims the key and
    calibrates, the others wait and fetch its output from the store — one production, three equal outputs."""
    import threading

    monkeypatch.setattr(StageCache, "WAIT_POLL_S", 0.05)
    caches = [worker(tmp_path, shared, n) for n in "abc"]
    calls: list = []
    started = threading.Barrier(3)

    def slow(out: Path) -> dict:
        time.sleep(0.5)  # long enough that the others look while it runs
        return producer(calls)(out)

    results: dict = {}

    def run(cache: StageCache, name: str) -> None:
        started.wait()
        results[name] = cache.get("quantize", KEY_A, slow)

    threads = [threading.Thread(target=run, args=(c, n)) for c, n in zip(caches, "abc")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(calls) == 1
    assert sorted(r is None for _, r in results.values()) == [False, True, True]  # one produced, two reused
    trees = [files(path) for path, _ in results.values()]
    assert trees[0] == trees[1] == trees[2]
    with shared[0]() as s:
        from kiln.tables import StageClaim
        assert s.scalars(select(StageClaim)).all() == []  # released after the production


def test_a_claim_whose_holder_died_lapses_and_is_taken_over(tmp_path, shared, monkeypatch):
    from builder.claims import StageClaims

    monkeypatch.setattr(StageCache, "WAIT_POLL_S", 0.05)
    sessions, _ = shared
    dead = StageClaims(sessions, ttl_s=0.3, holder="dead-worker")
    assert dead.try_claim(KEY_B)  # and never renewed nor released: its worker was killed
    assert not StageClaims(sessions, ttl_s=0.3).try_claim(KEY_B)  # live: another holder cannot take it
    calls: list = []
    path, record = worker(tmp_path, shared, "a").get("quantize", KEY_B, producer(calls))
    assert len(calls) == 1 and record is not None and (path / "weights.bin").is_file()


def test_a_holder_renews_its_claim_while_it_produces(tmp_path, shared):
    from builder.claims import StageClaims

    sessions, _ = shared
    holder, other = StageClaims(sessions, ttl_s=0.3), StageClaims(sessions, ttl_s=0.3)
    assert holder.try_claim(KEY_C)
    with holder.renewing(KEY_C):
        time.sleep(0.8)  # well past one TTL: renewed every 0.1 s
        assert not other.try_claim(KEY_C)
    assert other.try_claim(KEY_C)  # released when the body ended
