"""A submit, from a validated spec to a stored job: once per idempotency key, with its run dir whole.

- `Idempotency-Key` (a header the client generates per submit): a repeated key gets the job that the
  first submit made (200, `existing: true`), so a client whose submit was cut off (the worker killed
  mid-request, a store locked past the client's timeout) asks again with the same key and never
  makes two jobs. The same key with another spec is refused (409): it is a client's bug.
- The store's file is still the one this worker opened (`JobStore.check_file`): a jobs.db deleted or
  replaced under the worker refuses submits (503 naming the file) instead of acknowledging them
  into a file no one will read again.
- A run dir that cannot be made whole (a full disk) is removed again: no half-made run dirs, no
  `.spec.yaml.tmp` left behind; the submit is refused (503) naming the dir and the cause.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from jobs import strict_json
from jobs.errors import InvalidTransition, SpecError, StoreError
from jobs.rundir import RunDir
from jobs.spec import JobSpec
from jobs.store import JobStore
from jobs.worker.faults import FaultPoints

__all__ = ["KEY_HEADER", "submit_job", "check_key"]

KEY_HEADER = "Idempotency-Key"
_KEY = re.compile(r"[A-Za-z0-9._:-]{8,64}")


def check_key(key: str | None) -> str | None:
    if key is None or key == "":
        return None
    if not _KEY.fullmatch(key):
        raise SpecError(KEY_HEADER, "must be 8-64 characters of A-Z a-z 0-9 . _ : -")
    return key


def submit_job(store: JobStore, home: Path, spec: JobSpec, data: dict[str, Any],
               key: str | None) -> tuple[dict[str, Any], bool]:
    """(job, created): the new job, or the one an earlier submit with `key` made."""
    key = check_key(key)
    FaultPoints(home).pause("received")  # the crash tests kill the worker here: read, nothing made yet
    store.check_file()  # before any read too: a replaced file may not even hold the tables
    if key is not None:
        prior = store.job_by_key(key)
        if prior is not None:
            return _same_spec(prior, data, key), False
    job_id = store.new_id()
    fields = dict(kind=spec.kind, name=spec.display_name(), priority=spec.priority, gpus=spec.gpus,
                  max_attempts=spec.retry.max_attempts, job_id=job_id, executor=spec.executor,
                  min_vram=spec.resources.min_vram or 0, submit_key=key)
    if store.shared:  # the worker that claims it makes its run dir, on its own host
        job = store.create_job(data, **fields)
    else:
        rd = RunDir.for_job(home, job_id)
        try:
            rd.create(data)  # first, so events.jsonl sees job.created
        except OSError as exc:
            shutil.rmtree(rd.path, ignore_errors=True)  # no half-made run dir
            raise StoreError(f"cannot create the job's run dir {rd.path}: {exc.strerror or exc}") from None
        try:
            job = store.create_job(data, run_dir_for=lambda _: str(rd.path), **fields)
        except BaseException:
            shutil.rmtree(rd.path, ignore_errors=True)  # no half-made job
            raise
        if job.get("existing"):  # a concurrent submit with the same key won
            shutil.rmtree(rd.path, ignore_errors=True)
    if job.pop("existing", False):
        return _same_spec(job, data, key), False
    FaultPoints(home).pause("submitted")  # the crash tests kill the worker here: made, not yet answered
    return job, True


def _same_spec(job: dict[str, Any], data: dict[str, Any], key: str | None) -> dict[str, Any]:
    if strict_json.dumps(job.get("spec")) != strict_json.dumps(data):
        raise InvalidTransition(f"{KEY_HEADER} {key} was used for job {job['id']} with another spec; "
                                "use a new key for a new job")
    return {**job, "existing": True}
