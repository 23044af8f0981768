"""`python -m jobs.runners.infer_main RUN_DIR`: the infer runner's entry point.

A user's mistake (a model folder of the wrong family, a LoRA of another family, a bad prompt
option) fails the job with reason setup_failed and one line saying what to fix.

In a co-scheduled batch (the worker sets OFFLOAD_JOBS_BATCH_DIR, jobs/batchdir.py) the leader's child
renders every member's images (jobs.runners.cosched) and each member's child waits for its own
result (jobs.runners.batch_member).
"""

from __future__ import annotations

import os

from jobs.batchdir import BATCH_DIR_ENV, BATCH_ROLE_ENV, BatchDir
from jobs.runners._entry import import_family, imports_without_gc, load_job
from jobs.runners.errors import reporting_failures


def main() -> None:
    spec, run_dir = load_job()
    role = os.environ.get(BATCH_ROLE_ENV) if os.environ.get(BATCH_DIR_ENV) else None
    if role == "member":
        from jobs.runners.batch_member import wait

        wait(BatchDir(os.environ[BATCH_DIR_ENV]), os.environ.get("OFFLOAD_JOBS_JOB_ID") or run_dir.name)
        return

    def work() -> None:
        from jobs.runners.telemetry import quiet_libraries

        if role == "leader":
            import psutil

            BatchDir(os.environ[BATCH_DIR_ENV]).write_leader(os.getpid(), psutil.Process().create_time())  # first
            with imports_without_gc():
                from jobs.runners.cosched import lead

                quiet_libraries()
            lead(spec, run_dir)
            return
        from jobs.runners.inputs import check_infer

        checked = check_infer(spec, run_dir.parent.parent)  # bad input fails here, before torch is imported
        with imports_without_gc():
            from jobs.runners.infer import infer

            import_family(checked.family)
        infer(spec, run_dir, checked)

    reporting_failures(work)


if __name__ == "__main__":
    main()
