"""`python -m jobs.runners.infer_main RUN_DIR`: the infer runner's entry point.

A user's mistake (a model folder of the wrong family, a LoRA of another family, a bad prompt
option) fails the job with reason setup_failed and one line saying what to fix.
"""

from __future__ import annotations

from jobs.runners._entry import load_job
from jobs.runners.errors import reporting_failures


def main() -> None:
    spec, run_dir = load_job()

    def work() -> None:
        from jobs.runners.inputs import check_infer

        checked = check_infer(spec, run_dir.parent.parent)  # bad input fails here, before torch is imported
        from jobs.runners.infer import infer
        from jobs.runners.telemetry import quiet_libraries

        quiet_libraries()
        infer(spec, run_dir, checked)

    reporting_failures(work)


if __name__ == "__main__":
    main()
