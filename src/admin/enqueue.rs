//! `locketd enqueue QUEUE CLASS [ARG_JSON...] [--at TIME | --in DURATION]`: one push through
//! PUSH (D-3a), or PUSH_AT for a delayed one (D-3b), as the Rust client makes it.

use super::*;

impl Admin {
    pub(super) async fn enqueue(
        &mut self,
        a: &EnqueueArgs,
        config: &Config,
    ) -> anyhow::Result<ExitCode> {
        let (Some(queue), Some(class)) = (&a.queue, &a.class) else {
            bail!("enqueue needs QUEUE and CLASS");
        };
        let mut client = Client::with_connection(self.conn.clone(), config)?;
        // D-3b: a delayed push places its holds now, through PUSH_AT; a time not in the
        // future pushes at once, as `enqueue_at` does (SC-2).
        let done = match schedule::delayed_at(a)? {
            Some(ts) => client.enqueue_json_at(queue, class, &a.args, ts).await?,
            None => client.enqueue_json(queue, class, &a.args).await?,
        };
        if let (Some(ts), false) = (done.scheduled_at, a.json) {
            if done.pushed {
                println!("scheduled {class} on {queue} at {ts} (delayed:{ts})");
                for h in &done.holds {
                    println!("hold added: {h}");
                }
            } else {
                println!("not scheduled: the unique key of this {class} job is taken");
            }
        } else if a.json {
            let mut out = json!({
                "queue": queue,
                "payload": done.payload,
                "digest": done.digest,
                "holds": done.holds,
                "queue_length": done.queue_length,
                "pushed": done.pushed,
            });
            if let Some(ts) = done.scheduled_at {
                out["at"] = json!(ts);
                out["item"] = json!(done.payload);
            }
            print_json(&out);
        } else if !done.pushed {
            println!(
                "not pushed: the unique key of this {class} job is taken (queue length {})",
                done.queue_length
            );
        } else {
            println!(
                "enqueued {class} on {queue} (length {}), digest {}",
                done.queue_length,
                &done.digest[..12]
            );
            for h in &done.holds {
                println!("hold added: {h}");
            }
        }
        Ok(ExitCode::SUCCESS)
    }
}
