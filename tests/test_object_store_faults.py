"""Object-store faults are ridden, not fatal: through a fault proxy in front of the moto server
(tests/support/fault_proxy.py) that answers 503 SlowDown or resets connections on a share of requests,
including after a write reached the server, a stage's push and pull are retried with backoff and complete, a
PUT whose answer was lost is not reported as a conflict, and a push that fails for good leaves the store
consistent for the next one to finish."""

from __future__ import annotations

import json
import time
from pathlib import Path

import obstore as obs
import polars as pl
import pytest
import yaml

from eagle3_assets.core.storage.remote import MANIFEST, ConflictError, RemoteRoot
from eagle3_assets.core.storage.remote_lease import LeaseHeld
from eagle3_assets.core.storage.remote_writes import RetryPolicy, StoreUnavailable

from .support.fault_proxy import FaultProxy
from .support.object_store import BUCKET, s3_options, s3_project
from .support.projects import STAGES_TO_REPORT, materialize_in_process

FAST = {"max_retries": 10, "init_backoff_s": 0.005, "max_backoff_s": 0.05, "retry_timeout_s": 30}
WRITES = ["prompts.parquet", "responses/", "hidden_states/"]


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server, seed=7) as p:
        yield p


def root(url: str, cache: Path, prefix: str, retry: dict | None = FAST) -> RemoteRoot:
    return RemoteRoot(f"s3://{BUCKET}/{prefix}", {**s3_options(url), "retry": retry}, cache)


def files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    }


def stored(url: str, prefix: str) -> dict[str, bytes]:
    """What the bucket holds under `prefix`, read directly (not through the proxy)."""
    store = RemoteRoot(f"s3://{BUCKET}", s3_options(url), Path("/tmp/unused")).store
    return {
        m["path"]: bytes(obs.get(store, m["path"]).bytes())
        for batch in obs.list(store, prefix)
        for m in batch
        if not Path(m["path"]).name.startswith(".")
    }


def write_stage(folder: Path, n: int = 24) -> None:
    """A partition's worth of files: a table, journal parts, shards and the index that names them."""
    (folder / "responses").mkdir(parents=True, exist_ok=True)
    (folder / "hidden_states").mkdir(parents=True, exist_ok=True)
    pl.DataFrame({"id": [f"p{i}" for i in range(n)]}).write_parquet(folder / "prompts.parquet")
    for i in range(n):
        pl.DataFrame({"id": [f"r{i}"], "text": ["x" * (50 * i)]}).write_parquet(
            folder / "responses" / f"part-{i:03d}.parquet"
        )
    for i in range(4):
        (folder / "hidden_states" / f"shard-{i:05d}.safetensors").write_bytes(bytes([i]) * (20_000 + i))
    index = pl.DataFrame({"shard": [f"shard-{i:05d}.safetensors" for i in range(4)]})
    index.write_parquet(folder / "hidden_states" / "index.parquet")


def round_trip(url: str, tmp: Path, prefix: str, retry: dict | None = FAST) -> tuple[float, Path]:
    """Push a partition, replace and delete some of it (a compaction), push again, pull it into a fresh copy
    and compare; returns the seconds it took and the working copy's folder."""
    start = time.monotonic()
    a = root(url, tmp / "a", prefix, retry)
    folder = a.local("B1")
    write_stage(folder)
    assert a.push("B1", WRITES) == 24 + 1 + 5
    time.sleep(0.01)
    parts = sorted((folder / "responses").iterdir())
    pl.concat([pl.read_parquet(p) for p in parts[:8]]).write_parquet(
        folder / "responses" / "part-folded.parquet"
    )
    for p in parts[:8]:
        p.unlink()
    pl.DataFrame({"id": ["p-new"]}).write_parquet(folder / "prompts.parquet")  # replaced: If-Match
    assert a.push("B1", WRITES) == 2
    b = root(url, tmp / "b", prefix, retry)
    assert b.pull("B1", WRITES) == 1 + 17 + 5
    assert files(b.local("B1")) == files(folder)
    return time.monotonic() - start, folder


def test_a_round_trip_rides_slowdowns_and_dropped_connections(tmp_path, proxy, s3_server, aws_env):
    healthy, _ = round_trip(proxy.url, tmp_path / "healthy", "faults/healthy")
    assert proxy.injected == 0
    proxy.set(slowdown=0.15, drop_before=0.05, drop_after=0.10)
    faulty, folder = round_trip(proxy.url, tmp_path / "faulty", "faults/rt")
    counts = dict(proxy.counts)
    # The faults really happened, of every kind, on a real share of the requests.
    assert all(n > 0 for n in counts.values()), counts
    assert proxy.injected >= 0.15 * proxy.requests, (counts, proxy.requests)
    # The store holds exactly the working copy (no lost file, no leftover of the compaction).
    assert stored(s3_server, "faults/rt") == {f"faults/rt/B1/{k}": v for k, v in files(folder).items()}
    print(f"\nround trip: {healthy:.2f}s healthy, {faulty:.2f}s with {counts} in {proxy.requests} requests")

    # Without retries the same faults break the same push: the test above can fail.
    proxy.reset_counts()
    with pytest.raises((StoreUnavailable, obs.exceptions.BaseError)):
        round_trip(proxy.url, tmp_path / "no-retry", "faults/no-retry", retry={"max_retries": 0})
    assert proxy.injected > 0


def test_a_put_whose_answer_was_lost_is_not_a_conflict(tmp_path, proxy, s3_server, aws_env):
    a = root(proxy.url, tmp_path / "a", "faults/lost")
    folder = a.local("B1")
    folder.mkdir(parents=True)
    (folder / "tokens.parquet").write_bytes(b"first")
    # The PUT (If-None-Match) reaches the server, the answer is a reset; the retry meets its own object (412).
    proxy.rule("PUT", "tokens.parquet", "drop_after")
    assert a.push("B1", ["tokens.parquet"]) == 1
    assert proxy.counts["drop_after"] == 1 and proxy.requests >= 2
    time.sleep(0.01)
    (folder / "tokens.parquet").write_bytes(b"second")
    # The same for a replacement (If-Match): the retry finds the ETag changed, to the one of these bytes.
    proxy.rule("PUT", "tokens.parquet", "drop_after")
    assert a.push("B1", ["tokens.parquet"]) == 1
    assert proxy.counts["drop_after"] == 2
    assert stored(s3_server, "faults/lost") == {"faults/lost/B1/tokens.parquet": b"second"}
    # The manifest holds the stored ETag: the next replacement is not refused as stale.
    time.sleep(0.01)
    (folder / "tokens.parquet").write_bytes(b"third")
    assert a.push("B1", ["tokens.parquet"]) == 1
    # A delete whose answer was lost (obstore's bulk delete is a POST naming the key) is done, not an error.
    (folder / "tokens.parquet").unlink()
    proxy.rule("POST", "tokens.parquet", "drop_after")
    a.push("B1", ["tokens.parquet"])
    assert proxy.counts["drop_after"] == 3 and stored(s3_server, "faults/lost") == {}

    # A real conflict is still one: another writer's different bytes, behind the same lost answers.
    (folder / "tokens.parquet").write_bytes(b"from a")
    a.push("B1", ["tokens.parquet"])
    b = root(proxy.url, tmp_path / "b", "faults/lost")
    b.local("B1").mkdir(parents=True)
    (b.local("B1") / "tokens.parquet").write_bytes(b"from b")
    proxy.rule("PUT", "tokens.parquet", "drop_after")
    with pytest.raises(ConflictError):
        b.push("B1", ["tokens.parquet"])


def test_obstore_alone_does_not_retry_a_conditional_put_that_was_reset(proxy, aws_env):
    """Why remote.py retries conditional PUTs itself: obstore gives up on a reset it cannot call
    idempotent."""
    store = root(proxy.url, Path("/tmp/unused"), "faults/raw").store
    proxy.rule("PUT", "raw-create", "drop_before")
    with pytest.raises(obs.exceptions.BaseError):
        obs.put(store, "raw-create", b"x", mode="create")
    proxy.rule("PUT", "raw-overwrite", "drop_before")
    obs.put(store, "raw-overwrite", b"x")  # an overwrite is idempotent: retried
    assert proxy.counts["drop_before"] == 2


def test_holds_compares_bytes_where_the_etag_is_not_an_md5(tmp_path):
    r = RemoteRoot("memory://", {}, tmp_path)
    etag = obs.put(r.writes._writes, "k/a", b"abc")["e_tag"]
    assert etag.strip('"') != __import__("hashlib").md5(b"abc").hexdigest()
    assert r.writes.holds("k/a", b"abc") == etag
    assert (
        r.writes.holds("k/a", b"abd") is None
        and r.writes.holds("k/a", b"ab") is None
        and r.writes.holds("k/b", b"") is None
    )


def test_a_push_that_outlasts_the_retries_leaves_the_old_state_and_the_next_push_finishes(
    tmp_path,
    proxy,
    s3_server,
    aws_env,
):
    few = {**FAST, "max_retries": 2}
    a = root(proxy.url, tmp_path / "a", "faults/half", few)
    folder = a.local("B1")
    write_stage(folder, n=6)
    a.push("B1", WRITES)
    before = stored(s3_server, "faults/half")

    def consistent() -> None:
        """Every shard the stored index names is stored, and no journal row was lost."""
        now = stored(s3_server, "faults/half")
        index = pl.read_parquet(now["faults/half/B1/hidden_states/index.parquet"])
        assert {f"faults/half/B1/hidden_states/{s}" for s in index["shard"]} <= set(now)
        ids = {i for k, v in now.items() if "/responses/" in k for i in pl.read_parquet(v)["id"]}
        assert ids == {f"r{i}" for i in range(6)}

    # A re-extraction (new shards, a new index, old shards gone) and a compaction of the journal.
    time.sleep(0.01)
    for p in (folder / "hidden_states").glob("shard-*"):
        p.unlink()
    for i in range(2):
        (folder / "hidden_states" / f"shard-new-{i}.safetensors").write_bytes(b"n" * 1000)
    pl.DataFrame({"shard": [f"shard-new-{i}.safetensors" for i in range(2)]}).write_parquet(
        folder / "hidden_states" / "index.parquet"
    )
    parts = sorted((folder / "responses").iterdir())
    pl.concat([pl.read_parquet(p) for p in parts]).write_parquet(folder / "responses" / "part-folded.parquet")
    for p in parts:
        p.unlink()

    # 1. A new shard's PUT fails for good: the index naming it is not published (it goes last), the old index
    #    and everything it names are still there.
    proxy.rule("PUT", "shard-new-1", "slowdown", times=100)
    with pytest.raises(StoreUnavailable, match="Nothing is half-published"):
        a.push("B1", WRITES)
    consistent()
    assert (
        stored(s3_server, "faults/half")["faults/half/B1/hidden_states/index.parquet"]
        == (before["faults/half/B1/hidden_states/index.parquet"])
    )
    # Then the shards go up but the index's PUT fails for good: the same.
    proxy.healthy()
    proxy.rule("PUT", "index.parquet", "slowdown", times=100)
    with pytest.raises(StoreUnavailable, match="Nothing is half-published"):
        a.push("B1", WRITES)
    consistent()
    now = stored(s3_server, "faults/half")
    assert (
        now["faults/half/B1/hidden_states/index.parquet"]
        == before["faults/half/B1/hidden_states/index.parquet"]
    )
    assert set(before) <= set(now)
    # A checkout before the next push does not fetch the deleted files back into the working copy.
    assert a.pull("B1", WRITES) == 0
    assert (
        not list((folder / "hidden_states").glob("shard-0*"))
        and len(list((folder / "responses").iterdir())) == 1
    )

    # 2. Healthy for the index, failing for good on deleting the old shards: the new index is in, the old
    #    shards linger (named by nothing), the deletions stay pending.
    proxy.healthy()
    proxy.rule("POST", "shard-00000", "slowdown", times=100)
    with pytest.raises(StoreUnavailable):
        a.push("B1", WRITES)
    consistent()
    pending = [k for k, v in json.loads((folder / MANIFEST).read_text()).items() if v[3:] == ["delete"]]
    assert pending and all(k.startswith(("hidden_states/shard-0", "responses/part-0")) for k in pending)

    # 3. Healthy: the next push finishes, and the store holds exactly the working copy.
    proxy.healthy()
    assert a.push("B1", WRITES) == 0
    consistent()
    assert stored(s3_server, "faults/half") == {f"faults/half/B1/{k}": v for k, v in files(folder).items()}
    fresh = root(proxy.url, tmp_path / "fresh", "faults/half")
    fresh.pull("B1", WRITES)
    assert files(fresh.local("B1")) == files(folder)


def test_the_lease_is_renewed_through_faults(tmp_path, proxy, s3_server, aws_env):
    a = root(proxy.url, tmp_path / "a", "faults/lease")
    other = root(s3_server, tmp_path / "b", "faults/lease")  # direct, healthy
    ttl = 3.0  # renewed every second: a renewal that rides its faults is back well within the lease's life

    def expires() -> float:
        return json.loads(bytes(obs.get(other.store, "B1/.lease.json").bytes()))["expires"]

    def held_off_until(done) -> None:
        """Until `done()`, a second holder is refused every time it tries (the lease never lapsed)."""
        hang_guard = time.monotonic() + 120  # only a broken renewal gets here: not a speed bound
        while not done():
            with pytest.raises(LeaseHeld), other.lease("B1", "generation for B1"):
                pass
            assert time.monotonic() < hang_guard, proxy.counts
            time.sleep(0.2)

    with a.lease("B1", "generation for B1", ttl_s=ttl):
        # The next renewals' attempts: three land but their answers are lost, three meet SlowDown.
        proxy.rule("PUT", ".lease.json", "drop_after", times=3)
        proxy.rule("PUT", ".lease.json", "slowdown", times=3)
        held_off_until(lambda: proxy.counts["drop_after"] == 3 and proxy.counts["slowdown"] == 3)
        after_faults = expires()
        held_off_until(lambda: expires() > after_faults)  # and the renewals go on
        assert expires() > time.time()
    with other.lease("B1", "generation for B1"):  # released at the end, through the proxy
        pass


def test_the_retry_policy_comes_from_the_storage_options(tmp_path, aws_env):
    opts = {**s3_options("http://127.0.0.1:9"), "retry": {"max_retries": 3, "init_backoff_s": 0.5}}
    r = RemoteRoot(f"s3://{BUCKET}/p", opts, tmp_path)
    assert r.retry == RetryPolicy(max_retries=3, init_backoff_s=0.5)
    assert r.store.retry_config["max_retries"] == 3
    assert r.store.retry_config["backoff"]["init_backoff"].total_seconds() == 0.5
    assert (
        r.writes._writes.retry_config["max_retries"] == 0
    )  # conditional writes: retried by remote_writes.py
    assert RemoteRoot(f"s3://{BUCKET}/p", s3_options("http://127.0.0.1:9"), tmp_path).retry == RetryPolicy()
    with pytest.raises(ValueError, match="unknown keys"):
        RetryPolicy.from_options({"retries": 3})


@pytest.mark.slow
def test_the_pipeline_rides_a_faulty_store(tmp_path, proxy, s3_server, aws_env):
    proxy.set(slowdown=0.12, drop_before=0.04, drop_after=0.15)
    path = s3_project(tmp_path, proxy.url, "faults/pipeline")
    cfg = yaml.safe_load(path.read_text())
    cfg["storage"]["options"]["retry"] = FAST
    path.write_text(yaml.safe_dump(cfg))
    result = materialize_in_process(path, STAGES_TO_REPORT)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    assert all(n > 0 for n in proxy.counts.values()), proxy.counts
    print(f"\npipeline: {proxy.counts} in {proxy.requests} requests")
    keys = set(stored(s3_server, "faults/pipeline"))
    for name in ("prompts.parquet", "tokens.parquet", "report.json"):
        assert f"faults/pipeline/B1/{name}" in keys, name
    report = json.loads(stored(s3_server, "faults/pipeline")["faults/pipeline/B1/report.json"])
    assert report["n_responses"] == 6
