// The Node app of `locketd-bench threads` (issue 38): the MODULE given to
// adapters/node/locketd-handler.js. It stands in for a loaded app: about 60 MB
// of retained heap (RETAINED_MB, default 60) made of many small live objects,
// kept for the life of the process so every GC marks them. Its one job, Sleep,
// waits 50 ms (SLEEP_MS overrides), as a job that waits on a remote API does.
"use strict";

// What one record below costs in RSS, measured with Node 20.
const RECORD_BYTES = 550;

function retain(megabytes) {
  const count = Math.floor((megabytes * 1024 * 1024) / RECORD_BYTES);
  const out = new Array(count);
  for (let i = 0; i < count; i++) {
    out[i] = { id: i, name: `record-${i}-${"x".repeat(24)}`, tags: [`t${i % 97}`, `u${i}`] };
  }
  return out;
}

const RETAINED = retain(Number(process.env.RETAINED_MB || 60));
const SLEEP_MS = Number(process.env.SLEEP_MS || 50);

module.exports.retained = RETAINED;
module.exports.jobs = {
  Sleep: {
    perform: () => new Promise((resolve) => setTimeout(resolve, SLEEP_MS)),
  },
};
