"""Secrets never leave the worker: a spec's `env:` values are stored (the job needs them) but every
answer shows them as `***`, names kept. Stdlib only, so the API, the CLI and the dashboard's
report all hide them the same way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HIDDEN", "redact_spec", "redact_job"]

HIDDEN = "***"


def redact_spec(spec: Any) -> Any:
    """A copy of `spec` with its `env` values hidden; anything that is not a spec dict as it was."""
    if not isinstance(spec, dict) or not isinstance(spec.get("env"), dict) or not spec["env"]:
        return spec
    return {**spec, "env": {k: HIDDEN for k in spec["env"]}}


def redact_job(job: Any) -> Any:
    """A copy of a job record (as the store gives it) with its spec's `env` values hidden."""
    if not isinstance(job, dict) or "spec" not in job:
        return job
    return {**job, "spec": redact_spec(job["spec"])}
