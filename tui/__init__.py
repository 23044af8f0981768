"""tui: the Textual dashboard on the jobs client API (never imports torch). Not built yet."""
