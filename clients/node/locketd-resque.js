"use strict";
// locketd's PUSH for node-resque (locking-semantics.md D-3a): `queue.enqueue` places the
// enqueue-time holds and applies the `unique` rule of the job's class in the same step as the
// push. Copy this file into your app (it needs only node-resque) and wrap your Queue:
//
//   const { withLocketd } = require("./locketd-resque");
//   const queue = withLocketd(new Queue({ connection }));
//   await queue.connect();
//   const pushed = await queue.enqueue("a", "Webhook::Receive", [42]); // false: a duplicate
//
// The payload is node-resque's own (`queue.encode`), and its beforeEnqueue/afterEnqueue plugins
// run as in node-resque (afterEnqueue only when the job was pushed). PUSH is found in
// `<ns>:locket:push`, written by every locketd daemon at start and on HUP; until one has, the
// wrapper pushes as node-resque does (no holds) and warns once. enqueueAt and enqueueIn stay
// node-resque's own: a delayed job gets its holds when it starts (D-4).

const { RunPlugins } = require("node-resque/dist/core/pluginRunner");

function withLocketd(queue, { warn = (m) => process.emitWarning(m) } = {}) {
  const plainEnqueue = queue.enqueue.bind(queue);
  let entry = null; // {function, sha1, script} once read
  let noFunctions = false; // Redis 6: EVALSHA only
  let warned = false;

  async function readEntry() {
    const e = await queue.connection.redis.hgetall(queue.connection.key("locket", "push"));
    entry = e && e.sha1 ? e : null;
    return entry;
  }

  // One call of PUSH; with `load`, a function not found falls back to the script, loaded if
  // Redis lacks it. Without it, "not found" errors go to the caller, which re-reads the entry.
  async function call(e, args, load) {
    const redis = queue.connection.redis;
    if (e.function && !noFunctions) {
      try {
        return await redis.call("FCALL", e.function, ...args);
      } catch (err) {
        if (/unknown command/i.test(err.message)) noFunctions = true;
        else if (!load || !/function not found/i.test(err.message)) throw err;
      }
    }
    try {
      return await redis.call("EVALSHA", e.sha1, ...args);
    } catch (err) {
      if (!load || !/^NOSCRIPT/.test(err.message)) throw err;
      await redis.call("SCRIPT", "LOAD", e.script);
      return redis.call("EVALSHA", e.sha1, ...args);
    }
  }

  queue.enqueue = async function enqueue(q, func, args = []) {
    args = Array.isArray(args) ? args : [args];
    const e = entry || (await readEntry());
    if (!e) {
      if (!warned) {
        warned = true;
        warn(`locketd: no ${queue.connection.key("locket", "push")} (no daemon has started): ` +
          "jobs are pushed without their enqueue-time holds");
      }
      return plainEnqueue(q, func, args);
    }
    const job = queue.jobs[func];
    const toRun = await RunPlugins(queue, "beforeEnqueue", func, q, job, args);
    if (toRun === false) return toRun;
    const c = queue.connection;
    const callArgs = [3, c.key("queue", q), c.key("queues"), c.key("locket", "plans"),
      q, queue.encode(q, func, args), `${c.key("locket")}:`];
    let reply;
    try {
      reply = await call(e, callArgs, false);
    } catch (err) {
      if (!/function not found|^NOSCRIPT/i.test(err.message)) throw err;
      // Another build took over, or Redis lost its scripts: re-read once, retry once.
      const again = (await readEntry()) || e;
      reply = await call(again, callArgs, true);
    }
    const pushed = Number(reply[0]) === 1;
    if (pushed) await RunPlugins(queue, "afterEnqueue", func, q, job, args);
    return pushed;
  };
  return queue;
}

module.exports = { withLocketd };
