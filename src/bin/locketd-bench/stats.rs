//! Redis-side cost: `INFO commandstats` and `INFO cpu` snapshots and their differences.

use anyhow::Result;
use std::collections::BTreeMap;

/// One snapshot.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Redis CPU seconds, used_cpu_sys + used_cpu_user.
    pub cpu_s: f64,
    /// Command → (calls, usec), commands run inside scripts included.
    pub cmds: BTreeMap<String, (u64, u64)>,
}

/// Takes a snapshot.
pub fn snapshot(conn: &mut redis::Connection) -> Result<Snapshot> {
    let cpu: String = redis::cmd("INFO").arg("cpu").query(conn)?;
    let stats: String = redis::cmd("INFO").arg("commandstats").query(conn)?;
    Ok(parse(&cpu, &stats))
}

/// Parses INFO cpu and INFO commandstats text.
pub fn parse(cpu: &str, stats: &str) -> Snapshot {
    let field = |name: &str| -> f64 {
        cpu.lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let cpu_s = field("used_cpu_sys:") + field("used_cpu_user:");
    let mut cmds = BTreeMap::new();
    for line in stats.lines() {
        let Some(rest) = line.trim().strip_prefix("cmdstat_") else {
            continue;
        };
        let Some((name, kvs)) = rest.split_once(':') else {
            continue;
        };
        let mut calls = 0;
        let mut usec = 0;
        for kv in kvs.split(',') {
            match kv.split_once('=') {
                Some(("calls", v)) => calls = v.parse().unwrap_or(0),
                Some(("usec", v)) => usec = v.parse().unwrap_or(0),
                _ => {}
            }
        }
        cmds.insert(name.to_string(), (calls, usec));
    }
    Snapshot { cpu_s, cmds }
}

/// What happened between two snapshots, less the harness's own commands.
#[derive(Debug, Clone, Default)]
pub struct Delta {
    /// Redis CPU seconds.
    pub cpu_s: f64,
    /// Command → (calls, usec) in the interval.
    pub cmds: BTreeMap<String, (u64, u64)>,
}

impl Delta {
    /// `after - before`, without INFO and without `own` (command → calls the harness made).
    pub fn between(before: &Snapshot, after: &Snapshot, own: &[(&str, u64)]) -> Delta {
        let mut cmds = BTreeMap::new();
        for (name, (calls, usec)) in &after.cmds {
            let (c0, u0) = before.cmds.get(name).copied().unwrap_or((0, 0));
            let mut calls = calls.saturating_sub(c0);
            let mut usec = usec.saturating_sub(u0);
            if name == "info" {
                continue;
            }
            if let Some((_, mine)) = own.iter().find(|(n, _)| *n == name) {
                // Take the harness's share of the time out in proportion.
                let keep = calls.saturating_sub(*mine);
                usec = (usec * keep).checked_div(calls).unwrap_or(0);
                calls = keep;
            }
            if calls > 0 {
                cmds.insert(name.clone(), (calls, usec));
            }
        }
        Delta {
            cpu_s: (after.cpu_s - before.cpu_s).max(0.0),
            cmds,
        }
    }

    /// Every command, those run inside scripts included.
    pub fn total_calls(&self) -> u64 {
        self.cmds.values().map(|(c, _)| c).sum()
    }

    /// Script calls (EVALSHA, EVAL, FCALL).
    pub fn script_calls(&self) -> u64 {
        ["evalsha", "eval", "fcall"]
            .iter()
            .filter_map(|n| self.cmds.get(*n))
            .map(|(c, _)| c)
            .sum()
    }

    /// `name calls/job (usec/call)` for the commands that cost most, largest first.
    pub fn breakdown(&self, jobs: u64, top: usize) -> String {
        self.breakdown_per(jobs.max(1) as f64, "job", top)
    }

    /// `name calls/<unit> (usec/call)` with calls divided by `denom`, largest first.
    pub fn breakdown_per(&self, denom: f64, unit: &str, top: usize) -> String {
        let mut v: Vec<_> = self.cmds.iter().collect();
        v.sort_by_key(|(_, (calls, _))| std::cmp::Reverse(*calls));
        v.iter()
            .take(top)
            .map(|(n, (c, u))| {
                format!(
                    "{n} {:.2}/{unit} ({:.1} us/call)",
                    *c as f64 / denom.max(1e-9),
                    *u as f64 / (*c).max(1) as f64
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_info_and_subtracts_the_harness_share() {
        let a = parse(
            "used_cpu_sys:1.5\r\nused_cpu_user:0.5\r\n",
            "cmdstat_get:calls=10,usec=100,usec_per_call=10.00\r\ncmdstat_info:calls=3,usec=9\r\n",
        );
        let b = parse(
            "used_cpu_sys:2.5\r\nused_cpu_user:1.0\r\n",
            "cmdstat_get:calls=30,usec=300,usec_per_call=10.00\r\n\
             cmdstat_evalsha:calls=4,usec=40\r\ncmdstat_info:calls=9,usec=20\r\n",
        );
        let d = Delta::between(&a, &b, &[("get", 10)]);
        assert!((d.cpu_s - 1.5).abs() < 1e-9);
        assert_eq!(d.cmds["get"], (10, 100));
        assert_eq!(d.script_calls(), 4);
        assert_eq!(d.total_calls(), 14);
        assert!(!d.cmds.contains_key("info"));
    }
}
