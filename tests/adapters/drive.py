#!/usr/bin/env python3
"""Drive a locketd persistent-handler adapter by hand, without the daemon.

Spawns ADAPTER_COMMAND the way locketd does (docs/persistent-handlers.md H-3):
its own process group, fd 0 = /dev/null, fd 3 = read end of the request pipe,
fd 4 = write end of the reply pipe, LOCKETD_PROTOCOL=1 and
LOCKETD_PROTOCOL_FDS=3,4 in the environment. It waits for `ready`, then runs
the steps given on the command line in order, waiting for the `done` of each
job before the next, like locketd. Every reply frame is printed to stdout
exactly as received (one JSON line each); the driver's own notes are JSON lines
with a "driver" key. After each `done`, when any `group` frame (H-18) was seen,
a note {"driver":"groups","after_done":ID,"alive":[PGID...],"dead":[PGID...]}
says which announced job process groups still hold a live (non-zombie) process. At the end it closes fd 3 (EOF: the adapter must exit 0),
reports the exit status and kills whatever is left in the process group and in
the job groups announced by `group` frames.

    python3 tests/adapters/drive.py \\
        --payload '{"class":"Greeter","args":["world"]}' \\
        --signal group:TERM:0.5 --payload '{"class":"Slow","args":[5]}' \\
        -- adapters/ruby/locketd-ruby examples/ruby-app/app.rb

Steps (in order, each may repeat):
  --payload JSON          send a `job` frame with this exact payload text, wait for done
  --id ID                 the id of the next job or frame (default: j<step number>,
                          f<step number> for --frame/--failure-hooks)
  --concurrent N          the next N job/failure_hooks steps are all written before
                          any is waited for (each `job` frame then carries "thread": k,
                          k = 0..N-1), then the driver waits for all N `done`s; frames
                          are printed in the order they arrive (for --threads)
  --payload-file PATH     the same with the payload text read from a file (big payloads)
  --signal WHO:SIG:SECS[:stop]
                          for the next job: SECS after its `started`, send SIG to
                          WHO = group (the adapter's process group), pid (the adapter)
                          or child (the adapter's forked child, --fork mode);
                          with ":stop", first write a `stop` frame as locketd does
  --failure-hooks JSON    send `failure_hooks` for this payload (exception
                          Resque::DirtyExit unless --exception/--error said otherwise)
  --exception NAME, --error MSG   for the following --failure-hooks
  --frame JSON            send this frame as is (waits for done if it is a job/failure_hooks)
  --raw TEXT              send TEXT plus "\\n" as is, without waiting
  --sleep SECS            pause
Other options:
  --threads N             set LOCKETD_THREADS=N in the adapter's environment, as locketd
                          does for `threads = N` (H-18)
  --stop-after ID:SECS[:requeue]
                          SECS after the `started` of job ID, write a `stop` frame for
                          it (reason "timeout"; with ":requeue", "requeue": true), no
                          signal: the threaded soft stop (may repeat, one per job)
  --end close|term|none   how to finish: EOF on fd 3 (default), SIGTERM to the
                          idle group, or just wait for the adapter to exit
  --capture               collect the adapter's stdout/stderr and print them as
                          {"driver":"stdout"|"stderr","data":...} lines at the end
                          (default: they go to this script's stderr)
  --queue Q               the `queue` field of job frames (default "default")
  --timeout SECS          per reply (default 30)

Exit status: 0 when every awaited frame arrived, 1 otherwise.
Python 3.9+, stdlib only.
"""

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

USAGE = "usage: drive.py [STEP ...] [OPTIONS] -- ADAPTER_COMMAND [ARG ...]"


def child_of(pid):
    """The first child of `pid` (the --fork adapter's job child), from /proc; KeyError if none."""
    for tid in os.listdir("/proc/%d/task" % pid):
        with open("/proc/%d/task/%s/children" % (pid, tid)) as f:
            kids = f.read().split()
        if kids:
            return int(kids[0])
    raise KeyError("child_pid")


def group_alive(pgid):
    """Whether a process that is not a zombie is in process group `pgid` (from /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


OUTPUT = threading.Lock()  # whole lines: the signal and stop threads print too


def emit(text):
    with OUTPUT:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def note(**fields):
    emit(json.dumps({"driver": fields.pop("event"), **fields}, ensure_ascii=False))


def parse_args(argv):
    if "--" not in argv:
        sys.exit(USAGE)
    split = argv.index("--")
    opts, command = argv[:split], argv[split + 1:]
    if not command:
        sys.exit(USAGE)
    config = {"end": "close", "capture": False, "queue": "default", "timeout": 30.0, "threads": None, "stops": {}}
    steps, exception, error = [], "Resque::DirtyExit", "Child process received unhandled signal SIGKILL (signal 9)"
    i = 0
    while i < len(opts):
        flag = opts[i]
        if flag == "--capture":
            config["capture"] = True
            i += 1
            continue
        if i + 1 >= len(opts):
            sys.exit(f"{flag} needs a value\n{USAGE}")
        value = opts[i + 1]
        i += 2
        if flag in ("--end", "--queue"):
            config[flag[2:]] = value
        elif flag == "--timeout":
            config["timeout"] = float(value)
        elif flag == "--threads":
            config["threads"] = str(int(value))
        elif flag == "--stop-after":
            job_id, secs, *requeue = value.split(":")
            config["stops"][job_id] = (float(secs), requeue == ["requeue"])
        elif flag == "--concurrent":
            steps.append(("concurrent", int(value)))
        elif flag == "--id":
            steps.append(("id", value))
        elif flag == "--exception":
            exception = value
        elif flag == "--error":
            error = value
        elif flag == "--payload":
            steps.append(("job", value))
        elif flag == "--payload-file":
            with open(value, encoding="utf-8", newline="") as f:
                steps.append(("job", f.read()))
        elif flag == "--failure-hooks":
            steps.append(("frame", {"t": "failure_hooks", "payload": value, "exception": exception, "error": error}))
        elif flag == "--frame":
            steps.append(("frame", json.loads(value)))
        elif flag == "--signal":
            who, sig, secs, *stop = value.split(":")
            steps.append(("signal", (who, sig, float(secs), stop == ["stop"])))
        elif flag == "--raw":
            steps.append(("raw", value))
        elif flag == "--sleep":
            steps.append(("sleep", float(value)))
        else:
            sys.exit(f"unknown option {flag}\n{USAGE}")
    return config, steps, command


def spawn(command, capture, threads=None):
    """Start the adapter with the request pipe on fd 3 and the reply pipe on fd 4."""
    # Move both pipes above fd 10, then put the adapter's ends on 3 and 4 here in
    # the driver: pass_fds hands exactly those to the child, and no pipe that
    # Popen creates for itself can land on 3 or 4 meanwhile.
    for fd in (3, 4):
        try:
            os.fstat(fd)
        except OSError:
            continue
        sys.exit(f"fd {fd} is already open in the driver; run it without extra fds")
    low = os.pipe() + os.pipe()
    req_r, req_w, rep_r, rep_w = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in low]
    for fd in low:
        os.close(fd)
    os.dup2(req_r, 3, inheritable=False)
    os.dup2(rep_w, 4, inheritable=False)
    for fd in (req_r, rep_w):
        os.close(fd)
    env = dict(os.environ, LOCKETD_PROTOCOL="1", LOCKETD_PROTOCOL_FDS="3,4")
    if threads is not None:
        env["LOCKETD_THREADS"] = threads
    out = subprocess.PIPE if capture else sys.stderr
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                start_new_session=True, pass_fds=(3, 4))
    finally:
        os.close(3)
        os.close(4)
    return proc, req_w, rep_r


class Replies:
    """Line reader over the reply pipe with a timeout."""

    def __init__(self, fd):
        self.fd, self.buf, self.eof = fd, b"", False

    def next_line(self, timeout):
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self.fd, 65536)
            if chunk:
                self.buf += chunk
            else:
                self.eof = True
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def bye_within(self, timeout):
        """Print and consume a `bye` frame arriving within timeout; leave anything else."""
        try:
            line = self.next_line(timeout)
        except TimeoutError:
            return False
        if line is None:
            return True
        if json.loads(line).get("t") == "bye":
            emit(line.decode("utf-8", errors="replace"))
            return True
        self.buf = line + b"\n" + self.buf
        return False


def drain(stream, sink):
    # Chunk by chunk: a leftover grandchild may hold the pipe open long after the adapter exited.
    for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
        sink.append(chunk)


def main():
    config, steps, command = parse_args(sys.argv[1:])
    proc, req_w, rep_r = spawn(command, config["capture"], config["threads"])
    pgid = proc.pid  # start_new_session: the adapter leads its own group
    note(event="spawned", pid=proc.pid, command=command)
    captured = {}
    threads = []
    if config["capture"]:
        for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            captured[name] = []
            thread = threading.Thread(target=drain, args=(stream, captured[name]), daemon=True)
            thread.start()
            threads.append(thread)

    replies = Replies(rep_r)
    ok = True
    started_at = {}

    def expect(what):
        """Print the next reply frame and return it parsed (None on EOF/timeout/garbage)."""
        nonlocal ok
        try:
            line = replies.next_line(config["timeout"])
        except TimeoutError:
            note(event="timeout", waiting_for=what)
            ok = False
            return None
        if line is None:
            note(event="eof", waiting_for=what)
            ok = False
            return None
        text = line.decode("utf-8", errors="replace")
        emit(text)
        try:
            frame = json.loads(line)
        except ValueError:
            note(event="bad_frame", raw=text[:200])
            ok = False
            return None
        return frame

    def send(frame_or_text):
        nonlocal ok
        # Raw UTF-8 like serde_json: only controls, quotes and backslashes are escaped.
        data = frame_or_text if isinstance(frame_or_text, str) else json.dumps(frame_or_text, separators=(",", ":"), ensure_ascii=False)
        try:
            os.write(req_w, data.encode() + b"\n")
            return True
        except BrokenPipeError:
            note(event="request_pipe_closed")
            ok = False
            return False

    def fire(action, frame):
        who, sig, delay, stop = action
        time.sleep(delay)
        if stop:
            send({"t": "stop", "id": frame["id"], "reason": "timeout"})
        signum = getattr(signal, sig if sig.startswith("SIG") else "SIG" + sig)
        try:
            if who == "group":
                os.killpg(pgid, signum)
            elif who == "pid":
                os.kill(proc.pid, signum)
            elif who == "child":
                os.kill(child_of(proc.pid), signum)
            note(event="signal", who=who, signal=signum.name, after_started_s=delay)
        except (ProcessLookupError, KeyError) as err:
            note(event="signal_failed", who=who, error=repr(err))

    def soft_stop(job_id, delay, requeue):
        time.sleep(delay)
        frame = {"t": "stop", "id": job_id, "reason": "timeout"}
        if requeue:
            frame["requeue"] = True
        if send(frame):
            note(event="stop", id=job_id, after_started_s=delay, requeue=requeue)

    groups = {}  # pgid -> job id, from `group` frames

    def await_done(job_ids, pending_signal=None):
        """Wait for the `done` of every id in job_ids (frames of any of them in any order)."""
        nonlocal ok, retired
        waiting = set(job_ids)
        while waiting:
            frame = expect("done " + " ".join(sorted(waiting)))
            if frame is None:
                return
            kind, job_id = frame.get("t"), frame.get("id")
            if kind == "started" and job_id in waiting:
                started_at[job_id] = time.monotonic()
                if pending_signal:
                    threading.Thread(target=fire, args=(pending_signal, frame), daemon=True).start()
                if job_id in config["stops"]:
                    delay, requeue = config["stops"][job_id]
                    threading.Thread(target=soft_stop, args=(job_id, delay, requeue), daemon=True).start()
            elif kind == "done" and job_id in waiting:
                waiting.discard(job_id)
                if job_id in started_at:
                    note(event="elapsed", id=job_id, ms=round((time.monotonic() - started_at[job_id]) * 1000, 1))
                if groups:
                    alive = sorted(p for p in groups if group_alive(p))
                    note(event="groups", after_done=job_id, alive=alive, dead=sorted(set(groups) - set(alive)))
                if pending_signal and not waiting:  # a signalled adapter may announce its exit
                    retired = replies.bye_within(1.0)
            elif kind == "group" and isinstance(frame.get("pgid"), int):
                groups[frame["pgid"]] = job_id
            elif kind == "bye":
                retired = True
            else:
                note(event="unexpected", frame=frame)
                ok = False

    def job_frame(job_id, text, thread=None):
        try:
            cls = json.loads(text).get("class", "")
        except (ValueError, AttributeError):
            cls = ""
        frame = {"t": "job", "id": job_id, "payload": text, "queue": config["queue"], "class": cls,
                 "worker": f"driver:{os.getpid()}:{config['queue']}", "lock_keys": [],
                 "lock_token": "driver-token", "deadline_ms": None}
        if thread is not None:
            frame["thread"] = thread
        return frame

    retired = False  # the adapter said bye: send nothing more
    ready = expect("ready")
    ok = ok and ready is not None and ready.get("t") == "ready"
    pending_signal = None
    next_id = None  # from --id
    batch, batch_left = [], 0  # --concurrent: ids written, not yet awaited; steps still to write
    for n, (kind, arg) in enumerate(steps, 1):
        if not ok or retired or proc.poll() is not None:
            break
        if kind == "id":
            next_id = arg
            continue
        if kind == "concurrent":
            batch, batch_left = [], arg
            continue
        if kind == "signal":
            pending_signal = arg
        elif kind == "sleep":
            time.sleep(arg)
        elif kind == "raw":
            send(arg)
        elif kind in ("job", "frame"):
            if kind == "job":
                frame = job_frame(next_id or f"j{n}", arg, len(batch) if batch_left else None)
            else:
                frame = dict(arg)
                frame.setdefault("id", next_id or f"f{n}")
            next_id = None
            awaited = frame.get("t") in ("job", "failure_hooks")
            if not send(frame) or not awaited:
                continue
            if batch_left:
                batch.append(frame["id"])
                batch_left -= 1
                if batch_left:
                    continue
                await_done(batch, pending_signal)
                batch = []
            else:
                await_done([frame["id"]], pending_signal)
            pending_signal = None
    if batch and ok and not retired:  # fewer steps than --concurrent said
        await_done(batch, pending_signal)

    # Finish: EOF (idle shutdown), TERM while idle, or just wait.
    end = config["end"]
    if end == "term" and proc.poll() is None:
        os.killpg(pgid, signal.SIGTERM)
    os.close(req_w)
    began = time.monotonic()
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        note(event="no_exit_after", end=end, seconds=10)
        os.killpg(pgid, signal.SIGKILL)
        code = proc.wait()
        ok = False
    # Frames written before the exit (e.g. bye) are still in the pipe.
    while True:
        try:
            line = replies.next_line(0.2)
        except TimeoutError:
            break
        if line is None:
            break
        emit(line.decode("utf-8", errors="replace"))
    status = {"exit": code} if code >= 0 else {"signal": signal.Signals(-code).name}
    note(event="exit", end=end, ms=round((time.monotonic() - began) * 1000, 1), **status)

    try:  # leftovers in the adapter's process group (e.g. `sleep &` from a job)
        os.killpg(pgid, 0)
        note(event="group_leftovers_killed")
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for job_group in groups:  # job groups (H-18) the adapter left alive
        if job_group != pgid and group_alive(job_group):
            note(event="job_group_leftovers_killed", pgid=job_group, id=groups[job_group])
            try:
                os.killpg(job_group, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 1
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for name, chunks in captured.items():
        data = b"".join(chunks).decode("utf-8", errors="replace")
        if data:
            note(event=name, data=data)
    os.close(rep_r)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
