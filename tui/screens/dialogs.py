"""Small modal screens: confirm, pick one of a few, and the key help."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Label, Static

__all__ = ["ConfirmScreen", "ChoiceScreen", "HelpScreen"]

_DIALOG_CSS = """
    {name} {{ align: center middle; }}
    {name} > Vertical {{ width: auto; max-width: 80; height: auto; border: thick $accent; padding: 1 2;
                         background: $surface; }}
    {name} Horizontal {{ height: auto; margin-top: 1; }}
    {name} Button {{ margin-right: 2; }}
"""


class ConfirmScreen(ModalScreen[bool]):
    """Yes or no; `y`/Enter on the focused button, `n`/Esc says no."""

    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]
    DEFAULT_CSS = _DIALOG_CSS.format(name="ConfirmScreen")

    def __init__(self, question: str, yes: str = "Yes", no: str = "No") -> None:
        super().__init__()
        self.question, self.yes, self.no = question, yes, no

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question)
            with Horizontal():
                yield Button(f"{self.yes} (y)", variant="error", id="yes")
                yield Button(f"{self.no} (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class ChoiceScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "dismiss_none", "Back")]
    DEFAULT_CSS = _DIALOG_CSS.format(name="ChoiceScreen")

    def __init__(self, question: str, choices: list[str]) -> None:
        super().__init__()
        self.question, self.choices = question, choices

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question)
            with Horizontal():
                for c in self.choices:
                    yield Button(c, id=f"choice-{c}")
                yield Button("back", variant="primary", id="back")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        bid = event.button.id or ""
        self.dismiss(bid.removeprefix("choice-") if bid.startswith("choice-") else None)

    def action_dismiss_none(self) -> None:
        self.dismiss(None)


class HelpScreen(ModalScreen[None]):
    """The keys of the screen underneath, from its bindings."""

    BINDINGS = [Binding("escape,q,question_mark", "close", "Close")]
    DEFAULT_CSS = _DIALOG_CSS.format(name="HelpScreen")

    def __init__(self, under: Screen) -> None:
        super().__init__()
        self.under = under

    def compose(self) -> ComposeResult:
        lines = [f"[b]{type(self.under).__name__.removesuffix('Screen')}[/b] keys", ""]
        seen = set()
        for b in [*getattr(self.under, "BINDINGS", []), *self.app.BINDINGS]:
            key = b.key if hasattr(b, "key") else b[0]
            if key in seen:
                continue
            seen.add(key)
            action = b.action if hasattr(b, "action") else b[1]
            desc = (b.description if hasattr(b, "description") else b[2]) or action
            if self.under.check_action(action.split("(")[0], ()) is False:
                continue
            shown = getattr(b, "key_display", None) or key
            lines.append(f"  [b]{shown:>10}[/b]  {desc}")
        lines += ["", "Esc goes back; q quits from the jobs screen."]
        with Vertical():
            yield Static("\n".join(lines))

    def action_close(self) -> None:
        self.dismiss(None)
