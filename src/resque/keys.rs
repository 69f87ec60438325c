//! Key names, Ruby Resque's and locketd's, under one namespace prefix.
//!
//! Every key locketd touches is `<ns>:<key>` (resque-protocol.md §13 item 1). Resque's names
//! follow `lib/resque/data_store.rb`; locketd's own live under `<ns>:locket:` (locking-semantics.md
//! §2). A `redis-cli` look at a busy default namespace:
//!
//! ```text
//! 127.0.0.1:6379> KEYS resque:*
//! 1) "resque:queues"                        2) "resque:queue:high"
//! 3) "resque:workers"                       4) "resque:worker:vm:4242:high,low"
//! 5) "resque:worker:vm:4242:high,low:started"
//! 6) "resque:workers:heartbeat"             7) "resque:stat:processed"
//! 8) "resque:locket:inflight:vm:4242:1f0c9a2e:0"
//! 9) "resque:locket:lock:Billing::Sync:5d41..."   10) "resque:locket:locks"
//! ```

/// Builds every key name from the namespace.
#[derive(Clone, Debug)]
pub struct Keys {
    ns: String,
    locket: String,
}

impl Keys {
    /// Keys under namespace `ns` (Resque's default is `resque`).
    pub fn new(ns: &str) -> Keys {
        Keys {
            ns: ns.to_string(),
            locket: format!("{ns}:locket:"),
        }
    }

    /// The namespace, without the trailing colon.
    pub fn ns(&self) -> &str {
        &self.ns
    }

    fn resque(&self, key: &str) -> String {
        cat(&[&self.ns, ":", key])
    }

    /// `<ns>:<kind><name>`.
    fn resque_with(&self, kind: &str, name: &str) -> String {
        cat(&[&self.ns, ":", kind, name])
    }

    /// `<ns>:locket:<kind><name>`.
    fn locket_with(&self, kind: &str, name: &str) -> String {
        cat(&[&self.locket, kind, name])
    }

    /// `<ns>:delayed_queue_schedule`: resque-scheduler's ZSET of due timestamps (SC-1).
    pub fn delayed_schedule(&self) -> String {
        self.resque("delayed_queue_schedule")
    }
    /// `<ns>:delayed:<ts>`: resque-scheduler's list of the items due at `ts`.
    pub fn delayed_bucket(&self, ts: &str) -> String {
        self.resque_with("delayed:", ts)
    }
    /// `<ns>:timestamps:<item>`: the buckets (`delayed:<ts>`) holding an item.
    pub fn delayed_index(&self, item: &str) -> String {
        self.resque_with("timestamps:", item)
    }
    /// `<ns>:delayed:last_enqueued_at`: schedule name → last enqueue (Ruby `Time#to_s`).
    pub fn last_enqueued_at(&self) -> String {
        self.resque("delayed:last_enqueued_at")
    }
    /// `<ns>:persistent_schedules`: schedule name → its JSON config (SC-14).
    pub fn persistent_schedules(&self) -> String {
        self.resque("persistent_schedules")
    }
    /// `<ns>:schedules_changed`: names of changed schedules (SC-14).
    pub fn schedules_changed(&self) -> String {
        self.resque("schedules_changed")
    }
    /// `<ns>:locket:schedule:last`: schedule name → the last tick fired (SC-12).
    pub fn schedule_last(&self) -> String {
        self.locket("schedule:last")
    }

    /// `<ns>:locket:scheduler:problems`: JSON of the delayed items the scheduler keeps back
    /// and why (SC-5), for `status`; expires unless refreshed.
    pub fn scheduler_problems(&self) -> String {
        self.locket("scheduler:problems")
    }

    /// `<ns>:queues`: the set of known queue names.
    pub fn queues(&self) -> String {
        self.resque("queues")
    }
    /// `<ns>:queue:<q>`: a queue's list of JSON payloads.
    pub fn queue(&self, q: &str) -> String {
        self.resque_with("queue:", q)
    }
    /// `<ns>:workers`: the set of registered worker ids.
    pub fn workers(&self) -> String {
        self.resque("workers")
    }
    /// `<ns>:worker:<id>`: what a worker is working on.
    pub fn worker(&self, id: &str) -> String {
        self.resque_with("worker:", id)
    }
    /// `<ns>:worker:<id>:started`: when a worker registered.
    pub fn worker_started(&self, id: &str) -> String {
        cat(&[&self.ns, ":worker:", id, ":started"])
    }
    /// `<ns>:workers:heartbeat`: worker id → last heartbeat.
    pub fn heartbeat(&self) -> String {
        self.resque("workers:heartbeat")
    }
    /// `<ns>:pruning_dead_workers_in_progress`: the pruning mutex.
    pub fn pruning(&self) -> String {
        self.resque("pruning_dead_workers_in_progress")
    }
    /// `<ns>:pause-all-workers`.
    pub fn pause_all(&self) -> String {
        self.resque("pause-all-workers")
    }
    /// `<ns>:locket:cancel:<process id>`: the process's cancel requests, rid → request (A-21).
    pub fn cancel(&self, process: &str) -> String {
        self.locket_with("cancel:", process)
    }
    /// `<ns>:locket:cancel_start:<rid>`: an operator's cancel of reservation `rid` before it
    /// starts, taken by its ACQUIRE (or RETURN) instead of starting it (A-21).
    pub fn cancel_start(&self, rid: &str) -> String {
        self.locket_with("cancel_start:", rid)
    }
    /// `<ns>:locket:cap:<q>`: the queue's fleet-wide concurrency cap (A-22), as the daemons'
    /// configs set it.
    pub fn cap(&self, q: &str) -> String {
        self.locket_with("cap:", q)
    }
    /// `<ns>:locket:running:<q>`: the units of a capped queue in use, one member
    /// `"<rid> <inflight key>"` per reserved job (A-22).
    pub fn running(&self, q: &str) -> String {
        self.locket_with("running:", q)
    }
    /// `<ns>:pause:`, the prefix of resque-pause's keys (A-20).
    pub fn pause_prefix(&self) -> String {
        self.resque("pause:")
    }
    /// `<ns>:pause:queue:<q>`: resque-pause's key pausing queue `q` (A-20).
    pub fn pause_queue(&self, q: &str) -> String {
        self.resque_with("pause:queue:", q)
    }
    /// `<ns>:pause:all`: pauses every queue (A-20).
    pub fn pause_every_queue(&self) -> String {
        self.resque("pause:all")
    }
    /// `<ns>:stat:processed`.
    pub fn stat_processed(&self) -> String {
        self.resque("stat:processed")
    }
    /// `<ns>:stat:processed:<id>`.
    pub fn stat_processed_by(&self, id: &str) -> String {
        self.resque_with("stat:processed:", id)
    }
    /// `<ns>:stat:failed`.
    pub fn stat_failed(&self) -> String {
        self.resque("stat:failed")
    }
    /// `<ns>:stat:failed:<id>`.
    pub fn stat_failed_by(&self, id: &str) -> String {
        self.resque_with("stat:failed:", id)
    }
    /// `<ns>:failed`: the failure list.
    pub fn failed(&self) -> String {
        self.resque("failed")
    }
    /// `<ns>:<q>_failed`: a per-queue failure list (`redis_multi_queue` backend).
    pub fn queue_failed(&self, q: &str) -> String {
        cat(&[&self.ns, ":", q, "_failed"])
    }
    /// `<ns>:failed_queues`: names of the per-queue failure lists.
    pub fn failed_queues(&self) -> String {
        self.resque("failed_queues")
    }

    /// `<ns>:locket:`, the prefix of every locket key.
    pub fn locket_prefix(&self) -> &str {
        &self.locket
    }
    /// `<ns>:locket:<key>`.
    pub fn locket(&self, key: &str) -> String {
        cat(&[&self.locket, key])
    }
    /// `<ns>:locket:inflight:<slot key>`.
    pub fn inflight(&self, slot_key: &str) -> String {
        self.locket_with("inflight:", slot_key)
    }
    /// `<ns>:locket:counter:<q>`.
    pub fn counter(&self, q: &str) -> String {
        self.locket_with("counter:", q)
    }
    /// `<ns>:locket:counter:`, for scripts that reset counters of queues they find in sets.
    pub fn counter_prefix(&self) -> String {
        self.locket("counter:")
    }
    /// `<ns>:locket:locks`: lock id → earliest holder deadline.
    pub fn locks(&self) -> String {
        self.locket("locks")
    }
    /// `<ns>:locket:lock:<id>`: token → deadline.
    pub fn lock(&self, id: &str) -> String {
        self.locket_with("lock:", id)
    }
    /// `<ns>:locket:lockinfo:<id>`: token → holder metadata.
    pub fn lockinfo(&self, id: &str) -> String {
        self.locket_with("lockinfo:", id)
    }
    /// `<ns>:locket:blocked:lock:<id>`: queues that requeued a job because of this lock.
    pub fn blocked_lock(&self, id: &str) -> String {
        self.locket_with("blocked:lock:", id)
    }
    /// `<ns>:locket:processes`: live (or not yet recovered) process ids.
    pub fn processes(&self) -> String {
        self.locket("processes")
    }
    /// `<ns>:locket:alive:<process id>`: the liveness lease.
    pub fn alive(&self, process: &str) -> String {
        self.locket_with("alive:", process)
    }
    /// `<ns>:locket:slots:<process id>`: slot number → Resque worker id.
    pub fn slots(&self, process: &str) -> String {
        self.locket_with("slots:", process)
    }
    /// `<ns>:locket:handlers:<process id>`: the process's persistent handler processes, as
    /// JSON, for `locketd status` (written when they change, expiring after an hour).
    pub fn handlers(&self, process: &str) -> String {
        self.locket_with("handlers:", process)
    }
    /// `<ns>:locket:janitor`: the janitor mutex.
    pub fn janitor(&self) -> String {
        self.locket("janitor")
    }
    /// `<ns>:locket:plans`: class → its published plan JSON (D-3a, src/config/published.rs).
    pub fn plans(&self) -> String {
        self.locket("plans")
    }
    /// `<ns>:locket:holding_plans`: the fields of `plans` whose plan holds at enqueue (D-3a).
    pub fn holding_plans(&self) -> String {
        self.locket("holding_plans")
    }
    /// `<ns>:locket:push`: how a client calls PUSH (D-3a): `function` (its FCALL name, where
    /// Redis has FUNCTION), `sha1` and `script` (the same script, for EVALSHA and SCRIPT LOAD);
    /// and PUSH_AT (D-3b): `function_at`, `sha1_at`, `script_at`.
    pub fn push_entry(&self) -> String {
        self.locket("push")
    }
    /// `<ns>:locket:deps`: hold name → earliest field deadline.
    pub fn deps(&self) -> String {
        self.locket("deps")
    }
    /// `<ns>:locket:dep:<name>`: digest → `"<count>:<deadline ms>"`.
    pub fn dep(&self, name: &str) -> String {
        self.locket_with("dep:", name)
    }
    /// `<ns>:locket:delayed`: delayed jobs by due time.
    pub fn delayed(&self) -> String {
        self.locket("delayed")
    }
    /// `<ns>:locket:attempts`: digest → delays so far.
    pub fn attempts(&self) -> String {
        self.locket("attempts")
    }
    /// `<ns>:locket:fence`: lock id → last fencing number.
    pub fn fence(&self) -> String {
        self.locket("fence")
    }
    /// `<ns>:locket:stat:<event>`: running total of an event (O-3).
    pub fn stat(&self, event: &str) -> String {
        self.locket_with("stat:", event)
    }
    /// `<ns>:locket:metrics:<epoch minute>`: per-minute event counts (O-3).
    pub fn metrics(&self, minute: u64) -> String {
        self.locket_with("metrics:", &minute.to_string())
    }
    /// `<ns>:locket:blocked:dep:<name>`: queues that requeued a job because of this hold.
    pub fn blocked_dep(&self, name: &str) -> String {
        self.locket_with("blocked:dep:", name)
    }
    /// `<ns>:locket:recoveries`: digest → crash requeues.
    pub fn recoveries(&self) -> String {
        self.locket("recoveries")
    }
}

/// The parts joined, in a string of exactly their length: key names are built on every job,
/// and `format!` costs several times as much.
fn cat(parts: &[&str]) -> String {
    let mut out = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    for p in parts {
        out.push_str(p);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // resque-protocol.md §13 item 1: every key is under the configured namespace.
    #[test]
    fn every_key_is_under_the_namespace() {
        let k = Keys::new("app");
        for key in [
            k.queues(),
            k.queue("q"),
            k.workers(),
            k.worker("h:1:q"),
            k.worker_started("h:1:q"),
            k.heartbeat(),
            k.pruning(),
            k.pause_all(),
            k.stat_processed(),
            k.stat_failed(),
            k.failed(),
            k.inflight("h:1:abc:0"),
            k.counter("q"),
            k.lock("x"),
            k.alive("p"),
        ] {
            assert!(key.starts_with("app:"), "{key}");
        }
        assert_eq!(k.queue("high"), "app:queue:high");
        assert_eq!(k.stat_processed_by("h:1:q"), "app:stat:processed:h:1:q");
        assert_eq!(k.counter("low"), "app:locket:counter:low");
    }
}
