"""The model picker (ctrl+l on the submit screen): what the worker has under its model roots.

The list is the worker's (`GET /v1/models`, `offload-jobs models`), fetched in a thread when the
picker opens. Diffusers folders and transformer checkpoints can be picked (Enter); the screen under
it puts the path in the field the entry names (`model.path` or `model.transformer`). VAEs, text
encoders, LoRAs and unreadable files are listed, dimmed, so the list says what the disk holds.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from jobs.errors import JobsError
from tui.screens.actions import call_worker
from jobs.display import fmt_bytes

__all__ = ["ModelPickerScreen", "PICKABLE", "entry_label"]

PICKABLE = ("model.path", "model.transformer")  # the fields a pick fills



def entry_label(m: dict[str, Any]) -> Text:
    """One row: name, kind, family (variant), layout, dtype, size, and what the cache holds."""
    family = (m.get("family") or "-") + (f" {m['variant']}" if m.get("variant") else "")
    cache = "+".join(w for w in ("converted", "sharded") if m.get(w)) or ("not converted" if m.get("converted") is False
                                                                         else "")
    t = Text(f"{m.get('name')}", style="bold" if m.get("field") in PICKABLE else "dim")
    t.append(f"  {m.get('kind')} · {family} · {m.get('layout') or '-'} · {m.get('dtype') or '-'} · "
             f"{fmt_bytes(m.get('bytes'))}" + (f" · {cache}" if cache else "")
             + (f" · {m['note']}" if m.get("note") else ""), style="dim")
    return t


class ModelPickerScreen(ModalScreen[dict[str, Any] | None]):
    """Pick a model the worker has; dismissed with its entry (None with Esc)."""

    BINDINGS = [Binding("escape", "close", "Back")]
    DEFAULT_CSS = """
    ModelPickerScreen { align: center middle; }
    ModelPickerScreen > Vertical { width: 90%; max-width: 140; height: 80%; border: thick $accent; padding: 0 1;
                                   background: $surface; }
    ModelPickerScreen #models-status { height: auto; color: $text-muted; }
    ModelPickerScreen OptionList { height: 1fr; }
    """

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[dict[str, Any]] = []
        self.loaded = False
        self.error: str | None = None

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("models on the worker (Enter picks a folder or transformer, Esc goes back)", id="models-status")
            yield OptionList(id="models")

    def on_mount(self) -> None:
        call_worker(self.app, lambda c: c.models(), self._show, self._failed, group="models",
                    errors=(JobsError, RuntimeError))

    def _failed(self, message: str) -> None:
        self.error, self.loaded = message, True
        self.query_one("#models-status", Label).update(Text(message, style="bold"))

    def _show(self, body: dict[str, Any]) -> None:
        self.entries = list(body.get("models") or [])
        roots = ", ".join(r["path"] + ("" if r.get("exists") else " (not there)") for r in body.get("roots") or [])
        options = [Option(entry_label(m), id=str(i), disabled=m.get("field") not in PICKABLE)
                   for i, m in enumerate(self.entries)]
        listing = self.query_one("#models", OptionList)
        listing.add_options(options)
        self.query_one("#models-status", Label).update(
            f"{len(self.entries)} under {roots or 'no roots'} (Enter picks a folder or transformer, Esc goes back)")
        self.loaded = True
        listing.focus()
        first = next((i for i, m in enumerate(self.entries) if m.get("field") in PICKABLE), None)
        if first is not None:
            listing.highlighted = first

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.entries[int(event.option.id or 0)])

    def action_close(self) -> None:
        self.dismiss(None)
