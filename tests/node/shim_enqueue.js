"use strict";
// Enqueues jobs through locketd's node-resque shim (clients/node/locketd-resque.js).
//
// Config: { "port": P, "namespace": "resque",
//           "jobs": [ { "queue": "q", "class": "Job", "args": [1, "x"], "at": <unix secs> } ] }
// A job with `at` is scheduled with enqueueAt. Prints {"ok":true,"pushed":[true|false, ...]}:
// each enqueue's return value.

const path = require("path");
const { main } = require("./common");
const { withLocketd } = require(path.join(__dirname, "../../clients/node/locketd-resque.js"));

main(async (queue, config) => {
  withLocketd(queue);
  const pushed = [];
  for (const job of config.jobs || []) {
    pushed.push(job.at === undefined
      ? await queue.enqueue(job.queue, job.class, job.args || [])
      : await queue.enqueueAt(job.at * 1000, job.queue, job.class, job.args || []));
  }
  return { ok: true, pushed };
});
