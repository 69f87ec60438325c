"""Enqueues jobs through locketd's pyres shim (clients/python/locketd_pyres.py).

argv[1]: {"port": P, "jobs": [{"queue": "q", "class": "Job", "args": [1, "x"]}]}
Prints {"ok": true, "pushed": [true|false, ...]}: each enqueue_from_string's return value.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "clients", "python"))

from pyres import ResQ  # noqa: E402
from locketd_pyres import wrap  # noqa: E402

config = json.loads(sys.argv[1])
resq = wrap(ResQ("127.0.0.1:%d" % config["port"]))
pushed = [resq.enqueue_from_string(j["class"], j["queue"], *j.get("args", []))
          for j in config["jobs"]]
print(json.dumps({"ok": True, "pushed": pushed}))
