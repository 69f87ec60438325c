"use strict";
// Shared helpers of the node-resque interop scripts (CommonJS).
//
// Every script takes one JSON config object, from argv[2] or else from the
// LOCKETD_NODE_CONFIG environment variable, with at least
//   { "port": 6380, "namespace": "resque" }   (host defaults to 127.0.0.1)
// and an optional "timeout_ms" (default 20000) after which the script
// gives up with exit code 3. It prints exactly one JSON line on stdout.

const { Queue } = require("node-resque");

function readConfig() {
  const raw = process.argv[2] || process.env.LOCKETD_NODE_CONFIG;
  if (!raw) {
    fail(new Error("usage: node script.js '<json config>' (or LOCKETD_NODE_CONFIG)"), 2);
  }
  let config;
  try {
    config = JSON.parse(raw);
  } catch (error) {
    fail(new Error(`config is not JSON: ${error.message}`), 2);
  }
  if (!config || typeof config !== "object" || !Number.isInteger(config.port)) {
    fail(new Error("config needs an integer \"port\""), 2);
  }
  return config;
}

function armTimeout(config) {
  const ms = Number.isInteger(config.timeout_ms) ? config.timeout_ms : 20000;
  const timer = setTimeout(() => {
    process.stderr.write(`timed out after ${ms} ms\n`);
    process.exit(3);
  }, ms);
  timer.unref();
}

function fail(error, code) {
  process.stderr.write(`${error && error.stack ? error.stack : String(error)}\n`);
  process.exit(code || 1);
}

// Connects a node-resque Queue; rejects on the first connection error
// instead of letting ioredis retry forever.
async function connectQueue(config) {
  const queue = new Queue({
    connection: {
      host: config.host || "127.0.0.1",
      port: config.port,
      database: Number.isInteger(config.database) ? config.database : 0,
      namespace: config.namespace || "resque",
      options: {
        connectTimeout: 5000,
        maxRetriesPerRequest: 1,
        retryStrategy: () => null,
      },
    },
  });
  let firstError = null;
  queue.on("error", (error) => {
    if (!firstError) firstError = error;
  });
  await queue.connect();
  if (firstError || !queue.connection.connected) {
    throw firstError || new Error("node-resque queue did not connect");
  }
  return queue;
}

async function main(run) {
  const config = readConfig();
  armTimeout(config);
  let queue;
  try {
    queue = await connectQueue(config);
    const result = await run(queue, config);
    process.stdout.write(`${JSON.stringify(result)}\n`);
  } catch (error) {
    fail(error, 1);
  } finally {
    if (queue) {
      try {
        await queue.end();
      } catch (_) {
        // ignore errors while closing
      }
    }
  }
  process.exit(0);
}

module.exports = { main };
