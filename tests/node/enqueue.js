"use strict";
// Enqueues jobs the way a node-resque producer does.
//
// Config: { "port": P, "namespace": "resque",
//           "jobs": [ { "queue": "q", "class": "Job", "args": [1, "x"],
//                       "delay_ms": 0 } ] }
// "delay_ms" (optional) uses queue.enqueueIn (the delayed-job schedule)
// instead of queue.enqueue. Prints {"ok":true,"enqueued":N}.

const { main } = require("./common");

main(async (queue, config) => {
  const jobs = Array.isArray(config.jobs) ? config.jobs : [];
  let enqueued = 0;
  for (const job of jobs) {
    if (typeof job.queue !== "string" || typeof job.class !== "string") {
      throw new Error(`job needs string "queue" and "class": ${JSON.stringify(job)}`);
    }
    const args = job.args === undefined ? [] : job.args;
    if (Number.isInteger(job.delay_ms) && job.delay_ms > 0) {
      await queue.enqueueIn(job.delay_ms, job.queue, job.class, args);
    } else {
      await queue.enqueue(job.queue, job.class, args);
    }
    enqueued += 1;
  }
  return { ok: true, enqueued };
});
