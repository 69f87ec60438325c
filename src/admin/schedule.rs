//! `locketd schedule` and `locketd enqueue --at/--in`: resque-scheduler's delayed items and
//! recurring schedules from the command line (scheduler-protocol.md §5).

use super::*;

/// The Unix second `--at` or `--in` names, if either is given.
pub(super) fn delayed_at(a: &EnqueueArgs) -> anyhow::Result<Option<i64>> {
    if let Some(at) = &a.at {
        if let Ok(n) = at.trim().parse::<i64>() {
            return Ok(Some(n));
        }
        let t = chrono::DateTime::parse_from_rfc3339(at.trim())
            .with_context(|| format!("--at {at:?}: not Unix seconds nor RFC 3339"))?;
        return Ok(Some(t.timestamp()));
    }
    if let Some(d) = &a.in_ {
        let d = crate::config::parse_duration(d).map_err(|e| anyhow::anyhow!("--in: {e}"))?;
        return Ok(Some(
            crate::scheduler::unix_now() + d.as_secs_f64().ceil() as i64,
        ));
    }
    Ok(None)
}

impl Admin {
    pub(super) async fn schedule(
        &mut self,
        a: &ScheduleArgs,
        config: &Config,
    ) -> anyhow::Result<ExitCode> {
        use crate::scheduler::ops;
        if let Some(ScheduleAction::Run { name }) = &a.action {
            if !ops::run_now(&mut self.conn, config, name).await? {
                eprintln!("locketd: no [schedule.{name:?}] in the config");
                return Ok(ExitCode::from(2));
            }
            if a.json {
                print_json(&json!({"schedule": name, "enqueued": true}));
            } else {
                println!("enqueued one tick of {name}");
            }
            return Ok(ExitCode::SUCCESS);
        }
        let now = crate::scheduler::unix_now();
        let l = ops::listing(&mut self.conn, config, now).await?;
        if a.json {
            print_json(&serde_json::to_value(&l)?);
            return Ok(ExitCode::SUCCESS);
        }
        match &l.lock_holder {
            Some(h) => println!(
                "scheduler lock {} held by {h} (ttl {}s)",
                l.lock_key, l.lock_ttl
            ),
            None => println!("scheduler lock {} is free: no scheduler runs", l.lock_key),
        }
        let stamp = |t: i64| {
            crate::resque::time::started_at(
                std::time::UNIX_EPOCH + std::time::Duration::from_secs(t.max(0) as u64),
            )
        };
        let rows: Vec<Vec<String>> = l
            .schedules
            .iter()
            .map(|s| {
                vec![
                    s.name.clone(),
                    s.when.clone(),
                    format!("{} on {}", s.class, s.queue),
                    s.next.map_or("-".into(), |t| {
                        format!("{} (in {})", stamp(t), human_ms((t - now) * 1000))
                    }),
                    s.last_enqueued_at.clone().unwrap_or("-".into()),
                    s.description.clone().unwrap_or_default(),
                ]
            })
            .collect();
        if rows.is_empty() {
            println!("no [schedule.*] tables in the config");
        } else {
            table(
                &[
                    "NAME",
                    "WHEN",
                    "JOB",
                    "NEXT",
                    "LAST ENQUEUED",
                    "DESCRIPTION",
                ],
                &rows,
            );
        }
        Ok(ExitCode::SUCCESS)
    }
}
