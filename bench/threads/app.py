"""The Python app of `locketd-bench threads` (issue 38): the MODULE given to
adapters/python/locketd_handler.py. It stands in for a loaded app: a few
stdlib packages a web app imports, and about 60 MB of retained heap
(RETAINED_MB, default 60) made of many small live objects, kept for the life
of the process. Its one job, Sleep, waits 50 ms (SLEEP_MS overrides), as a job
that waits on a remote API does."""

import decimal  # noqa: F401  (loaded code, as an app's)
import email.message  # noqa: F401
import http.client  # noqa: F401
import json  # noqa: F401
import logging  # noqa: F401
import os
import time

# What one record below costs in RSS, measured with CPython 3.11.
RECORD_BYTES = 550


def _retain(megabytes):
    count = megabytes * 1024 * 1024 // RECORD_BYTES
    return [
        {"id": i, "name": f"record-{i}-{'x' * 24}", "tags": [f"t{i % 97}", f"u{i}"]}
        for i in range(count)
    ]


RETAINED = _retain(int(os.environ.get("RETAINED_MB", "60")))
SECONDS = int(os.environ.get("SLEEP_MS", "50")) / 1000.0


class Sleep:
    @staticmethod
    def perform(*_args):
        time.sleep(SECONDS)
