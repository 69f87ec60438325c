"use strict";
// locketd's PUSH for node-resque (locking-semantics.md D-3a, D-3b): `queue.enqueue` places the
// enqueue-time holds and applies the `unique` rule of the job's class in the same step as the
// push; `queue.enqueueAt` and `queue.enqueueIn` do the same when the job is scheduled (PUSH_AT,
// PUSH's delayed form, writing the delayed queue as node-resque writes it). Copy this file into
// your app (it needs only node-resque) and wrap your Queue:
//
//   const { withLocketd } = require("./locketd-resque");
//   const queue = withLocketd(new Queue({ connection }));
//   await queue.connect();
//   const pushed = await queue.enqueue("a", "Webhook::Receive", [42]); // false: a duplicate
//   await queue.enqueueIn(60000, "a", "Webhook::Receive", [43]);
//
// The payload and the delayed item are node-resque's own (`queue.encode`), and its
// beforeEnqueue/afterEnqueue plugins run as in node-resque (afterEnqueue only when the job was
// pushed; enqueueAt runs none, as in node-resque, and still refuses the same item at the same
// second). PUSH is found in `<ns>:locket:push`, written by every locketd daemon at start and on
// HUP; until one has, the wrapper pushes as node-resque does (no holds) and warns once.

const { RunPlugins } = require("node-resque/dist/core/pluginRunner");

// The fields of `<ns>:locket:push` naming each function and its script.
const FIELDS = {
  push: ["function", "sha1", "script"],
  push_at: ["function_at", "sha1_at", "script_at"],
};

function withLocketd(queue, { warn = (m) => process.emitWarning(m) } = {}) {
  const plainEnqueue = queue.enqueue.bind(queue);
  const plainEnqueueAt = queue.enqueueAt.bind(queue);
  let entry = null; // the `push` hash once read
  let noFunctions = false; // Redis 6: EVALSHA only
  let warned = false;

  async function readEntry() {
    const e = await queue.connection.redis.hgetall(queue.connection.key("locket", "push"));
    entry = e && e.sha1 ? e : null;
    return entry;
  }

  // One call of PUSH or PUSH_AT (`names`: function, sha1, script); with `load`, a function not
  // found falls back to the script, loaded if Redis lacks it. Without it, "not found" errors go
  // to the caller, which re-reads the entry.
  async function call([fn, sha1, script], args, load) {
    const redis = queue.connection.redis;
    if (fn && !noFunctions) {
      try {
        return await redis.call("FCALL", fn, ...args);
      } catch (err) {
        if (/unknown command/i.test(err.message)) noFunctions = true;
        else if (!load || !/function not found/i.test(err.message)) throw err;
      }
    }
    try {
      return await redis.call("EVALSHA", sha1, ...args);
    } catch (err) {
      if (!load || !/^NOSCRIPT/.test(err.message)) throw err;
      await redis.call("SCRIPT", "LOAD", script);
      return redis.call("EVALSHA", sha1, ...args);
    }
  }

  function warnOnce(op) {
    if (warned) return;
    warned = true;
    warn(`locketd: no ${op === "push" ? "PUSH" : "PUSH_AT"} in ` +
      `${queue.connection.key("locket", "push")} (no daemon of this version has started): ` +
      "jobs are pushed without their enqueue-time holds");
  }

  // The published entry that names `op` ("push" or "push_at"), read once; null (after one
  // warning) while no daemon has published it: the caller pushes as node-resque does.
  async function entryFor(op) {
    const e = entry || (await readEntry());
    if (e && e[FIELDS[op][1]]) return e;
    warnOnce(op);
    return null;
  }

  // `op` of the entry `e` with `callArgs`: true when pushed, false for a duplicate.
  async function run(op, e, callArgs) {
    const names = (x) => FIELDS[op].map((f) => x[f]);
    let reply;
    try {
      reply = await call(names(e), callArgs, false);
    } catch (err) {
      if (!/function not found|^NOSCRIPT/i.test(err.message)) throw err;
      // Another build took over, or Redis lost its scripts: re-read once, retry once.
      const again = await readEntry();
      reply = await call(again && again[FIELDS[op][1]] ? names(again) : names(e), callArgs, true);
    }
    return Number(reply[0]) === 1;
  }

  queue.enqueue = async function enqueue(q, func, args = []) {
    args = Array.isArray(args) ? args : [args];
    const e = await entryFor("push");
    if (!e) return plainEnqueue(q, func, args);
    const job = queue.jobs[func];
    const toRun = await RunPlugins(queue, "beforeEnqueue", func, q, job, args);
    if (toRun === false) return toRun;
    const c = queue.connection;
    const pushed = await run("push", e, [3, c.key("queue", q), c.key("queues"),
      c.key("locket", "plans"), q, queue.encode(q, func, args), `${c.key("locket")}:`]);
    if (pushed) await RunPlugins(queue, "afterEnqueue", func, q, job, args);
    return pushed;
  };

  // `timestamp` in ms, as node-resque's: the job is due at its second.
  queue.enqueueAt = async function enqueueAt(timestamp, q, func, args = [],
    suppressDuplicateTaskError = false) {
    args = Array.isArray(args) ? args : [args];
    const e = await entryFor("push_at");
    if (!e) return plainEnqueueAt(timestamp, q, func, args, suppressDuplicateTaskError);
    const c = queue.connection;
    const item = queue.encode(q, func, args);
    const ts = Math.round(timestamp / 1000);
    if ((await c.redis.sismember(c.key(`timestamps:${item}`), `delayed:${ts}`)) === 1) {
      if (suppressDuplicateTaskError) return undefined;
      throw new Error("Job already enqueued at this time with same arguments");
    }
    return run("push_at", e, [4, c.key(`delayed:${ts}`), c.key(`timestamps:${item}`),
      c.key("delayed_queue_schedule"), c.key("locket", "plans"), q, item, String(ts),
      `${c.key("locket")}:`]);
  };

  queue.enqueueIn = async function enqueueIn(time, q, func, args = [],
    suppressDuplicateTaskError = false) {
    const timestamp = Date.now() + parseInt(String(time), 10);
    return queue.enqueueAt(timestamp, q, func, args, suppressDuplicateTaskError);
  };
  return queue;
}

module.exports = { withLocketd };
