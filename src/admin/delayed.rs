//! `locketd delayed`: the jobs the `delay` conflict policy put in `<ns>:locket:delayed` (P-4),
//! listed, or one promoted to its queue now.

use super::*;

impl Admin {
    async fn delayed_members(&mut self) -> anyhow::Result<Vec<(String, i64, Value)>> {
        let raw: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(self.keys.delayed())
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut self.conn)
            .await?;
        Ok(raw
            .into_iter()
            .map(|(m, s)| {
                let v = serde_json::from_str(&m).unwrap_or(Value::Null);
                (m, s as i64, v)
            })
            .collect())
    }

    pub(super) async fn delayed(&mut self, a: &DelayedArgs) -> anyhow::Result<ExitCode> {
        if let Some(DelayedAction::Promote { rid }) = &a.action {
            let members = self.delayed_members().await?;
            let Some((m, ..)) = members.iter().find(|(_, _, v)| v["rid"] == rid.as_str()) else {
                eprintln!("locketd: no delayed job with rid {rid}");
                return Ok(ExitCode::from(1));
            };
            let n = store::promote_delayed(&mut self.conn, &self.keys, 1, Some(m)).await?;
            println!("promoted {n} job(s)");
            return Ok(if n > 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            });
        }
        let out = read_delayed(&mut self.conn, &self.keys, a.queue.as_deref(), usize::MAX)
            .await?
            .rows;
        let rows: Vec<Vec<String>> = out
            .iter()
            .map(|r| {
                let s = |k: &str| r[k].as_str().unwrap_or("").to_string();
                vec![
                    s("rid"),
                    s("queue"),
                    s("class"),
                    format!("{}:{}", s("reason"), s("resource")),
                    r["attempt"].to_string(),
                    human_ms(r["due_in_ms"].as_i64().unwrap_or(0).max(0)),
                ]
            })
            .collect();
        if a.json {
            print_json(&Value::Array(out));
        } else if rows.is_empty() {
            println!("no delayed jobs");
        } else {
            table(
                &["RID", "QUEUE", "CLASS", "RESOURCE", "ATTEMPT", "DUE IN"],
                &rows,
            );
        }
        Ok(ExitCode::SUCCESS)
    }
}
