//! The settings of the daemon: the top level, `[locket]`, `[queue.<name>]`, `[scheduler]` and
//! `[schedule.<name>]`.

use super::{set, Absent, Absent::*, Setting};

const TOP: &str = "";
const LOCKET: &str = "locket";
const QUEUE: &str = "queue.<name>";
const SCHEDULER: &str = "scheduler";
const SCHEDULE: &str = "schedule.<name>";

const POLICY: &str = "string: park, requeue, discard, wait, delay or fail";
const FALLBACK: &str = "string: requeue, delay, discard or fail";
const NONE: Absent = Means("none");

#[rustfmt::skip]
pub(super) const SETTINGS: &[Setting] = &[
    // -- the top level --
    set(TOP, "redis", "string (URL)", Value("\"redis://127.0.0.1:6379/0\""), &["C-1"],
        "Redis URL: redis://[:password@]host:port/db, rediss:// for TLS, unix:// for a socket; \
         through Redis Sentinel, redis+sentinel://[:password@]host1:26379,host2:26379/mymaster/0 \
         (the sentinels, the name they monitor the primary by, the db; the password is the \
         primary's). Also --redis / REDIS_URL, which win over the file."),
    set(TOP, "redis_connect_timeout", "duration", Value("\"30s\""), &[],
        "How long start-up waits for Redis to answer before giving up (exit status 69)."),
    set(TOP, "namespace", "string", Value("\"resque\""), &["C-1"],
        "Resque namespace: every key is \"<namespace>:<key>\", e.g. resque:queue:high. Also \
         --namespace."),
    set(TOP, "queues", "list of strings", Value("[]"), &["A-3"],
        "Queues in priority order, with Resque's patterns: \"*\", globs (\"mail_*\"), \"!skip\"; \
         an array or one comma-separated string. Also --queues / QUEUES. check-config refuses \
         a config that gives none.")
        .set_to("[\"default\"]"),
    set(TOP, "interval", "duration", Value("5"), &["A-16"],
        "After a pass that found nothing, the longest wait before the next pass (Resque's \
         INTERVAL); a job pushed to any of the queues wakes an idle worker at once. 0 = drain \
         and exit. Also --interval / INTERVAL."),
    set(TOP, "log_format", "string: text or json", Value("\"text\""), &[],
        "Log lines as text or as one JSON object per line. Also --log-format."),
    set(TOP, "log_level", "string (log filter)", Value("\"info\""), &[],
        "Log filter when RUST_LOG is not set, e.g. \"info\" or \"locketd=debug\"."),
    set(TOP, "max_payload_bytes", "integer (bytes)", Value("8388608"), &["A-4"],
        "Payloads larger than this are failed with Locket::BadPayload (never run, never \
         dropped)."),
    set(TOP, "failure_backend", "string: redis or redis_multi_queue", Value("\"redis\""), &[],
        "Where failures are recorded: \"redis\" (the failed list) or \"redis_multi_queue\" \
         (<queue>_failed lists)."),
    set(TOP, "prune_dead_workers", "bool", Value("true"), &[],
        "Unregister dead Resque workers at start, by Resque's own rules, except that a worker \
         of this host whose pid is alive and is not a Resque or locketd process (pyres, \
         node-resque) is left alone."),
    set(TOP, "workers", "integer", Value("1"), &[],
        "Worker processes run by the master; each is one Resque worker with its own pid. Also \
         --workers."),
    set(TOP, "slots", "integer", Value("1"), &[],
        "Concurrent jobs per worker process, each slot its own Resque worker \
         \"host:pid+k:queues\", over one Redis connection. 1 = Resque's one-job-per-process \
         model. Also --slots. A Ruby or php Resque worker started on the same host with the \
         same queues (or \"*\") prunes such ids: use slots > 1 only on hosts where locketd runs \
         alone."),
    set(TOP, "graceful_term", "bool", Value("false"), &[],
        "TERM behaves like QUIT (running jobs finish), as Resque's GRACEFUL_TERM (INT never \
         does). Also --graceful-term / GRACEFUL_TERM."),
    set(TOP, "term_timeout", "duration", Value("\"4s\""), &[],
        "On TERM/INT a running handler gets SIGTERM, then SIGKILL this long after (Resque's \
         RESQUE_TERM_TIMEOUT). Also --term-timeout / RESQUE_TERM_TIMEOUT."),
    set(TOP, "metrics", "string (host:port)", Means("none (no endpoint)"), &[],
        "Serve Prometheus metrics on http://<addr>/metrics. Also --metrics. The same listener \
         as `http`: set one of them.")
        .ex("\"127.0.0.1:9187\""),
    set(TOP, "http", "string (host:port or port)", Means("none (no listener)"), &[],
        "The same listener under a clearer name: /metrics, the web page at / and its JSON API \
         under /api/ (README \"Web page\"). A bare port means 127.0.0.1:<port>; an address that \
         is not loopback is logged as a warning. Also --http. Set one of http and metrics.")
        .ex("\"127.0.0.1:9187\""),
    set(TOP, "http_admin_token", "string (at least 16 characters)",
        Means("none (the page is read-only)"), &[],
        "The token the web page's actions (release a lock holder, reset a counter, retry or \
         remove a failure) need, sent as Authorization: Bearer <token>.")
        .ex("\"change-me-to-a-long-secret\""),
    set(TOP, "http_allowed_hosts", "list of strings (host or host:port)", Value("[]"), &[],
        "Names the listener answers for besides its own address, localhost, 127.0.0.1, [::1] \
         and the machine's host name; a request with any other Host gets 421 and no data (DNS \
         rebinding). A name without a port matches any port.")
        .ex("[\"metrics.example.com\", \"10.0.0.5:9187\"]"),
    set(TOP, "resque_web_url", "string (URL)", NONE, &[],
        "resque-web's address: the web page links its failures there.")
        .ex("\"http://127.0.0.1:5678\""),
    // -- [locket] --
    set(LOCKET, "lock_all", "bool", Value("true"), &["A-5"],
        "Lock every job class that does not say `lock = false`."),
    set(LOCKET, "lock_queues", "list of strings", Value("[]"), &["A-5"],
        "Only jobs from these queues are locked (resque-locket's locketed_queues). Empty = all \
         queues."),
    set(LOCKET, "lock_ttl", "duration", Value("\"35s\""), &["C-1", "L-9"],
        "Job lock lease: at least 1s, at most process_ttl."),
    set(LOCKET, "heartbeat_interval", "duration", Means("lock_ttl / 3 (11.7s with the default lock_ttl)"),
        &["A-10", "C-1", "C-2"],
        "How often a running job's lease is extended; by default a third of lock_ttl, so two \
         renewals can fail before the job is stopped.")
        .ex("\"11666ms\""),
    set(LOCKET, "counter_ttl", "duration", Value("\"15s\""), &["A-15"],
        "Longest life of a queue's lock counter: a skipped queue is retried at least this \
         often."),
    set(LOCKET, "clear_counters_when_idle", "bool", Value("false"), &["A-16"],
        "resque-locket's behaviour: clear the skipped queues' counters when a pass reserved \
         nothing."),
    set(LOCKET, "one_call_take", "bool", Value("true"), &["A-7a"],
        "Reserve a job and take its locks in one Redis call where its class allows it (lock \
         templates without {digest} or {args_digest}; no holds, locked_by, rates, fencing or \
         unique policy that follows the job; a conflict policy of requeue, park or discard; \
         with slots > 1, while the process's batches run light): false sends the two calls of \
         earlier versions."),
    set(LOCKET, "on_lock_lost", "string: kill, requeue or continue", Value("\"kill\""),
        &["A-11"],
        "What to do when a running job's lock is lost: \"kill\" (fail it as \
         Locket::LockLost), \"requeue\" (stop it and push it back), or \"continue\" (keep \
         running without exclusivity)."),
    set(LOCKET, "kill_grace", "duration", Value("\"10s\""), &["L-9", "C-1"],
        "Time between SIGTERM and SIGKILL when a handler is stopped. When renewals of a job's \
         lease keep failing, SIGTERM comes kill_grace before the lease's end and SIGKILL at it, \
         so the handler is dead before another holder can start: heartbeat_interval + \
         kill_grace must be shorter than lock_ttl (check-config refuses it otherwise, here and \
         per class)."),
    set(LOCKET, "process_heartbeat", "duration", Value("\"10s\""), &["R-1"],
        "Process liveness renewal period (100ms to 60s; it also paces Resque's \
         workers:heartbeat)."),
    set(LOCKET, "process_ttl", "duration", Value("\"60s\""), &["R-1", "R-4"],
        "Process liveness lease: a process silent this long is recovered."),
    set(LOCKET, "janitor_interval", "duration", Value("\"5s\""), &["R-3"],
        "How often the janitor purges expired locks and recovers dead processes."),
    set(LOCKET, "on_worker_death", "string: fail or requeue", Value("\"fail\""), &["R-4"],
        "Jobs that were running in a dead process: \"fail\" (Resque::DirtyExit, as Resque \
         does) or \"requeue\" (to the tail, up to max_recoveries times)."),
    set(LOCKET, "max_recoveries", "integer", Value("3"), &["R-4"],
        "Crash requeues of one payload before it is failed instead."),
    set(LOCKET, "shutdown_timeout", "duration", Value("\"25s\""), &["R-8"],
        "Time a running job gets to finish after QUIT/TERM before it is stopped."),
    set(LOCKET, "allow_evicting_redis", "bool", Value("false"), &["S-7"],
        "Run even when Redis may evict keys (a maxmemory-policy other than noeviction); \
         refused otherwise."),
    set(LOCKET, "on_conflict", POLICY, Value("\"park\""), &["P-1", "P-5", "PK-1"],
        "What happens to a job whose lock is taken: \"park\" waits on the lock and goes back \
         to the head of its queue when the lock frees a unit; \"requeue\" is resque-locket's \
         requeue to the tail; \"discard\" drops it (logged and counted, not a failure); \
         \"wait\" retries for up to wait_timeout; \"delay\" backs off; \"fail\" fails it."),
    set(LOCKET, "on_dependency_conflict", POLICY, Value("\"delay\""), &["D-10"],
        "What happens to a job whose locked_by hold is live (the same policies)."),
    set(LOCKET, "max_parked", "integer", Value("100000"), &["PK-7"],
        "Most jobs parked on one lock or hold; beyond it a conflict takes on_park_full."),
    set(LOCKET, "on_park_full", FALLBACK, Value("\"requeue\""), &["PK-7"],
        "The policy of a conflict whose parked list is full."),
    set(LOCKET, "park_check_interval", "duration", Value("\"1s\""), &["PK-4"],
        "How often the janitor wakes the jobs parked on locks whose holder's lease lapsed."),
    set(LOCKET, "wait_timeout", "duration", Value("\"5s\""), &["P-3"],
        "The \"wait\" policy retries for at most this long (at most 60s), then applies \
         wait_then."),
    set(LOCKET, "wait_then", FALLBACK, Value("\"requeue\""), &["P-3"],
        "What a timed-out wait does."),
    set(LOCKET, "delay_base", "duration", Value("\"5s\""), &["P-4"],
        "The \"delay\" policy waits min(delay_base * 2^(n-1), delay_max) * (1 + random[0, \
         delay_jitter)) before the n-th retry; this is its first delay."),
    set(LOCKET, "delay_max", "duration", Value("\"5m\""), &["P-4"],
        "Longest delay of the \"delay\" policy before jitter."),
    set(LOCKET, "delay_jitter", "number", Value("0.2"), &["P-4"],
        "Random extra fraction added to each delay, in [0, delay_jitter)."),
    set(LOCKET, "max_delays", "integer", Value("0"), &["P-4"],
        "Delays of one payload before it is failed as Locket::LockConflict; 0 = unlimited."),
    set(LOCKET, "fencing", "bool", Value("false"), &["L-10"],
        "Hand fencing numbers to handlers (LOCKETD_LOCK_FENCES)."),
    set(LOCKET, "hold_ttl", "duration", Value("\"24h\""), &["D-1"],
        "Lifetime of a dependency hold."),
    // -- [queue.<name>] --
    set(QUEUE, "concurrency", "integer", Means("none (no cap)"), &["A-22"],
        "At most this many jobs reserved from the queue run at once, over every daemon on the \
         Redis.")
        .ex("3"),
    // -- [scheduler] --
    set(SCHEDULER, "enabled", "bool", Value("true"), &["SC-8"],
        "Run the scheduler in the master (delayed delivery and the [schedule.<name>] tables)."),
    set(SCHEDULER, "lock_key", "string",
        Means("\"<namespace>:<namespace>:resque_scheduler_master_lock\", the gem's own"),
        &["SC-6"],
        "The master lock's key.")
        .ex("\"resque:resque:resque_scheduler_master_lock\""),
    set(SCHEDULER, "lock_ttl", "duration", Value("\"180s\""), &["SC-8"],
        "The master lock's TTL (the gem's is 180s); at least 2s."),
    set(SCHEDULER, "misfire_grace", "duration", Value("\"60s\""), &["SC-13"],
        "A tick missed while no scheduler ran is fired once if it is younger than this; 0 = \
         never."),
    set(SCHEDULER, "publish", "bool", Value("false"), &["SC-14"],
        "Publish the schedules into persistent_schedules (resque-web's Schedule tab, a Ruby \
         scheduler that takes over later)."),
    // -- [schedule.<name>] --
    set(SCHEDULE, "class", "string", Required, &["SC-10"], "The job class.")
        .ex("\"NightlyReport\""),
    set(SCHEDULE, "queue", "string", Required, &["SC-10"], "The queue it is pushed to.")
        .ex("\"low\""),
    set(SCHEDULE, "cron", "string (cron expression)", NONE, &["SC-11"],
        "When it fires: 5 fields, or 6 with seconds first; @hourly, @daily, names, L.")
        .ex("\"0 3 * * *\""),
    set(SCHEDULE, "every", "string (period)", NONE, &["SC-11"],
        "When it fires, instead of cron: a period such as \"30s\", \"5m\", \"1h30m\", \"1d\", \
         \"PT1H\", aligned on the Unix epoch.")
        .ex("\"5m\""),
    set(SCHEDULE, "tz", "string (IANA zone)", Means("UTC"), &["SC-11", "SC-12"],
        "The zone of a cron expression: UTC on every host unless given, never TZ or the \
         system's zone, so the fleet names the same ticks.")
        .ex("\"Europe/Berlin\""),
    set(SCHEDULE, "args", "any TOML value", Means("[]"), &["SC-10"],
        "The job's args as the gem normalises them: an array as is, anything else wrapped in \
         one.")
        .ex("[\"all\"]"),
    set(SCHEDULE, "description", "string", NONE, &[],
        "Free text, shown by `locketd schedule`.")
        .ex("\"The nightly report\""),
];
