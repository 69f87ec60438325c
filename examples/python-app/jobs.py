"""The MODULE given to adapters/python/locketd_handler.py: imported once per
handler process, before the first job. Jobs are pyres-style classes with a
static `perform`; the payload's "class" names them ("Greeter", "Namespaced.Job")
or names a function elsewhere ("tasks:send_email", see tasks.py).

Hooks log one line each to the file named by $HOOK_LOG (when set), so tests can
compare their order with Resque's.
"""

import json
import os
import subprocess
import sys
import time

from locketd_handler import DontPerform, Reschedule


def hook_log(line):
    path = os.environ.get("HOOK_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


class Greeter:
    """A plain job: no hooks."""

    @staticmethod
    def perform(name="world"):
        print(f"Hello, {name}!")


class Noop:
    """Does nothing: for throughput benchmarks."""

    @staticmethod
    def perform(*args):
        pass


class Audited:
    """Every kind of hook, each logged to $HOOK_LOG. Defined out of alphabetical
    order on purpose: the adapter sorts them by name, as Resque does.

    Expected log for a success:
      before_perform_a, before_perform_b, perform [args], after_perform_z
    args[0] changes the story: "fail" raises in perform (then on_failure_log
    runs, after_perform_z does not), "skip" raises DontPerform in
    before_perform_b (done ok, performed false; perform does not run).
    """

    @staticmethod
    def before_perform_b(*args):
        hook_log("before_perform_b")
        if args and args[0] == "skip":
            raise DontPerform()

    @staticmethod
    def before_perform_a(*args):
        hook_log("before_perform_a")

    @staticmethod
    def perform(*args):
        hook_log("perform " + json.dumps(list(args), separators=(",", ":")))
        if args and args[0] == "fail":
            raise ValueError("audited job failed")

    @staticmethod
    def after_perform_z(*args):
        hook_log("after_perform_z")

    @staticmethod
    def on_failure_log(exception, *args):
        hook_log(f"on_failure_log {type(exception).__name__}: {exception} "
                 + json.dumps(list(args), separators=(",", ":")))


class Failing:
    """Always fails. args[0] == "explode-hook" makes the on_failure hook raise too
    (logged on stderr; the job still fails with its own exception)."""

    @staticmethod
    def perform(*args):
        raise RuntimeError(f"boom: {list(args)!r}")

    @staticmethod
    def on_failure_report(exception, *args):
        hook_log(f"Failing.on_failure_report {type(exception).__name__}: {exception}")
        if args and args[0] == "explode-hook":
            raise RuntimeError("hook exploded")


class Slow:
    """Sleeps args[0] seconds. On SIGTERM the adapter raises TermException inside
    perform: the finally block and the on_failure hook still run."""

    @staticmethod
    def perform(seconds=1):
        hook_log("Slow start")
        try:
            time.sleep(float(seconds))
            hook_log("Slow finished")
        finally:
            hook_log("Slow ensure")

    @staticmethod
    def on_failure_note(exception, *args):
        hook_log(f"Slow.on_failure_note {type(exception).__name__}: {exception}")


class Rescheduling:
    """Asks locketd to put the job back on its queue (what exit 75 means for a
    command handler). Not a failure: on_failure hooks do not run."""

    @staticmethod
    def perform(*args):
        raise Reschedule("not yet")

    @staticmethod
    def on_failure_log(exception, *args):
        hook_log(f"Rescheduling.on_failure_log {type(exception).__name__}")  # must not run


class Echo:
    """Prints its args as one line of JSON: checks that payloads arrive
    byte-exact (escaped newlines, U+2028, big integers)."""

    @staticmethod
    def perform(*args):
        print(json.dumps(list(args), separators=(",", ":"), ensure_ascii=False))


class Exiter:
    """sys.exit(args[0]) raises SystemExit: an ordinary failure, the handler lives on.
    With "hard", os._exit(3) kills the handler (locketd records that)."""

    @staticmethod
    def perform(code=3):
        sys.stdout.flush()
        if code == "hard":
            os._exit(3)
        sys.exit(code)


class FdLister:
    """Fails when a subprocess of the job inherits a protocol pipe (fds 3 and 4)."""

    @staticmethod
    def perform(*args):
        listing = subprocess.run(["ls", "-l", "/proc/self/fd"], capture_output=True, text=True).stdout
        print(listing, end="")
        leaked = [line for line in listing.splitlines() if "pipe:" in line and line.split(" -> ")[0].split()[-1] in ("3", "4")]
        inherited = subprocess.run(["sh", "-c", "ls /proc/$$/fd"], capture_output=True, text=True,
                                   close_fds=False).stdout.split()
        if leaked or "3" in inherited or "4" in inherited:
            raise RuntimeError(f"a subprocess inherited a protocol fd: {leaked or inherited}")
        print("FdLister: no protocol fd inherited")


class Namespaced:
    class Job:
        """Resolved by attribute path: {"class":"Namespaced.Job"}."""

        @staticmethod
        def perform(*args):
            print("Namespaced.Job " + json.dumps(list(args)))
