"""The submit screen (`n`): pick a YAML file or a kind's template, edit its fields, submit.

Every keystroke re-validates the spec with the edits as `--set` overrides, through the same code
as `offload-jobs validate`, and shows its one-line error (or "ok"). Submit is refused while the
spec does not validate; once the worker takes it, the new job's detail screen opens. ctrl+l lists
the models the worker has (tui.screens.models); a pick fills `model.path` or `model.transformer`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.suggester import Suggester
from textual.widgets import Button, DirectoryTree, Footer, Header, Input, Label, Select, Static, TextArea

from jobs.errors import JobsError
from tui.screens.actions import call_worker
from tui.specform import SpecSource, check_spec, complete_path, flatten, overrides_from, show_value

__all__ = ["SubmitScreen", "PathSuggester"]

KINDS = ("train", "infer", "shard", "command")


class PathSuggester(Suggester):
    """Completes a path as you type (accept with the right arrow key)."""

    def __init__(self) -> None:
        super().__init__(use_cache=False, case_sensitive=True)

    async def get_suggestion(self, value: str) -> str | None:
        return complete_path(value)


class _YamlTree(DirectoryTree):
    def filter_paths(self, paths: Any) -> Any:
        return [p for p in paths if not p.name.startswith(".") and (p.is_dir() or p.suffix in (".yaml", ".yml"))]


class SubmitScreen(Screen):
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("ctrl+s", "submit", "Submit"),
        Binding("ctrl+o", "browse", "Browse files"),
        Binding("ctrl+l", "models", "Worker's models"),
    ]
    DEFAULT_CSS = """
    SubmitScreen #pick { height: auto; }
    SubmitScreen #path { width: 1fr; }
    SubmitScreen #template { width: 28; }
    SubmitScreen #tree { display: none; height: 12; }
    SubmitScreen #tree.-shown { display: block; }
    SubmitScreen #verdict { height: auto; padding: 0 1; }
    SubmitScreen #verdict.-bad { background: $error 30%; }
    SubmitScreen #verdict.-good { background: $success 20%; }
    SubmitScreen #body { height: 1fr; }
    SubmitScreen #form { width: 1fr; }
    SubmitScreen #preview { width: 1fr; border-left: solid $panel-lighten-2; padding: 0 1; }
    SubmitScreen .field { height: 1; }
    SubmitScreen .field Label { width: 36; padding: 0 1; color: $text-muted; }
    SubmitScreen .field Input { width: 1fr; height: 1; border: none; padding: 0; }
    SubmitScreen #extra { height: 5; }
    """

    def __init__(self, start_dir: str | None = None) -> None:
        super().__init__()
        self.start_dir = Path(start_dir or ".")
        self.source: SpecSource | None = None
        self.initial: dict[str, str] = {}
        self.fields: dict[str, str] = {}
        self.spec: Any = None
        self.error: str | None = "pick a YAML file or a template"
        self.submitted: dict[str, Any] | None = None
        self._generation = 0

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal(id="pick"):
            yield Input(placeholder="path to a job YAML (→ completes, Enter loads, ctrl+o browses)", id="path",
                        suggester=PathSuggester())
            yield Select([(f"template: {k}", k) for k in KINDS], prompt="or a template", id="template")
        yield _YamlTree(str(self.start_dir), id="tree")
        yield Static(id="verdict")
        with Horizontal(id="body"):
            with VerticalScroll(id="form"):
                yield Label("fields (edits become --set overrides)", classes="heading")
                yield Vertical(id="fields")
                yield Label("more --set overrides, one per line (key.sub=value)")
                yield TextArea(id="extra")
                yield Button("Submit (ctrl+s)", variant="success", id="submit")
            yield VerticalScroll(Static(id="preview"), id="preview-box")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "new job"
        self.query_one("#path", Input).focus()
        self._show_verdict()

    # ------------------------------------------------------------ loading a source
    @on(Input.Submitted, "#path")
    def _path_entered(self, event: Input.Submitted) -> None:
        self.load_file(event.value.strip())

    @on(DirectoryTree.FileSelected, "#tree")
    def _tree_pick(self, event: DirectoryTree.FileSelected) -> None:
        self.query_one("#path", Input).value = str(event.path)
        self.query_one("#tree").remove_class("-shown")
        self.load_file(str(event.path))

    @on(Select.Changed, "#template")
    def _template_pick(self, event: Select.Changed) -> None:
        if isinstance(event.value, str):
            self.load(SpecSource.from_template(event.value))

    def load_file(self, path: str) -> None:
        if not path:
            return
        p = Path(path).expanduser()
        if not p.is_absolute():
            p = (self.start_dir / p) if not p.exists() else p
        if p.is_dir():
            self.error = f"error: {p}: is a directory, not a YAML spec file"
            self._show_verdict()
            return
        try:
            self.load(SpecSource.from_file(p))
        except JobsError as exc:
            from jobs._cli.output import error_line

            self.source, self.spec, self.error = None, None, error_line(exc)
            self._show_verdict()

    def load(self, source: SpecSource) -> None:
        self.source = source
        self.initial = {k: show_value(v) for k, v in flatten(source.data)}
        self.fields = dict(self.initial)
        self._generation += 1
        box = self.query_one("#fields", Vertical)
        box.remove_children()
        rows = []
        for i, (key, shown) in enumerate(self.initial.items()):
            rows.append(Horizontal(Label(key), Input(shown, id=f"f{self._generation}-{i}", name=key),
                                   classes="field"))
        box.mount_all(rows)
        self.revalidate()

    # ------------------------------------------------------------ validation
    @on(Input.Changed)
    def _field_changed(self, event: Input.Changed) -> None:
        if event.input.id and event.input.id.startswith("f") and event.input.name:
            self.fields[event.input.name] = event.value
            self.revalidate()

    @on(TextArea.Changed, "#extra")
    def _extra_changed(self) -> None:
        self.revalidate()

    def overrides(self) -> list[str]:
        return overrides_from(self.fields, self.initial, self.query_one("#extra", TextArea).text)

    def revalidate(self) -> None:
        if self.source is None:
            return
        self.spec, self.error = check_spec(self.source, self.overrides())
        self._show_verdict()

    def _show_verdict(self) -> None:
        verdict = self.query_one("#verdict", Static)
        preview = self.query_one("#preview", Static)
        if self.error or self.spec is None:
            verdict.update(Text(self.error or "", style="bold"))
            verdict.set_class(self.source is not None, "-bad")
            verdict.remove_class("-good")
            if self.source is not None:
                preview.update(self.source.text)
            return
        import yaml

        sets = self.overrides()
        label = f"ok: a {self.spec.kind} job '{self.spec.display_name()}' from {self.source.label if self.source else '?'}"
        verdict.update(Text(label + (f" with {len(sets)} override(s)" if sets else ""), style="bold"))
        verdict.set_class(True, "-good")
        verdict.remove_class("-bad")
        preview.update(yaml.safe_dump(self.spec.model_dump(mode="json", exclude_unset=True), sort_keys=False))

    # ------------------------------------------------------------ actions
    def action_browse(self) -> None:
        tree = self.query_one("#tree")
        tree.toggle_class("-shown")
        if tree.has_class("-shown"):
            tree.focus()

    def action_models(self) -> None:
        from tui.screens.models import ModelPickerScreen

        if self.app.make_client is None:
            self.app.notify("no worker: its models cannot be listed", severity="warning")
            return
        self.app.push_screen(ModelPickerScreen(), self.use_model)

    def use_model(self, entry: dict[str, Any] | None) -> None:
        """Put a picked model's path in its field: the form's input when the spec has it, else an override line."""
        if not entry or not entry.get("field"):
            return
        key, value = str(entry["field"]), show_value(str(entry["path"]))
        if self.source is None:
            self.load(SpecSource.from_template("infer"))
        field = next((i for i in self.query(Input) if i.name == key), None)
        if field is not None:
            field.value = value
            self.fields[key] = value
        else:
            extra = self.query_one("#extra", TextArea)
            lines = [ln for ln in extra.text.splitlines() if ln.split("=", 1)[0].strip() != key]
            extra.text = "\n".join([*lines, f"{key}={value}"])
        self.revalidate()
        self.app.notify(f"{key} = {entry['path']}", timeout=3)

    def action_back(self) -> None:
        tree = self.query_one("#tree")
        if tree.has_class("-shown"):
            tree.remove_class("-shown")
            return
        self.app.pop_screen()

    @on(Button.Pressed, "#submit")
    def _submit_pressed(self) -> None:
        self.action_submit()

    def action_submit(self) -> None:
        self.revalidate()
        if self.spec is None:
            self.app.notify(self.error or "nothing to submit", severity="error", timeout=5)
            return
        if self.app.read_only:
            self.app.notify("read-only dashboard: submit is off", severity="warning")
            return
        payload = self.spec.model_dump(mode="json", exclude_unset=True)
        call_worker(self.app, lambda c: c.submit(payload), self._accepted, self._refused, group="submit")

    def _refused(self, message: str) -> None:
        self.error, self.spec = message, None
        self._show_verdict()
        self.app.notify(message, severity="error", timeout=6)

    def _accepted(self, job: dict[str, Any]) -> None:
        self.submitted = job
        self.app.merge_jobs([job])
        self.app.notify(f"submitted job {job['id']} ({job.get('name') or job.get('kind')})", timeout=4)
        self.app.pop_screen()
        self.app.open_detail(str(job["id"]))
