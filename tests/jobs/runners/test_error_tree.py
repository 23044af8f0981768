"""Every error a user can cause in the runners and executors is a named class on the tree drawn in jobs.errors."""

from __future__ import annotations

import inspect

import jobs.errors
import jobs.runners.errors as runner_errors
from jobs.executors.base import SetupFailed


def test_every_runner_and_executor_error_is_on_the_drawn_tree() -> None:
    drawn = jobs.errors.__doc__ or ""
    classes = [c for _, c in inspect.getmembers(runner_errors, inspect.isclass)
               if issubclass(c, BaseException) and c.__module__ == runner_errors.__name__] + [SetupFailed]
    assert len(classes) >= 9
    for cls in classes:
        assert issubclass(cls, jobs.errors.JobsError), cls
        assert f"── {cls.__name__} " in drawn, f"{cls.__name__} is not drawn in jobs.errors"
    assert issubclass(SetupFailed, jobs.errors.ExecutorError)


def test_the_runner_modules_raise_the_named_classes() -> None:
    from jobs.runners import data, folders, prompts

    assert data.DatasetError is runner_errors.DatasetError and prompts.PromptError is runner_errors.PromptError
    assert folders.FamilyError is runner_errors.FamilyError
    known = runner_errors.classify_exception(folders.FamilyError("model.path: x is not a folder"))
    assert known == ("setup_failed", "model.path: x is not a folder", 2)


def test_an_out_of_memory_hidden_behind_an_error_raised_while_unwinding_is_named() -> None:
    # On CUDA, an out-of-memory inside a layer-major step came out as torch's internal assert from a
    # checkpoint hook's exit, with the OOM only in the chain: the job must still say out of GPU memory.
    import torch

    try:
        try:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 54.00 MiB.\nmore")
        except torch.cuda.OutOfMemoryError:
            raise RuntimeError("is_initialized && !tls.stack.empty() INTERNAL ASSERT FAILED")  # noqa: B904
    except RuntimeError as exc:
        known = runner_errors.classify_exception(exc)
    assert known == ("cuda_oom", "out of GPU memory: CUDA out of memory. Tried to allocate 54.00 MiB.", 1)
    assert runner_errors.classify_exception(RuntimeError("a bug")) is None  # a plain bug still raises
