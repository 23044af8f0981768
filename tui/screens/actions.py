"""Keys that act on one job, shared by the jobs and detail screens: cancel, retry, logs, signal, delete."""

from __future__ import annotations

from typing import Any

from textual.binding import Binding

from jobs.errors import JobsError

__all__ = ["JobActions", "call_worker"]

def call_worker(app: Any, call: Any, done: Any, failed: Any, group: str,
                errors: tuple[type[BaseException], ...] = (JobsError,)) -> None:
    """``call(client)`` on a thread (the screen stays live); ``done(result)`` or ``failed(one line)`` back
    on the app's thread."""
    def run() -> None:
        try:
            with app.client() as c:
                result = call(c)
        except errors as exc:
            from jobs._cli.output import error_line

            app.call_from_thread(failed, error_line(exc))
            return
        app.call_from_thread(done, result)

    app.run_worker(run, thread=True, group=group, exclusive=True, exit_on_error=False)


WRITE_ACTIONS = frozenset({"cancel", "retry", "signal", "submit", "delete"})


class JobActions:
    """Mixin for a Screen with `selected_job_id()`; `--read-only` hides cancel, retry, signal and delete."""

    ACTION_BINDINGS = [
        Binding("c", "cancel", "Cancel"),
        Binding("r", "retry", "Retry"),
        Binding("l", "logs", "Logs"),
        Binding("s", "signal", "Save/sample"),
        Binding("d", "delete", "Delete"),
    ]

    app: Any

    def selected_job_id(self) -> str | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in WRITE_ACTIONS and self.app.read_only:
            return False
        return True

    def _job(self) -> dict[str, Any] | None:
        job_id = self.selected_job_id()
        return self.app.jobs.get(job_id, {"id": job_id}) if job_id else None

    def action_cancel(self) -> None:
        from tui.screens.dialogs import ConfirmScreen

        job = self._job()
        if job is None or self.app.read_only:
            return
        job_id = job["id"]
        question = f"Cancel job {job_id} ({job.get('name') or job.get('kind') or '?'}, {job.get('status', '?')})?"

        def done(yes: bool | None) -> None:
            if yes:
                self._call(f"cancel {job_id}", lambda c: c.cancel(job_id), "cancel requested")

        self.app.push_screen(ConfirmScreen(question, yes="Cancel job", no="Keep running"), done)

    def action_retry(self) -> None:
        job = self._job()
        if job is None or self.app.read_only:
            return
        job_id = job["id"]
        self._call(f"retry {job_id}", lambda c: c.retry(job_id), "queued again")

    def action_logs(self) -> None:
        from tui.screens.logs import LogsScreen

        job = self._job()
        if job is not None:
            self.app.push_screen(LogsScreen(job["id"], tail=self.app.tail, follow=self.app.follow))

    def action_signal(self) -> None:
        from tui.screens.dialogs import ChoiceScreen

        job = self._job()
        if job is None or self.app.read_only:
            return
        job_id = job["id"]

        def done(choice: str | None) -> None:
            if not choice:
                return

            def send(c: Any) -> Any:
                signal = getattr(c, "signal", None)
                if signal is None:
                    raise JobsError("this worker's API has no job signals yet (they come with the train runner)")
                return signal(job_id, choice)

            self._call(f"signal {choice} to {job_id}", send, f"{choice} requested")

        self.app.push_screen(ChoiceScreen(f"Signal job {job_id}:", ["save", "sample"]), done)

    def action_delete(self) -> None:
        from tui.screens.dialogs import ConfirmScreen

        job = self._job()
        if job is None or self.app.read_only:
            return
        job_id = job["id"]
        question = (f"Delete job {job_id} ({job.get('name') or job.get('kind') or '?'}, {job.get('status', '?')}) "
                    f"for good?\nIts record, logs and run dir go, with its checkpoints and samples.")

        def done(yes: bool | None) -> None:
            if yes:
                self._call(f"delete {job_id}", lambda c: c.delete(job_id), "deleted",
                           then=lambda: self.deleted(job_id))

        self.app.push_screen(ConfirmScreen(question, yes="Delete job", no="Keep it"), done)

    def deleted(self, job_id: str) -> None:
        """The worker deleted `job_id`: drop it now rather than at the next full listing."""
        if self.app.jobs.pop(job_id, None) is not None:
            self.app.touch(job_id)

    def _call(self, what: str, fn: Any, ok: str, then: Any = None) -> None:
        app = self.app

        def run() -> None:
            try:
                with app.client() as client:
                    fn(client)
            except JobsError as exc:
                app.call_from_thread(app.notify, f"{what}: {exc}", severity="error", timeout=6)
                return
            app.call_from_thread(app.notify, f"{what}: {ok}", timeout=3)
            if then is not None:
                app.call_from_thread(then)
            if app.feed is not None:
                app.feed.poke()

        app.run_worker(run, thread=True, group="job-actions", exit_on_error=False)
