"""End to end against a real worker process: submit, logs, cancel, limits, auth, events, metrics."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from jobs.client import JobsClient
from jobs.errors import AuthError, InvalidTransition, JobNotFound, SpecError

from jobs_helpers import pgid_alive, read_json_lines


def test_command_job_succeeds_with_logs_and_metrics(client: JobsClient) -> None:
    cmd = 'for i in 1 2 3; do echo "line $i"; echo "{\\"step\\": $i, \\"loss\\": 0.5}" >> "$OFFLOAD_JOBS_METRICS"; done'
    job = client.submit({"kind": "command", "name": "hello", "command": cmd})
    assert job["status"] == "PENDING" and job["name"] == "hello" and job["attempt"] == 0
    text = "".join(client.follow_logs(job["id"]))  # ends only once the job is terminal
    done = client.get(job["id"])
    assert done["status"] == "SUCCEEDED" and done["reason"] is None and done["exit_code"] == 0
    assert [ln for ln in text.splitlines() if ln.startswith("line")] == ["line 1", "line 2", "line 3"]
    assert done["last_metrics"] == {"step": 3, "loss": 0.5}
    m = client.metrics(job["id"])
    assert [r["step"] for r in m["records"]] == [1, 2, 3]
    assert client.metrics(job["id"], offset=m["next_offset"])["records"] == []
    for key in ("id", "name", "kind", "status", "reason", "attempt", "priority", "created_at", "started_at",
                "finished_at", "exit_code", "run_dir", "spec", "last_metrics"):
        assert key in done
    assert done["attempts"][0]["status"] == "SUCCEEDED"
    # run dir contract
    from pathlib import Path

    rd = Path(done["run_dir"])
    assert (rd / "spec.yaml").exists() and (rd / "outputs").is_dir()
    statuses = [e.get("status") for e in read_json_lines(rd / "events.jsonl")]
    assert statuses == ["PENDING", "STARTING", "RUNNING", "SUCCEEDED"]


def test_list_command_job_runs_directly_with_env(client: JobsClient) -> None:
    job = client.submit({"kind": "command", "command": ["sh", "-c", "echo $GREETING-$OFFLOAD_JOBS_ATTEMPT"],
                         "env": {"GREETING": "hi"}})
    assert client.wait(job["id"], timeout=30)["status"] == "SUCCEEDED"
    assert "hi-1" in client.logs(job["id"])["data"]


def test_logs_are_offset_based_and_resumable(client: JobsClient) -> None:
    job = client.submit({"kind": "command", "command": "printf 'abcdef\\n'; printf 'é\\n'"})
    client.wait(job["id"], timeout=30)
    full = client.logs(job["id"])
    assert full["eof"] and full["next_offset"] == full["size"]
    i = full["data"].encode().index(b"abcdef")
    part = client.logs(job["id"], offset=i, limit=3)
    assert part["data"] == "abc" and part["next_offset"] == i + 3 and not part["eof"]
    tail = client.logs(job["id"], offset=-len("é\n".encode()) - len("[offload-jobs] attempt 1 ended: SUCCEEDED\n"))
    assert tail["data"].startswith("é\n")


def test_submitted_job_reaches_running(client: JobsClient) -> None:
    # The latency is measured by `python -m bench.api_latency`; this checks the path only.
    job = client.submit({"kind": "command", "command": "sleep 30"})
    deadline = time.monotonic() + 30
    while client.get(job["id"])["status"] not in ("RUNNING", "SUCCEEDED", "FAILED") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.get(job["id"])["status"] == "RUNNING"
    client.cancel(job["id"])
    assert client.get(job["id"])["status"] in ("CANCELLING", "CANCELLED")


def test_cancel_kills_the_whole_process_tree(client: JobsClient) -> None:
    job = client.submit({"kind": "command", "command": "sleep 100 & sleep 100 & echo started; wait",
                         "limits": {"stop_grace": 3}})
    for _ in range(300):
        j = client.get(job["id"])
        if j["status"] == "RUNNING" and "started" in client.logs(job["id"])["data"]:
            break
        time.sleep(0.02)
    pgid = j["attempts"][0]["pgid"]
    assert len(pgid_alive(pgid)) == 3  # sh and both sleeps
    t0 = time.monotonic()
    assert client.cancel(job["id"])["status"] == "CANCELLING"
    done = client.wait(job["id"], timeout=15)
    assert done["status"] == "CANCELLED" and done["reason"] == "cancelled"
    assert time.monotonic() - t0 < 3 + 2
    assert pgid_alive(pgid) == []
    with pytest.raises(InvalidTransition):
        client.cancel(job["id"])


def test_cancel_escalates_to_sigkill_after_stop_grace(client: JobsClient) -> None:
    job = client.submit({"kind": "command", "command": "trap '' TERM; echo ready; while true; do sleep 0.1; done",
                         "limits": {"stop_grace": 1}})
    while "ready" not in client.logs(job["id"])["data"]:
        time.sleep(0.02)
    pgid = client.get(job["id"])["attempts"][0]["pgid"]
    t0 = time.monotonic()
    client.cancel(job["id"])
    done = client.wait(job["id"], timeout=15)
    assert done["status"] == "CANCELLED"
    assert 0.9 < time.monotonic() - t0 < 5
    assert pgid_alive(pgid) == []


def test_cancel_pending_job_is_immediate(client: JobsClient) -> None:
    # gpus=1 jobs run one at a time: the second waits behind the first.
    first = client.submit({"kind": "command", "command": "sleep 30", "resources": {"gpus": 1}, "priority": 50})
    second = client.submit({"kind": "command", "command": "echo never", "resources": {"gpus": 1}})
    assert client.get(second["id"])["status"] == "PENDING"
    assert client.cancel(second["id"])["status"] == "CANCELLED"
    client.cancel(first["id"])
    assert client.wait(first["id"], timeout=15)["status"] == "CANCELLED"
    assert client.get(second["id"])["attempt"] == 0


def test_max_duration_gives_timeout(client: JobsClient) -> None:
    job = client.submit({"kind": "command", "command": "echo go; sleep 60", "limits": {"max_duration": 1, "stop_grace": 1}})
    done = client.wait(job["id"], timeout=20)
    assert done["status"] == "FAILED" and done["reason"] == "timeout"
    assert "max_duration" in client.logs(job["id"])["data"]


def test_failure_reasons(client: JobsClient) -> None:
    nonzero = client.submit({"kind": "command", "command": "exit 3"})
    missing = client.submit({"kind": "command", "command": ["/nonexistent/binary"]})
    killed = client.submit({"kind": "command", "command": "kill -9 $$"})
    cuda = client.submit({"kind": "command", "command":
                          'echo \'{"reason": "cuda_oom", "message": "CUDA out of memory"}\' > "$OFFLOAD_JOBS_EXIT_REPORT"; exit 1'})
    got = {k: client.wait(j["id"], timeout=30) for k, j in
           {"nonzero": nonzero, "missing": missing, "killed": killed, "cuda": cuda}.items()}
    assert (got["nonzero"]["reason"], got["nonzero"]["exit_code"]) == ("exit_nonzero", 3)
    assert got["missing"]["reason"] == "setup_failed" and "/nonexistent/binary" in got["missing"]["message"]
    # A SIGKILL that neither the worker nor the OOM killer sent is `killed` (the OOM case: test_tree.py).
    assert got["killed"]["reason"] == "killed" and "SIGKILL" in got["killed"]["message"]
    assert got["cuda"]["reason"] == "cuda_oom" and got["cuda"]["message"] == "CUDA out of memory"
    assert all(j["status"] == "FAILED" for j in got.values())


def test_retry_policy_and_manual_retry(client: JobsClient) -> None:
    job = client.submit({"kind": "command", "command": 'echo "try $OFFLOAD_JOBS_ATTEMPT"; [ "$OFFLOAD_JOBS_ATTEMPT" -ge 2 ]',
                         "retry": {"max_attempts": 2, "on": ["exit_nonzero"]}})
    done = client.wait(job["id"], timeout=30)
    assert done["status"] == "SUCCEEDED" and done["attempt"] == 2
    assert [a["reason"] for a in done["attempts"]] == ["exit_nonzero", None]
    failed = client.wait(client.submit({"kind": "command", "command": "exit 1", "retry": {"max_attempts": 1}})["id"], timeout=30)
    assert failed["status"] == "FAILED" and failed["attempt"] == 1
    again = client.retry(failed["id"])
    assert again["status"] == "PENDING"
    assert client.wait(failed["id"], timeout=30)["attempt"] == 2
    with pytest.raises(InvalidTransition):
        client.retry(job["id"])  # SUCCEEDED jobs are not retried


def test_train_infer_on_a_folder_that_is_no_model_fail_as_setup_failed_and_missing_paths_fail_at_submit(client: JobsClient, tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for kind in ("train", "infer"):  # a folder that is no diffusers model: refused at submit (issue 28)
        with pytest.raises(SpecError) as e:
            client.submit({"kind": kind, "model": {"path": str(model)}, "retry": {"max_attempts": 1}})
        assert e.value.field == "model.path" and "has no model_index.json" in str(e.value)
    # A checkpoint, model or workdir that is not there is the user's to fix, at submit, naming it.
    missing = tmp_path / "no-such-checkpoint"
    cases = [({"kind": "shard", "shard": {"src": str(missing), "dst": str(tmp_path / "out")}}, "shard.src"),
             ({"kind": "train", "model": {"path": str(missing)}}, "model.path"),
             ({"kind": "train", "model": {"path": str(model)}, "train": {"dataset": str(missing)}}, "train.dataset"),
             ({"kind": "command", "command": "true", "workdir": str(missing)}, "workdir")]
    before = len(client.list())
    for spec, field in cases:
        with pytest.raises(SpecError) as e:
            client.submit(spec)
        assert e.value.field == field and "no-such-checkpoint" in str(e.value) and "does not exist" in str(e.value)
    assert len(client.list()) == before  # nothing half-made


def test_priority_then_fifo_order(client: JobsClient) -> None:
    blocker = client.submit({"kind": "command", "command": "sleep 30", "resources": {"gpus": 1}, "priority": 100})
    while client.get(blocker["id"])["status"] != "RUNNING":
        time.sleep(0.02)
    low = client.submit({"kind": "command", "command": "true", "resources": {"gpus": 1}, "priority": 0})
    high1 = client.submit({"kind": "command", "command": "true", "resources": {"gpus": 1}, "priority": 5})
    high2 = client.submit({"kind": "command", "command": "true", "resources": {"gpus": 1}, "priority": 5})
    client.cancel(blocker["id"])
    ends = {j["id"]: client.wait(j["id"], timeout=30)["started_at"] for j in (low, high1, high2)}
    assert ends[high1["id"]] < ends[high2["id"]] < ends[low["id"]]


def test_bad_spec_is_400_naming_the_field(client: JobsClient) -> None:
    with pytest.raises(SpecError) as e:
        client.submit({"kind": "command", "command": "true", "limits": {"max_duration": "soon"}})
    assert e.value.field == "limits.max_duration"
    with pytest.raises(SpecError) as e:
        client.submit({"kind": "command", "command": "true", "resources": {"gpus": 64}})
    assert e.value.field == "resources.gpus"
    auth = {"Authorization": f"Bearer {client.token}", "Content-Type": "application/json"}
    r = httpx.post(f"{client.url}/v1/jobs", json={"spec": {"kind": "train"}}, headers=auth)
    assert r.status_code == 400 and r.json()["field"] == "model.path"
    # What used to be a 500, or a job that could never end, is a 400 naming the field.
    bodies = [
        ('{"spec": {"kind": "command", "command": "true", "priority": 99999999999999999999999}}', "priority"),
        ('{"spec": {"kind": "command", "command": "true", "limits": {"stop_grace": 1e999}}}', "limits.stop_grace"),
        ('{"spec": {"kind": "command", "command": "true", "train": {"lr": NaN}}}', None),
        ('{"spec": {"kind": "command", "command": "true", "name": "a", "name": "b"}}', "name"),
        ('{"spec": {"kind": "command", "command": "true", "env": {"BAD NAME": "x"}}}', "env.BAD NAME"),
        ('{"spec": {"kind": "command", "command": "true", "outputs": ' + "[" * 5000 + "]" * 5000 + "}}", None),
        ('{"spec": {"kind": "command", "command": "a\\u0000b"}}', "command"),
    ]
    for body, field in bodies:
        r = httpx.post(f"{client.url}/v1/jobs", content=body, headers=auth)
        assert r.status_code == 400, (body[:80], r.status_code, r.text[:200])
        assert r.json()["field"] == field, (body[:80], r.json())


def test_unknown_job_is_job_not_found(client: JobsClient) -> None:
    with pytest.raises(JobNotFound):
        client.get("doesnotexist")
    with pytest.raises(JobNotFound):
        client.logs("doesnotexist")


def test_job_id_prefix_and_list_filters(client: JobsClient) -> None:
    client.wait(client.submit({"kind": "command", "command": "true"})["id"], timeout=30)
    job = client.wait(client.submit({"kind": "command", "command": "true", "name": "prefix"})["id"], timeout=30)
    assert client.get(job["id"][:6])["id"] == job["id"]
    ids = [j["id"] for j in client.list(status="SUCCEEDED")]
    assert job["id"] in ids
    assert all(j["status"] == "SUCCEEDED" for j in client.list(status="SUCCEEDED"))
    assert len(client.list(limit=2)) == 2
    assert client.list(limit=1)[0]["id"] == job["id"]  # newest first


def test_token_required_everywhere_but_healthz(worker) -> None:
    assert httpx.get(f"{worker.url}/healthz").status_code == 200
    for method, path in [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/x"), ("GET", "/v1/events"),
                         ("GET", "/metrics"), ("GET", "/v1/openapi.json"), ("GET", "/nope")]:
        assert httpx.request(method, f"{worker.url}{path}").status_code == 401, path
        bad = httpx.request(method, f"{worker.url}{path}", headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401, path
    with pytest.raises(AuthError):
        JobsClient(worker.url, "wrong").list()


def test_foreign_host_header_is_refused(worker) -> None:
    auth = {"Authorization": f"Bearer {worker.token}"}
    assert httpx.get(f"{worker.url}/v1/jobs", headers=auth).status_code == 200
    for host in ("evil.example.com", "evil.example.com:80", "127.0.0.1.nip.io"):
        r = httpx.get(f"{worker.url}/v1/jobs", headers={**auth, "Host": host})
        assert r.status_code == 400 and "Host" in r.json()["error"], host
    for host in ("localhost", f"localhost:{worker.port}", "[::1]:1"):
        assert httpx.get(f"{worker.url}/v1/jobs", headers={**auth, "Host": host}).status_code == 200, host


def test_wait_is_woken_by_the_jobs_events_not_by_polling(worker) -> None:
    """`wait` reads the job again when one of its events arrives (or every WAIT_STREAM_S): a job that
    runs ~1.5 s costs a handful of reads, not one every `poll` seconds (150 here), and a cancel ends
    the wait."""
    reads: list[str] = []
    with worker.client() as c:
        c._http.event_hooks["request"].append(lambda r: reads.append(r.url.path))
        job = c.submit({"kind": "command", "name": "waited", "command": "sleep 1.5"})
        done = c.wait(job["id"], timeout=60, poll=0.01)
        assert done["status"] == "SUCCEEDED"
        gets = [p for p in reads if p == f"/v1/jobs/{job['id']}"]
        assert 1 <= len(gets) < 20, reads  # one per status change and one every 2 s (polling: >= 150)
        held = c.submit({"kind": "command", "name": "held", "command": "sleep 60"})
        def cancel() -> None:
            with worker.client() as other:
                other.cancel(held["id"])

        threading.Timer(1.0, cancel).start()
        assert c.wait(held["id"], timeout=60)["status"] == "CANCELLED"


def test_events_stream_with_ids_and_resume(client: JobsClient) -> None:
    seen: list[dict] = []
    start_id = client.list(limit=1)  # any request; make sure the worker is idle enough
    ready = threading.Event()

    def listen() -> None:
        for ev in client.events(last_event_id=0):
            seen.append(ev)
            ready.set()
            if ev.get("job_id") == job_id and ev.get("status") == "SUCCEEDED":
                return

    job_id = client.submit({"kind": "command", "command": "echo sse"})["id"]
    t = threading.Thread(target=listen, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive() and start_id is not None
    ids = [e["id"] for e in seen]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    mine = [e for e in seen if e.get("job_id") == job_id]
    assert [e["status"] for e in mine] == ["PENDING", "STARTING", "RUNNING", "SUCCEEDED"]
    # resume after the RUNNING event: only what came later
    running_id = next(e["id"] for e in mine if e["status"] == "RUNNING")
    it = client.events(last_event_id=running_id)
    nxt = next(it)
    assert nxt["id"] > running_id
    it.close()


def test_prometheus_metrics(worker, client: JobsClient) -> None:
    client.wait(client.submit({"kind": "command", "command": "true"})["id"], timeout=30)
    r = httpx.get(f"{worker.url}/metrics", headers={"Authorization": f"Bearer {worker.token}"})
    assert r.status_code == 200
    text = r.text
    for name in ("offload_jobs_submitted_total", "offload_jobs_attempts_finished_total", "offload_jobs_jobs{",
                 "offload_jobs_http_request_duration_seconds_bucket", "offload_jobs_queue_wait_seconds_count",
                 "offload_jobs_running_attempts"):
        assert name in text, name
    assert 'offload_jobs_jobs{status="SUCCEEDED"}' in text
