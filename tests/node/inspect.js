"use strict";
// Reads what a Resque admin UI reads, through node-resque's Queue API.
//
// Config: { "port": P, "namespace": "resque", "queues": ["a", "b"] }
// ("queues" is optional; lengths are reported for these plus every queue
// in the <ns>:queues set). Prints one JSON object:
//   workers       queue.workers()        { "host:pid": "q1,q2" | null }
//   allWorkingOn  queue.allWorkingOn()   { worker: payload object | "started" }
//   failedCount   queue.failedCount()
//   failed        queue.failed(0, -1)    [ parsed failure payloads ]
//   stats         queue.stats()          { "processed": "3", "failed": "1", ... }
//   queues        queue.queues()         sorted
//   lengths       queue.length(q)        { q: n }

const { main } = require("./common");

main(async (queue, config) => {
  const workers = await queue.workers();
  const allWorkingOn = await queue.allWorkingOn();
  const failedCount = await queue.failedCount();
  const failed = await queue.failed(0, -1);
  const stats = await queue.stats();
  const queues = (await queue.queues()).slice().sort();
  const names = new Set(queues);
  for (const q of Array.isArray(config.queues) ? config.queues : []) {
    names.add(q);
  }
  const lengths = {};
  for (const q of Array.from(names).sort()) {
    lengths[q] = await queue.length(q);
  }
  return { workers, allWorkingOn, failedCount, failed, stats, queues, lengths };
});
