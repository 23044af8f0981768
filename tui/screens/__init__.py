"""The dashboard's screens: jobs (home), detail, logs, submit, and the small dialogs."""
