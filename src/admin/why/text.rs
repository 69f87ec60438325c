//! `locketd why`'s text: where the job is, then one line per reason with its owner and the
//! earliest time it can change (UTC clock times, and how far from now).

use super::{Place, Reason, Why};
use crate::admin::{clock_ms, human_ms};
use serde_json::Value;
use std::fmt::Write as _;

/// `12:00:03.250 (in 4.2s)`, or `12:00:03.250 (1.0s ago)`.
fn at(ms: u64, now: u64) -> String {
    if ms >= now {
        format!("{} (in {})", clock_ms(ms), human_ms((ms - now) as i64))
    } else {
        format!("{} ({} ago)", clock_ms(ms), human_ms((now - ms) as i64))
    }
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "?".into(),
        other => other.to_string(),
    }
}

/// The place, as one line.
pub fn place_line(why: &Why) -> String {
    let now = why.now_ms;
    match &why.place {
        Place::Queued { position, length } => {
            format!("queued: position {position} of {length} ({position} job(s) ahead of it)")
        }
        Place::Delayed {
            until_ms,
            reason,
            resource,
            attempt,
        } => format!(
            "delayed until {} (after a {} conflict on {}, attempt {}); then back to the tail \
             of its queue",
            at(*until_ms, now),
            s(reason),
            s(resource),
            s(attempt)
        ),
        Place::Parked {
            resource,
            position,
            parked,
            parked_at_ms,
            next_check_ms,
        } => {
            let mut t = format!(
                "parked on {resource}: position {position} of {parked} ({position} ahead), \
                 since {}",
                at(*parked_at_ms, now)
            );
            if let Some(due) = next_check_ms {
                let _ = write!(t, "; next checked at {}", at(*due, now));
            }
            t
        }
        Place::Reserved {
            step,
            worker,
            host,
            since_ms,
        } => format!(
            "{step}: held by worker {worker} on {host} since {}, not started",
            at(*since_ms, now)
        ),
        Place::Running {
            worker,
            host,
            since_ms,
            locks,
        } => format!(
            "running on worker {worker} on {host} since {}, holding {}",
            at(*since_ms, now),
            locks
        ),
        Place::Failed {
            list,
            index,
            failed_at,
            exception,
            error,
            worker,
        } => format!(
            "failed at {} on {}: {}: {} ({list} index {index})",
            s(failed_at),
            s(worker),
            s(exception),
            s(error)
        ),
        Place::NotFound { .. } => "not found".into(),
    }
}

/// One reason, as one line (holders on lines of their own).
pub fn reason_lines(r: &Reason, now: u64) -> Vec<String> {
    match r {
        Reason::Lock {
            lock_id,
            limit,
            holders,
            parked,
            until_ms,
        } => {
            let mut out = vec![format!(
                "lock {lock_id} is full (limit {limit}, {} holder(s), {parked} job(s) parked \
                 on it){}",
                holders.len(),
                until_ms.map_or(String::new(), |u| format!(
                    "; the first lease ends at {}",
                    at(u, now)
                ))
            )];
            for h in holders {
                if h.handoff {
                    out.push(format!(
                        "    kept for a job woken from its parked list (queue {}), until {}",
                        s(&h.queue),
                        at(h.lease_end_ms, now)
                    ));
                    continue;
                }
                out.push(format!(
                    "    held by {} on {} ({} from {}) since {}, lease ends {}, token {}",
                    s(&h.worker),
                    h.host.as_deref().unwrap_or("?"),
                    s(&h.class),
                    s(&h.queue),
                    h.since_ms.map_or("?".into(), |t| at(t, now)),
                    at(h.lease_end_ms, now),
                    h.token
                ));
            }
            out
        }
        Reason::Hold {
            name,
            fields,
            until_ms,
        } => {
            let mut out = vec![format!(
                "hold {name} is live{}",
                until_ms.map_or(String::new(), |u| format!(
                    " until {} at the latest",
                    at(u, now)
                ))
            )];
            for f in fields {
                let owners: Vec<String> = f
                    .owners
                    .iter()
                    .map(|o| {
                        format!(
                            "{} ({}, {})",
                            s(&o["worker"]),
                            s(&o["class"]),
                            s(&o["state"])
                        )
                    })
                    .collect();
                out.push(format!(
                    "    placed by digest {} (count {}{}), expires {}; {}",
                    &f.digest[..f.digest.len().min(12)],
                    f.count,
                    if f.own { ", this job's own" } else { "" },
                    at(f.deadline_ms, now),
                    if owners.is_empty() {
                        "no worker holds a job of that digest now (queued, failed, or \
                         finished without success)"
                            .to_string()
                    } else {
                        format!("held by {}", owners.join(", "))
                    }
                ));
            }
            out
        }
        Reason::Rate {
            key,
            limit,
            period_ms,
            used,
            closed_until_ms,
            until_ms,
        } => vec![format!(
            "rate {key}: {used} of {limit} starts per {} used{}; next start allowed at {}",
            human_ms(*period_ms as i64),
            closed_until_ms.map_or(String::new(), |c| format!(
                ", closed by a handler's back-off until {}",
                at(c, now)
            )),
            at(*until_ms, now)
        )],
        Reason::Paused { scope, key } => vec![if scope == "*" {
            format!("every queue is paused ({key}) until an operator resumes it")
        } else {
            format!("queue {scope} is paused ({key}) until an operator resumes it")
        }],
        Reason::Cap {
            queue,
            cap,
            running,
            units,
        } => {
            let mut out = vec![format!(
                "queue {queue} is at its cap: {running} of {cap} units held; one frees when \
                 one of these jobs ends"
            )];
            for u in units {
                out.push(format!("    rid {} on {}", s(&u["rid"]), s(&u["worker"])));
            }
            out
        }
        Reason::Skipped {
            queue,
            counter,
            length,
            until_ms,
        } => vec![format!(
            "queue {queue} is skipped: its lock counter {counter} has reached its length \
             {length} (every job in it waits on a lock){}",
            until_ms.map_or(String::new(), |u| format!(
                "; the counter expires at {}",
                at(u, now)
            ))
        )],
        Reason::NoWorker { queue, processes } => vec![format!(
            "no live locketd worker works queue {queue} ({processes} live process(es) work \
             other queues)"
        )],
        Reason::HandlerNotReady {
            handler,
            slots,
            last_error,
            until_ms,
        } => vec![format!(
            "handler {handler} is ready on none of its {slots} slot(s): its jobs go back to \
             the tail of the queue{}{}",
            if last_error.is_empty() {
                String::new()
            } else {
                format!("; last error: {last_error}")
            },
            until_ms.map_or(String::new(), |u| format!("; next boot at {}", at(u, now)))
        )],
    }
}

/// The whole answer.
pub fn render(why: &Why) -> String {
    let mut out = String::new();
    if let Some(j) = &why.job {
        let _ = write!(out, "job {} {} on queue {}", j.class, j.args, j.queue);
        if let Some(rid) = &j.rid {
            let _ = write!(out, ", rid {rid}");
        }
        if let Some(d) = &j.digest {
            let _ = write!(out, ", digest {}", &d[..d.len().min(12)]);
        }
        out.push('\n');
    }
    let _ = writeln!(out, "{}", place_line(why));
    if let Place::NotFound { searched } = &why.place {
        for place in searched {
            let _ = writeln!(out, "  looked in {place}");
        }
    }
    let waits = matches!(
        why.place,
        Place::Queued { .. }
            | Place::Delayed { .. }
            | Place::Parked { .. }
            | Place::Reserved { .. }
    );
    if waits && why.reasons.is_empty() {
        out.push_str("nothing holds it back now: a worker of its queue takes it in turn\n");
    } else if !why.reasons.is_empty() {
        out.push_str("waiting because:\n");
        for r in &why.reasons {
            for (i, line) in reason_lines(r, why.now_ms).into_iter().enumerate() {
                let lead = if i == 0 { "  - " } else { "  " };
                let _ = writeln!(out, "{lead}{line}");
            }
        }
    }
    if let Some(u) = &why.unique {
        let _ = writeln!(
            out,
            "unique key {} is taken by {}{}: a push of the same key is refused until then",
            u.key,
            if u.own {
                "this payload"
            } else {
                "another payload"
            },
            u.until_ms
                .map_or(String::new(), |t| format!(" until {}", at(t, why.now_ms)))
        );
    }
    for n in &why.notes {
        let _ = writeln!(out, "note: {n}");
    }
    out
}
