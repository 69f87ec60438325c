//! The locket Lua scripts, one operation per file under `lua/`, each prefixed with the shared
//! helpers in `lua/lib.lua`. Only this file names the files.

use redis::Script;
use std::sync::OnceLock;

/// The end of every script: run `$entry` (a function of KEYS and ARGV), write the O-3 and stat
/// counts it summed (`flush_counts`, lib.lua), then return its reply. A body that raises has
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

/// `lib.lua`, then the script's body as a function of KEYS and ARGV, run as
/// [`run_and_flush`] says.
macro_rules! script {
    ($file:literal) => {
        concat!(
            include_str!("lua/lib.lua"),
            "local function main_part(KEYS, ARGV)\n",
            include_str!(concat!("lua/", $file)),
            "\nend\n",
            run_and_flush!("main_part")
        )
    };
}

/// `lib.lua`, the job-path bodies as functions of their own KEYS and ARGV (`finish_part`,
/// `reserve_part`, `acquire_part`, and the dispatchers `finish_reserve_part` and `batch_part`
/// over them), then `ENTRY` run as [`run_and_flush`] says, as `script!` ends every script.
fn combined(entry: &str) -> String {
    format!(
        "{}\n\
         local function finish_part(KEYS, ARGV)\n{}\nend\n\
         local function reserve_part(KEYS, ARGV)\n{}\nend\n\
         local function acquire_part(KEYS, ARGV)\n{}\nend\n\
         local function finish_reserve_part(KEYS, ARGV)\n{}\nend\n\
         local function batch_part(KEYS, ARGV)\n{}\nend\n\
         local ENTRY = {entry}\n{}",
        include_str!("lua/lib.lua"),
        include_str!("lua/finish.lua"),
        include_str!("lua/reserve.lua"),
        include_str!("lua/acquire.lua"),
        include_str!("lua/finish_reserve.lua"),
        include_str!("lua/batch.lua"),
        run_and_flush!("ENTRY"),
    )
}

/// ENQUEUE's full text, as `locketd enqueue --print-script` gives it to clients in other
/// languages: the same script the daemon runs, counts' flush included.
pub const ENQUEUE_SOURCE: &str = script!("enqueue.lua");

/// Every locket script, built once per process.
#[derive(Debug)]
pub struct Scripts {
    /// RESERVE.
    pub reserve: Script,
    /// ACQUIRE and START.
    pub acquire: Script,
    /// EXTEND.
    pub extend: Script,
    /// FINISH.
    pub finish: Script,
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
    /// FINISH of one job and RESERVE of the next, in one call.
    pub finish_reserve: Script,
    /// Several calls of `reserve`, `acquire`, `finish` and `finish_reserve` in one call.
    pub batch: Script,
    /// Deliver one batch of a due resque-scheduler timestamp (SC-4, SC-5).
    pub deliver: Script,
    /// Fire one tick of a recurring schedule (SC-12).
    pub fire: Script,
    /// Renew or release the scheduler's master lock (SC-8).
    pub sched_lock: Script,
}

/// The scripts, compiled (hashed) on first use.
pub fn scripts() -> &'static Scripts {
    static SCRIPTS: OnceLock<Scripts> = OnceLock::new();
    SCRIPTS.get_or_init(|| Scripts {
        reserve: Script::new(script!("reserve.lua")),
        acquire: Script::new(script!("acquire.lua")),
        extend: Script::new(script!("extend.lua")),
        finish: Script::new(script!("finish.lua")),
        return_job: Script::new(script!("return.lua")),
        register: Script::new(script!("register.lua")),
        heartbeat: Script::new(script!("heartbeat.lua")),
        unregister: Script::new(script!("unregister.lua")),
        recover: Script::new(script!("recover.lua")),
        purge: Script::new(script!("purge.lua")),
        promote: Script::new(script!("promote.lua")),
        purge_deps: Script::new(script!("purge_deps.lua")),
        enqueue: Script::new(ENQUEUE_SOURCE),
        admin: Script::new(script!("admin.lua")),
        park: Script::new(script!("park.lua")),
        finish_reserve: Script::new(&combined("finish_reserve_part")),
        batch: Script::new(&combined("batch_part")),
        deliver: Script::new(script!("deliver.lua")),
        fire: Script::new(script!("fire.lua")),
        sched_lock: Script::new(script!("sched_lock.lua")),
    })
}

/// The source of every script, for checks over all of them (no KEYS, no SCAN: NEVER-7).
pub fn sources() -> [(&'static str, &'static str); 20] {
    [
        ("reserve.lua", script!("reserve.lua")),
        ("acquire.lua", script!("acquire.lua")),
        ("extend.lua", script!("extend.lua")),
        ("finish.lua", script!("finish.lua")),
        ("return.lua", script!("return.lua")),
        ("register.lua", script!("register.lua")),
        ("heartbeat.lua", script!("heartbeat.lua")),
        ("unregister.lua", script!("unregister.lua")),
        ("recover.lua", script!("recover.lua")),
        ("purge.lua", script!("purge.lua")),
        ("promote.lua", script!("promote.lua")),
        ("purge_deps.lua", script!("purge_deps.lua")),
        ("enqueue.lua", script!("enqueue.lua")),
        ("admin.lua", script!("admin.lua")),
        ("park.lua", script!("park.lua")),
        ("finish_reserve.lua", include_str!("lua/finish_reserve.lua")),
        ("batch.lua", include_str!("lua/batch.lua")),
        ("deliver.lua", script!("deliver.lua")),
        ("fire.lua", script!("fire.lua")),
        ("sched_lock.lua", script!("sched_lock.lua")),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

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
