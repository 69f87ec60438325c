#!/usr/bin/env python3
"""locketd_handler: the Python adapter for locketd's persistent-handler protocol (v1).

    locketd_handler.py MODULE

locketd starts this script in its own process group with the request pipe on
fd 3 and the reply pipe on fd 4 (docs/persistent-handlers.md, H-3, H-4, H-16).
It imports MODULE once, says `ready`, then serves one request at a time until
EOF on fd 3 (then it exits 0):

    job            -> started, then exactly one done (ok | failed | reschedule | throttled)
    failure_hooks  -> done, after the class's on_failure* hooks ran
    stop           -> advisory, the SIGTERM that follows is what counts; read
                      when that SIGTERM comes during a job (see below)

MODULE is a module name importable from the current directory ("jobs",
"myapp.jobs") or a path to a .py file ("examples/python-app/jobs.py"; its
directory then also goes on sys.path, after the current directory).

A payload's class name C is resolved as follows ("::" is read as "."):
  * "pkg.mod:func"  import pkg.mod, then the attribute path after the colon;
  * "Foo", "Foo.Bar" the attribute path inside MODULE;
  * "pkg.mod.Foo"   (pyres style) otherwise: the longest importable module
                     prefix, then the attribute path after it.
An object with a `perform` attribute (pyres style: a class with a static or
class method) runs as obj.perform(*args); any other callable except a class
runs as obj(*args). A coroutine returned by either is run with asyncio.run.
Unresolvable: done failed "NameError".

Hooks, Resque's order (attributes found by name prefix, sorted, callables only):
  before_perform*(*args)           raising DontPerform skips the job (ok, performed false)
  perform(*args)
  after_perform*(*args)            only when perform succeeded
  on_failure*(exception, *args)    once, on any exception but Reschedule (one that
                                   raises is logged on stderr; the job keeps its own failure)
Raising Reschedule (this module's, or any exception class named "Reschedule")
answers status "reschedule". SIGTERM during a job raises TermException inside
the job (reported as "Resque::TermException", message "SIGTERM"), the hooks
run, done is sent, then `bye` and exit 0; SIGTERM while idle exits 0. When the
stop frame locketd wrote just before that SIGTERM says "requeue": true (H-14: a
lost lock under on_lock_lost = "requeue" puts the job back in its queue, which
is no failure), no on_failure hook runs; done still says failed with the
TermException (locketd requeues the job whatever done says).
SystemExit from job code is an ordinary failure ("SystemExit").

Job code may `import locketd_handler` (it is this very module) for Reschedule,
DontPerform, TermException and `current`, the request frame of the running job
(id, queue, worker, deadline_ms, lock_keys, ...; None between jobs).

Threaded mode (H-16, H-18). With LOCKETD_THREADS=N (N > 1) in its environment
(locketd sets it for `threads = N`; the adapter unsets it) the adapter says
"threads" in ready.features and runs each `job` it is sent in a thread of its
own (locketd sends at most N at once); the main thread keeps reading requests.
Frames of different jobs interleave, each one whole line (writes hold a lock).
Without the variable, or with 1, everything above holds unchanged.
  * `current` (locketd_handler.current) is the calling thread's job frame.
  * stop {id, reason, requeue}: TermException (message "stop: <reason>") is
    raised in that job's thread only, with ctypes.pythonapi.PyThreadState_SetAsyncExc.
    It lands at the thread's next bytecode: a blocking C call (a long
    time.sleep, a socket read without a timeout, a lock wait) is not
    interrupted and the job goes on until it returns (locketd then kills the
    whole process at its kill point). The job ends as for SIGTERM above:
    on_failure hooks (not when requeue), done failed Resque::TermException,
    whatever the job did with the exception. The process lives on.
  * What a job starts: subprocess.Popen (so run, call, check_call,
    check_output, getoutput, os.popen and asyncio's subprocesses) and os.system,
    called from a job's thread, start the child in a process group of its own
    (process_group=0 on 3.11+, else preexec_fn=os.setpgrp; a child the caller
    gives start_new_session=True or process_group=0 keeps that, and counts
    too; one given another process_group is left alone), announced as
    {"t":"group","id":JOB,"pgid":PID}; each is SIGKILLed before the job's
    done. Not covered: os.fork, os.spawn*, os.posix_spawn, multiprocessing; a
    subprocess started from a thread the job started itself (that thread is not
    the job's) or one that calls setsid/setpgid itself.
  * SIGTERM: every running job is stopped as by a stop frame (message
    "SIGTERM"), each answers done, then bye and exit 0. EOF: exit 0 once the
    running jobs answered. Children are reaped (see H-9) only while no job runs.

Python 3.9+, stdlib only.
"""

import asyncio
import bisect
import builtins
import importlib
import importlib.util
import inspect
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback

# Job code that does `import locketd_handler` gets this very module, not a second copy
# with its own exception classes.
if __name__ == "__main__":
    sys.modules.setdefault("locketd_handler", sys.modules[__name__])

USAGE = ("usage: locketd_handler.py MODULE\n"
         "Runs pyres-style jobs for locketd over fds 3 (requests) and 4 (replies).")


class Reschedule(Exception):
    """Raised by a job to be put back on its queue: not a failure, no on_failure hooks."""


class Throttled(Reschedule):
    """Raised by a job whose remote side throttled it (HTTP 429): every job of the class's
    rate key waits `retry_after` seconds (None: the rate's period); not a failure, no
    on_failure hooks (rate-limits.md RL-4)."""

    def __init__(self, message="throttled by the remote side", retry_after=None):
        super().__init__(message)
        self.retry_after = retry_after


class DontPerform(Exception):
    """Raised by a before_perform hook: the job is skipped, a success with performed false."""


class TermException(BaseException):
    """Raised inside the running job when the handler receives SIGTERM.

    A BaseException (like KeyboardInterrupt, and like Ruby's SignalException):
    `except Exception` in job code does not swallow it."""
    locketd_name = "Resque::TermException"


class DirtyExit(Exception):
    """The exception on_failure hooks get in a failure_hooks request for Resque::DirtyExit."""
    locketd_name = "Resque::DirtyExit"


class BadPayload(Exception):
    """The payload is not a JSON object with a class name and an array of args."""
    locketd_name = "Locket::BadPayload"
    _locketd_no_backtrace = True


for _cls in (Reschedule, Throttled, DontPerform, TermException, DirtyExit, BadPayload):
    _cls.__module__ = "locketd_handler"
del _cls

# The request frame of the running job (a dict), None between jobs.
current = None


class _IdleTerm(BaseException):
    """SIGTERM while waiting for a request: exit 0."""


class _State:
    pid = os.getpid()
    requests = 3         # fd locketd writes requests to
    replies = 4          # fd we write frames to
    idle = False         # blocked reading the next request
    in_job_code = False  # job code (a hook, perform) is running: SIGTERM raises TermException there
    term_requested = False
    term_raised = False  # TermException already raised for this request (only once)
    requeued = False     # the job's stop frame said "requeue": no on_failure hooks (H-14)
    reader = None        # the _Requests over fd 3
    threads = 1          # LOCKETD_THREADS: above 1, a thread per running job (threaded mode)


# Threaded mode: `.job` is the _Job of a job's own thread (unset elsewhere).
_tls = threading.local()


# -- protocol ---------------------------------------------------------------

def _open_protocol():
    fds = os.environ.pop("LOCKETD_PROTOCOL_FDS", "")
    os.environ.pop("LOCKETD_PROTOCOL", None)
    parts = fds.split(",")
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        _State.requests, _State.replies = int(parts[0]), int(parts[1])
    try:
        for fd in (_State.requests, _State.replies):
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
                raise OSError(f"fd {fd} is not a pipe")
            os.set_inheritable(fd, False)  # FD_CLOEXEC: job subprocesses inherit neither pipe
    except OSError as err:
        sys.exit(f"locketd_handler: fds {_State.requests} and {_State.replies} must be locketd's "
                 f"protocol pipes ({err})\n{USAGE}")
    # A process forked (not exec'd) from job code, e.g. multiprocessing: drop the pipes
    # and our SIGTERM handling at once; only the adapter speaks on fd 4.
    os.register_at_fork(after_in_child=_forked_child)


def _forked_child():
    for fd in (_State.requests, _State.replies):
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):  # fork from a thread other than the main one
        pass


_SURROGATE = re.compile("[\ud800-\udfff]")


def _scrub(value):
    """Strings become valid UTF-8 (lone surrogates -> U+FFFD), recursively."""
    if isinstance(value, str):
        # A Python str holds astral characters as single code points, so any
        # surrogate in it is a lone one (e.g. from surrogateescape decoding).
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_scrub(str(k)): _scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrub(v) for v in value]
    return value


def _send(frame):
    if os.getpid() != _State.pid:
        return  # a forked child of job code never speaks for the adapter
    text = json.dumps(_scrub(frame), separators=(",", ":"), ensure_ascii=False)
    if "\n" in text or "\r" in text:  # cannot happen (JSON escapes control characters); belt and braces
        text = json.dumps(_scrub(frame), separators=(",", ":"))
    _write_line(text)


def _send_plain(kind, frame_id, tail=""):
    """The frames of every job, {"t": kind, "id": frame_id} plus `tail` (JSON members, with
    their leading comma), written without the general path's walk: about 8 us a job less.
    Its two callers are the adapter's own process for certain (`started` goes out before
    job code runs, `done` after _dispatch's check for a forked child), so it asks for no
    pid; frame_id is the id already encoded as JSON (_json_id), once for both frames."""
    _write_line('{"t":"' + kind + '","id":' + frame_id + tail + "}")


def _locked(write_line):
    """Threaded mode: one frame at a time on fd 4, each line whole."""
    lock = threading.Lock()

    def locked_write_line(text):
        with lock:
            write_line(text)

    return locked_write_line


def _json_id(frame_id):
    return json.dumps(_scrub(frame_id))


def _write_line(text):
    data = memoryview((text + "\n").encode("utf-8"))
    while data:
        data = data[os.write(_State.replies, data):]


class _Requests:
    """Line reader over fd 3 (binary; frames may be megabytes long)."""

    def __init__(self, fd):
        self.fd = fd
        self.buf = bytearray()
        self.scanned = 0  # no newline in buf[:scanned]

    def next_line(self):
        """The next request line (bytes, without "\\n"), or None at EOF."""
        while True:
            nl = self.buf.find(b"\n", self.scanned)
            if nl >= 0:
                line = bytes(self.buf[:nl])
                del self.buf[:nl + 1]
                self.scanned = 0
                return line
            self.scanned = len(self.buf)
            _State.idle = True
            try:
                if _State.term_requested:
                    raise _IdleTerm
                chunk = os.read(self.fd, 1 << 20)
            finally:
                _State.idle = False
            if not chunk:
                if self.buf.strip():
                    _warn(f"ignoring an unterminated request at EOF ({len(self.buf)} bytes)")
                return None
            self.buf += chunk


def _warn(message):
    try:
        sys.stderr.write(f"locketd_handler: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _flush_output():
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


# -- signals ----------------------------------------------------------------

def _on_term(signum, frame):
    _State.term_requested = True
    if _State.idle:
        raise _IdleTerm
    if _State.threads > 1:
        return  # the main thread is about to read the next request: it raises _IdleTerm there
    _note_requeue()
    if _State.in_job_code and not _State.term_raised:
        _State.term_raised = True
        raise TermException("SIGTERM")
    # Otherwise the adapter is between job code and its frames: _call raises
    # TermException when job code is about to run, and the loop retires after done.


def _note_requeue():
    """H-14: whether the stop frame locketd wrote just before this SIGTERM says the job
    goes back to its queue. It is in the pipe already: read what is there without
    blocking into the request buffer (the loop ignores stop frames later)."""
    reader = _State.reader
    if current is None or reader is None or _State.requeued:
        return
    try:
        os.set_blocking(reader.fd, False)
        try:
            while True:
                chunk = os.read(reader.fd, 1 << 16)
                if not chunk:
                    break
                reader.buf += chunk
        except BlockingIOError:
            pass
        finally:
            os.set_blocking(reader.fd, True)
    except OSError:
        return
    for line in bytes(reader.buf).split(b"\n")[:-1]:
        try:
            request = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            continue
        if isinstance(request, dict) and request.get("t") == "stop" and request.get("id") == current.get("id"):
            _State.requeued = request.get("requeue") is True


def _call(fn, *args):
    """Runs job code (a hook or perform); SIGTERM raises TermException in it."""
    if _State.threads > 1:
        job = getattr(_tls, "job", None)
        if job is not None:
            return job.call(fn, args)
    _State.in_job_code = True
    try:
        if _State.term_requested and not _State.term_raised:
            _State.term_raised = True
            raise TermException("SIGTERM")
        result = fn(*args)
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        return result
    finally:
        _State.in_job_code = False


# -- jobs -------------------------------------------------------------------

class _NotFound(Exception):
    pass


def _name_error(message):
    """NameError for a job class that cannot be resolved; its backtrace (the adapter's
    own frames) is left out of the failure record."""
    err = NameError(message)
    err._locketd_no_backtrace = True
    return err


def _attr_path(obj, path):
    for name in path:
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise _NotFound(name) from None
    return obj


def _import(name):
    """The module, or None when it (or a parent package) does not exist.
    Any other error from importing it propagates (the job fails with it)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing == name or name.startswith(missing + "."):
            return None
        raise


def _resolve(app, class_name):
    """The job object named class_name; raises NameError when there is none."""
    name = class_name.replace("::", ".")
    if ":" in name:
        module_name, _, attr = name.partition(":")
        module = _import(module_name) if module_name and attr else None
        if module is None:
            raise _name_error(f"no job {class_name!r}: no module named {module_name!r}")
        try:
            return _attr_path(module, attr.split("."))
        except _NotFound:
            raise _name_error(f"no job {class_name!r}: module {module_name!r} has no {attr!r}") from None
    parts = name.split(".")
    if not all(parts):
        raise _name_error(f"no job {class_name!r}: not a class name")
    try:
        return _attr_path(app, parts)
    except _NotFound:
        pass
    for i in range(len(parts) - 1, 0, -1):  # pyres style: pkg.mod.Class
        module_name = ".".join(parts[:i])
        module = _import(module_name)
        if module is None:
            continue
        try:
            return _attr_path(module, parts[i:])
        except _NotFound:
            raise _name_error(f"no job {class_name!r}: module {module_name!r} has no "
                              f"{'.'.join(parts[i:])!r}") from None
    tried = f"module {app.__name__!r} has no {name!r}"
    if len(parts) > 1:
        tried += ", and no module " + " nor ".join(repr(".".join(parts[:i])) for i in range(len(parts) - 1, 0, -1))
        tried += " can be imported"
    raise _name_error(f"no job {class_name!r}: {tried}")


def _performer(obj, class_name):
    perform = getattr(obj, "perform", None)
    if perform is not None:
        if not callable(perform):
            raise _name_error(f"job {class_name!r}: its perform is not callable")
        return perform
    if callable(obj) and not inspect.isclass(obj):
        return obj
    raise _name_error(f"job {class_name!r} has no perform (and is not a function)")


def _hooks(obj, prefix, names=None):
    """The callables whose names start with `prefix`, sorted by name (Resque's order);
    `names` is dir(obj) when the caller has it."""
    if names is None:
        names = dir(obj)
    try:
        # dir() returns its names sorted, so those with the prefix are one run, found by
        # bisection instead of a startswith over every name (about 30 on a plain class).
        start = bisect.bisect_left(names, prefix)
        matched = []
        for n in names[start:]:
            if not n.startswith(prefix):
                break
            matched.append(n)
    except TypeError:  # a __dir__ that answers something other than strings
        matched = sorted(n for n in names if isinstance(n, str) and n.startswith(prefix))
    hooks = []
    for n in matched:
        hook = getattr(obj, n, None)
        if callable(hook):
            hooks.append(hook)
    return hooks


def _named(exc, name):
    return any(cls.__name__ == name for cls in type(exc).__mro__)


def _parse_payload(text):
    if not isinstance(text, str):
        raise BadPayload("payload is not a string")
    try:
        payload = json.loads(text)
    except ValueError as err:
        raise BadPayload(f"payload is not JSON ({err})") from None
    if not isinstance(payload, dict):
        raise BadPayload("payload is not a JSON object")
    args = payload.get("args")
    if args is None:
        args = []
    if not isinstance(args, list):
        raise BadPayload("args is not an array")
    class_name = payload.get("class")
    if not isinstance(class_name, str) or not class_name:
        raise BadPayload("payload has no class")
    return class_name, args


def _perform(obj, class_name, args):
    """Resque::Job#perform's order. True when performed, False when a before hook
    raised DontPerform; raises the job's exception after the on_failure hooks."""
    perform = _performer(obj, class_name)
    names = dir(obj)  # once for both kinds of hook: a job's code adds none in between
    try:
        try:
            for hook in _hooks(obj, "before_perform", names):
                _call(hook, *args)
        except BaseException as err:
            if _named(err, "DontPerform"):
                return False
            raise
        _call(perform, *args)
        for hook in _hooks(obj, "after_perform", names):
            _call(hook, *args)
        return True
    except BaseException as err:
        if not (_named(err, "Reschedule") or _named(err, "Throttled")) and not _requeued():
            _run_failure_hooks(obj, err, args)
        raise


def _requeued():
    job = getattr(_tls, "job", None)
    return job.requeued if job is not None else _State.requeued


def _run_failure_hooks(obj, exception, args):
    """Once per job. A hook that raises is logged; the job fails with its own exception."""
    job = getattr(_tls, "job", None)
    if job is not None:
        job.hooks_ran = True
    for hook in _hooks(obj, "on_failure"):
        try:
            _call(hook, exception, *args)
        except BaseException as err:
            _warn(f"on_failure hook {getattr(hook, '__qualname__', hook)!r} raised "
                  f"{_exception_name(err)}: {_message(err)}\n" + "".join(_format_tb(err)).rstrip("\n"))


def _run_job(app, frame, json_id):
    global current
    _send_plain("started", json_id)
    current = frame
    try:
        class_name, args = _parse_payload(frame.get("payload"))
        obj = _resolve(app, class_name)
        job = getattr(_tls, "job", None)
        if job is not None:
            job.obj, job.args = obj, args  # for on_failure hooks after a stop the job missed
        performed = _perform(obj, class_name, args)
        return {"status": "ok", "performed": performed}
    except BaseException as err:
        return _outcome(err)
    finally:
        current = None


def _foreign_exception(name, message):
    """An exception object of the class named in a failure_hooks request."""
    if name == "Resque::DirtyExit":
        return DirtyExit(message)
    if name == "Resque::TermException":
        return TermException(message)
    cls = None
    if "." not in name and "::" not in name:
        cls = getattr(builtins, name, None)
    else:
        parts = name.replace("::", ".").split(".")
        for i in range(len(parts) - 1, 0, -1):  # "pkg.mod.Error", "pkg.mod.Outer.Error"
            module = sys.modules.get(".".join(parts[:i]))  # only what is loaded: no imports for this
            if module is not None:
                try:
                    cls = _attr_path(module, parts[i:])
                except _NotFound:
                    pass
                break
    if inspect.isclass(cls) and issubclass(cls, BaseException):
        try:
            return cls(message)
        except Exception:
            pass
    short = name.replace("::", ".").rsplit(".", 1)[-1] or "Exception"
    stand_in = type(short, (Exception,), {"locketd_name": name, "__module__": "locketd_handler"})
    return stand_in(message)


def _failure_hooks(app, frame):
    """A previous handler was killed during this job: run its on_failure* hooks."""
    global current
    current = frame
    try:
        class_name, args = _parse_payload(frame.get("payload"))
        obj = _resolve(app, class_name)
        exception = _foreign_exception(str(frame.get("exception") or "Resque::DirtyExit"),
                                       str(frame.get("error") or ""))
        for hook in _hooks(obj, "on_failure"):
            _call(hook, exception, *args)
        return {"status": "ok", "performed": False}
    except BaseException as err:
        return _failure(err)
    finally:
        current = None


# -- outcomes ---------------------------------------------------------------

def _outcome(err):
    if _named(err, "Throttled"):
        frame = {"status": "throttled"}
        after = getattr(err, "retry_after", None)
        if after is not None:
            frame["retry_after"] = float(after)
        return frame
    if _named(err, "Reschedule"):
        return {"status": "reschedule"}
    return _failure(err)


def _exception_name(err):
    cls = type(err)
    name = cls.__dict__.get("locketd_name")
    if isinstance(name, str) and name:
        return name
    module = getattr(cls, "__module__", None)
    qualname = getattr(cls, "__qualname__", cls.__name__)
    if module in (None, "builtins"):
        return qualname
    return f"{module}.{qualname}"


def _message(err):
    if isinstance(err, SystemExit):
        code = err.code
        if code is None or isinstance(code, int):
            return f"exit status {code or 0}"
    try:
        return str(err)
    except BaseException:
        return f"({type(err).__name__} raised from str())"


def _format_tb(err):
    """Python's traceback lines for the frames below the adapter (outermost first,
    the raise last): '  File "path", line N, in name' and '    source' per frame."""
    if getattr(err, "_locketd_no_backtrace", False):
        return []
    try:
        frames = traceback.extract_tb(err.__traceback__)
    except Exception:
        return []
    here = os.path.abspath(__file__)
    first = 0
    while first < len(frames) and os.path.abspath(frames[first].filename) == here:
        first += 1  # the adapter's frames above the job (kept if there is nothing else)
    last = len(frames)
    while last > first and os.path.abspath(frames[last - 1].filename) == here:
        last -= 1  # e.g. the signal handler that raised TermException inside the job
    job_frames = list(frames[first:last]) or list(frames)
    lines = []
    for f in job_frames:
        lines.append(f'  File "{f.filename}", line {f.lineno}, in {f.name}\n')
        if f.line:
            lines.append(f"    {f.line.strip()}\n")
    return lines


def _failure(err):
    return {"status": "failed", "exception": _exception_name(err), "error": _message(err),
            "backtrace": [line.rstrip("\n") for line in _format_tb(err)]}


# -- threaded mode (LOCKETD_THREADS > 1) -------------------------------------

class _StopException(TermException):
    """What a stop raises in its job's thread. PyThreadState_SetAsyncExc raises a class
    without arguments, so the message comes from the job of the thread it lands in."""
    locketd_name = "Resque::TermException"

    def __init__(self, *args):
        if not args:
            job = getattr(_tls, "job", None)
            args = (job.stop_message if job is not None and job.stop_message else "stop",)
        super().__init__(*args)


_StopException.__module__ = "locketd_handler"
_StopException.__name__ = _StopException.__qualname__ = "TermException"  # what job code sees


def _set_async_exc(ident, exc):
    """Raises `exc` (a class) in thread `ident` at its next bytecode; None clears one not raised yet."""
    import ctypes  # only threaded mode needs it
    arg = ctypes.py_object(exc) if exc is not None else None
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), arg)


class _Job:
    """A request running in its own thread. `lock` orders a stop (from the main thread)
    against the job's thread entering and leaving job code: the exception is only ever
    set while job code runs, and is cleared when job code ends before it landed, so it
    never surfaces in the adapter's own code outside _Job.call."""

    def __init__(self, frame):
        self.frame = frame
        self.kind = frame.get("t")
        self.lock = threading.Lock()
        self.thread = None
        self.ident = None
        self.in_job_code = False
        self.stop_message = None  # set by the stop
        self.raised = False       # the stop's exception was raised (or set to be) in the job
        self.pending = False      # set with PyThreadState_SetAsyncExc, maybe not landed yet
        self.requeued = False
        self.over = False         # the outcome is decided: stops are ignored
        self.hooks_ran = False
        self.obj = None
        self.args = []
        self.groups = []          # (pgid, Popen or None) of what the job started

    def call(self, fn, args):
        with self.lock:
            if self.stop_message is not None and not self.raised:
                self.raised = True
                raise _StopException(self.stop_message)
            self.in_job_code = True
        try:
            result = fn(*args)
            if inspect.iscoroutine(result):
                result = asyncio.run(result)
            return result
        finally:
            with self.lock:
                self.in_job_code = False
                if self.pending:
                    self.pending = False
                    _set_async_exc(self.ident, None)

    def stop(self, message, requeue):
        with self.lock:
            if self.over or self.stop_message is not None:
                return
            self.stop_message = message
            if requeue:
                self.requeued = True
            if self.in_job_code and not self.raised:
                self.raised = True
                self.pending = True
                _set_async_exc(self.ident, _StopException)
            # else: raised when the job's thread next enters job code (Job.call)

    def finish(self, outcome):
        """The outcome to answer: a stopped job's is its TermException's, whatever the job
        did with it (caught it, or ended just before it landed)."""
        with self.lock:
            self.over = True
            message = self.stop_message
        if message is None or self.kind != "job" or outcome.get("exception") == "Resque::TermException":
            return outcome  # no stop, or its exception ended the job (with the job's backtrace)
        err = _StopException(message)
        if not self.requeued and not self.hooks_ran and self.obj is not None:
            _run_failure_hooks(self.obj, err, self.args)
        return _failure(err)

    def add_group(self, pgid, popen):
        self.groups.append((pgid, popen))
        _send({"t": "group", "id": self.frame.get("id"), "pgid": pgid})

    def kill_groups(self):
        for pgid, _popen in self.groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except OSError as err:
                _warn(f"killing process group {pgid} failed: {err}")
        for _pgid, popen in self.groups:
            if popen is not None:  # reaped here: the job is over and will not wait for it
                try:
                    popen.wait(timeout=1)
                except Exception:  # TimeoutExpired (a process in D state), or the job's own wait
                    pass
        _wait_groups_dead([pgid for pgid, _popen in self.groups])


def _wait_groups_dead(pgids, timeout=1.0):
    """Waits (at most `timeout`) until no process of `pgids` is alive (a zombie is not): a
    SIGKILLed process dies when it is next scheduled."""
    deadline = time.monotonic() + timeout
    while pgids:
        left = set()
        for pgid in pgids:
            try:
                os.killpg(pgid, 0)
                left.add(pgid)
            except ProcessLookupError:
                pass
            except OSError:
                left.add(pgid)
        if left:
            left = _live_groups(left)
        if not left:
            return
        if time.monotonic() >= deadline:
            _warn(f"process groups {sorted(left)} still alive {timeout} s after SIGKILL")
            return
        time.sleep(0.005)


def _live_groups(pgids):
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()  # no /proc: the SIGKILL has to do
    live = set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] != b"Z" and int(fields[2]) in pgids:
            live.add(int(fields[2]))
    return live


class _Jobs:
    """The running jobs of threaded mode, by id."""
    lock = threading.Lock()
    running = {}


def _job_thread(app, job):
    _tls.job = job
    job.ident = threading.get_ident()
    frame = job.frame
    try:
        json_id = _json_id(frame.get("id"))
        outcome = _run_job(app, frame, json_id) if job.kind == "job" else _failure_hooks(app, frame)
        if os.getpid() != _State.pid:  # job code forked and its child came back here
            _flush_output()
            os._exit(0 if outcome.get("status") == "ok" else 1)
        outcome = job.finish(outcome)
        job.kill_groups()
        _flush_output()
        _send({"t": "done", "id": frame.get("id"), **outcome})
    except BaseException as err:  # the adapter's own failure (the reply pipe closed, ...)
        _warn(f"job thread of {frame.get('id')!r} failed: {_exception_name(err)}: {_message(err)}")
        os._exit(1)
    finally:
        with _Jobs.lock:
            _Jobs.running.pop(frame.get("id"), None)


def _stop_all(message):
    with _Jobs.lock:
        jobs = list(_Jobs.running.values())
    for job in jobs:
        job.stop(message, False)


def _join_all():
    while True:
        with _Jobs.lock:
            jobs = list(_Jobs.running.values())
        if not jobs:
            return
        for job in jobs:
            job.thread.join()


def _serve_threaded(app, requests):
    """The main thread of threaded mode: reads requests, starts a thread per job."""
    try:
        while True:
            line = requests.next_line()
            if line is None:
                break  # EOF: idle shutdown or recycling, once the running jobs answered
            if not line.strip():
                continue
            frame = _request(line)
            kind = frame.get("t")
            if kind == "stop":
                with _Jobs.lock:
                    job = _Jobs.running.get(frame.get("id"))
                if job is not None and job.kind == "job":
                    job.stop(f"stop: {frame.get('reason', '')}", frame.get("requeue") is True)
            elif kind in ("job", "failure_hooks"):
                with _Jobs.lock:
                    if frame.get("id") in _Jobs.running:
                        _warn(f"ignoring a second request for running job {frame.get('id')!r}")
                        continue
                    if not _Jobs.running:
                        _reap_children()  # only while no job runs: a running job's Popen waits itself
                    job = _Jobs.running[frame.get("id")] = _Job(frame)
                job.thread = threading.Thread(target=_job_thread, args=(app, job), daemon=True,
                                              name=f"locketd-job-{frame.get('id')}")
                job.thread.start()
            else:
                _warn(f"ignoring a request of unknown type {kind!r}")
    except _IdleTerm:
        with _Jobs.lock:
            busy = bool(_Jobs.running)
        _stop_all("SIGTERM")
        _join_all()
        if busy:
            _send({"t": "bye", "reason": "SIGTERM"})
        return
    _join_all()


def _wrap_subprocess():
    """Threaded mode: a subprocess started from a job's thread gets a process group of its
    own, announced to locketd and killed before the job's done (see the module doc)."""
    popen_init = subprocess.Popen.__init__
    signature = inspect.signature(popen_init)
    own_group_kw = sys.version_info >= (3, 11)

    def __init__(self, *args, **kwargs):
        job = getattr(_tls, "job", None)
        if job is None or job.over:
            return popen_init(self, *args, **kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return popen_init(self, *args, **kwargs)  # Popen raises its own error
        given = bound.arguments
        if given.get("start_new_session"):
            own = True  # setsid: a session and group of its own
        elif given.get("process_group") is not None:
            own = given["process_group"] == 0
        elif own_group_kw:
            given["process_group"] = 0
            own = True
        else:
            theirs = given.get("preexec_fn")
            if theirs is None:
                given["preexec_fn"] = os.setpgrp
            else:
                def setpgrp_then_theirs():
                    os.setpgrp()
                    theirs()
                given["preexec_fn"] = setpgrp_then_theirs
            own = True
        popen_init(*bound.args, **bound.kwargs)
        if own and self.pid:
            job.add_group(self.pid, self)

    __init__.__wrapped__ = popen_init
    subprocess.Popen.__init__ = __init__
    system = os.system

    def _system(command):
        job = getattr(_tls, "job", None)
        if job is None or job.over:
            return system(command)
        _flush_output()  # as system(3) would see it: what was printed before comes first
        code = subprocess.Popen(command, shell=True).wait()  # /bin/sh -c, in a group of its own
        return code << 8 if code >= 0 else -code  # the wait status os.system returns

    os.system = _system


class _ThreadedModule(type(sys)):
    """locketd_handler's module type in threaded mode: `current` is per job thread."""

    @property
    def current(self):
        job = getattr(_tls, "job", None)
        return job.frame if job is not None else None


def _threads_from_env():
    raw = os.environ.pop("LOCKETD_THREADS", "")  # job code and its subprocesses do not see it
    n = int(raw) if raw.isdigit() else 1
    return n if n > 1 else 1


# -- boot and loop ----------------------------------------------------------

def _load(target):
    cwd = os.getcwd()
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and sys.path[0] and os.path.abspath(sys.path[0]) == here:
        del sys.path[0]  # the adapter's own directory: not the app's
    path_form = target.endswith(".py") or os.sep in target
    if path_form:
        path = os.path.abspath(target)
        name = os.path.splitext(os.path.basename(path))[0]
        sys.path[0:0] = [cwd] + ([os.path.dirname(path)] if os.path.dirname(path) != cwd else [])
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None or not os.path.isfile(path):
            sys.exit(f"locketd_handler: cannot load {target!r}: no such .py file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module
    sys.path.insert(0, cwd)
    return importlib.import_module(target)


def _reap_children():
    """Children that job code started and never waited for (os.spawn*, os.fork, a Popen
    dropped while running) are dead by the next request: locketd killed what the last job
    left in the group before it recorded the job (H-9). Reaped here, between jobs, so a
    long-lived handler collects no zombies (they count against a service's TasksMax). Only
    children that have exited are reaped; a Popen polled later reads returncode 0."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except OSError:  # ChildProcessError: no child left
            return
        if pid == 0:
            return


def _request(line):
    """The request frame in `line`; garbage ends the process."""
    try:
        frame = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        _warn(f"unreadable request frame ({err}): {line[:200]!r}")
        sys.exit(1)
    if not isinstance(frame, dict):
        _warn(f"request frame is not a JSON object: {line[:200]!r}")
        sys.exit(1)
    return frame


def _dispatch(app, line):
    frame = _request(line)
    kind = frame.get("t")
    if kind not in ("job", "failure_hooks"):
        if kind != "stop":
            _warn(f"ignoring a request of unknown type {kind!r}")
        return
    _reap_children()
    _State.term_raised = False
    _State.requeued = False
    json_id = _json_id(frame.get("id"))
    outcome = _run_job(app, frame, json_id) if kind == "job" else _failure_hooks(app, frame)
    if os.getpid() != _State.pid:
        # job code forked and its child came back here instead of exiting
        _flush_output()
        os._exit(0 if outcome.get("status") == "ok" else 1)
    _flush_output()
    if outcome.get("status") == "ok" and len(outcome) == 2 and isinstance(outcome.get("performed"), bool):
        _send_plain("done", json_id, ',"status":"ok","performed":' + ("true" if outcome["performed"] else "false"))
    else:
        _send({"t": "done", "id": frame.get("id"), **outcome})
    if _State.term_requested:
        _send({"t": "bye", "reason": "SIGTERM"})
        sys.exit(0)


def main(argv):
    if len(argv) != 1 or argv[0].startswith("-"):
        sys.exit(USAGE)
    _State.threads = _threads_from_env()
    _open_protocol()
    try:
        sys.stdout.reconfigure(line_buffering=True)  # job output reaches locketd's log as printed
    except (AttributeError, ValueError, OSError):
        pass
    app = _load(argv[0])  # a crash here: traceback on stderr, exit 1 (locketd logs it)
    signal.signal(signal.SIGTERM, _on_term)
    requests = _State.reader = _Requests(_State.requests)
    try:
        if _State.threads > 1:
            global _write_line
            _write_line = _locked(_write_line)
            _wrap_subprocess()
            module = sys.modules.get("locketd_handler")
            if module is not None and type(module) is type(sys):
                module.__class__ = _ThreadedModule
            _send({"t": "ready", "v": 1, "pid": os.getpid(), "adapter": "python", "features": ["threads"]})
            _serve_threaded(app, requests)
            _flush_output()
            sys.exit(0)
        _send({"t": "ready", "v": 1, "pid": os.getpid(), "adapter": "python", "features": []})
        while True:
            line = requests.next_line()
            if line is None:
                break  # EOF: idle shutdown or recycling
            if line.strip():
                _dispatch(app, line)
    except _IdleTerm:
        pass
    except BrokenPipeError:
        _warn(f"the reply pipe (fd {_State.replies}) is closed; exiting")
        sys.exit(1)
    _flush_output()
    sys.exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
