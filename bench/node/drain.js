// The `peers` scenario of locketd-bench: node-resque drains N no-op jobs ({"class":"Noop"})
// from resque:queue:bench and prints one JSON line with its rate.
// usage: node drain.js --port P --n N [--mode worker|multi] [--max 10] [--joblock]
// The rate is counted from start() to the N-th success, so connection set-up is left out,
// as locketd-bench leaves out locketd's start-up.
const { Worker, MultiWorker, Plugins } = require("node-resque");

function opts() {
  const o = { port: 6379, n: 1000, mode: "worker", max: 10, joblock: false, timeout: 5, limit: 600 };
  const a = process.argv.slice(2);
  for (let i = 0; i < a.length; i++) {
    const k = a[i].replace(/^--/, "");
    if (k === "joblock") o.joblock = true;
    else if (k === "mode") o.mode = a[++i];
    else o[k] = Number(a[++i]);
  }
  return o;
}

async function main() {
  const o = opts();
  const connection = { host: "127.0.0.1", port: o.port, namespace: "resque" };
  const job = { perform: async () => null };
  if (o.joblock) {
    job.plugins = [Plugins.JobLock];
    job.pluginOptions = { JobLock: { reEnqueue: true } };
  }
  const jobs = { Noop: job };
  let done = 0;
  let finish;
  const finished = new Promise((r) => (finish = r));
  const count = () => { if (++done === o.n) finish("ok"); };
  let w;
  if (o.mode === "multi") {
    // The settings of docs/peer-bench.md: checkTimeout and maxEventLoopDelay 10 ms.
    w = new MultiWorker({ connection, queues: ["bench"], timeout: o.timeout, minTaskProcessors: 1,
      maxTaskProcessors: o.max, checkTimeout: 10, maxEventLoopDelay: 10 }, jobs);
  } else {
    w = new Worker({ connection, queues: ["bench"], timeout: o.timeout }, jobs);
    await w.connect();
  }
  w.on("success", count);
  w.on("failure", count);
  const limit = setTimeout(() => finish("timeout"), o.limit * 1000);
  const t0 = process.hrtime.bigint();
  if (o.mode === "multi") w.start(); else await w.start();
  const how = await finished;
  const wall = Number(process.hrtime.bigint() - t0) / 1e9;
  clearTimeout(limit);
  console.log(JSON.stringify({ mode: o.mode, joblock: o.joblock, n: o.n, done, status: how,
    wallS: +wall.toFixed(3), jobsPerS: Math.round(done / wall) }));
  await Promise.race([w.end(), new Promise((r) => setTimeout(r, 10000))]);
  process.exit(how === "ok" ? 0 : 1);
}
main().catch((e) => { console.error(e); process.exit(1); });
