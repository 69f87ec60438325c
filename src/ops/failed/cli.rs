//! `locketd failed`: the operator's view of the failure list(s), and retries and removals
//! by index or by filter.

use super::*;

/// Renders `list` output.
pub fn render(len: u64, list: &FailedList, rows: &[Summary]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {len} failure(s){}",
        list.name,
        if (rows.len() as u64) < len {
            format!(", newest {} shown", rows.len())
        } else {
            String::new()
        }
    );
    for s in rows {
        let o = |v: &Option<String>| v.clone().unwrap_or_else(|| "?".into());
        let _ = writeln!(
            out,
            "[{}] {}  {} on {}  {}: {}\n      worker {}{}",
            s.index,
            o(&s.failed_at),
            o(&s.class),
            o(&s.queue),
            o(&s.exception),
            clip(&o(&s.error), 100),
            o(&s.worker),
            s.retried_at
                .as_ref()
                .map(|r| format!("  (retried {r})"))
                .unwrap_or_default()
        );
    }
    out
}

/// `locketd failed …` (clap subcommand).
#[derive(Debug, Clone, clap::Args)]
pub struct FailedArgs {
    /// With failure_backend = "redis_multi_queue": the queue whose `<Q>_failed` list to use.
    #[arg(long, global = true, value_name = "Q", value_parser = crate::ops::queue_name)]
    pub failed_queue: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub action: FailedAction,
}

/// The `failed` actions.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum FailedAction {
    /// List failures, newest first, with Resque's index (0 = oldest).
    List {
        /// Show at most N (0 = all).
        #[arg(long, default_value_t = 50, value_name = "N")]
        limit: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print failure N's record, verbatim JSON.
    Show {
        /// Resque's index.
        index: u64,
    },
    /// Requeue failures as Resque does: mark retried_at, push {class,args} back to the queue.
    Retry {
        /// Resque's index.
        #[arg(required_unless_present_any = ["all", "class", "queue"], conflicts_with_all = ["all", "class", "queue"])]
        index: Option<u64>,
        /// Every failure in the list.
        #[arg(long, conflicts_with_all = ["class", "queue"])]
        all: bool,
        /// Every failure of this class.
        #[arg(long, value_name = "C")]
        class: Option<String>,
        /// Every failure from this queue.
        #[arg(long, value_name = "Q", value_parser = crate::ops::queue_name)]
        queue: Option<String>,
    },
    /// Remove failure N (Resque's remove; indexes after it shift down by one).
    Remove {
        /// Resque's index.
        index: u64,
    },
    /// Delete the whole failure list (Resque's clear).
    Clear,
}

/// Runs `locketd failed …`. Exit 0, 1 on a bad index or a record that cannot be retried, 69
/// when Redis does not answer.
pub fn run_cli(config: &Config, args: &FailedArgs) -> anyhow::Result<std::process::ExitCode> {
    use std::process::ExitCode;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    if let (Some(q), FailureBackend::Redis) = (&args.failed_queue, config.failure_backend) {
        // Acting on the main list instead would be a surprise (`clear` would wipe it).
        eprintln!(
            "locketd: --failed-queue {q} needs failure_backend = \"redis_multi_queue\"; \
             with the redis backend every failure is in the one `failed` list (drop the flag)"
        );
        return Ok(ExitCode::FAILURE);
    }
    rt.block_on(async {
        let mut conn = match crate::ops::connect_or_report(config).await {
            Ok(c) => c,
            Err(code) => return Ok(code),
        };
        let keys = Keys::new(&config.namespace);
        let all_lists = lists(&mut conn, config, args.failed_queue.as_deref()).await?;
        let one = || -> anyhow::Result<FailedList> {
            match all_lists.as_slice() {
                [l] => Ok(l.clone()),
                _ => anyhow::bail!(
                    "failure_backend is redis_multi_queue: name the list with --failed-queue Q"
                ),
            }
        };
        let fail = |e: FailedError| -> anyhow::Result<ExitCode> {
            match e {
                FailedError::Redis(e) => Err(e.into()),
                other => {
                    eprintln!("locketd: {other}");
                    Ok(ExitCode::FAILURE)
                }
            }
        };
        match &args.action {
            FailedAction::List { limit, json } => {
                let mut all = Vec::new();
                for l in &all_lists {
                    let (len, rows) = list(&mut conn, l, *limit).await?;
                    if !*json {
                        print!("{}", render(len, l, &rows));
                    }
                    all.extend(rows);
                }
                if *json {
                    println!("{}", serde_json::to_string(&all)?);
                } else if all_lists.is_empty() {
                    println!("no failure lists (failed_queues is empty)");
                }
            }
            // Verbatim: re-encoding would sort the keys and could round big numbers.
            FailedAction::Show { index } => match show(&mut conn, &one()?, *index).await {
                Ok(raw) => {
                    use std::io::Write;
                    let mut out = std::io::stdout().lock();
                    out.write_all(&raw)?;
                    out.write_all(b"\n")?;
                }
                Err(e) => return fail(e),
            },
            FailedAction::Retry { index: Some(i), .. } => {
                match retry_one(&mut conn, &keys, &one()?, *i).await {
                    Ok(r) => println!("retried [{}] {} to queue {}", r.index, r.class, r.queue),
                    Err(e) => return fail(e),
                }
            }
            FailedAction::Retry { class, queue, .. } => {
                let filter = Filter {
                    class: class.clone(),
                    queue: queue.clone(),
                };
                let mut problems = 0;
                for l in &all_lists {
                    let (done, skipped) = retry_matching(&mut conn, &keys, l, &filter).await?;
                    for r in &done {
                        println!(
                            "retried {}[{}] {} to queue {}",
                            if all_lists.len() > 1 {
                                format!("{} ", l.name)
                            } else {
                                String::new()
                            },
                            r.index,
                            r.class,
                            r.queue
                        );
                    }
                    for e in &skipped {
                        eprintln!("locketd: {}: {e}", l.name);
                    }
                    problems += skipped.len();
                    println!("{}: {} retried", l.name, done.len());
                }
                if problems > 0 {
                    return Ok(ExitCode::FAILURE);
                }
            }
            FailedAction::Remove { index } => match remove(&mut conn, &one()?, *index).await {
                Ok(_) => println!("removed [{index}]"),
                Err(e) => return fail(e),
            },
            FailedAction::Clear => {
                let l = one()?;
                let n = clear(&mut conn, &l).await?;
                println!("cleared {}: {n} failure(s) deleted", l.name);
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}
