"""locketd's PUSH for pyres (locking-semantics.md D-3a).

``enqueue`` and ``enqueue_from_string`` place the enqueue-time holds and apply the ``unique``
rule of the job's class in the same step as the push, and return True when the job was pushed,
False for a duplicate that ``unique`` refused. Copy this file into your app (it needs only
pyres) and use ``LocketResQ`` where you used ``pyres.ResQ``, or wrap one you have::

    from locketd_pyres import wrap
    resq = wrap(ResQ("localhost:6379"))
    resq.enqueue_from_string("Webhook::Receive", "a", 42)   # False: a duplicate

The payload is pyres's own (``ResQ.encode`` of the dict pyres builds). PUSH is found in
``resque:locket:push``, written by every locketd daemon at start and on HUP; until one has, the
push is pyres's own (no holds) with one warning. ``enqueue_at`` stays pyres's: a delayed job gets
its holds when it starts (D-4); the pyres scheduler's delivery goes through PUSH.
"""

import logging
import threading

import pyres
from redis.exceptions import NoScriptError, ResponseError

log = logging.getLogger(__name__)
NS = "resque:"  # pyres's namespace, fixed


class LocketResQ(pyres.ResQ):
    """A pyres ``ResQ`` whose pushes go through locketd's PUSH."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._locket_init()

    def _locket_init(self):
        self._locket_entry = None
        self._locket_no_functions = False
        self._locket_warned = False
        self._locket_last = threading.local()

    def _locket_read(self):
        e = self.redis.hgetall(NS + "locket:push")
        e = {k.decode() if isinstance(k, bytes) else k: v for k, v in e.items()}
        self._locket_entry = e if e.get("sha1") else None
        return self._locket_entry

    def _locket_call(self, e, args, load):
        """One call of PUSH; with ``load``, a function not found falls back to the script,
        loaded if Redis lacks it. Without it, "not found" errors go to the caller."""
        r = self.redis
        if e.get("function") and not self._locket_no_functions:
            try:
                return r.execute_command("FCALL", e["function"], *args)
            except NoScriptError:
                raise
            except ResponseError as err:
                if "unknown command" in str(err).lower():
                    self._locket_no_functions = True
                elif not load or "function not found" not in str(err).lower():
                    raise
        try:
            return r.execute_command("EVALSHA", e["sha1"], *args)
        except NoScriptError:
            if not load:
                raise
            r.execute_command("SCRIPT", "LOAD", e["script"])
            return r.execute_command("EVALSHA", e["sha1"], *args)

    def push(self, queue, item):
        """Pushes ``item`` (pyres's payload dict) through PUSH; True when pushed."""
        e = self._locket_entry or self._locket_read()
        if e is None:
            if not self._locket_warned:
                self._locket_warned = True
                log.warning("locketd: no %slocket:push (no daemon has started): jobs are "
                            "pushed without their enqueue-time holds", NS)
            super().push(queue, item)
            self._locket_last.pushed = True
            return True
        args = [3, "%squeue:%s" % (NS, queue), NS + "queues", NS + "locket:plans",
                queue, pyres.ResQ.encode(item), NS + "locket:"]
        try:
            reply = self._locket_call(e, args, False)
        except ResponseError as err:
            text = str(err).lower()
            if not isinstance(err, NoScriptError) and "function not found" not in text:
                raise
            # Another build took over, or Redis lost its scripts: re-read once, retry once.
            reply = self._locket_call(self._locket_read() or e, args, True)
        pushed = int(reply[0]) == 1
        self._locket_last.pushed = pushed
        return pushed

    def enqueue_from_string(self, klass_as_string, queue, *args, **kwargs):
        self._locket_last.pushed = None
        super().enqueue_from_string(klass_as_string, queue, *args, **kwargs)
        return self._locket_last.pushed

    def enqueue(self, klass, *args):
        self._locket_last.pushed = None
        super().enqueue(klass, *args)
        return self._locket_last.pushed


def wrap(resq):
    """A ``LocketResQ`` on the Redis connection of ``resq`` (a ``pyres.ResQ``)."""
    wrapped = LocketResQ.__new__(LocketResQ)
    wrapped.__dict__.update(resq.__dict__)
    wrapped._locket_init()
    return wrapped
