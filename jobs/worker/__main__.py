from __future__ import annotations

import sys

from jobs.worker.main import main

sys.exit(main())
