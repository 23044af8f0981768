"""tui: the Textual dashboard of an offload-jobs worker (`offload-jobs tui`).

It talks to the worker only through `jobs.client.JobsClient` and never imports torch.

    app.py        DashboardApp: the one copy of the jobs it knows, and main()
    feed.py       background threads: the poller, the SSE follower, a job's metrics tail
    history.py    metrics rows -> bounded chart series (NaN-tolerant); shared with the report
    logsource.py  a log read by byte offset in blocks, with a line cache
    specform.py   the submit screen's spec fields and validation (the `validate` path)
    screens/      jobs, detail, logs, submit, dialogs
    widgets/      TimeChart (braille), LogView (line API), GpuPanel, ConnectionBar
    report.py     `offload-jobs report`: one self-contained HTML file
"""
