// The MODULE given to adapters/node/locketd-handler.js: required once per
// handler process, before the first job. node-resque-style job definitions,
// keyed by the payload's "class".
//
// Hooks log one line each to the file named by $HOOK_LOG (when set), so tests
// can compare their order with Resque's.
"use strict";

const fs = require("fs");

function hookLog(line) {
  if (process.env.HOOK_LOG) fs.appendFileSync(process.env.HOOK_LOG, `${line}\n`);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

module.exports.jobs = {
  // Does nothing: for throughput benchmarks.
  Noop: {
    perform: async () => {},
  },

  Greeter: {
    perform: async (name = "world") => {
      console.log(`Hello, ${name}!`);
    },
  },

  // Always fails.
  Failing: {
    perform: async (...args) => {
      throw new TypeError(`boom: ${JSON.stringify(args)}`);
    },
    onFailure: async (error) => {
      hookLog(`Failing.onFailure ${error.name}: ${error.message}`);
    },
  },

  // Sleeps args[0] seconds. On SIGTERM the adapter runs onFailure with an error
  // named "Resque::TermException", answers, and exits (the sleep is abandoned).
  Slow: {
    perform: async (seconds = 1) => {
      hookLog("Slow start");
      await sleep(Number(seconds) * 1000);
      hookLog("Slow finished");
    },
    onFailure: async (error) => {
      hookLog(`Slow.onFailure ${error.name}: ${error.message}`);
    },
  },

  // Every hook, each logged to $HOOK_LOG. Expected log for a success:
  //   beforePerform, perform [args], afterPerform
  // args[0] == "fail" throws in perform (onFailure runs, afterPerform does not);
  // "skip" throws DontPerform in beforePerform (done ok, performed false).
  Audited: {
    beforePerform: async (...args) => {
      hookLog("beforePerform");
      if (args[0] === "skip") {
        const veto = new Error("skipped");
        veto.name = "DontPerform";
        throw veto;
      }
    },
    perform: async (...args) => {
      hookLog(`perform ${JSON.stringify(args)}`);
      if (args[0] === "fail") throw new RangeError("audited job failed");
    },
    afterPerform: async () => {
      hookLog("afterPerform");
    },
    onFailure: async (error, ...args) => {
      hookLog(`onFailure ${error.name}: ${error.message} ${JSON.stringify(args)}`);
    },
  },

  // Back on the queue (what exit 75 means for a command handler); no onFailure.
  Rescheduling: {
    perform: async () => {
      const later = new Error("not yet");
      later.name = "Reschedule";
      throw later;
    },
    onFailure: async (error) => {
      hookLog(`Rescheduling.onFailure ${error.name}`); // must not run
    },
  },

  // Prints its args as one line of JSON (big integers arrive rounded: see the adapter).
  Echo: {
    perform: async (...args) => {
      console.log(JSON.stringify(args));
    },
  },
};
