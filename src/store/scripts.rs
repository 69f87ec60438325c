//! The locket Lua scripts, one operation per file under `lua/`, each prefixed with the shared
//! library (`lib_parts!`: `lua/lib.lua` and the `lua/lib_*.lua` parts by subject, then
//! `lua/rate.lua`). Only this file names the files.

use redis::Script;
use std::sync::OnceLock;

/// The end of every script: run `$entry` (a function of KEYS and ARGV), write the O-3 and stat
/// counts it summed (`flush_counts`, lib_count.lua), then return its reply. A body that raises has
/// its counts written too, as the writes it made before raising stay (Redis does not roll a
/// script back), and its error is returned as the script's.
macro_rules! run_and_flush {
    ($entry:expr) => {
        concat!(
            "local ok, reply = pcall(",
            $entry,
            ", KEYS, ARGV)\nflush_counts()\n",
            "if not ok then\n",
            "  if type(reply) == 'table' and reply.err then reply = reply.err end\n",
            "  return redis.error_reply(tostring(reply))\n",
            "end\nreturn reply\n"
        )
    };
}

/// The end of every job-path script (RESERVE, ACQUIRE, FINISH, their pair and their batch):
/// run `$entry` with the O-3 counts kept for the reply, write Resque's own counters, and
/// return `{reply, counts}`, the counts joined in one string (src/store/tally.rs sums them in
/// memory). A body that raises writes its counts itself, as the other scripts do, and returns
/// its error.
macro_rules! run_and_reply {
    ($entry:expr) => {
        concat!(
            "counts_reply = true\n",
            "local ok, reply = pcall(",
            $entry,
            ", KEYS, ARGV)\n",
            "if not ok then\n",
            "  counts_reply = false\n",
            "  flush_counts()\n",
            "  if type(reply) == 'table' and reply.err then reply = reply.err end\n",
            "  return redis.error_reply(tostring(reply))\n",
            "end\n",
            "if reply == nil then reply = false end\n",
            "return {reply, flush_counts()}\n"
        )
    };
}

/// The first line of every EVAL script: Redis 5 needs effects replication turned on before a
/// script writes after TIME (later versions always replicate effects). Not in a FUNCTION
/// library, whose load may not touch `redis.replicate_commands` (nor `pcall`).
macro_rules! replicate {
    () => {
        "if redis.replicate_commands then pcall(redis.replicate_commands) end\n"
    };
}

/// The shared library, in the order its parts need (each `local function` is defined above its
/// first use; lib_park.lua's are declared in lib.lua): lib.lua (the core: S-6 checks, the
/// server clock, the step's reads, leases), lib_lock.lua (locks), lib_count.lua (O-3 counts),
/// lib_reads.lua (the job path's MGET), lib_hold.lua (D-* holds, the per-run reset),
/// lib_park.lua (parked waits), lib_unique.lua (unique entries), rate.lua (rates).
macro_rules! lib_parts {
    () => {
        concat!(
            include_str!("lua/lib.lua"),
            include_str!("lua/lib_lock.lua"),
            "\n",
            include_str!("lua/lib_count.lua"),
            "\n",
            include_str!("lua/lib_reads.lua"),
            "\n",
            include_str!("lua/lib_hold.lua"),
            include_str!("lua/lib_park.lua"),
            include_str!("lua/lib_unique.lua"),
            "\n",
            include_str!("lua/rate.lua"),
            "\n",
        )
    };
}

/// The renderer's files, in the order they need: render_sha256.lua (SHA-256, and the names the
/// three define), render_cjson.lua (the usual payload read by cjson), render.lua.
macro_rules! render_lua {
    () => {
        concat!(
            include_str!("lua/render_sha256.lua"),
            include_str!("lua/render_cjson.lua"),
            include_str!("lua/render.lua"),
        )
    };
}

/// [`script!`] with the renderer (render.lua) between the library and the body: RECOVER
/// works out the digest of a job TAKE started without one (A-7a).
macro_rules! script_with_render {
    ($file:literal) => {
        concat!(
            replicate!(),
            lib_parts!(),
            render_lua!(),
            "local function main_part(KEYS, ARGV)\n",
            include_str!(concat!("lua/", $file)),
            "\nend\n",
            run_and_flush!("main_part")
        )
    };
}

/// `lib.lua`, then the script's body as a function of KEYS and ARGV, run as
/// [`run_and_flush`] says.
macro_rules! script {
    ($file:literal) => {
        concat!(
            replicate!(),
            lib_parts!(),
            "local function main_part(KEYS, ARGV)\n",
            include_str!(concat!("lua/", $file)),
            "\nend\n",
            run_and_flush!("main_part")
        )
    };
}

/// `lib.lua`, the job-path bodies as functions of their own KEYS and ARGV (`finish_part`,
/// `reserve_part`, `acquire_part`, and the dispatchers `finish_reserve_part` and `batch_part`
/// over them), then `ENTRY` run as [`run_and_reply`] says (`tallied`: a worker's job path) or as
/// [`run_and_flush`] says (the counts written in the step: any other caller, e.g. the tests of
/// the store).
fn combined(entry: &str, tallied: bool) -> String {
    let end = if tallied {
        run_and_reply!("ENTRY")
    } else {
        run_and_flush!("ENTRY")
    };
    format!(
        "{}{}local ENTRY = {entry}\n{}",
        replicate!(),
        job_path_parts(),
        end
    )
}

/// The library (`lib_parts!`), ACQUIRE's steps (`lua/lib_acquire.lua`, `lua/lib_conflict.lua`,
/// `lua/lib_start.lua`: the `acq` table's functions, which acquire.lua composes), the renderer
/// and TAKE's steps (`lua/render.lua`, `lua/lib_take.lua`), and the
/// job-path bodies as functions of their own KEYS and ARGV, the common part of the job-path
/// scripts and of their FUNCTION library.
fn job_path_parts() -> String {
    format!(
        "{}\n{}\n{}\n{}\n{}\n{}\n\
         local function finish_part(KEYS, ARGV)\n{}\nend\n\
         local function reserve_part(KEYS, ARGV)\n{}\nend\n\
         local function acquire_part(KEYS, ARGV)\n{}\nend\n\
         local function finish_reserve_part(KEYS, ARGV)\n{}\nend\n\
         local function take_part(KEYS, ARGV)\n{}\nend\n\
         local function batch_part(KEYS, ARGV)\n{}\nend\n",
        lib_parts!(),
        include_str!("lua/lib_acquire.lua"),
        include_str!("lua/lib_conflict.lua"),
        include_str!("lua/lib_start.lua"),
        RENDER_LUA,
        include_str!("lua/lib_take.lua"),
        include_str!("lua/finish.lua"),
        include_str!("lua/reserve.lua"),
        include_str!("lua/acquire.lua"),
        include_str!("lua/finish_reserve.lua"),
        include_str!("lua/take.lua"),
        include_str!("lua/batch.lua"),
    )
}

/// The Lua renderer of key templates and payloads (render.lua, locking-semantics.md D-3a), as
/// the differential test runs it beside the Rust renderer.
pub const RENDER_LUA: &str = render_lua!();

/// PUSH or PUSH_AT as an EVAL script: the shared helpers, the renderer, the plans and
/// push_lib.lua, then the body, counts written in the step.
macro_rules! push_script {
    ($file:literal) => {
        concat!(
            replicate!(),
            lib_parts!(),
            render_lua!(),
            include_str!("lua/plans.lua"),
            include_str!("lua/push_lib.lua"),
            "local function main_part(KEYS, ARGV)\n",
            include_str!(concat!("lua/", $file)),
            "\nend\n",
            run_and_flush!("main_part")
        )
    };
}

/// PUSH (push.lua, D-3a) as an EVAL script: the same Lua as the library's `push` function,
/// counts written in the step. What a Redis without FUNCTION runs, and what
/// `locketd enqueue --print-script` prints for clients that cannot send FCALL.
pub const PUSH_SOURCE: &str = push_script!("push.lua");

/// PUSH_AT (push_at.lua, D-3b), PUSH's delayed form, as an EVAL script: the same Lua as the
/// library's `push_at` function.
pub const PUSH_AT_SOURCE: &str = push_script!("push_at.lua");

/// The job-path scripts as one Redis 7 FUNCTION library (`FUNCTION LOAD`, then `FCALL`): the
/// same parts and the same tallied ending as the `tallied` scripts, but loaded once. An EVALSHA
/// runs the script's whole chunk each time (lib.lua's closures and tables, about 6-8 us of Redis
/// CPU per call here); a library's chunk runs once, at its load, and each function resets the
/// per-run values itself (`reset_run`, lib_hold.lua). The multi-slot connection (batch.rs) calls it
/// when Redis has FUNCTION and falls back to the scripts when it has not (Redis 6).
#[derive(Debug)]
pub struct JobLibrary {
    /// `locketd_<16 hex of the source's SHA1>`: each build's library beside the others, so
    /// daemons of different versions can share a Redis.
    pub name: String,
    /// The `FUNCTION LOAD` text.
    pub source: String,
}

impl JobLibrary {
    fn new() -> JobLibrary {
        let body = format!(
            "{}\n{}\n{}\n\
             local function push_part(KEYS, ARGV)\n{}\nend\n\
             local function push_at_part(KEYS, ARGV)\n{}\nend\n\
             local function entry(f)\n\
             return function(KEYS, ARGV)\n\
             reset_run()\n\
             local ENTRY = f\n{}\
             end\n\
             end\n\
             local function entry_flush(f)\n\
             return function(KEYS, ARGV)\n\
             reset_run()\n\
             local ENTRY = f\n{}\
             end\n\
             end\n\
             {}\n",
            job_path_parts(),
            include_str!("lua/plans.lua"),
            include_str!("lua/push_lib.lua"),
            include_str!("lua/push.lua"),
            include_str!("lua/push_at.lua"),
            run_and_reply!("ENTRY"),
            run_and_flush!("ENTRY"),
            include_str!("lua/take_args.lua"),
        );
        let hash = Script::new(&body).get_hash().to_string();
        let name = format!("locketd_{}", &hash[..16]);
        let mut source = format!("#!lua name={name}\n{body}");
        for op in [
            "reserve",
            "acquire",
            "finish",
            "finish_reserve",
            "take",
            "batch",
        ] {
            source.push_str(&format!(
                "redis.register_function('{name}_{op}', entry({op}_part))\n"
            ));
        }
        // TAKE with its arguments sent as changes (take_args.lua, fcall.rs).
        source.push_str(&format!(
            "redis.register_function('{name}_take_args', args_delta(entry(take_part)))\n"
        ));
        // PUSH writes its counts in the step: its callers are clients, not a worker's tally.
        for op in ["push", "push_at"] {
            source.push_str(&format!(
                "redis.register_function('{name}_{op}', entry_flush({op}_part))\n"
            ));
        }
        JobLibrary { name, source }
    }

    /// The name of job-path function `op` ("reserve", "acquire", "finish", "finish_reserve",
    /// "batch", "push": PUSH, D-3a, or "push_at": PUSH_AT, D-3b).
    pub fn function(&self, op: &str) -> String {
        format!("{}_{op}", self.name)
    }
}

/// ENQUEUE's full text, as `locketd enqueue --print-script` gives it to clients in other
/// languages: the same script the daemon runs, counts' flush included.
pub const ENQUEUE_SOURCE: &str = script!("enqueue.lua");

/// Every locket script, built once per process.
#[derive(Debug)]
pub struct Scripts {
    /// EXTEND.
    pub extend: Script,
    /// Return a reservation to the head of its queue.
    pub return_job: Script,
    /// Resque registration and process liveness.
    pub register: Script,
    /// Process heartbeat and Resque heartbeat.
    pub heartbeat: Script,
    /// Resque unregistration.
    pub unregister: Script,
    /// Recover one slot of a dead process.
    pub recover: Script,
    /// Purge expired lock holders (R-3 step 2).
    pub purge: Script,
    /// Reset the counters blocked by lapsed limit-1 locks.
    pub unblock: Script,
    /// Promote due delayed jobs (R-3 step 1, P-4).
    pub promote: Script,
    /// Purge expired dependency holds (R-3 step 3).
    pub purge_deps: Script,
    /// Push a job with its enqueue-time holds (D-3).
    pub enqueue: Script,
    /// Admin releases of locks and holds (O-2).
    pub admin: Script,
    /// Mark an inflight record whose FINISH Redis refused (E-3).
    pub park: Script,
    /// Wake the jobs parked on resources whose holders lapsed (PK-4, PK-7).
    pub wake_due: Script,
    /// Move parked jobs back to their queues (PK-9).
    pub unpark: Script,
    /// Set or delete resque-pause's keys.
    pub pause: Script,
    /// Ask the process running a job to stop it.
    pub cancel: Script,
    /// Cancel a parked or delayed job.
    pub cancel_parked: Script,
    /// Push a job with the holds its class's published plan names, rendered in Lua (D-3a).
    pub push: Script,
    /// Schedule a job in resque-scheduler's layout with those holds, placed now (D-3b).
    pub push_at: Script,
    /// The job-path scripts that write their O-3 counts themselves.
    pub direct: JobScripts,
    /// The same, handing their O-3 counts back with the reply: what a worker's connection
    /// sends instead (src/store/batch.rs, src/store/tally.rs).
    pub tallied: JobScripts,
    /// The tallied job-path scripts as a FUNCTION library (Redis 7).
    pub library: JobLibrary,
    /// Deliver one batch of a due resque-scheduler timestamp (SC-4, SC-5).
    pub deliver: Script,
    /// Fire one tick of a recurring schedule (SC-12).
    pub fire: Script,
    /// Renew or release the scheduler's master lock (SC-8).
    pub sched_lock: Script,
}

/// The job-path scripts (RESERVE, ACQUIRE+START, FINISH, FINISH+RESERVE, batch) of one counting
/// mode.
#[derive(Debug)]
pub struct JobScripts {
    /// RESERVE.
    pub reserve: Script,
    /// ACQUIRE and START.
    pub acquire: Script,
    /// FINISH.
    pub finish: Script,
    /// FINISH of one job and RESERVE of the next, in one call.
    pub finish_reserve: Script,
    /// RESERVE (with the slot's last FINISH) and the job's ACQUIRE+START by the worker's take
    /// plan, in one call (A-7a).
    pub take: Script,
    /// Several calls of `reserve`, `acquire`, `finish`, `finish_reserve` and `take` in one call.
    pub batch: Script,
}

impl JobScripts {
    fn new(tallied: bool) -> JobScripts {
        JobScripts {
            reserve: Script::new(&combined("reserve_part", tallied)),
            acquire: Script::new(&combined("acquire_part", tallied)),
            finish: Script::new(&combined("finish_part", tallied)),
            finish_reserve: Script::new(&combined("finish_reserve_part", tallied)),
            take: Script::new(&combined("take_part", tallied)),
            batch: Script::new(&combined("batch_part", tallied)),
        }
    }
}

/// The scripts, compiled (hashed) on first use.
pub fn scripts() -> &'static Scripts {
    static SCRIPTS: OnceLock<Scripts> = OnceLock::new();
    SCRIPTS.get_or_init(|| Scripts {
        extend: Script::new(script!("extend.lua")),
        return_job: Script::new(script!("return.lua")),
        register: Script::new(script!("register.lua")),
        heartbeat: Script::new(script!("heartbeat.lua")),
        unregister: Script::new(script!("unregister.lua")),
        recover: Script::new(script_with_render!("recover.lua")),
        purge: Script::new(script!("purge.lua")),
        unblock: Script::new(script!("unblock.lua")),
        promote: Script::new(script!("promote.lua")),
        purge_deps: Script::new(script!("purge_deps.lua")),
        enqueue: Script::new(ENQUEUE_SOURCE),
        admin: Script::new(script!("admin.lua")),
        park: Script::new(script!("park.lua")),
        wake_due: Script::new(script!("wake_due.lua")),
        unpark: Script::new(script!("unpark.lua")),
        pause: Script::new(script!("pause.lua")),
        cancel: Script::new(script!("cancel.lua")),
        cancel_parked: Script::new(script!("cancel_parked.lua")),
        push: Script::new(PUSH_SOURCE),
        push_at: Script::new(PUSH_AT_SOURCE),
        direct: JobScripts::new(false),
        tallied: JobScripts::new(true),
        library: JobLibrary::new(),
        deliver: Script::new(script!("deliver.lua")),
        fire: Script::new(script!("fire.lua")),
        sched_lock: Script::new(script!("sched_lock.lua")),
    })
}

/// The source of every script, for checks over all of them (no KEYS, no SCAN: NEVER-7).
pub fn sources() -> [(&'static str, &'static str); 31] {
    [
        ("push.lua", PUSH_SOURCE),
        ("push_at.lua", PUSH_AT_SOURCE),
        ("job-path library", scripts().library.source.as_str()),
        ("reserve.lua", script!("reserve.lua")),
        ("acquire.lua", include_str!("lua/acquire.lua")),
        ("extend.lua", script!("extend.lua")),
        ("finish.lua", script!("finish.lua")),
        ("return.lua", script!("return.lua")),
        ("register.lua", script!("register.lua")),
        ("heartbeat.lua", script!("heartbeat.lua")),
        ("unregister.lua", script!("unregister.lua")),
        ("recover.lua", script_with_render!("recover.lua")),
        ("purge.lua", script!("purge.lua")),
        ("unblock.lua", script!("unblock.lua")),
        ("promote.lua", script!("promote.lua")),
        ("purge_deps.lua", script!("purge_deps.lua")),
        ("enqueue.lua", script!("enqueue.lua")),
        ("admin.lua", script!("admin.lua")),
        ("park.lua", script!("park.lua")),
        ("wake_due.lua", script!("wake_due.lua")),
        ("unpark.lua", script!("unpark.lua")),
        ("pause.lua", script!("pause.lua")),
        ("cancel.lua", script!("cancel.lua")),
        ("cancel_parked.lua", script!("cancel_parked.lua")),
        ("finish_reserve.lua", include_str!("lua/finish_reserve.lua")),
        ("batch.lua", include_str!("lua/batch.lua")),
        ("take.lua", include_str!("lua/take.lua")),
        ("lib_take.lua", include_str!("lua/lib_take.lua")),
        ("deliver.lua", script!("deliver.lua")),
        ("fire.lua", script!("fire.lua")),
        ("sched_lock.lua", script!("sched_lock.lua")),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    // Issue 40: the Lua stays readable: no file under src/store/lua is over 600 lines.
    #[test]
    fn no_lua_file_is_over_600_lines() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/store/lua");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).expect("src/store/lua") {
            let path = entry.expect("a directory entry").path();
            if path.extension().and_then(|e| e.to_str()) != Some("lua") {
                continue;
            }
            seen += 1;
            let lines = std::fs::read_to_string(&path)
                .expect("a Lua file")
                .lines()
                .count();
            assert!(
                lines <= 600,
                "{} has {lines} lines (at most 600)",
                path.display()
            );
        }
        assert!(
            seen > 20,
            "only {seen} Lua files found in {}",
            dir.display()
        );
    }

    // locking-semantics.md NEVER-7 and K-1: no script lists keys by pattern.
    #[test]
    fn no_script_calls_keys_or_scan() {
        for (name, src) in sources() {
            for bad in [
                "'KEYS'", "'SCAN'", "\"KEYS\"", "\"SCAN\"", "'keys'", "'scan'",
            ] {
                assert!(!src.contains(bad), "{name} calls {bad}");
            }
        }
    }
}
