#!/usr/bin/env node
// locketd-handler: the Node adapter for locketd's persistent-handler protocol (v1).
//
//   locketd-handler.js MODULE
//
// locketd starts this script in its own process group with the request pipe on
// fd 3 and the reply pipe on fd 4 (docs/persistent-handlers.md, H-3, H-4, H-16).
// It loads MODULE once (require(path.resolve(MODULE)), or import() for an ES
// module), says `ready`, then serves one request at a time until EOF on fd 3
// (then it exits 0):
//
//   job            -> started, then exactly one done (ok | failed | reschedule | throttled)
// A rejected error with a numeric `retryAfter` (seconds), or named "Throttled", answers
// "throttled": the remote side throttled the job, every job of its class's rate key waits
// that long (rate-limits.md RL-4); not a failure, no onFailure hooks.
//   failure_hooks  -> done, after the job's onFailure hook ran
//   stop           -> advisory, the SIGTERM that follows is what counts; read
//                     when that SIGTERM comes during a job (see below)
//
// MODULE exports node-resque-style job definitions, as module.exports.jobs or as
// module.exports itself:
//
//   module.exports = { Greeter: { perform: async (name) => { ... } } };
//
// The payload's "class" is the key (exactly). Hooks on the definition, in
// Resque's order, each awaited, `this` being the definition:
//   before_perform / beforePerform (...args)  throwing an error named "DontPerform"
//                                              skips the job (ok, performed false)
//   perform(...args)
//   after_perform / afterPerform (...args)    only when perform succeeded
//   on_failure / onFailure (error, ...args)   once, on any error but Reschedule
// When both spellings exist both run, sorted by name as Resque sorts hooks.
// node-resque `plugins` need the node-resque package: they are ignored (with a
// warning on stderr).
//
// An error whose name (or constructor name) is "Reschedule" answers status
// "reschedule"; this module exports a Reschedule class for that (and DontPerform):
//   const { Reschedule } = require("<path>/locketd-handler.js")
// works from job code: it is the running adapter itself, not a second copy.
// SIGTERM during a job: the onFailure hook runs with an error named
// "Resque::TermException" (for at most TERM_HOOKS_MS), done failed
// "Resque::TermException" "SIGTERM" is sent, then `bye`, then exit 0; the job's
// promise is abandoned (JavaScript cannot interrupt it): should it settle while
// the hook runs, its result is ignored, so a job whose onFailure ran is never
// recorded as a success. When the stop frame locketd wrote just before the
// signal says "requeue": true (H-14: a lost lock under on_lock_lost = "requeue"
// puts the job back in its queue, which is no failure), no onFailure hook runs;
// done still says failed with Resque::TermException (locketd requeues the job
// whatever done says). SIGTERM while idle:
// exit 0. process.exit() in job code ends the handler like Ruby's exit!
// (locketd records it).
//
// Close-on-exec: Node cannot set FD_CLOEXEC itself, but it does not need to. At
// startup Node calls libuv's uv_disable_stdio_inheritance(), which marks every
// inherited descriptor (fds 3 and 4 included) close-on-exec, and child_process
// (libuv's uv_spawn) hands a child only the descriptors named in its `stdio`
// option. The adapter checks the flag in /proc/self/fdinfo and, should it be
// missing, reopens the pipe through /proc/self/fd (Node opens files
// close-on-exec) and closes the inherited descriptor.
//
// Big integers: JSON.parse turns numbers beyond 2^53 into doubles, so such args
// reach perform rounded (12345678901234567890123 -> 1.2345678901234568e+22), as
// in node-resque. Keep big integers in payloads as strings for Node jobs.
//
// Threaded mode (H-16, H-18). With LOCKETD_THREADS=N (N > 1) in its environment
// (locketd sets it for `threads = N`; the adapter unsets it) the adapter says
// "threads" in ready.features and runs every `job` it is sent at once, each an
// async perform in the event loop (locketd sends at most N). Frames of
// different jobs interleave; each is one whole line (send() is synchronous).
// Without the variable, or with 1, everything above holds unchanged.
//   - The job's AbortSignal: perform and the hooks get as `this` an object whose
//     prototype is the definition, with `this.signal` (the job's AbortSignal)
//     and `this.job` (its request frame); so `this.x = ...` in a hook is per job.
//     Arrow functions have no `this`: they call
//     require("<path>/locketd-handler.js").signal() (AsyncLocalStorage knows the
//     job), or the definition says `withSignal: true` and perform gets the
//     signal as one more, last, argument. `current` is the calling job's frame.
//   - stop {id, reason, requeue}: aborts that job's signal (reason: the
//     Resque::TermException error, message "stop: <reason>"), runs its
//     onFailure hook with that error (not when requeue; at most TERM_HOOKS_MS)
//     and answers done failed Resque::TermException once the job's own promise
//     settled (its result is then ignored): JavaScript cannot interrupt a
//     promise, so a job that ignores its signal keeps its done back, and
//     locketd's kill point (kill_grace after the stop, before the lease ends)
//     kills the whole process; its sibling jobs go back to their queues.
//   - What a job starts: child_process spawn, exec, execFile and fork (all go
//     through ChildProcess#spawn), and spawnSync, execSync, execFileSync (through
//     the spawn_sync binding), called from a job's async context, are started
//     `detached: true` (a session and process group of their own) and announced
//     as {"t":"group","id":JOB,"pgid":PID}; the adapter SIGKILLs each group of
//     the job before its done. Not covered: a child that leaves its group
//     (setsid) itself; one started from outside the job's async context (a
//     callback registered before the job), or after the job's done.
//   - SIGTERM: every running job is stopped as by a stop frame (message
//     "SIGTERM"), each answers done, then bye and exit 0. EOF: exit 0 once the
//     running jobs answered.
//
// node 20+, no dependencies.
"use strict";

const { AsyncLocalStorage } = require("async_hooks");
const childProcess = require("child_process");
const fs = require("fs");
const net = require("net");
const path = require("path");
const url = require("url");

const USAGE = "usage: locketd-handler.js MODULE\n" +
  "Runs node-resque-style jobs for locketd over fds 3 (requests) and 4 (replies).";
const TERM_HOOKS_MS = 3000; // SIGTERM during a job: how long the onFailure hook may take
const STOP_FRAME_MS = 100; // SIGTERM during a job: how long to wait for its stop frame to be read
const GROUP_DEATH_MS = 1000; // threaded mode: how long a job's SIGKILLed groups may take to die
const O_CLOEXEC = 0o2000000; // Linux, as in /proc/self/fdinfo "flags:"

class Reschedule extends Error {
  constructor(message) { super(message); this.name = "Reschedule"; }
}
class Throttled extends Error {
  constructor(message, retryAfter) {
    super(message || "throttled by the remote side");
    this.name = "Throttled";
    this.retryAfter = retryAfter;
  }
}
class DontPerform extends Error {
  constructor(message) { super(message); this.name = "DontPerform"; }
}
class LocketError extends Error {
  constructor(name, message, backtrace) {
    super(message);
    this.name = name;
    this.locketdBacktrace = backtrace; // undefined: taken from the stack
  }
}

const state = {
  requests: 3,
  replies: 4,
  jobs: null,        // the loaded job definitions (module exports)
  queue: [],         // request lines not handled yet
  eof: false,
  running: null,     // the request being served: { frame, kind, def, args, answered, hooks }
  terminating: false,
  warnedPlugins: new Set(),
  threads: 1,        // LOCKETD_THREADS: above 1, jobs run at once (threaded mode)
  active: new Map(), // threaded mode: job id -> the request's ctx, until its done is written
};

// Threaded mode: the ctx of the job whose async context is running.
const jobContext = new AsyncLocalStorage();

// The AbortSignal of the calling job (threaded mode; undefined otherwise).
function signal() {
  const ctx = jobContext.getStore();
  return ctx && ctx.abort ? ctx.abort.signal : undefined;
}

module.exports = { Reschedule, Throttled, DontPerform, current: null, signal };

function warn(message) {
  try { process.stderr.write(`locketd-handler: ${message}\n`); } catch (_) { /* nothing to do */ }
}

// -- protocol -----------------------------------------------------------------

function openProtocol() {
  const spec = process.env.LOCKETD_PROTOCOL_FDS || "";
  delete process.env.LOCKETD_PROTOCOL_FDS; // job code and its subprocesses do not see them
  delete process.env.LOCKETD_PROTOCOL;
  if (/^\d+,\d+$/.test(spec)) [state.requests, state.replies] = spec.split(",").map(Number);
  try {
    for (const fd of [state.requests, state.replies]) {
      // Node opens descriptors of its own at startup: a closed 3 or 4 may be reused.
      const stat = fs.fstatSync(fd);
      if (!stat.isFIFO() && !stat.isSocket()) throw new Error(`fd ${fd} is not a pipe`);
    }
    state.requests = ensureCloexec(state.requests, false);
    state.replies = ensureCloexec(state.replies, true);
  } catch (err) {
    process.stderr.write(`locketd-handler: fds ${state.requests} and ${state.replies} must be ` +
      `locketd's protocol pipes (${err.message})\n${USAGE}\n`);
    process.exit(1);
  }
}

function isCloexec(fd) {
  const info = fs.readFileSync(`/proc/self/fdinfo/${fd}`, "latin1");
  const match = /^flags:\s*([0-7]+)/m.exec(info);
  return match ? (parseInt(match[1], 8) & O_CLOEXEC) !== 0 : null;
}

// The fd to use for `fd`, close-on-exec.
function ensureCloexec(fd, write) {
  let cloexec;
  try {
    cloexec = isCloexec(fd);
  } catch (_) {
    cloexec = null; // no /proc: trust Node's uv_disable_stdio_inheritance()
  }
  if (cloexec !== false) return fd;
  const reopened = fs.openSync(`/proc/self/fd/${fd}`, write ? fs.constants.O_WRONLY : fs.constants.O_RDONLY);
  fs.closeSync(fd);
  return reopened;
}

// Strings become valid UTF-8 (lone surrogates -> U+FFFD), recursively.
function scrub(value) {
  if (typeof value === "string") {
    return typeof value.toWellFormed === "function" ? value.toWellFormed()
      : value.replace(/[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/g, "\uFFFD");
  }
  if (Array.isArray(value)) return value.map(scrub);
  if (value && typeof value === "object") {
    const out = {};
    for (const [k, v] of Object.entries(value)) out[scrub(k)] = scrub(v);
    return out;
  }
  return value;
}

const pause = new Int32Array(new SharedArrayBuffer(4));

// Synchronous, so a frame is whole on fd 4 before anything else happens (and
// before process.exit).
function send(frame) {
  // JSON.stringify escapes every control character: no raw newline in a frame.
  const data = Buffer.from(JSON.stringify(scrub(frame)) + "\n", "utf8");
  let offset = 0;
  while (offset < data.length) {
    try {
      offset += fs.writeSync(state.replies, data, offset, data.length - offset);
    } catch (err) {
      if (err.code === "EAGAIN") {
        Atomics.wait(pause, 0, 0, 1);
        continue;
      }
      if (err.code === "EPIPE") {
        warn(`the reply pipe (fd ${state.replies}) is closed; exiting`);
        process.exit(1);
      }
      throw err;
    }
  }
}

function readRequests() {
  let stream;
  try {
    stream = new net.Socket({ fd: state.requests, readable: true, writable: false });
  } catch (_) {
    stream = fs.createReadStream(null, { fd: state.requests, highWaterMark: 1 << 20 });
  }
  let chunks = [];
  stream.on("data", (chunk) => {
    let start = 0;
    let nl;
    while ((nl = chunk.indexOf(10, start)) !== -1) {
      chunks.push(chunk.subarray(start, nl));
      state.queue.push(Buffer.concat(chunks));
      chunks = [];
      start = nl + 1;
    }
    if (start < chunk.length) chunks.push(chunk.subarray(start));
    pump();
  });
  stream.on("end", () => {
    if (chunks.some((c) => c.length)) warn("ignoring an unterminated request at EOF");
    state.eof = true;
    pump();
  });
  stream.on("error", (err) => {
    warn(`reading requests (fd ${state.requests}) failed: ${err.message}`);
    process.exit(1);
  });
}

// Serves queued requests one at a time; exits at EOF once idle.
function pump() {
  if (state.threads > 1) return pumpThreaded();
  if (state.running || state.terminating) return;
  const line = state.queue.shift();
  if (line === undefined) {
    if (state.eof) process.exit(0); // idle shutdown or recycling
    return;
  }
  dispatch(line).then(() => setImmediate(pump), (err) => {
    warn(`internal error: ${err && err.stack || err}`);
    process.exit(1);
  });
}

// The request frame of `line` (null for a blank line); garbage ends the process.
function parseRequest(line) {
  if (!line.length || !line.toString("latin1").trim()) return null;
  let frame;
  try {
    frame = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(line));
  } catch (err) {
    warn(`unreadable request frame (${err.message}): ${line.subarray(0, 200).toString()}`);
    process.exit(1);
  }
  if (!frame || typeof frame !== "object" || Array.isArray(frame)) {
    warn(`request frame is not a JSON object: ${line.subarray(0, 200).toString()}`);
    process.exit(1);
  }
  return frame;
}

async function dispatch(line) {
  const frame = parseRequest(line);
  if (!frame) return;
  if (frame.t !== "job" && frame.t !== "failure_hooks") {
    if (frame.t !== "stop") warn(`ignoring a request of unknown type ${JSON.stringify(frame.t)}`);
    return;
  }
  const ctx = { frame, kind: frame.t, def: null, args: [], outcome: null, answered: false, hooks: null };
  state.running = ctx;
  module.exports.current = frame;
  try {
    let outcome;
    if (ctx.kind === "job") {
      send({ t: "started", id: frame.id });
      outcome = await runJob(ctx);
    } else {
      outcome = await failureHooks(ctx);
    }
    // A SIGTERM that came first owns the answer: it decided the job failed
    // (Resque::TermException) and ran onFailure for it, so a job that settles
    // afterwards must not turn that into a success (or a second failure).
    if (ctx.termed) return;
    ctx.outcome = outcome;
    await flushOutput();
    answer(ctx, outcome);
  } finally {
    if (!state.terminating) {
      state.running = null;
      module.exports.current = null;
    }
  }
}

function answer(ctx, outcome) {
  if (ctx.answered) return;
  ctx.answered = true;
  send({ t: "done", id: ctx.frame.id, ...outcome });
}

// process.stdout/stderr are synchronous for pipes and files on Linux; wait for
// anything still buffered (a TTY) all the same.
function flushOutput() {
  const pending = [process.stdout, process.stderr]
    .filter((s) => s && s.writableLength > 0)
    .map((s) => new Promise((resolve) => s.once("drain", resolve)));
  if (!pending.length) return Promise.resolve();
  return Promise.race([Promise.all(pending), sleep(1000)]);
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms).unref());
}

// -- signals --------------------------------------------------------------------

async function onTerm() {
  const ctx = state.running;
  if (!ctx) process.exit(0); // idle
  if (state.terminating) return;
  state.terminating = true;
  if (!ctx.outcome) { // else the request is over, its done about to be written
    ctx.termed = true; // from here on, the job settling changes nothing (see dispatch)
    const error = new LocketError("Resque::TermException", "SIGTERM", []);
    if (ctx.kind === "job" && await stopRequeues(ctx)) ctx.requeued = true;
    if (ctx.kind === "job" && ctx.def && !ctx.requeued) {
      await Promise.race([runFailureHooks(ctx, error), sleep(TERM_HOOKS_MS)]);
    }
    ctx.outcome = failure(error);
  }
  await flushOutput();
  answer(ctx, ctx.outcome);
  send({ t: "bye", reason: "SIGTERM" });
  process.exit(0);
}

// H-14: whether the stop frame of this job, written just before the SIGTERM,
// says it goes back to its queue. The frame is in the pipe already; it reaches
// state.queue (where the loop later skips it) once the stream has read it, at
// the latest a poll or two after the signal.
async function stopRequeues(ctx) {
  const deadline = Date.now() + STOP_FRAME_MS;
  for (;;) {
    for (const line of state.queue) {
      let frame;
      try {
        frame = JSON.parse(line.toString("utf8"));
      } catch (_) {
        continue;
      }
      if (frame && frame.t === "stop" && frame.id === ctx.frame.id) return frame.requeue === true;
    }
    if (state.eof || Date.now() >= deadline) return false;
    await new Promise((resolve) => setTimeout(resolve, 2));
  }
}

// -- jobs -----------------------------------------------------------------------

function hasOwn(obj, key) {
  return obj !== null && (typeof obj === "object" || typeof obj === "function") &&
    Object.prototype.hasOwnProperty.call(obj, key);
}

function resolve(name) {
  const mod = state.jobs;
  const containers = [mod && mod.jobs, mod, mod && mod.default && mod.default.jobs, mod && mod.default];
  for (const container of containers) {
    if (hasOwn(container, name)) {
      const def = container[name];
      if (def && typeof def.perform === "function") return def;
      if (typeof def === "function") return { perform: def };
      throw new LocketError("NameError", `job ${name} has no perform function`, []);
    }
  }
  throw new LocketError("NameError", `no job named ${name}`, []);
}

function parsePayload(text) {
  if (typeof text !== "string") throw new LocketError("Locket::BadPayload", "payload is not a string", []);
  let payload;
  try {
    payload = JSON.parse(text);
  } catch (err) {
    throw new LocketError("Locket::BadPayload", `payload is not JSON (${err.message})`, []);
  }
  if (!payload || typeof payload !== "object" || Array.isArray(payload)) {
    throw new LocketError("Locket::BadPayload", "payload is not a JSON object", []);
  }
  const args = payload.args === undefined || payload.args === null ? [] : payload.args;
  if (!Array.isArray(args)) throw new LocketError("Locket::BadPayload", "args is not an array", []);
  if (typeof payload.class !== "string" || !payload.class) {
    throw new LocketError("Locket::BadPayload", "payload has no class", []);
  }
  return { className: payload.class, args };
}

// The hook functions for `kind`, both spellings, sorted by name as Resque sorts hooks.
function hooks(def, snake, camel) {
  return [camel, snake].sort()
    .filter((name) => typeof def[name] === "function")
    .map((name) => def[name]);
}

function setUp(ctx) {
  const { className, args } = parsePayload(ctx.frame.payload);
  ctx.def = resolve(className);
  ctx.args = args;
  if (Array.isArray(ctx.def.plugins) && ctx.def.plugins.length && !state.warnedPlugins.has(className)) {
    state.warnedPlugins.add(className);
    warn(`job ${className}: node-resque plugins are not supported here and are ignored`);
  }
}

async function runJob(ctx) {
  try {
    setUp(ctx);
    const { def, args } = ctx;
    // Threaded mode: `this` is the job's own object (its signal and frame), see the header.
    const self = ctx.abort ? jobThis(ctx) : def;
    const performArgs = ctx.abort && def.withSignal === true ? [...args, ctx.abort.signal] : args;
    try {
      try {
        for (const hook of hooks(def, "before_perform", "beforePerform")) await hook.apply(self, args);
      } catch (err) {
        if (errorName(err) === "DontPerform") return { status: "ok", performed: false };
        throw err;
      }
      await def.perform.apply(self, performArgs);
      for (const hook of hooks(def, "after_perform", "afterPerform")) await hook.apply(self, args);
      return { status: "ok", performed: true };
    } catch (err) {
      if (!isReschedule(err) && !isThrottled(err)) await runFailureHooks(ctx, err);
      throw err;
    }
  } catch (err) {
    if (isThrottled(err)) {
      const frame = { status: "throttled" };
      if (typeof err.retryAfter === "number" && isFinite(err.retryAfter)) frame.retry_after = err.retryAfter;
      return frame;
    }
    return isReschedule(err) ? { status: "reschedule" } : failure(err);
  }
}

// Once per job. A hook that throws is logged; the job fails with its own error.
function runFailureHooks(ctx, error) {
  if (ctx.requeued) return Promise.resolve(); // the job goes back to its queue: no failure
  if (!ctx.hooks) {
    ctx.hooks = (async () => {
      for (const hook of hooks(ctx.def, "on_failure", "onFailure")) {
        try {
          await hook.call(ctx.abort ? jobThis(ctx) : ctx.def, error, ...ctx.args);
        } catch (err) {
          warn(`onFailure hook raised ${errorName(err)}: ${errorMessage(err)}\n` +
            backtrace(err).map((l) => `    ${l}`).join("\n"));
        }
      }
    })();
  }
  return ctx.hooks;
}

// A previous handler was killed during this job: run its onFailure hook.
async function failureHooks(ctx) {
  try {
    setUp(ctx);
    const error = new Error(String(ctx.frame.error === undefined ? "" : ctx.frame.error));
    error.name = String(ctx.frame.exception || "Resque::DirtyExit");
    for (const hook of hooks(ctx.def, "on_failure", "onFailure")) await hook.call(ctx.def, error, ...ctx.args);
    return { status: "ok", performed: false };
  } catch (err) {
    return failure(err);
  }
}

// -- threaded mode (LOCKETD_THREADS > 1) ----------------------------------------

function jobThis(ctx) {
  if (!ctx.self) {
    ctx.self = Object.create(ctx.def, {
      signal: { value: ctx.abort.signal, enumerable: true },
      job: { value: ctx.frame, enumerable: true },
    });
  }
  return ctx.self;
}

// Serves every queued request at once: jobs start, stops stop their job.
function pumpThreaded() {
  while (state.queue.length && !state.terminating) {
    const frame = parseRequest(state.queue.shift());
    if (!frame) continue;
    if (frame.t === "stop") {
      stopJob(frame.id, `stop: ${frame.reason === undefined ? "" : frame.reason}`, frame.requeue === true);
    } else if (frame.t === "job" || frame.t === "failure_hooks") {
      startThreaded(frame);
    } else {
      warn(`ignoring a request of unknown type ${JSON.stringify(frame.t)}`);
    }
  }
  if (state.eof && !state.active.size && !state.terminating) process.exit(0);
}

function startThreaded(frame) {
  if (state.active.has(frame.id)) {
    warn(`ignoring a second request for running job ${JSON.stringify(frame.id)}`);
    return;
  }
  const ctx = {
    frame, kind: frame.t, def: null, args: [], outcome: null, answered: false, hooks: null,
    abort: new AbortController(), groups: [], stopping: null, stopped: null,
  };
  ctx.stopped = new Promise((resolve) => { ctx.onStop = resolve; });
  state.active.set(frame.id, ctx);
  jobContext.run(ctx, () => runThreaded(ctx)).catch((err) => {
    warn(`internal error: ${err && err.stack || err}`);
    process.exit(1);
  });
}

async function runThreaded(ctx) {
  try {
    let outcome;
    if (ctx.kind === "job") {
      send({ t: "started", id: ctx.frame.id });
      const run = runJob(ctx);
      outcome = await Promise.race([run, ctx.stopped]);
      if (ctx.stopping) {
        // H-18: a stopped job's done waits until its own promise settled, so nothing of it
        // runs once locketd releases its lock; one that ignores its signal is ended by
        // locketd's kill point, which takes the whole process down.
        await run;
        outcome = await ctx.stopping;
      }
    } else {
      outcome = await failureHooks(ctx);
    }
    ctx.outcome = outcome;
    killGroups(ctx);
    await groupsDead(ctx.groups);
    await flushOutput();
    answer(ctx, outcome);
  } finally {
    state.active.delete(ctx.frame.id);
    if (state.terminating && !state.active.size) {
      send({ t: "bye", reason: "SIGTERM" });
      process.exit(0);
    }
    if (state.eof && !state.active.size) process.exit(0);
  }
}

// Stops a running job (a stop frame, or SIGTERM): see the header.
function stopJob(id, message, requeue) {
  const ctx = state.active.get(id);
  if (!ctx || ctx.kind !== "job" || ctx.outcome || ctx.stopping) return; // over already, or unknown
  if (requeue) ctx.requeued = true;
  const error = new LocketError("Resque::TermException", message, []);
  ctx.stopping = jobContext.run(ctx, async () => {
    // runFailureHooks starts before the abort below, so the hook sees this error, once.
    if (ctx.def && !ctx.requeued) await Promise.race([runFailureHooks(ctx, error), sleep(TERM_HOOKS_MS)]);
    return failure(error);
  });
  ctx.onStop(ctx.stopping);
  ctx.abort.abort(error);
}

// The job started a child: `pgid` is its group (the child leads it).
function announceGroup(ctx, pgid) {
  ctx.groups.push(pgid);
  send({ t: "group", id: ctx.frame.id, pgid });
}

function killGroups(ctx) {
  for (const pgid of ctx.groups) {
    try {
      process.kill(-pgid, "SIGKILL");
    } catch (err) {
      if (err.code !== "ESRCH") warn(`killing process group ${pgid} failed: ${err.message}`);
    }
  }
}

// Waits (at most GROUP_DEATH_MS) until no process of `pgids` is alive (a zombie is not):
// a SIGKILLed process dies when it is next scheduled, and its zombie is its parent's.
async function groupsDead(pgids) {
  const deadline = Date.now() + GROUP_DEATH_MS;
  for (;;) {
    const left = liveGroups(pgids);
    if (!left.length) return;
    if (Date.now() >= deadline) {
      warn(`process groups ${left.join(", ")} still alive ${GROUP_DEATH_MS} ms after SIGKILL`);
      return;
    }
    await sleep(5);
  }
}

function liveGroups(pgids) {
  const maybe = new Set(pgids.filter((pgid) => {
    try {
      process.kill(-pgid, 0);
      return true;
    } catch (err) {
      return err.code !== "ESRCH";
    }
  }));
  if (!maybe.size) return [];
  const live = new Set();
  let entries;
  try {
    entries = fs.readdirSync("/proc");
  } catch (_) {
    return []; // no /proc: the SIGKILL has to do
  }
  for (const entry of entries) {
    if (!/^\d+$/.test(entry)) continue;
    let stat;
    try {
      stat = fs.readFileSync(`/proc/${entry}/stat`, "latin1");
    } catch (_) {
      continue;
    }
    const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    if (fields[0] !== "Z" && maybe.has(Number(fields[2]))) live.add(Number(fields[2]));
  }
  return [...live];
}

// Children started from a running job get a process group of their own (see the header).
function wrapChildProcess() {
  const proto = childProcess.ChildProcess.prototype;
  const spawnAsync = proto.spawn;
  proto.spawn = function spawn(options) {
    const ctx = jobContext.getStore();
    if (!ctx || ctx.outcome || !options || typeof options !== "object") return spawnAsync.call(this, options);
    options.detached = true;
    const result = spawnAsync.call(this, options);
    if (Number.isInteger(this.pid) && this.pid > 0) announceGroup(ctx, this.pid);
    return result;
  };
  let binding = null;
  try {
    binding = process.binding("spawn_sync"); // the object child_process's sync forms call
  } catch (_) {
    binding = null;
  }
  if (!binding || typeof binding.spawn !== "function") {
    warn("child_process's spawn_sync binding is not reachable: spawnSync/execSync children stay in the handler's group");
    return;
  }
  const spawnSync = binding.spawn;
  binding.spawn = function spawn(options) {
    const ctx = jobContext.getStore();
    if (!ctx || ctx.outcome || !options || typeof options !== "object") return spawnSync.call(this, options);
    options.detached = true;
    const result = spawnSync.call(this, options);
    // The child has exited; what it left running in its group is killed at the job's done.
    if (result && Number.isInteger(result.pid) && result.pid > 0) announceGroup(ctx, result.pid);
    return result;
  };
}

function onTermThreaded() {
  if (state.terminating) return;
  if (!state.active.size) process.exit(0); // idle
  state.terminating = true; // no new job; bye and exit once the last one answered
  for (const id of [...state.active.keys()]) stopJob(id, "SIGTERM", false);
}

function threadsFromEnv() {
  const raw = process.env.LOCKETD_THREADS;
  delete process.env.LOCKETD_THREADS; // job code and its subprocesses do not see it
  const n = /^\d+$/.test(raw || "") ? parseInt(raw, 10) : 1;
  return n > 1 ? n : 1;
}

// -- outcomes -----------------------------------------------------------------

function errorName(err) {
  if (err !== null && (typeof err === "object" || typeof err === "function")) {
    const name = err.name;
    if (typeof name === "string" && name && name !== "Error") return name;
    const ctor = err.constructor && err.constructor.name;
    if (typeof ctor === "string" && ctor && ctor !== "Object" && ctor !== "Function") return ctor;
  }
  return "Error";
}

function isThrottled(err) {
  return err !== null && typeof err === "object" &&
    (errorName(err) === "Throttled" || err.name === "Throttled" ||
     (typeof err.retryAfter === "number" && isFinite(err.retryAfter)));
}

function isReschedule(err) {
  return errorName(err) === "Reschedule" || (err !== null && typeof err === "object" && err.name === "Reschedule");
}

function errorMessage(err) {
  try {
    if (err !== null && typeof err === "object" && typeof err.message === "string") return err.message;
    return String(err);
  } catch (_) {
    return "(the thrown value cannot be turned into a string)";
  }
}

// The stack's frames above the adapter's own ("at perform (/app/jobs.js:3:11)").
function backtrace(err) {
  if (err instanceof LocketError && err.locketdBacktrace) return err.locketdBacktrace;
  let stack;
  try {
    stack = err !== null && typeof err === "object" ? err.stack : undefined;
  } catch (_) {
    stack = undefined;
  }
  if (typeof stack !== "string") return [];
  const frames = stack.split("\n").filter((l) => /^\s+at /.test(l)).map((l) => l.trim());
  const cut = frames.findIndex((l) => l.includes(`${__filename}:`));
  return cut >= 0 ? frames.slice(0, cut) : frames;
}

function failure(err) {
  return { status: "failed", exception: errorName(err), error: errorMessage(err), backtrace: backtrace(err) };
}

// -- boot -------------------------------------------------------------------------

async function load(target) {
  const file = path.resolve(target);
  try {
    return require(file);
  } catch (err) {
    if (err && err.code === "ERR_REQUIRE_ESM") return import(url.pathToFileURL(file).href);
    throw err;
  }
}

async function main(argv) {
  if (argv.length !== 1 || argv[0].startsWith("-")) {
    process.stderr.write(`${USAGE}\n`);
    process.exit(2);
  }
  state.threads = threadsFromEnv();
  openProtocol();
  try {
    state.jobs = await load(argv[0]);
  } catch (err) {
    process.stderr.write(`locketd-handler: cannot load ${argv[0]}: ${err && err.stack || err}\n`);
    process.exit(1);
  }
  if (state.threads > 1) {
    wrapChildProcess();
    Object.defineProperty(module.exports, "current", {
      get() {
        const ctx = jobContext.getStore();
        return ctx ? ctx.frame : null;
      },
    });
    process.on("SIGTERM", onTermThreaded);
    send({ t: "ready", v: 1, pid: process.pid, adapter: "node", features: ["threads"] });
  } else {
    process.on("SIGTERM", () => { onTerm(); });
    send({ t: "ready", v: 1, pid: process.pid, adapter: "node", features: [] });
  }
  readRequests();
}

if (require.main === module) main(process.argv.slice(2));
