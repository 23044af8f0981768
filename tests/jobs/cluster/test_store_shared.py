"""The store on a real Postgres: claims, fits, leases, fencing, the reaper, event order, migrations,
NOTIFY and shipped output. Claims and fits run on SQLite too (the same code, one writer)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from jobs.store import SCHEMA_VERSION, JobStore, LeaseLost

GIB = 2**30


@pytest.fixture(params=["sqlite", "postgres"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path):
    url = str(tmp_path / "jobs.db") if request.param == "sqlite" else request.getfixturevalue("pg_url")
    s = JobStore(url)
    yield s
    s.close()


@pytest.fixture
def pg(pg_url: str):
    s = JobStore(pg_url)
    yield s
    s.close()


def _job(store: JobStore, name: str = "j", *, gpus: int = 0, min_vram: int = 0, executor: str = "process",
         priority: int = 0, max_attempts: int = 3) -> dict:
    return store.create_job({"kind": "command", "command": "true", "retry": {"on": ["worker_lost"]}},
                            kind="command", name=name, gpus=gpus, min_vram=min_vram, executor=executor,
                            priority=priority, max_attempts=max_attempts)


def _expire(store: JobStore, job_id: str) -> None:
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE attempts SET lease_until = lease_until - 3600 WHERE job_id = :j"), {"j": job_id})


def test_claims_fit_gpus_vram_and_slurm(any_store: JobStore) -> None:
    s = any_store
    big = _job(s, "big", gpus=1, min_vram=20 * GIB, priority=3)
    two = _job(s, "two", gpus=2, min_vram=8 * GIB, priority=2)
    slurm = _job(s, "slurm", gpus=4, executor="slurm", priority=1)
    cpu = _job(s, "cpu")
    # an 8 GiB box: not the 20 GiB job, not two GPUs it lacks, not Slurm's; the CPU job
    assert s.claim_next(gpu_slots=1, cpu_slots=1, gpu_vram=[8 * GIB])["name"] == "cpu"
    assert s.claim_next(gpu_slots=1, cpu_slots=1, gpu_vram=[8 * GIB]) is None
    # two 8 GiB GPUs: the two-GPU job
    assert s.claim_next(gpu_slots=2, cpu_slots=0, gpu_vram=[8 * GIB, 8 * GIB])["id"] == two["id"]
    # a 24 GiB and an unknown GPU: the 20 GiB job fits on one
    assert s.claim_next(gpu_slots=2, cpu_slots=0, gpu_vram=[0, 24 * GIB])["id"] == big["id"]
    # only a worker with Slurm slots takes the Slurm job, whatever its GPUs
    assert s.claim_next(gpu_slots=8, cpu_slots=8, gpu_vram=[80 * GIB] * 8) is None
    assert s.claim_next(gpu_slots=0, cpu_slots=0, slurm_slots=1)["id"] == slurm["id"]


def test_concurrent_claims_across_engines_take_each_job_once(pg_url: str) -> None:
    stores = [JobStore(pg_url) for _ in range(6)]  # separate engines: separate workers
    ids = {_job(stores[0], f"j{i}")["id"] for i in range(150)}
    claimed: list[tuple[str, str]] = []
    lock = threading.Lock()

    def run(st: JobStore, wid: str) -> None:
        while (j := st.claim_next(gpu_slots=0, cpu_slots=1, worker_id=wid, lease_s=30)) is not None:
            with lock:
                claimed.append((j["id"], wid))

    threads = [threading.Thread(target=run, args=(st, f"w{i}")) for i, st in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for i, _ in claimed) == sorted(ids)  # each once
    assert len({w for _, w in claimed}) > 1  # SKIP LOCKED let them claim side by side
    assert all(len(stores[0].attempts(i)) == 1 for i in ids)
    for st in stores:
        st.close()


def test_batch_member_claims_by_id_race_once_each_across_engines(pg_url: str) -> None:
    """claim_job (a co-scheduled batch's leader claiming its members by id) on Postgres: workers racing
    for the same ids each take a job once, with one attempt; a cancelled or taken job is not claimed."""
    stores = [JobStore(pg_url) for _ in range(4)]
    ids = [_job(stores[0], f"m{i}")["id"] for i in range(40)]
    gone = _job(stores[0], "gone")
    stores[0].request_cancel(gone["id"])  # still PENDING: cancelled at once
    claimed: list[tuple[str, str]] = []
    rows: list[bool] = []  # each claimed row as the claimer wrote it
    lock = threading.Lock()

    def run(st: JobStore, wid: str) -> None:
        for i in ids + [gone["id"]]:  # every worker goes for every id, in the same order
            got = st.claim_job(i, worker_id=wid, lease_s=30, run_root="/runs")
            if got is not None:
                with lock:
                    claimed.append((got["id"], wid))
                    rows.append((got["status"], got["worker_id"], got["run_dir"]) == ("STARTING", wid, f"/runs/{i}"))

    threads = [threading.Thread(target=run, args=(st, f"w{n}")) for n, st in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for i, _ in claimed) == sorted(ids), "each member once, the cancelled one never"
    assert all(rows) and len(rows) == len(ids), "STARTING, the claimer's worker id, its run dir"
    assert all(len(stores[0].attempts(i)) == 1 for i in ids)
    assert stores[1].claim_job(ids[0], worker_id="late") is None, "a claimed job is not claimed again"
    for st in stores:
        st.close()


def test_a_reaped_attempt_is_fenced_everywhere(pg: JobStore) -> None:
    j = _job(pg)
    pg.claim_next(gpu_slots=0, cpu_slots=1, worker_id="a", lease_s=30)
    assert pg.mark_running(j["id"], 1, executor="process", worker_id="a")
    pg.append_output(j["id"], 1, "a", log=b"from a\n")
    assert pg.expired_attempts() == []
    assert pg.reap_attempt(j["id"], 1, retry_on=["worker_lost"], never_ran=False, message="m") is None  # not due
    _expire(pg, j["id"])
    (exp,) = pg.expired_attempts()
    assert (exp["job_id"], exp["worker_id"]) == (j["id"], "a")
    reaped = pg.reap_attempt(j["id"], 1, retry_on=["worker_lost"], never_ran=False, message="lost", note="note")
    assert (reaped["status"], reaped["reason"]) == ("PENDING", "worker_lost")
    # worker b runs the retry to the end
    assert pg.claim_next(gpu_slots=0, cpu_slots=1, worker_id="b", lease_s=30)["attempt"] == 2
    assert pg.mark_running(j["id"], 2, executor="process", worker_id="b")
    # a comes back: every write of its attempt 1 is refused or a no-op
    with pytest.raises(LeaseLost):
        pg.append_output(j["id"], 1, "a", log=b"late\n")
    with pytest.raises(LeaseLost):
        pg.mark_running(j["id"], 1, executor="process", worker_id="a")
    late = pg.finish_attempt(j["id"], 1, status="SUCCEEDED", exit_code=0, worker_id="a", output={"log": b"late\n"})
    assert (late["status"], late["attempt"], late["worker_id"]) == ("RUNNING", 2, "b")
    pg.register_worker("a", instance="x", host="h", boot_id=None, pid=1, url=None, heartbeat_timeout=30, info={})
    assert pg.heartbeat("a", "x", 30, renew_attempts=True) == set()  # its heartbeat no longer renews attempt 1
    done = pg.finish_attempt(j["id"], 2, status="SUCCEEDED", exit_code=0, worker_id="b", output={"log": b"from b\n"})
    assert done["status"] == "SUCCEEDED"
    atts = pg.attempts(j["id"])
    assert [(a["number"], a["status"], a["reason"], a["worker_id"]) for a in atts] == [
        (1, "FAILED", "worker_lost", "a"), (2, "SUCCEEDED", None, "b")]
    log = pg.read_log(j["id"])[1].decode()
    assert log == "from a\nnote\nfrom b\n"  # nothing of a's after the reap
    completions = [e for e in pg.events_since(0, 1000, j["id"]) if e.get("status") == "SUCCEEDED"]
    assert len(completions) == 1


def test_two_reapers_close_each_expired_attempt_once(pg_url: str) -> None:
    a, b = JobStore(pg_url), JobStore(pg_url)
    ids = [_job(a, f"j{i}")["id"] for i in range(40)]
    for _ in ids:
        a.claim_next(gpu_slots=0, cpu_slots=1, worker_id="dead", lease_s=30)
    for i in ids[::2]:
        a.mark_running(i, 1, executor="process", worker_id="dead")  # half ran, half never started
    with a.engine.begin() as conn:
        conn.execute(text("UPDATE attempts SET lease_until = lease_until - 3600"))
    closed: list[str] = []
    lock = threading.Lock()

    def reap(st: JobStore) -> None:
        for e in st.expired_attempts():
            job = st.reap_attempt(e["job_id"], e["number"], retry_on=["worker_lost"],
                                  never_ran=e["status"] == "STARTING", message="lost")
            if job is not None:
                with lock:
                    closed.append(e["job_id"])

    threads = [threading.Thread(target=reap, args=(st,)) for st in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(closed) == sorted(ids)  # each closed once, by one reaper
    for i in ids:
        job = a.get_job(i)
        assert job["status"] == "PENDING"
        retries = [e for e in a.events_since(0, 1000, i) if e.get("retry_of")]
        assert len(retries) == 1
    never_ran = a.get_job(ids[1])
    assert never_ran["max_attempts"] == 4  # a never-started attempt is given back
    a.close()
    b.close()


def test_heartbeat_renews_only_live_unexpired_leases(pg: JobStore) -> None:
    pg.register_worker("w", instance="i1", host="h", boot_id=None, pid=1, url=None, heartbeat_timeout=10, info={})
    j1, j2 = _job(pg, "1"), _job(pg, "2")
    pg.claim_next(gpu_slots=0, cpu_slots=2, worker_id="w", lease_s=10)
    pg.claim_next(gpu_slots=0, cpu_slots=2, worker_id="w", lease_s=10)
    assert pg.heartbeat("w", "i1", 10, renew_attempts=True) == {(j1["id"], 1), (j2["id"], 1)}
    _expire(pg, j2["id"])
    assert pg.heartbeat("w", "i1", 10, renew_attempts=True) == {(j1["id"], 1)}  # expired: reaped, never renewed
    # a second process registering under the same id takes it over; the first one learns at its next beat
    pg.register_worker("w", instance="i2", host="h", boot_id=None, pid=2, url=None, heartbeat_timeout=10, info={})
    with pytest.raises(LeaseLost):
        pg.heartbeat("w", "i1", 10, renew_attempts=True)
    (w,) = pg.workers()
    assert (w["id"], w["pid"], w["status"]) == ("w", 2, "up")
    assert {r["job_id"] for r in w["running"]} == {j1["id"], j2["id"]}


def test_event_ids_commit_in_order_under_concurrent_writers(pg_url: str) -> None:
    """An SSE client resuming from the last id it saw never skips an event that committed late."""
    writers = [JobStore(pg_url) for _ in range(4)]
    reader = JobStore(pg_url)
    stop = threading.Event()
    seen: list[int] = []

    def read() -> None:
        last = 0
        while not stop.is_set() or reader.last_event_id() > last:
            for ev in reader.events_since(last, 500):
                seen.append(ev["id"])
                last = ev["id"]

    def write(st: JobStore) -> None:
        for i in range(60):
            _job(st, f"e{i}")

    r = threading.Thread(target=read)
    r.start()
    threads = [threading.Thread(target=write, args=(st,)) for st in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    r.join()
    every = [e["id"] for e in reader.events_since(0, 10_000)]
    assert len(every) == 240 and seen == every  # no gaps, no reordering
    for st in (*writers, reader):
        st.close()


def _downgrade_to_v2(store: JobStore) -> None:
    with store.engine.begin() as conn:
        conn.execute(text("DROP INDEX IF EXISTS ux_jobs_submit_key"))  # schema 4's
        for table, col in (("jobs", "submit_key"), ("jobs", "min_vram"), ("jobs", "executor"), ("jobs", "worker_id"),
                           ("attempts", "worker_id"), ("attempts", "lease_until"), ("attempts", "run_dir")):
            conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {col}"))
        conn.execute(text("DROP INDEX IF EXISTS ix_attempts_live"))
        for table in ("workers", "log_chunks", "metric_rows"):
            conn.execute(text(f"DROP TABLE {table}"))
        conn.execute(text("UPDATE schema_version SET version = 2"))


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_schema_2_store_migrates_with_its_jobs(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = str(tmp_path / "jobs.db") if backend == "sqlite" else request.getfixturevalue("pg_url")
    old = JobStore(url)
    j = _job(old, "old")
    with old.engine.begin() as conn:
        conn.execute(text("DROP INDEX IF EXISTS ix_attempts_live"))
    _downgrade_to_v2(old)
    old.close()
    new = JobStore(url)
    assert new.schema_version() == SCHEMA_VERSION == 4
    job = new.get_job(j["id"])
    assert (job["name"], job["executor"], job["min_vram"]) == ("old", "process", 0)
    claimed = new.claim_next(gpu_slots=0, cpu_slots=1, worker_id="w", lease_s=5)
    assert claimed["id"] == j["id"] and claimed["worker_id"] == "w"
    new.close()


def test_workers_starting_together_migrate_once(pg_url: str) -> None:
    errors: list[BaseException] = []
    stores: list[JobStore] = []

    def open_one() -> None:
        try:
            stores.append(JobStore(pg_url))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(stores) == 6
    with stores[0].engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM schema_version")).scalar() == 1
    for st in stores:
        st.close()


def test_notify_wakes_a_listener_on_submit_retry_and_cancel(pg: JobStore) -> None:
    from jobs.worker.listen import Listener

    queue, events = threading.Event(), threading.Event()
    listener = Listener(pg.url, queue.set, events.set)
    listener.start()
    try:
        assert listener.connected.wait(10)
        assert queue.wait(5)  # the wake-up on (re)connect
        queue.clear()
        events.clear()
        t0 = time.monotonic()
        j = _job(pg)
        assert queue.wait(5) and events.wait(5)
        print(f"\n[notify] submit -> listener woken in {1000 * (time.monotonic() - t0):.1f} ms")
        queue.clear()
        pg.claim_next(gpu_slots=0, cpu_slots=1, worker_id="w", lease_s=30)
        pg.mark_running(j["id"], 1, executor="process", worker_id="w")
        pg.request_cancel(j["id"])
        assert queue.wait(5)  # the worker holding it wakes to stop it
    finally:
        listener.stop()


def test_shipped_log_reads_like_a_file(pg: JobStore) -> None:
    from jobs.store_output import CHUNK_BYTES

    j = _job(pg)
    pg.claim_next(gpu_slots=0, cpu_slots=1, worker_id="w", lease_s=30)
    data = bytes(range(256)) * (CHUNK_BYTES // 100)  # spans several chunks
    pg.append_output(j["id"], 1, "w", log=data[:1000], metrics=[{"step": 1}, {"step": 2}])
    pg.append_output(j["id"], 1, "w", log=data[1000:], metrics=[{"step": 3, "loss": 0.5}])
    start, got, size = pg.read_log(j["id"])
    assert (start, got, size) == (0, data, len(data))
    for off, lim in ((0, 10), (999, 2), (CHUNK_BYTES - 3, 7), (len(data) - 5, 100), (len(data), 10)):
        assert pg.read_log(j["id"], off, lim)[1] == data[off:off + lim]
    assert pg.read_log(j["id"], -6)[1] == data[-6:]
    records, nxt = pg.metric_records(j["id"])
    assert [r["step"] for r in records] == [1, 2, 3] and nxt == 3
    assert pg.metric_records(j["id"], 2) == ([{"step": 3, "loss": 0.5}], 3)
    assert pg.get_job(j["id"])["last_metrics"] == {"step": 3, "loss": 0.5}
    assert pg.shipped(j["id"], 1) == (len(data), 3)
