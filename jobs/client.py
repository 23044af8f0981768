"""`JobsClient`: the sync HTTP client of a worker, used by the CLI and the TUI.

Light on purpose (httpx + stdlib): `offload-jobs ps` must answer at once.

A job is a dict with at least: id, name, kind, status, reason, attempt, max_attempts, priority,
created_at, started_at, finished_at (epoch seconds or None), exit_code, run_dir, spec, last_metrics.

The token in a state dir is sent only to the worker that state dir names (its worker.json), and
only once that worker has proved it holds the token (an HMAC of a fresh challenge, `/healthz`):
a stale worker.json, or another program on the worker's old port, never sees it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import ssl
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

if "httpx" not in sys.modules:
    # httpx imports its command-line tool on import (click, rich, pygments: ~70 ms of `ps`);
    # with this placeholder its own ImportError fallback skips that. The library is unchanged.
    sys.modules["httpx._main"] = types.ModuleType("httpx._main")
    try:
        import httpx
    finally:
        if getattr(sys.modules.get("httpx._main"), "__file__", None) is None:
            sys.modules.pop("httpx._main", None)
else:
    import httpx

from jobs.errors import (
    AuthError, InvalidTransition, JobNotFound, JobsError, RequestTooLarge, SpecError, StoreError, WorkerUnreachable,
)
from jobs.home import DEFAULT_URL, read_token, read_worker_info, state_home
from jobs.contract import TERMINAL

__all__ = ["JobsClient", "TERMINAL_STATES", "SUBMIT_KEY_HEADER"]

SUBMIT_KEY_HEADER = "Idempotency-Key"  # jobs/worker/intake.py

TERMINAL_STATES = TERMINAL
# The longest `wait` holds one event stream open without any event before it reads the job again.
WAIT_STREAM_S = 2.0


class _LazyTLSTransport(httpx.BaseTransport):
    """Loads the CA bundle only when a request is https.

    httpx's default transport builds a verifying SSL context up front (20-60 ms), a sizeable part
    of `offload-jobs ps`'s 300 ms budget, while a local worker speaks plain http on loopback.
    """

    def __init__(self) -> None:
        self._by_scheme: dict[str, httpx.HTTPTransport] = {}

    def _for(self, scheme: str) -> httpx.HTTPTransport:
        if scheme not in self._by_scheme:
            if scheme == "https":
                self._by_scheme[scheme] = httpx.HTTPTransport()  # full certificate verification
            else:
                # Never used for TLS: a bare client context (verifying, no CAs) is enough and cheap.
                self._by_scheme[scheme] = httpx.HTTPTransport(verify=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
        return self._by_scheme[scheme]

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._for(request.url.scheme).handle_request(request)

    def close(self) -> None:
        for transport in self._by_scheme.values():
            transport.close()


class JobsClient:
    """Talks to one worker at `url` with a bearer `token`.

    With `verify=True` the token is sent only after the worker proved it holds it (see above).
    """

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, *, timeout: float = 10.0,
                 transport: httpx.BaseTransport | None = None, verify: bool = False) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self._verify = bool(verify and token)
        headers = {"Authorization": f"Bearer {token}"} if token and not self._verify else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                  transport=transport if transport is not None else _LazyTLSTransport())

    @classmethod
    def from_env(cls, home: str | os.PathLike[str] | None = None, **kwargs: Any) -> "JobsClient":
        """The worker of $OFFLOAD_JOBS_URL (token: $OFFLOAD_JOBS_TOKEN) or of the state dir.

        The state dir's token goes only to the state dir's own worker (worker.json), verified.
        With neither a URL nor a worker.json, no request is made at all.
        """
        h = state_home(home)
        info = read_worker_info(h) or {}
        home_url = str(info["url"]).rstrip("/") if info.get("url") else None
        env_url = os.environ.get("OFFLOAD_JOBS_URL")
        env_token = os.environ.get("OFFLOAD_JOBS_TOKEN")
        url = env_url.rstrip("/") if env_url else home_url
        if url is None:
            raise WorkerUnreachable(str(h), message=(
                f"no offload-jobs worker is running for {h} (it has no worker.json); start one with "
                "`offload-jobs up --local`, or point OFFLOAD_JOBS_URL (and OFFLOAD_JOBS_TOKEN) at one"))
        if env_token:
            return cls(url, env_token, **kwargs)
        if url == home_url:
            return cls(url, read_token(h), verify=True, **kwargs)
        return cls(url, None, **kwargs)  # some other worker: it gets no token of ours

    # ------------------------------------------------------------ plumbing
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "JobsClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure_verified(self) -> None:
        if not self._verify:
            return
        challenge = secrets.token_hex(16)
        try:
            r = self._http.get("/healthz", params={"challenge": challenge})
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            raise WorkerUnreachable(self.url, type(exc).__name__) from None
        except httpx.TimeoutException:
            raise WorkerUnreachable(self.url, "timed out") from None
        try:
            proof = r.json().get("proof") if r.status_code == 200 else None
        except ValueError:
            proof = None
        expected = hmac.new(str(self.token).encode(), challenge.encode(), hashlib.sha256).hexdigest()
        if not isinstance(proof, str) or not hmac.compare_digest(proof, expected):
            raise AuthError(f"the server at {self.url} is not the worker of this state dir (it cannot prove it holds "
                            "the token); the token was not sent. Is worker.json stale? Start the worker again with "
                            "`offload-jobs up --local`")
        self._http.headers["Authorization"] = f"Bearer {self.token}"
        self._verify = False

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        self._ensure_verified()
        try:
            r = self._http.request(method, path, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            # ReadError: a connection reset mid-answer (Docker's port proxy resets while the worker starts)
            raise WorkerUnreachable(self.url, type(exc).__name__) from None
        except httpx.TimeoutException:
            raise WorkerUnreachable(self.url, "timed out") from None
        return self._check(r)

    def _check(self, r: httpx.Response) -> Any:
        if r.status_code < 400:
            return r.json() if r.content else None
        try:
            body = r.json()
        except ValueError:
            body = {"error": r.text.strip() or r.reason_phrase}
        if not isinstance(body, dict):
            body = {"error": str(body)}
        msg = body.get("error") or body.get("detail") or r.reason_phrase
        if r.status_code == 401:
            raise AuthError(f"worker at {self.url} refused the token ({msg}); set OFFLOAD_JOBS_TOKEN or check the state dir's token file")
        if r.status_code in (403, 421):
            raise AuthError(f"worker at {self.url} refused the request: {msg}")
        if r.status_code == 404 and body.get("job_id"):
            raise JobNotFound(body["job_id"])
        if r.status_code == 409:
            raise InvalidTransition(msg)
        if r.status_code in (400, 422) and "field" in body:
            raise SpecError(body.get("field"), body.get("message") or msg, line=body.get("line"))
        if r.status_code == 413:
            raise RequestTooLarge(msg)
        if r.status_code == 503 and body.get("store"):
            raise StoreError(f"worker at {self.url}: {msg}")
        raise JobsError(f"worker at {self.url} answered {r.status_code}: {msg}")

    # ------------------------------------------------------------ API
    def health(self) -> dict[str, Any]:
        return self._request("GET", "/healthz")

    def submit(self, spec: dict[str, Any], *, key: str | None = None, confirm_for: float = 30.0) -> dict[str, Any]:
        """Queue a job from a spec dict (e.g. `load_spec(...).model_dump()` or raw YAML data).

        Every submit carries an idempotency key (`key`, else a fresh one): when the answer is lost
        (a timeout, the connection cut, the worker killed mid-request) the job may exist or not, so
        the same submit is asked again with the same key for up to `confirm_for` seconds (the
        worker returns the job the first one made, or makes it now) before anything is called
        failed. The job carries `submit_key`; `existing` is True when an earlier submit made it.
        """
        key = key or secrets.token_hex(16)
        headers = {SUBMIT_KEY_HEADER: key}
        self._ensure_verified()
        try:
            return self._check(self._http.post("/v1/jobs", json={"spec": spec}, headers=headers))
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise WorkerUnreachable(self.url, "connection refused") from None  # never sent: nothing to ask
        except httpx.TransportError as exc:
            first = "timed out" if isinstance(exc, httpx.TimeoutException) else type(exc).__name__
        deadline = time.monotonic() + confirm_for
        wait, last = 0.2, first
        while time.monotonic() < deadline:
            time.sleep(wait)
            wait = min(2.0, wait * 2)
            try:
                return self._check(self._http.post("/v1/jobs", json={"spec": spec}, headers=headers))
            except httpx.TransportError as exc:
                last = "timed out" if isinstance(exc, httpx.TimeoutException) else type(exc).__name__
        raise WorkerUnreachable(self.url, message=(
            f"the submit to {self.url} was not confirmed ({first}; asked again by its key for {confirm_for:.0f}s: "
            f"{last}); the job may exist: submit again with --key {key} to get it, or to make it once"))

    def validate(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Validate a spec on the worker, with its paths and image checked there; raises SpecError."""
        return self._request("POST", "/v1/validate", json={"spec": spec})

    def list(self, status: str | None = None, limit: int | None = None, *, summary: bool = False) -> list[dict[str, Any]]:
        """Jobs, newest first; `summary` leaves out each spec and its metrics (what a table needs)."""
        return self.page(status, limit, summary=summary)[0]

    def page(self, status: str | None = None, limit: int | None = None, *,
             summary: bool = False) -> tuple[list[dict[str, Any]], int]:
        """(the newest `limit` jobs, how many match in all)."""
        body = self.jobs_page(status, limit, summary=summary)
        return body["jobs"], int(body.get("total", len(body["jobs"])))

    def jobs_page(self, status: str | None = None, limit: int | None = None, *,
                  summary: bool = False) -> dict[str, Any]:
        """The worker's whole answer: {"jobs": [...], "total": N, "shared": true on a store many workers share}."""
        params: dict[str, Any] = {}
        if status:
            params["status"] = status
        if limit is not None:
            params["limit"] = limit
        if summary:
            params["view"] = "summary"
        return self._request("GET", "/v1/jobs", params=params)

    def workers(self) -> dict[str, Any]:
        """{"workers": [...], "this": id, "shared": bool}: every worker on the store, with its GPUs (and the
        job on each), slots, executors, heartbeat age and status (up, lost, stopped), and what it runs."""
        return self._request("GET", "/v1/workers")

    def models(self) -> dict[str, Any]:
        """{"roots": [{path, exists}], "models": [...], "truncated": bool}: the checkpoints the worker sees
        under its model roots (jobs.catalog), each with kind, field, family, layout, dtype, bytes, converted
        and sharded."""
        return self._request("GET", "/v1/models")

    def delete(self, job_id: str) -> dict[str, Any]:
        """Remove a finished job, its history and its run dir."""
        return self._request("DELETE", f"/v1/jobs/{job_id}")

    def prune(self, older_than: float, dry_run: bool = False) -> dict[str, Any]:
        """Remove every finished job that finished more than `older_than` seconds ago."""
        return self._request("POST", "/v1/prune", json={"older_than": older_than, "dry_run": dry_run})

    def get(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/jobs/{job_id}/cancel")

    def retry(self, job_id: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/jobs/{job_id}/retry")

    # ---- runner controls (issue 15) ------------------------------------------------------------
    def signal(self, job_id: str, action: str) -> dict[str, Any]:
        """Ask a running train job to `save` a checkpoint, render a `sample`, or `stop` after a checkpoint."""
        return self._request("POST", f"/v1/jobs/{job_id}/signal", json={"action": action})
    # ---- end of runner controls -------------------------------------------------------------------

    def logs(self, job_id: str, offset: int = 0, limit: int | None = None) -> dict[str, Any]:
        """A chunk of output.log from byte `offset`: {offset, next_offset, data, eof, size, status}.

        A negative offset counts from the end (for --tail). `eof` is true when the job is
        terminal and nothing is left to read.
        """
        params: dict[str, Any] = {"offset": offset}
        if limit is not None:
            params["limit"] = limit
        return self._request("GET", f"/v1/jobs/{job_id}/logs", params=params)

    def follow_logs(self, job_id: str, offset: int = 0, poll: float = 0.2) -> Iterator[str]:
        """Yield output as it grows; ends when the job is terminal and all output is read."""
        while True:
            chunk = self.logs(job_id, offset)
            if chunk["data"]:
                yield chunk["data"]
            offset = chunk["next_offset"]
            if chunk["eof"]:
                return
            if not chunk["data"]:
                time.sleep(poll)

    def metrics(self, job_id: str, offset: int = 0) -> dict[str, Any]:
        """Records of metrics.jsonl from byte `offset`: {offset, next_offset, records}."""
        return self._request("GET", f"/v1/jobs/{job_id}/metrics", params={"offset": offset})

    def wait(self, job_id: str, timeout: float | None = None, poll: float = 0.1) -> dict[str, Any]:
        """Until the job is terminal; returns the job (raises TimeoutError after `timeout`).

        The worker's event stream for the job wakes it: the job is read again when one of its events
        arrives, or WAIT_STREAM_S after the last read (an event another worker wrote may reach this one
        late). A waiting client costs the worker next to nothing between them (a 10 Hz poll cost it
        ~2 ms of CPU a request) and sees the end at once. Where no stream can be held open, it polls
        every `poll` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        since = self.last_event_id()  # read before the job: no event after it is missed
        while True:
            job = self.get(job_id)
            if job["status"] in TERMINAL_STATES:
                return job
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"job {job_id} still {job['status']} after {timeout}s")
            opened = time.monotonic()
            for ev in self.events(since, job_id=job_id, read_timeout=min(WAIT_STREAM_S, left or WAIT_STREAM_S)):
                if isinstance(ev.get("id"), int):
                    since = max(since, ev["id"])
                break  # an event of this job: read it again
            else:
                if time.monotonic() - opened < poll:  # the stream ended at once: poll instead
                    time.sleep(poll if left is None else min(poll, left))

    def events(self, last_event_id: int | None = None, job_id: str | None = None,
               read_timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Server-sent events: dicts with `id`, `type` and the event's fields. Ends when the worker stops.

        `job_id` keeps only that job's events. `read_timeout` ends the stream (without error) after
        that long with nothing, not even a keep-alive, from the worker.
        """
        self._ensure_verified()
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        params = {"job_id": job_id} if job_id else None
        try:
            with self._http.stream("GET", "/v1/events", headers=headers, params=params,
                                   timeout=httpx.Timeout(10.0, read=read_timeout)) as r:
                if r.status_code >= 400:
                    r.read()
                    self._check(r)
                yield from _parse_sse(r.iter_lines())
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise WorkerUnreachable(self.url, type(exc).__name__) from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout):
            return  # the worker went away mid-stream; callers resume with the last id


def _parse_sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    ev_id: str | None = None
    ev_type = "message"
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                try:
                    payload = json.loads("\n".join(data), parse_constant=lambda _c: None)
                except ValueError:
                    ev_id, ev_type, data = None, "message", []
                    continue
                if not isinstance(payload, dict):
                    payload = {"data": payload}
                payload.setdefault("type", ev_type)
                if ev_id is not None:
                    payload["id"] = int(ev_id) if ev_id.isdigit() else ev_id
                yield payload
            ev_id, ev_type, data = None, "message", []
        elif line.startswith(":"):
            continue  # keep-alive comment
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "id":
                ev_id = value
            elif name == "event":
                ev_type = value
            elif name == "data":
                data.append(value)


# ---------------------------------------------------------------- for the dashboard and `report` (issue 14)
def _job_events(self: JobsClient, job_id: str) -> list[dict[str, Any]]:
    """The job's own events (its run dir's events.jsonl), oldest first."""
    return self._request("GET", f"/v1/jobs/{job_id}/events")["events"]


def _outputs(self: JobsClient, job_id: str) -> list[dict[str, Any]]:
    """Regular files under the job's outputs/: [{path, size, mtime}]."""
    return self._request("GET", f"/v1/jobs/{job_id}/outputs")["files"]


def _output_file(self: JobsClient, job_id: str, path: str) -> bytes:
    """The bytes of one file listed by `outputs` (at most 64 MiB)."""
    try:
        r = self._http.get(f"/v1/jobs/{job_id}/outputs/{path}")
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
        raise WorkerUnreachable(self.url, type(exc).__name__) from None
    except httpx.TimeoutException:
        raise WorkerUnreachable(self.url, "timed out") from None
    if r.status_code >= 400:
        self._check(r)
    return r.content


def _last_event_id(self: JobsClient) -> int:
    """The id of the worker's newest event: `events()` from it misses nothing that follows."""
    return int(self._request("GET", "/v1/events/last")["id"])


JobsClient.job_events = _job_events  # type: ignore[attr-defined]
JobsClient.last_event_id = _last_event_id  # type: ignore[attr-defined]
JobsClient.outputs = _outputs  # type: ignore[attr-defined]
JobsClient.output_file = _output_file  # type: ignore[attr-defined]
