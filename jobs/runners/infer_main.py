"""`python -m jobs.runners.infer_main RUN_DIR`: the infer runner's entry point.

A user's mistake (a model folder of the wrong family, a LoRA of another family, a bad prompt
option) fails the job with reason setup_failed and one line saying what to fix.
"""

from __future__ import annotations

from jobs.runners._entry import fail, load_job
from jobs.runners.errors import classify_exception


def main() -> None:
    spec, run_dir = load_job()
    try:
        from jobs.runners.inputs import check_infer

        checked = check_infer(spec, run_dir.parent.parent)  # bad input fails here, before torch is imported
        from jobs.runners.telemetry import quiet_libraries
        from jobs.runners.infer import infer

        quiet_libraries()
        infer(spec, run_dir, checked)
    except Exception as exc:
        known = classify_exception(exc)
        if known is None:
            raise
        reason, message, code = known
        fail(reason, message, code=code)


if __name__ == "__main__":
    main()
