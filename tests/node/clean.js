"use strict";
// Runs node-resque's stuck-worker cleanup, as its scheduler or an admin script
// would, and reads the result back through the Queue API.
//
// Config: { "port": P, "namespace": "resque", "age_ms": 1 }
// Prints { "allWorkingOn": {...} (before), "cleaned": queue.cleanOldWorkers(age_ms),
//          "workers": queue.workers() (after), "failed": queue.failed(0, -1),
//          "errors": [ messages the Queue emitted as "error" ] }

const { main } = require("./common");

main(async (queue, config) => {
  const errors = [];
  queue.on("error", (error) => errors.push(String(error)));
  const allWorkingOn = await queue.allWorkingOn();
  const cleaned = await queue.cleanOldWorkers(config.age_ms);
  const workers = await queue.workers();
  const failed = await queue.failed(0, -1);
  return { allWorkingOn, cleaned, workers, failed, errors };
});
