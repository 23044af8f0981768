"""The shared names of the jobs wing: job states, failure reasons, kinds and executors.

Stdlib only and import-free, so the store, the client, the CLI and the spec all read the same
tuples (and `offload-jobs ps` pays nothing for them).

    PENDING -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
                    \\          \\-> CANCELLING -> CANCELLED
                     \\-> (cancel while STARTING) CANCELLING
"""

from __future__ import annotations

__all__ = ["STATES", "TERMINAL", "ACTIVE", "LIVE", "REASONS", "RETRYABLE_REASONS", "KINDS", "EXECUTORS"]

STATES = ("PENDING", "STARTING", "RUNNING", "CANCELLING", "SUCCEEDED", "FAILED", "CANCELLED")
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
ACTIVE = frozenset({"PENDING", "STARTING", "RUNNING", "CANCELLING"})
LIVE = frozenset({"STARTING", "RUNNING", "CANCELLING"})  # an attempt exists (or is being made)

# Why an attempt ended other than with exit code 0:
#   exit_nonzero    the job exited non-zero, or died by a signal it raised itself
#   setup_failed    it could not start: bad spec, missing binary, image or path
#   cuda_oom        the job reported CUDA out of memory (its exit report)
#   host_oom        the kernel's OOM killer ended it
#   timeout         it ran past limits.max_duration
#   cancelled       a user cancelled it
#   worker_lost     the worker died and the attempt could not be recovered
#   killed          a SIGKILL that neither the worker nor the OOM killer sent
#   nonfinite_loss  the train runner's guard stopped a diverging run
#   no_cuda         the job asked for a CUDA device that the worker's torch cannot use (a CPU build)
#   permission_denied  a model or data file the job's uid cannot read (the file and uid are named)
REASONS = ("exit_nonzero", "setup_failed", "cuda_oom", "host_oom", "timeout", "cancelled", "worker_lost",
           "killed", "nonfinite_loss", "no_cuda", "permission_denied")
RETRYABLE_REASONS = tuple(r for r in REASONS if r != "cancelled")

KINDS = ("train", "infer", "shard", "command")
EXECUTORS = ("process", "docker", "slurm")

# OFFLOAD_JOBS_* variables a spec's `env` may set: options the runners read. Every other
# OFFLOAD_JOBS_* name is the worker's own (run dir, metrics file, outputs, exit report).
#   OFFLOAD_JOBS_VRAM_CAP           emulate a smaller card (torch.cuda.set_per_process_memory_fraction)
#   OFFLOAD_JOBS_HOST_MEMORY_WARN   the host-RAM fraction at which the train runner warns
RUNNER_ENV_OPTIONS = frozenset({"OFFLOAD_JOBS_VRAM_CAP", "OFFLOAD_JOBS_HOST_MEMORY_WARN"})
