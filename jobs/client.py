"""`JobsClient`: the sync HTTP client of a worker, used by the CLI and the TUI.

Light on purpose (httpx + stdlib): `offload-jobs ps` must answer at once.

A job is a dict with at least: id, name, kind, status, reason, attempt, max_attempts, priority,
created_at, started_at, finished_at (epoch seconds or None), exit_code, run_dir, spec, last_metrics.
"""

from __future__ import annotations

import json
import os
import ssl
import time
from collections.abc import Iterator
from typing import Any

import httpx

from jobs.errors import AuthError, InvalidTransition, JobNotFound, JobsError, SpecError, WorkerUnreachable
from jobs.home import DEFAULT_URL, read_token, read_worker_info, state_home

__all__ = ["JobsClient", "TERMINAL_STATES"]

TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


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
    """Talks to one worker at `url` with a bearer `token`."""

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, *, timeout: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.token = token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                  transport=transport if transport is not None else _LazyTLSTransport())

    @classmethod
    def from_env(cls, home: str | os.PathLike[str] | None = None, **kwargs: Any) -> "JobsClient":
        """URL from $OFFLOAD_JOBS_URL or the state dir's worker.json; token from $OFFLOAD_JOBS_TOKEN or its token file."""
        h = state_home(home)
        url = os.environ.get("OFFLOAD_JOBS_URL")
        if not url:
            info = read_worker_info(h)
            url = info.get("url") if info else None
        token = os.environ.get("OFFLOAD_JOBS_TOKEN") or read_token(h)
        return cls(url or DEFAULT_URL, token, **kwargs)

    # ------------------------------------------------------------ plumbing
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "JobsClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self._http.request(method, path, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
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
        raise JobsError(f"worker at {self.url} answered {r.status_code}: {msg}")

    # ------------------------------------------------------------ API
    def health(self) -> dict[str, Any]:
        return self._request("GET", "/healthz")

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Queue a job from a spec dict (e.g. `load_spec(...).model_dump()` or raw YAML data)."""
        return self._request("POST", "/v1/jobs", json={"spec": spec})

    def list(self, status: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {}
        if status:
            params["status"] = status
        if limit is not None:
            params["limit"] = limit
        return self._request("GET", "/v1/jobs", params=params)["jobs"]

    def get(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/jobs/{job_id}/cancel")

    def retry(self, job_id: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/jobs/{job_id}/retry")

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
        """Poll until the job is terminal; returns the job (raises TimeoutError after `timeout`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if job["status"] in TERMINAL_STATES:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['status']} after {timeout}s")
            time.sleep(poll)

    def events(self, last_event_id: int | None = None) -> Iterator[dict[str, Any]]:
        """Server-sent events: dicts with `id`, `type` and the event's fields. Ends when the worker stops."""
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        try:
            with self._http.stream("GET", "/v1/events", headers=headers, timeout=httpx.Timeout(10.0, read=None)) as r:
                if r.status_code >= 400:
                    r.read()
                    self._check(r)
                yield from _parse_sse(r.iter_lines())
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise WorkerUnreachable(self.url, type(exc).__name__) from None
        except (httpx.RemoteProtocolError, httpx.ReadError):
            return  # the worker went away mid-stream; callers resume with the last id


def _parse_sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    ev_id: str | None = None
    ev_type = "message"
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                payload = json.loads("\n".join(data))
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
