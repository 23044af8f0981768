"""Workers that see the disk as a container's worker would, for tests that run as root."""

from __future__ import annotations

import os
import subprocess
import sys

from jobs_helpers import REPO, WorkerProcess

NOBODY = 65534


class NoDacWorker(WorkerProcess):
    """The worker (and its jobs) as root without the capabilities that let root read any file
    (dac_override, dac_read_search): a file another uid owns with mode 0600 is then unreadable to
    it, as a container's worker under its own uid finds a host file written 0600."""

    def start(self, timeout: float = 60.0, wait: bool = True) -> "NoDacWorker":
        self.home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        drop = "-dac_override,-dac_read_search"
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(
                ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", sys.executable, "-m", "jobs.worker",
                 "--port", str(self.port), "--home", str(self.home), "--log-level", "warning"],
                stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        return self.wait_healthy(timeout) if wait else self
