"""Issue 26's exactly-once cases on Postgres (the probe's): a job that ended on a worker that could not
record it (killed right after the job's exit, or fenced by a store outage longer than the lease) is
recorded from its run dir's exit.json, not run again; where no survivor can read that run dir, the
re-run is named as one and the first attempt's result is kept once its worker is back.

Each job's command counts its own runs in a ledger file (start / end lines), outside the store.
Default sizes are small; `-m slow` runs the probe's size (60 jobs, 3 workers, a 10 s outage with a
6 s lease). docs/guarantees.md says what is and is not guaranteed.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from cluster_helpers import ClusterWorker, audit, ledger, ledger_job, wait_all
from jobs_helpers import tagged_processes, wait_until
from pg_helpers import PostgresServer, _as_user

from jobs.store import JobStore

# leases and heartbeats of a few seconds: run after the parallel part, away from its load (see pyproject)
pytestmark = pytest.mark.serial

TIMEOUT = 6.0  # heartbeat_timeout (the lease) of these workers


def _worker(tmp_path: Path, name: str, url: str, *extra: str, faults: str | None = None) -> ClusterWorker:
    w = ClusterWorker(tmp_path / name, name, url, *extra, timeout=TIMEOUT)
    if faults:
        w.extra_env["OFFLOAD_JOBS_FAULTS"] = faults
    return w


def _kill_after_an_end(w: ClusterWorker, timeout: float = 60) -> None:
    """kill -9 `w` while its scheduler holds an attempt that ended and is not yet recorded."""
    wait_until(lambda: (w.home / "fault-ended").exists(), timeout, what=f"a job ended on {w.worker_id}")
    w.kill9()
    (w.home / "fault-ended").unlink(missing_ok=True)


@pytest.fixture
def workers():
    started: list[ClusterWorker] = []
    yield started
    for w in started:
        w.stop()


def test_a_job_that_ended_on_a_killed_worker_is_recorded_from_its_exit_json(tmp_path: Path, pg_url: str,
                                                                              workers) -> None:
    book = tmp_path / "ledger"
    book.mkdir()
    a = _worker(tmp_path, "wa", pg_url, "--max-cpu-jobs", "2", faults="ended=120")
    workers.append(a.start())
    with a.client() as ca:
        ids = [ca.submit(ledger_job(book, name=f"k{i}"))["id"] for i in range(2)]
        wait_until(lambda: all(len(ledger(book, i)) == 2 for i in ids), 30, what="both jobs' commands ended")
        _kill_after_an_end(a)
    b, c = _worker(tmp_path, "wb", pg_url), _worker(tmp_path, "wc", pg_url)
    workers += [b.start(), c.start()]
    with b.client() as cb:
        jobs = wait_all(cb, ids, timeout=TIMEOUT + 30)
        for i in ids:
            assert jobs[i]["status"] == "SUCCEEDED", jobs[i]
            atts = cb.get(i)["attempts"]
            assert [(x["number"], x["status"], x["exit_code"], x["worker_id"]) for x in atts] == [
                (1, "SUCCEEDED", 0, "wa")]
            assert [ln[0] for ln in ledger(book, i)] == ["start", "end"]  # ran once: never re-run
            assert "was read from its run dir" in cb.logs(i)["data"]
        counts = audit(cb, book, ids)
    assert counts == dict.fromkeys(counts, 0)
    assert tagged_processes(set(ids)) == []


def test_a_re_run_is_named_and_the_first_result_kept_when_no_survivor_reads_the_run_dir(
        tmp_path: Path, pg_url: str, workers) -> None:
    book = tmp_path / "ledger"
    book.mkdir()
    a = _worker(tmp_path, "wa", pg_url, "--max-cpu-jobs", "1", faults="ended=120")
    workers.append(a.start())
    with a.client() as ca:
        job_id = ca.submit(ledger_job(book, name="r"))["id"]
        _kill_after_an_end(a)
    # Another host's survivor: the dead worker's run dir is not where it could read it.
    runs = a.home / "runs"
    runs.rename(a.home / "runs.away")
    b = _worker(tmp_path, "wb", pg_url)
    workers.append(b.start())
    with b.client() as cb:
        wait_until(lambda: cb.get(job_id)["attempt"] == 2 and cb.get(job_id)["status"] == "SUCCEEDED",
                   TIMEOUT + 30, what="the retry on wb")
        (a.home / "runs.away").rename(runs)
        a.extra_env.pop("OFFLOAD_JOBS_FAULTS")
        a.start()  # back: it finds its reaped attempt's exit.json
        wait_until(lambda: cb.get(job_id)["attempts"][0]["status"] == "SUCCEEDED", 30,
                   what="attempt 1's late result")
        job = cb.get(job_id)
        assert [(x["number"], x["status"], x["exit_code"], x["worker_id"]) for x in job["attempts"]] == [
            (1, "SUCCEEDED", 0, "wa"), (2, "SUCCEEDED", 0, "wb")]
        assert job["status"] == "SUCCEEDED" and job["attempt"] == 2
        store = JobStore(pg_url)
        reruns = store.events_since(0, job_id=job_id, types=["job.rerun"])
        store.close()
        assert [(e["attempt"], e["status"], e["rerun_attempt"], e["found_by"]) for e in reruns] == [
            (1, "SUCCEEDED", 2, "wa")]
        log = cb.logs(job_id)["data"]
        assert "attempt 2 is a re-run" in log, log
        assert [ln[0] for ln in ledger(book, job_id)] == ["start", "end", "start", "end"]
    # once only: another restart records nothing more
    a.stop()
    a.start()
    with b.client() as cb:
        time.sleep(1.0)
        assert cb.logs(job_id)["data"].count("is a re-run") == 1


def test_a_late_end_found_before_the_retry_started_settles_the_job_with_one_run(
        tmp_path: Path, pg_url: str, workers) -> None:
    book, gate = tmp_path / "ledger", tmp_path / "gate"
    book.mkdir()
    a = _worker(tmp_path, "wa", pg_url, "--max-cpu-jobs", "1", faults="ended=120")
    workers.append(a.start())
    with a.client() as ca:
        job_id = ca.submit(ledger_job(book, name="late"))["id"]
        _kill_after_an_end(a)
    runs = a.home / "runs"
    runs.rename(a.home / "runs.away")  # the survivor cannot read it, and has no slot for the retry
    b = _worker(tmp_path, "wb", pg_url, "--max-cpu-jobs", "1")
    workers.append(b.start())
    with b.client() as cb:
        blocker = cb.submit(ledger_job(book, gate=gate, name="blocker"))["id"]
        wait_until(lambda: cb.get(blocker)["status"] == "RUNNING", 30, what="wb's slot taken")
        wait_until(lambda: cb.get(job_id)["status"] == "PENDING", TIMEOUT + 30, what="wa's attempt reaped")
        assert cb.get(job_id)["attempts"][0]["reason"] == "worker_lost"
        (a.home / "runs.away").rename(runs)
        a.extra_env.pop("OFFLOAD_JOBS_FAULTS")
        a.start()  # it settles what it finds before it claims anything
        wait_until(lambda: cb.get(job_id)["status"] == "SUCCEEDED", 30, what="the late end recorded")
        job = cb.get(job_id)
        assert job["attempt"] == 1 and [(x["number"], x["status"], x["exit_code"]) for x in job["attempts"]] == [
            (1, "SUCCEEDED", 0)]
        assert [ln[0] for ln in ledger(book, job_id)] == ["start", "end"]  # one run: the retry never started
        assert "no re-run" in cb.logs(job_id)["data"]
        gate.touch()
        wait_all(cb, [blocker], timeout=30)


# ---------------------------------------------------------------- the probe: a kill and an outage

def _pg_ctl(server: PostgresServer, *args: str) -> None:
    assert server.bin_dir is not None and server.data_dir is not None
    subprocess.run([*_as_user(), str(server.bin_dir / "pg_ctl"), "-D", str(server.data_dir), *args],
                   check=True, capture_output=True, timeout=90)


@pytest.fixture
def own_pg():
    """A private server this test may stop (the outage) without disturbing other tests."""
    try:
        server = PostgresServer.start_private()
    except Exception as exc:
        pytest.skip(f"no PostgreSQL to test against ({exc})")
    yield server
    server.stop()


def _kill_and_outage(tmp_path: Path, server: PostgresServer, workers: list[ClusterWorker], n_jobs: int,
                     outage_s: float) -> dict[str, int]:
    _, url = server.fresh_database()
    book = tmp_path / "ledger"
    book.mkdir()
    a = _worker(tmp_path, "wa", url, "--max-cpu-jobs", "3", faults="ended=300")
    b = _worker(tmp_path, "wb", url, "--max-cpu-jobs", "4")
    c = _worker(tmp_path, "wc", url, "--max-cpu-jobs", "4")
    for w in (a, b, c):
        workers.append(w.start())
    with b.client() as cb:
        # every 5th job runs long enough to be cut off by its worker's fence during the outage
        lengths = [8.0 if i % 5 == 0 else 0.5 + (i % 4) * 0.5 for i in range(n_jobs)]
        ids = [cb.submit(ledger_job(book, seconds=s, name=f"p{i}"))["id"] for i, s in enumerate(lengths)]
        _kill_after_an_end(a)  # right after a job of wa's ended: its end is only in its run dir
        wait_until(lambda: sum(1 for j in cb.list(summary=True) if j["status"] == "RUNNING") >= 2, 60,
                   what="jobs running on the survivors")
        # Down, not amnesic: a fast stop keeps what it acknowledged (this throwaway server runs with
        # synchronous_commit=off, under which an immediate stop forgets its last commits).
        _pg_ctl(server, "-m", "fast", "-w", "stop")
        time.sleep(outage_s)  # longer than the lease: every attempt's lease runs out
        _pg_ctl(server, "-l", str(server.data_dir / "server.log"), "-w", "-t", "60", "start")
        jobs = wait_all(cb, ids, timeout=120 + n_jobs * 2)
        counts = audit(cb, book, ids)
        runs = {i: [ln[0] for ln in ledger(book, i)] for i in ids}
        counts["started_twice"] = sum(1 for r in runs.values() if r.count("start") > 1)
        counts["ran_once"] = sum(1 for r in runs.values() if r.count("end") == 1)
        counts["recorded_from_run_dir"] = sum(1 for i in ids if "was read from its run dir" in cb.logs(i)["data"])
        for i in ids:
            if runs[i].count("end") != 1:
                print(f"\n{i}: ledger {ledger(book, i)}; attempts {cb.get(i)['attempts']}\n{cb.logs(i)['data']}")
        print(f"\n[kill + {outage_s:g}s outage, {n_jobs} jobs, 3 workers, lease {TIMEOUT:g}s] {counts}; "
              f"statuses {sorted({j['status'] for j in jobs.values() if j['id'] in ids})}")
    assert tagged_processes(set(ids)) == []
    return counts


def _check(counts: dict[str, int], n_jobs: int) -> None:
    # The guarantee (docs/guarantees.md): no job's command completes twice, nothing is lost or stuck,
    # runs never overlap. A run stopped by its worker's fence before it ended may be started again.
    for k in ("lost", "stuck", "completed_twice", "ended_twice", "overlapped", "not_succeeded"):
        assert counts[k] == 0, counts
    assert counts["ran_once"] == n_jobs, counts
    assert counts["recorded_from_run_dir"] >= 1, counts  # the killed worker's ended job, at least


def test_a_kill_and_a_store_outage_longer_than_the_lease_run_nothing_twice(tmp_path: Path, own_pg, workers) -> None:
    counts = _kill_and_outage(tmp_path, own_pg, workers, n_jobs=8, outage_s=TIMEOUT + 4)
    _check(counts, 8)


@pytest.mark.slow
def test_the_probe_60_jobs_3_workers_a_kill_and_a_10s_outage(tmp_path: Path, own_pg, workers) -> None:
    counts = _kill_and_outage(tmp_path, own_pg, workers, n_jobs=60, outage_s=10.0)
    _check(counts, 60)
