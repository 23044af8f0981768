"""offload-jobs: the batch-job runner (spec, store, worker, executors, runners, client)."""

from __future__ import annotations

__version__ = "0.1.0"
