"""Small modal screens: confirm, pick one of a few, and the key help."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Label, Static

__all__ = ["ConfirmScreen", "ChoiceScreen", "HelpScreen", "help_rows"]

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
    """Every key that works on the screen underneath: its focused widget's, its own and the app's,
    read from Textual's active bindings (so a key hidden by `--read-only` is not listed)."""

    BINDINGS = [Binding("escape,q,question_mark", "close", "Close")]
    # A Static in a `width: auto` box is 1fr wide, which is 0 there: the box needs a width of its own.
    DEFAULT_CSS = _DIALOG_CSS.format(name="HelpScreen") + """
    HelpScreen > Vertical { width: 72; max-width: 100%; max-height: 100%; padding: 0 1; }
    HelpScreen VerticalScroll { height: auto; max-height: 100%; }
    HelpScreen #help-keys { width: 100%; height: auto; }
    """

    def __init__(self, under: Screen) -> None:
        super().__init__()
        self.under = under
        self.rows = help_rows(under)

    def compose(self) -> ComposeResult:
        t = Text()
        t.append(f"{type(self.under).__name__.removesuffix('Screen')} keys\n", style="bold")
        section = None
        for where, keys, desc, enabled in self.rows:
            if where != section:
                section = where
                t.append(f"\n{where}\n", style="bold dim")
            t.append(f"{keys:>14}", style="bold" if enabled else "dim")
            t.append(f"  {desc}\n", style="" if enabled else "dim")
        t.append("\nEsc, q or ? closes this help.", style="dim")
        with Vertical():
            with VerticalScroll():
                yield Static(t, id="help-keys")

    def action_close(self) -> None:
        self.dismiss(None)


def help_rows(screen: Screen) -> list[tuple[str, str, str, bool]]:
    """(where, keys, what it does, enabled) for each binding active on `screen`, the keys of one
    binding together ("n/esc"), grouped: the screen's, the focused widget's, then the app's."""
    app = screen.app
    grouped: dict[tuple[int, str, str], list[Any]] = {}
    order: list[tuple[int, str, str]] = []
    for active in screen.active_bindings.values():
        # Textual splits "ctrl+c,super+c" into a binding per key: one row for them all.
        mark = (id(active.node), active.binding.action, active.binding.description)
        if mark not in grouped:
            grouped[mark] = [active.node, active.binding, active.enabled, []]
            order.append(mark)
        grouped[mark][3].append(app.get_key_display(active.binding))
    rows = []
    for mark in order:
        node, binding, enabled, keys = grouped[mark]
        if node is app:
            where = "everywhere"
        elif node is screen:
            where = "this screen"
        else:  # the focused widget or one around it
            where = f"the {type(node).__name__}" + (f" #{node.id}" if node.id else "")
        desc = binding.description or binding.tooltip or binding.action.replace("_", " ")
        rows.append((where, "/".join(dict.fromkeys(keys)), desc, enabled, binding.action in _TEXTUAL_SCREEN_ACTIONS))
    rank = {"this screen": 0, "everywhere": 2}
    # Stable: each group keeps its bindings' order, the screen's own keys before Textual's (tab, copy).
    rows.sort(key=lambda r: (rank.get(r[0], 1), r[4]))
    return [r[:4] for r in rows]


_TEXTUAL_SCREEN_ACTIONS = frozenset(b.action for b in Screen.BINDINGS if isinstance(b, Binding))
