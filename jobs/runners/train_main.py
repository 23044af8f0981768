"""`python -m jobs.runners.train_main RUN_DIR`: the train runner's entry point.

Turns what a user can cause into the exit report the worker reads: bad data, a model folder of the
wrong family or a bad engine key -> setup_failed; a non-finite loss -> nonfinite_loss (with the
step); out of memory -> cuda_oom / host_oom. Bugs still raise with their traceback.
"""

from __future__ import annotations

from jobs.runners._entry import import_family, imports_without_gc, load_job
from jobs.runners.errors import reporting_failures


def main() -> None:
    spec, run_dir = load_job()

    def work() -> None:
        from jobs.runners.inputs import check_train

        checked = check_train(spec)  # bad input fails here, before torch is imported
        with imports_without_gc():
            import peft  # noqa: F401  (the LoRA)

            from jobs.runners.train import train

            import_family(checked.family)
        train(spec, run_dir, checked)

    reporting_failures(work)


if __name__ == "__main__":
    main()
