//! TAKE (locking-semantics.md A-7a): RESERVE, carrying the slot's last FINISH, and the reserved
//! job's ACQUIRE+START in one call (`take.lua`), by the worker's take plan: what each class
//! needs to be locked and started in Redis without the worker, published once per plan set.
//!
//! Layout: the hash `<ns>:locket:take:<digest>`, `digest` the SHA-256 of the plan set's
//! canonical JSON (the same settings give the same key on every host, so two versions of a
//! daemon in one rolling deploy each read their own). Fields: each class with a plan table or
//! a handler of its own, and `*` for every other class; values: a word for a class TAKE leaves
//! to the worker's own ACQUIRE (`class`: its settings or no handler; `digest`: a lock template
//! with `{digest}` or `{args_digest}`, whose SHA-256 in Lua costs Redis more than the round trip
//! it saves, the default template among them), else
//! `{"on":<conflict fallback>,"locks":[[<template>,<limit>]...]}` (`<template>` as
//! [`Template::compiled`](crate::locks::template::Template::compiled) gives it).
//! A class qualifies when its ACQUIRE needs no options (acquire.lua's ARGV[12] is empty): no
//! holds or `locked_by`, no rates, no fencing, no unique policy that follows the job, and a
//! conflict policy of `requeue`, `park` (with the default `max_parked` and `on_park_full`) or
//! `discard`; and when a handler takes it (a class without one is failed by the worker).

use super::acquire::parse_acquired;
use super::finish::finish_parts;
use super::reserve::{parse_after_finish, reserve_args, reserve_keys, ReserveFlags};
use super::scripts::scripts;
use super::{text, unexpected, AcquireOutcome, FinishHolds, FinishRequest, Reserved, SlotRef};
use crate::config::plans::{ClassPlan, Plans};
use crate::conn::evalsha;
use crate::locks::{canonical, LockSpec, Policy};
use crate::resque::keys::Keys;
use crate::resque::payload::Job;
use redis::aio::ConnectionLike;
use redis::{RedisResult, Value};
use serde_json::json;
use std::time::Duration;

/// How long a take plan lives in Redis without a worker publishing it again: a worker
/// publishes its plan at start, and again when TAKE finds it gone.
const PLAN_TTL: Duration = Duration::from_secs(30 * 86_400);

/// A worker's take plan: its key and fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakePlan {
    /// `<ns>:locket:take:<digest>`.
    pub key: String,
    /// Field (class name or `*`) and value, sorted by field.
    pub fields: Vec<(String, String)>,
}

/// Whether TAKE can lock and start jobs of a class with this plan (the module's rules).
pub fn takes_class(plan: &ClassPlan) -> bool {
    let policy_ok = plan.locks.is_empty()
        || match plan.on_conflict {
            Policy::Requeue | Policy::Discard => true,
            Policy::Park => {
                plan.max_parked == super::acquire::DEFAULT_MAX_PARKED
                    && plan.on_park_full == Policy::Requeue
            }
            Policy::Wait | Policy::Delay | Policy::Fail => false,
        };
    policy_ok
        && !plan.has_dependencies()
        && plan.rates.is_empty()
        && !plan.fencing
        && !plan.unique.as_ref().is_some_and(|u| u.policy.follows_job())
}

/// A class's entry: its JSON, or the word that says why TAKE leaves it to the worker.
fn entry(plan: &ClassPlan, handled: bool) -> String {
    if !handled || !takes_class(plan) {
        return "class".to_string();
    }
    // SHA-256 in Lua costs a job about 50 us of Redis CPU (the whole two-call job path costs
    // about 90): more than the round trip it saves (docs/dev/performance-log.md, issue 40).
    if plan.locks.iter().any(|(t, _)| t.needs_digest()) {
        return "digest".to_string();
    }
    let locks: Vec<_> = plan
        .locks
        .iter()
        .map(|(t, limit)| json!([t.compiled(), limit]))
        .collect();
    json!({"on": plan.on_conflict.script_word(), "locks": locks}).to_string()
}

impl TakePlan {
    /// Whether the plan takes any class in one call (else TAKE is not worth sending).
    pub fn takes_any(&self) -> bool {
        self.fields.iter().any(|(_, v)| v.starts_with('{'))
    }

    /// The take plan of a worker with these plans and handlers: `handled` the classes with a
    /// handler of their own, `fallback` whether the others have one (`Handlers::classes`,
    /// `Handlers::has_fallback`).
    pub fn new<'a>(keys: &Keys, plans: &'a Plans, handled: &[&'a str], fallback: bool) -> TakePlan {
        let mut classes: Vec<&str> = plans
            .fields()
            .map(|(f, _)| f)
            .filter(|f| !f.is_empty() && *f != "*")
            .chain(handled.iter().copied())
            .collect();
        classes.sort_unstable();
        classes.dedup();
        let mut fields: Vec<(String, String)> = classes
            .into_iter()
            .map(|c| {
                let has = fallback || handled.contains(&c);
                (c.to_string(), entry(plans.get(c), has))
            })
            .collect();
        // Any class named nowhere: the "*" table (else the defaults) and the fallback handler.
        // (A class literally named "*" is that table.)
        fields.retain(|(c, _)| c != "*");
        let other = entry(plans.get("\u{0}"), fallback);
        fields.push(("*".to_string(), other));
        fields.sort();
        let body = serde_json::Value::from(
            fields
                .iter()
                .map(|(f, v)| json!([f, v]))
                .collect::<Vec<_>>(),
        );
        let digest = canonical::sha256_hex(canonical::canonical_json(&body).as_bytes());
        TakePlan {
            key: keys.locket(&format!("take:{digest}")),
            fields,
        }
    }
}

/// Writes the take plan to Redis (and its expiry).
pub async fn publish_take_plan<C: ConnectionLike + Send>(
    conn: &mut C,
    plan: &TakePlan,
) -> RedisResult<()> {
    let mut p = redis::pipe();
    p.atomic();
    let hset = p.cmd("HSET").arg(&plan.key);
    for (f, v) in &plan.fields {
        hset.arg(f).arg(v);
    }
    p.ignore();
    p.cmd("PEXPIRE")
        .arg(&plan.key)
        .arg(u64::try_from(PLAN_TTL.as_millis()).unwrap_or(u64::MAX))
        .ignore();
    p.query_async(conn).await
}

/// What TAKE is given besides RESERVE's and FINISH's own arguments.
#[derive(Debug, Clone)]
pub struct TakeArgs<'a> {
    /// The take plan's key.
    pub plan_key: &'a str,
    /// The lock token of the step's jobs.
    pub token: &'a str,
    /// lock_ttl.
    pub lock_ttl: Duration,
    /// counter_ttl.
    pub counter_ttl: Duration,
    /// The holder's lockinfo fields, a JSON object without its closing brace.
    pub lockinfo_head: &'a str,
    /// Resque's run_at text for the working-on record.
    pub run_at: &'a str,
    /// The worker's node-resque name as a JSON string, for the same record.
    pub node_worker: &'a str,
    /// The largest payload the worker decodes.
    pub max_payload: usize,
    /// Sent again after a call whose reply never came (the same rid and token).
    pub resent: bool,
    /// The first reservation's rid; the k-th's is [`take_rid`]`(rid, k)`.
    pub rid: &'a str,
    /// The most reservations the step may make: the first, and one per job settled away.
    pub reservations: usize,
}

/// The rid of a TAKE's `k`-th reservation (from 1), made from the first's as take.lua makes
/// it: the first 16 hex digits of the SHA1 of `"<first>/<k>"` (A-7a). The worker sends only
/// the first.
pub fn take_rid(first: &str, k: usize) -> String {
    if k <= 1 {
        return first.to_string();
    }
    let mut hex = canonical::sha1_hex(format!("{first}/{k}").as_bytes());
    hex.truncate(16);
    hex
}

/// What TAKE did with the job it left in the slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Taken {
    /// ACQUIRE ran: its outcome, the digest it computed ("" when it needed none) and the locks
    /// it rendered.
    Acquired {
        /// ACQUIRE's reply.
        outcome: AcquireOutcome,
        /// The payload digest ACQUIRE computed, or "" (a start on free limit-1 locks).
        digest: String,
        /// The locks rendered from the plan.
        locks: Vec<LockSpec>,
    },
    /// The job stays reserved for the worker's own ACQUIRE: why ("no_plan", "class",
    /// "digest", "size", "payload", "render", "error", "started").
    Kept(String),
}

/// A job TAKE reserved and settled away by its class's conflict policy, before the slot's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettledAway {
    /// Its queue.
    pub queue: String,
    /// Its class.
    pub class: String,
    /// Its payload digest.
    pub digest: String,
    /// Its reservation id.
    pub rid: String,
    /// ACQUIRE's reply (a conflict).
    pub outcome: AcquireOutcome,
}

/// TAKE's reply.
#[derive(Debug)]
pub struct TakeReply {
    /// FINISH's answer (whether it found its reservation), when one was carried.
    pub finished: Option<bool>,
    /// The slot's last RESERVE.
    pub reserved: RedisResult<Reserved>,
    /// What became of the reserved job, when there is one.
    pub taken: Option<Taken>,
    /// The jobs settled away before it.
    pub settled: Vec<SettledAway>,
}

fn parse_taken(v: Value) -> RedisResult<Option<Taken>> {
    let parts = match v {
        Value::Nil | Value::Boolean(false) => return Ok(None),
        Value::Array(a) => a,
        other => return unexpected("take", &other),
    };
    match parts.first().map(text).as_deref() {
        Some("kept") => Ok(Some(Taken::Kept(
            parts.get(1).map(text).unwrap_or_default(),
        ))),
        Some("acquired") if parts.len() >= 3 && (parts.len() - 3).is_multiple_of(2) => {
            let mut it = parts.into_iter().skip(1);
            let outcome = match it.next() {
                Some(Value::Array(r)) => parse_acquired(r)?,
                Some(other) => return unexpected("take", &other),
                None => return unexpected("take", &Value::Nil),
            };
            let digest = it.next().map(|v| text(&v)).unwrap_or_default();
            let rest: Vec<Value> = it.collect();
            let locks = rest
                .chunks(2)
                .map(|c| LockSpec {
                    id: text(&c[0]),
                    limit: text(&c[1]).parse().unwrap_or(1),
                })
                .collect();
            Ok(Some(Taken::Acquired {
                outcome,
                digest,
                locks,
            }))
        }
        _ => unexpected("take", &Value::Array(parts)),
    }
}

fn parse_settled(v: Value) -> RedisResult<Vec<SettledAway>> {
    let Value::Array(list) = v else {
        return Ok(Vec::new());
    };
    list.into_iter()
        .map(|e| match e {
            Value::Array(mut f) if f.len() == 6 => {
                let outcome = match f.pop() {
                    Some(Value::Array(r)) => parse_acquired(r)?,
                    _ => return unexpected("take", &Value::Nil),
                };
                let (queue, class) = (text(&f[0]), text(&f[1]));
                let mut digest = text(&f[2]);
                if digest.is_empty() {
                    // A park sends the payload in its place (PK-3 keys the unit by the
                    // payload's SHA1): the digest is the worker's, for its log line.
                    let payload = match &f[4] {
                        Value::BulkString(b) => b.as_slice(),
                        _ => &[],
                    };
                    if let Ok(job) = Job::decode(payload, &queue, 0) {
                        digest = canonical::digest(&job.class, &job.args);
                    }
                }
                Ok(SettledAway {
                    queue,
                    class,
                    digest,
                    rid: text(&f[3]),
                    outcome,
                })
            }
            other => unexpected("take", &other),
        })
        .collect()
}

/// TAKE: RESERVE from `queues` (carrying `finish`, the slot's last FINISH, when given) and
/// the reserved job's ACQUIRE+START by the take plan. An `Ok` with a FINISH means the FINISH
/// landed (as [`super::finish_and_reserve`] says).
pub async fn take<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    finish: Option<(&FinishRequest<'_>, &FinishHolds<'_>)>,
    queues: &[String],
    flags: ReserveFlags,
    args: &TakeArgs<'_>,
) -> RedisResult<TakeReply> {
    let rid = args.rid;
    let fparts = finish.map(|(req, holds)| finish_parts(slot, req, holds));
    let nkeys = 2 + fparts.as_ref().map_or(0, |(k, _)| k.len());
    let reply: Value = evalsha(conn, &scripts().direct.take, nkeys + 1, |cmd| {
        if let Some((fk, _)) = &fparts {
            for k in fk {
                cmd.arg(k.as_str());
            }
        }
        reserve_keys(cmd, slot);
        cmd.arg(args.plan_key);
        let nargs = 6 + queues.len() + fparts.as_ref().map_or(0, |(_, a)| 2 + a.len());
        cmd.arg(if fparts.is_some() {
            "finish_reserve"
        } else {
            "reserve"
        })
        .arg(nkeys)
        .arg(nargs);
        if let Some((fk, fa)) = &fparts {
            cmd.arg(fk.len()).arg(fa.len());
            for a in fa {
                cmd.arg(a.as_str());
            }
        }
        reserve_args(cmd, slot, rid, queues, flags);
        cmd.arg(args.token)
            .arg(super::ms(args.lock_ttl))
            .arg(super::ms(args.counter_ttl))
            .arg(args.lockinfo_head)
            .arg(args.run_at)
            .arg(args.node_worker)
            .arg(args.max_payload)
            .arg(if args.resent { "1" } else { "0" })
            .arg(args.reservations);
    })
    .await?;
    let Value::Array(reply) = reply else {
        return unexpected("take", &reply);
    };
    let Ok([finished, reserved, taken, settled]) = <[Value; 4]>::try_from(reply) else {
        return unexpected("take", &Value::Nil);
    };
    let finished = match finished {
        Value::Nil | Value::Boolean(false) => None,
        v => Some(text(&v) == "ok"),
    };
    let reserved = match reserved {
        Value::Array(r) => parse_after_finish(r),
        other => unexpected("take", &other),
    };
    Ok(TakeReply {
        finished,
        reserved,
        taken: parse_taken(taken)?,
        settled: parse_settled(settled)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn plan_of(text: &str) -> TakePlan {
        let config = Config::parse(&format!("queues = \"q\"\n{text}"), "t").expect("config");
        let plans = Plans::compile(&config).expect("plans");
        let handlers = crate::handler::Handlers::from_config(&config);
        let handled: Vec<&str> = handlers.classes().collect();
        TakePlan::new(
            &Keys::new("resque"),
            &plans,
            &handled,
            handlers.has_fallback(),
        )
    }

    fn field<'a>(p: &'a TakePlan, name: &str) -> &'a str {
        &p.fields.iter().find(|(f, _)| f == name).expect(name).1
    }

    // A-7a: which classes TAKE locks in one call, and the word for the others.
    #[test]
    fn the_take_plan_names_each_class_and_why_one_is_left_to_two_calls() {
        let p = plan_of(
            "[classes.Free]\nbuiltin = \"noop\"\nlock = \"acct:{args[0]}\"\nlimit = 3\n\
             [classes.Digest]\nbuiltin = \"noop\"\n\
             [classes.Delay]\nbuiltin = \"noop\"\nlock = \"a:{args[0]}\"\non_conflict = \"delay\"\n\
             [classes.Held]\nbuiltin = \"noop\"\nlock = \"a:{args[0]}\"\nholds = [{ name = \"h\" }]\n\
             [classes.Unlocked]\nbuiltin = \"noop\"\nlock = false\n\
             [classes.NoHandler]\nlock = \"a:{args[0]}\"\n",
        );
        let free: serde_json::Value = serde_json::from_str(field(&p, "Free")).expect("JSON");
        assert_eq!(free["on"], "park");
        assert_eq!(free["locks"][0][1], 3);
        assert_eq!(free["locks"][0][0]["src"], "acct:{args[0]}");
        assert_eq!(field(&p, "Digest"), "digest");
        assert_eq!(field(&p, "Delay"), "class");
        assert_eq!(field(&p, "Held"), "class");
        assert_eq!(field(&p, "NoHandler"), "class");
        let unlocked: serde_json::Value =
            serde_json::from_str(field(&p, "Unlocked")).expect("JSON");
        assert_eq!(unlocked["locks"], serde_json::json!([]));
        // No fallback handler: a class named nowhere is failed by the worker, never locked.
        assert_eq!(field(&p, "*"), "class");
        assert!(p.takes_any());
        assert!(p.key.starts_with("resque:locket:take:"));
        // The key follows the settings: another limit, another key; the same, the same key.
        let q =
            plan_of("[classes.Free]\nbuiltin = \"noop\"\nlock = \"acct:{args[0]}\"\nlimit = 2\n");
        assert_ne!(q.key, p.key);
        assert_eq!(
            q.key,
            plan_of("[classes.Free]\nlock = \"acct:{args[0]}\"\nbuiltin = \"noop\"\nlimit = 2\n")
                .key
        );
        // Only default templates: nothing to take in one call.
        assert!(!plan_of("[classes.A]\nbuiltin = \"noop\"\n").takes_any());
    }
}
