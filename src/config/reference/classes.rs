//! The settings of job classes and handlers: `[classes.<name>]`, its `locks`, `holds` and
//! `rate` entries, and `[handlers.<name>]`.

use super::{set, Absent, Absent::*, Setting};

const CLASS: &str = "classes.<name>";
const LOCKS: &str = "classes.<name>.locks";
const HOLDS: &str = "classes.<name>.holds";
const RATE: &str = "classes.<name>.rate";
const HANDLER: &str = "handlers.<name>";

const POLICY: &str = "string: park, requeue, discard, wait, delay or fail";
const FALLBACK: &str = "string: requeue, delay, discard or fail";
const NONE: Absent = Means("none");
const LOCKET: Absent = Means("the [locket] value");

#[rustfmt::skip]
pub(super) const SETTINGS: &[Setting] = &[
    // -- [classes.<name>] --
    set(CLASS, "command", "list of strings (argv)", NONE, &["A-9"],
        "The handler command as argv, no shell; the payload arrives on stdin, the lock's \
         token, ids and fencing numbers in LOCKETD_* variables.")
        .ex("[\"/usr/local/bin/billing-sync\", \"--fast\"]"),
    set(CLASS, "builtin", "string: noop, probe or sleep", NONE, &[],
        "A built-in in-process handler instead of a command (no process per job): \"noop\" \
         succeeds at once, \"probe\" also logs the enqueue-to-start latency, \"sleep\" sleeps \
         args[0] seconds.")
        .ex("\"noop\""),
    set(CLASS, "handler", "string", NONE, &["H-1"],
        "The [handlers.<name>] table that runs this class, instead of command or builtin.")
        .ex("\"app\""),
    set(CLASS, "dir", "string (path)", Means("the daemon's working directory"), &[],
        "Working directory of the command (/var/lib/locketd under the packaged unit).")
        .ex("\"/srv/billing\""),
    set(CLASS, "env", "table of strings", Value("{}"), &[],
        "Extra environment for the command, beside the LOCKETD_* variables.")
        .ex("{ BILLING_ENV = \"production\" }"),
    set(CLASS, "timeout", "duration", Means("none (no limit)"), &["A-12"],
        "Longest run of one job; then the handler is stopped and the job fails as \
         Locket::Timeout. Also spelled max_runtime.")
        .ex("\"5m\""),
    set(CLASS, "lock", "bool or string (key template)",
        Means("the default lock ({class}:{args_digest}) when [locket] lock_all is on"),
        &["A-5", "T-4"],
        "false opts the class out of locking, true takes the default lock, a string is a key \
         template (\"user:{args[0]}\", locking-semantics.md §4).")
        .ex("\"user:{args[0]}\""),
    set(CLASS, "limit", "integer", Means("1"), &["L-1"],
        "How many jobs may hold the `lock` at once.")
        .ex("1"),
    set(CLASS, "locks", "array of lock entries", NONE, &["L-4"],
        "Several locks, all or nothing, instead of lock.")
        .ex("[ { key = \"render:{args[0].tenant}\", limit = 3 }, { key = \"gpu\", limit = 2 } ]"),
    set(CLASS, "on_lock_lost", "string: kill, requeue or continue", LOCKET, &["A-11"],
        "Overrides [locket] on_lock_lost.")
        .ex("\"requeue\""),
    set(CLASS, "kill_grace", "duration", LOCKET, &["L-9", "C-1"],
        "Overrides [locket] kill_grace; a locked class's must fit its lease as [locket]'s does.")
        .ex("\"5s\""),
    set(CLASS, "on_conflict", POLICY, LOCKET, &["P-1"],
        "Overrides [locket] on_conflict.")
        .ex("\"discard\""),
    set(CLASS, "on_dependency_conflict", POLICY, LOCKET, &["D-10"],
        "Overrides [locket] on_dependency_conflict.")
        .ex("\"delay\""),
    set(CLASS, "wait_timeout", "duration", LOCKET, &["P-3"],
        "Overrides [locket] wait_timeout.")
        .ex("\"30s\""),
    set(CLASS, "wait_then", FALLBACK, LOCKET, &["P-3"],
        "Overrides [locket] wait_then.")
        .ex("\"delay\""),
    set(CLASS, "delay_base", "duration", LOCKET, &["P-4"],
        "Overrides [locket] delay_base.")
        .ex("\"5s\""),
    set(CLASS, "delay_max", "duration", LOCKET, &["P-4"],
        "Overrides [locket] delay_max.")
        .ex("\"5m\""),
    set(CLASS, "delay_jitter", "number", LOCKET, &["P-4"],
        "Overrides [locket] delay_jitter.")
        .ex("0.2"),
    set(CLASS, "max_delays", "integer", LOCKET, &["P-4"],
        "Overrides [locket] max_delays.")
        .ex("50"),
    set(CLASS, "fencing", "bool", LOCKET, &["L-10"],
        "Overrides [locket] fencing.")
        .ex("true"),
    set(CLASS, "hold_ttl", "duration", LOCKET, &["D-1"],
        "Overrides [locket] hold_ttl.")
        .ex("\"24h\""),
    set(CLASS, "max_parked", "integer", LOCKET, &["PK-7"],
        "Overrides [locket] max_parked.")
        .ex("1000"),
    set(CLASS, "on_park_full", FALLBACK, LOCKET, &["PK-7"],
        "Overrides [locket] on_park_full.")
        .ex("\"delay\""),
    set(CLASS, "holds", "array of hold entries", Value("[]"), &["D-3"],
        "Dependency holds this class places (locking-semantics.md §8).")
        .ex("[ { name = \"order:{args[0]}\", when = \"enqueue\", release_on = \"success\" } ]"),
    set(CLASS, "locked_by", "list of strings (hold templates)", Value("[]"), &["D-5"],
        "Hold names that must be free before a job of this class starts; a live one is a \
         conflict handled by on_dependency_conflict.")
        .ex("[ \"order:{args[0]}\" ]"),
    set(CLASS, "unique", "string: until_expired, until_executing or until_executed",
        Means("none (every push is made)"), &["U-1", "U-2", "U-3"],
        "Unique jobs at enqueue: a push through locketd's PUSH (locketd enqueue, the client \
         shims, FCALL) whose unique_key is taken is not made. \"until_expired\": for \
         unique_ttl after the push that took it; \"until_executing\": while that job waits \
         (queued, parked, delayed), until it starts; \"until_executed\": while it waits or \
         runs, until it ends. The entry moves with its job (start, finish, recovery, discard, \
         cancel). A plain RPUSH, retries, requeues and scheduler deliveries are never refused.")
        .ex("\"until_executed\""),
    set(CLASS, "unique_ttl", "duration", NONE, &["U-1", "U-4"],
        "How long \"until_expired\" refuses duplicates after a push (required with it); with \
         the two other policies, optional: a cap on an entry's life, for jobs a foreign tool \
         removes (Resque.dequeue, a queue cleared from resque-web).")
        .ex("\"10m\""),
    set(CLASS, "unique_key", "string (key template)", Means("\"{class}:{args_digest}\""),
        &["U-1", "T-4"],
        "The key template of unique: two pushes are duplicates when it renders the same.")
        .ex("\"{class}:{args[0]}\""),
    set(CLASS, "rate", "rate entry", NONE, &["RL-1"],
        "One keyed rate limit.")
        .ex("{ key = \"gh-api:{args[1]}\", limit = 10, period = \"1s\" }"),
    set(CLASS, "rates", "array of rate entries", NONE, &["RL-1"],
        "Several rate limits, all must allow the start; give rate or rates, not both.")
        .ex("[ { key = \"smtp\", limit = 100, period = \"1s\" } ]"),
    set(CLASS, "throttled_exit_code", "integer", Means("76"), &["RL-4"],
        "A handler that exits with this status, with an optional last stdout line \
         `retry-after: S`, closes the key of the class's first rate for S seconds (default: \
         the period): every job of the key waits, the throttled one first; not a failure.")
        .ex("76"),
    // -- locks = [ {...} ] --
    set(LOCKS, "key", "string (key template)", Required, &["T-1"],
        "The lock id's template, as lock's.")
        .ex("\"gpu\""),
    set(LOCKS, "limit", "integer", Value("1"), &["L-1"],
        "How many jobs may hold this lock at once."),
    // -- holds = [ {...} ] --
    set(HOLDS, "name", "string (template)", Required, &["D-1"],
        "The hold name's template.")
        .ex("\"order:{args[0]}\""),
    set(HOLDS, "when", "string: enqueue or start", Value("\"enqueue\""), &["D-3", "D-9"],
        "When the hold is placed: with the push (and ensured at start) or when the job \
         starts."),
    set(HOLDS, "release_on", "string: success or completion", Value("\"success\""), &["D-7"],
        "When the hold is released: only when the job succeeds, or whatever the outcome."),
    // -- rate = {...} / rates = [ {...} ] --
    set(RATE, "key", "string (key template)", Required, &["RL-1"],
        "The rate's key template, as a lock id.")
        .ex("\"gh-api:{args[1]}\""),
    set(RATE, "limit", "integer", Required, &["RL-1"],
        "Most starts of one key in any window of period; at most 10000 (use a shorter \
         period for more).")
        .ex("10"),
    set(RATE, "period", "duration", Required, &["RL-1"],
        "The sliding window.")
        .ex("\"1s\""),
    set(RATE, "spread", "bool", Value("false"), &["RL-1"],
        "Also space the starts at least period / limit apart."),
    // -- [handlers.<name>] --
    set(HANDLER, "mode", "string: exec or persistent", Value("\"exec\""), &["H-1"],
        "exec runs command once per job; persistent keeps a preloaded process per worker slot.")
        .ex("\"persistent\""),
    set(HANDLER, "command", "list of strings (argv)", Value("[]"), &["H-1"],
        "The command as argv, no shell.")
        .ex("[\"bundle\", \"exec\", \"/usr/share/locketd/adapters/ruby/locketd-ruby\", \
             \"config/environment.rb\"]"),
    set(HANDLER, "dir", "string (path)", Means("the daemon's working directory"), &[],
        "Working directory of the command.")
        .ex("\"/srv/app\""),
    set(HANDLER, "env", "table of strings", Value("{}"), &[],
        "Extra environment for the command.")
        .ex("{ RAILS_ENV = \"production\" }"),
    set(HANDLER, "boot_timeout", "duration", Value("\"60s\""), &["H-8"],
        "Persistent: longest time from spawn to the handler's `ready` (at least 100ms).")
        .ex("\"120s\""),
    set(HANDLER, "start_timeout", "duration", Value("\"10s\""), &["H-9"],
        "Persistent: longest time from a job to its `started`; then the handler is wedged and \
         replaced."),
    set(HANDLER, "max_jobs", "integer", Value("0"), &["H-13"],
        "Persistent: recycle the process after this many jobs, plus a random \
         0..=max_jobs_jitter drawn per process; 0 = never.")
        .ex("1000"),
    set(HANDLER, "max_jobs_jitter", "integer", Value("0"), &["H-13"],
        "Persistent: the random extra of max_jobs, so the slots do not recycle together.")
        .ex("100"),
    set(HANDLER, "max_rss", "size", Means("none"), &["H-13"],
        "Persistent: recycle after the job that left the process above this resident size \
         (at least 1MiB; sizes: \"768MiB\", \"2GiB\", \"512MB\", or bytes).")
        .ex("\"768MiB\""),
    set(HANDLER, "max_lifetime", "duration", NONE, &["H-13"],
        "Persistent: recycle, between jobs, a process older than this.")
        .ex("\"6h\""),
    set(HANDLER, "idle_timeout", "duration", NONE, &["H-13"],
        "Persistent: a process idle this long exits; the next job starts another.")
        .ex("\"10m\""),
    set(HANDLER, "preload", "bool", Value("false"), &["H-1"],
        "Persistent: start the process with its worker slot, not at the first job."),
    set(HANDLER, "max_frame_bytes", "size", Means("max(1MiB, 2 x max_payload_bytes)"),
        &["H-5"],
        "Persistent: the longest reply line read from the handler.")
        .ex("\"16MiB\""),
    set(HANDLER, "failure_hooks_after_kill", "bool", Value("true"), &["H-14"],
        "Persistent: a killed job's on_failure hooks run in the next process."),
    set(HANDLER, "threads", "integer", Value("1"), &["H-18"],
        "Persistent: how many jobs one process runs at once (at most 1024). Above 1, a \
         worker's slots share processes, threads slots each, when the adapter says `threads` \
         in its `ready` features."),
];
