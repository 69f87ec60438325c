//! The start-up check (C-1, C-2): every setting a worker relies on, refused with a message
//! that names it, before any process starts.

use super::{invalid, plans, Builtin, Config, ConfigError, HandlerMode, Secs, BUILTIN_NAMES};
use std::time::Duration;

impl Config {
    /// Rejects what C-1 rejects; returns the warnings (C-2 and friends) to log once logging is up.
    pub fn check(&self) -> Result<Vec<String>, ConfigError> {
        let mut warnings = Vec::new();
        if self.namespace.is_empty() || self.namespace.contains(char::is_whitespace) {
            return Err(invalid("namespace", "must be non-empty, without spaces"));
        }
        if let (Some(h), Some(m)) = (&self.http, &self.metrics) {
            if h != m {
                return Err(invalid(
                    "http",
                    format!("{h:?} and metrics {m:?} name one listener: set one of them"),
                ));
            }
        }
        if let Some(addr) = self.listen() {
            let setting = if self.http.is_some() {
                "http"
            } else {
                "metrics"
            };
            let port = addr.rsplit_once(':').map(|(h, p)| (h, p.parse::<u16>()));
            let Some((host, Ok(_))) = port.filter(|(h, _)| !h.is_empty()) else {
                return Err(invalid(
                    setting,
                    format!("{addr:?} is not host:port (e.g. \"127.0.0.1:9187\")"),
                ));
            };
            if !is_loopback(host) {
                warnings.push(format!(
                    "{setting} = {addr:?} is not a loopback address: /metrics, the web page and \
                     its API are reachable from other hosts (the page shows queue, class and \
                     lock names)"
                ));
            }
        }
        for entry in &self.http_allowed_hosts {
            super::hosts::HostPort::parse(entry.trim()).map_err(|e| {
                invalid(
                    "http_allowed_hosts",
                    format!("{e} (e.g. \"metrics.example.com\" or \"10.0.0.5:9187\")"),
                )
            })?;
        }
        if self
            .http_admin_token
            .as_ref()
            .is_some_and(|t| t.0.trim().len() < 16)
        {
            return Err(invalid(
                "http_admin_token",
                "must be at least 16 characters (e.g. `openssl rand -hex 16`)",
            ));
        }
        if self.queues.0.is_empty() {
            return Err(invalid(
                "queues",
                "no queues: give --queues, QUEUES or `queues` in the config",
            ));
        }
        crate::resque::patterns::QueueSpec::from_list(&self.queues.0)
            .map_err(|e| invalid("queues", e.to_string()))?;
        // a cap of 0 would never run the queue's jobs (pause it instead).
        for (q, n) in self.queue_caps() {
            if n == 0 {
                return Err(invalid(
                    &format!("queue.{q}.concurrency"),
                    "must be at least 1 (to stop the queue, `locketd pause` it)",
                ));
            }
        }
        // Checked here too, not only when a worker starts: a HUP must refuse a bad list
        // rather than start workers that exit at once, over and over.
        if !self.locket.lock_queues.0.is_empty() {
            crate::resque::patterns::QueueSpec::from_list(&self.locket.lock_queues.0)
                .map_err(|e| invalid("locket.lock_queues", e.to_string()))?;
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log_level) {
            return Err(invalid(
                "log_level",
                format!("{:?} is not a log filter: {e}", self.log_level),
            ));
        }
        if let Err(e) = crate::conn::check_url(&self.redis) {
            return Err(invalid(
                "redis",
                format!("bad Redis URL {}: {e}", crate::conn::redact(&self.redis)),
            ));
        }
        if self.redis.ends_with("#insecure") {
            warnings.push(
                "redis: the URL ends in #insecure: TLS certificates and host names are not \
                 checked, so anyone on the path can read and change the jobs"
                    .to_string(),
            );
        }
        if self.workers == 0 || self.workers > 1024 {
            return Err(invalid(
                "workers",
                format!("{} is out of range 1..=1024", self.workers),
            ));
        }
        if self.slots == 0 || self.slots > 1024 {
            return Err(invalid(
                "slots",
                format!("{} is out of range 1..=1024", self.slots),
            ));
        }
        let l = &self.locket;
        if l.lock_ttl.get() < Duration::from_secs(1) {
            return Err(invalid(
                "locket.lock_ttl",
                format!("{} is below 1s", l.lock_ttl),
            ));
        }
        let heartbeat = Secs(l.heartbeat());
        if heartbeat.get() < Duration::from_millis(100) {
            return Err(invalid(
                "locket.heartbeat_interval",
                format!("{heartbeat} is below 100ms"),
            ));
        }
        if heartbeat >= l.lock_ttl {
            return Err(invalid(
                "locket.heartbeat_interval",
                format!(
                    "{heartbeat} must be shorter than locket.lock_ttl ({})",
                    l.lock_ttl
                ),
            ));
        }
        if l.counter_ttl.get() < Duration::from_secs(1) {
            return Err(invalid(
                "locket.counter_ttl",
                format!("{} is below 1s", l.counter_ttl),
            ));
        }
        if l.process_heartbeat.get() < Duration::from_millis(100) {
            return Err(invalid("locket.process_heartbeat", "is below 100ms"));
        }
        // It also paces the workers:heartbeat writes, which Resque wants at least every 60 s:
        // a Ruby or php worker prunes a worker whose heartbeat is 300 s old.
        if l.process_heartbeat.get() > Duration::from_secs(60) {
            return Err(invalid(
                "locket.process_heartbeat",
                format!(
                    "{} is above 60s: Resque's workers:heartbeat must be rewritten at least every minute",
                    l.process_heartbeat
                ),
            ));
        }
        if l.process_ttl.get() < l.process_heartbeat.get() * 2 {
            return Err(invalid(
                "locket.process_ttl",
                format!(
                    "{} must be at least twice locket.process_heartbeat ({})",
                    l.process_ttl, l.process_heartbeat
                ),
            ));
        }
        if l.process_ttl.get() < l.process_heartbeat.get() * 3 {
            warnings.push(format!(
                "locket.process_ttl ({}) is less than three times locket.process_heartbeat ({}): \
                 a Redis stall of about one heartbeat period makes a live worker presume itself dead",
                l.process_ttl, l.process_heartbeat
            ));
        }
        // R-4 releases a dead process's locks at once when its lease has lapsed: a lock lease
        // longer than the process lease would be cut short while its holder may only be
        // stalled, not dead.
        if l.lock_ttl > l.process_ttl {
            return Err(invalid(
                "locket.lock_ttl",
                format!(
                    "{} is longer than locket.process_ttl ({}): a worker presumed dead and \
                     recovered could still hold its locks",
                    l.lock_ttl, l.process_ttl
                ),
            ));
        }
        // The last extension of a lock may come up to one process heartbeat after the
        // process's last heartbeat: in a partition its lease can then end after the process
        // lease, and R-4 would free the lock while its holder (stalled, not dead) still runs.
        if l.lock_ttl.get() + l.process_heartbeat.get() > l.process_ttl.get() {
            warnings.push(format!(
                "locket.process_ttl ({}) is less than locket.lock_ttl ({}) + \
                 locket.process_heartbeat ({}): in a network partition, recovery may free a \
                 stalled worker's locks up to one heartbeat before their leases end, while its \
                 job still runs; set process_ttl to at least their sum",
                l.process_ttl, l.lock_ttl, l.process_heartbeat
            ));
        }
        if l.janitor_interval.get() < Duration::from_millis(100) {
            return Err(invalid("locket.janitor_interval", "is below 100ms"));
        }
        for (name, class) in &self.classes {
            let setting = format!("classes.{name:?}");
            if name.is_empty() {
                return Err(invalid("classes", "a class name is empty"));
            }
            if let Some(h) = &class.handler {
                if class.command.is_some() || class.builtin.is_some() {
                    return Err(invalid(
                        &format!("{setting}.handler"),
                        "give one of `handler`, `command` or `builtin`",
                    ));
                }
                if !self.handlers.contains_key(h) {
                    return Err(invalid(
                        &format!("{setting}.handler"),
                        format!("names handler {h:?}, but there is no [handlers.{h:?}] table"),
                    ));
                }
            } else if let Some(b) = &class.builtin {
                if class.command.is_some() {
                    return Err(invalid(
                        &format!("{setting}.builtin"),
                        "give either `command` or `builtin`, not both",
                    ));
                }
                if Builtin::from_name(b).is_none() {
                    return Err(invalid(
                        &format!("{setting}.builtin"),
                        format!(
                            "unknown builtin {b:?} (known: {})",
                            BUILTIN_NAMES.join(", ")
                        ),
                    ));
                }
            } else if let Some(cmd) = &class.command {
                if cmd.is_empty() || cmd[0].is_empty() {
                    return Err(invalid(
                        &format!("{setting}.command"),
                        "must name a program: [\"path\", \"arg\", ...]",
                    ));
                }
            } else if name != "*" && !self.classes.contains_key("*") {
                warnings.push(format!(
                    "{setting} has no command and there is no \"*\" fallback: its jobs fail unless \
                     an in-process handler is registered"
                ));
            }
            if let Some(t) = class.timeout {
                if t.get().is_zero() {
                    return Err(invalid(&format!("{setting}.timeout"), "must be above 0"));
                }
            }
        }
        self.check_handlers(&mut warnings)?;
        self.check_stop_before_lease_end(&mut warnings)?;
        self.schedules()?;
        if self.scheduler.lock_ttl.get() < Duration::from_secs(2) {
            return Err(invalid("scheduler.lock_ttl", "is below 2s"));
        }
        if self
            .scheduler
            .lock_key
            .as_deref()
            .is_some_and(str::is_empty)
        {
            return Err(invalid("scheduler.lock_key", "must be non-empty"));
        }
        plans::Plans::compile(self)?;
        if self.classes.is_empty() {
            warnings.push(
                "no [classes] configured: every job fails unless an in-process handler is registered"
                    .to_string(),
            );
        }
        Ok(warnings)
    }
}

impl Config {
    /// C-1, C-2 (issue 23): when renewals fail, the polite stop begins `kill_grace` before the
    /// lease's local end (L-9), so that the hard stop lands before it: `heartbeat_interval +
    /// kill_grace` must leave room for a renewal before that stop, for the `[locket]` values
    /// and for every locked class with a `kill_grace` of its own. Room for fewer than two
    /// renewals is a warning.
    fn check_stop_before_lease_end(&self, warnings: &mut Vec<String>) -> Result<(), ConfigError> {
        let l = &self.locket;
        let (ttl, heartbeat) = (l.lock_ttl.get(), l.heartbeat());
        // L-9's local lease: lock_ttl less its drift margin.
        let local = ttl.saturating_sub(ttl / 100 + Duration::from_millis(2));
        let plans = plans::Plans::compile(self)?;
        // The [locket] value serves every locked class without one of its own ("*" included,
        // which serves the classes without a table).
        let mut grace = Vec::new();
        let inherits = |c: &super::ClassConfig| c.kill_grace.is_none();
        let default_locked = match self.classes.get("*") {
            Some(star) => inherits(star) && !plans.get("*").locks.is_empty(),
            None => l.lock_all,
        };
        let any_inherits = default_locked
            || self
                .classes
                .iter()
                .any(|(name, c)| inherits(c) && !plans.get(name).locks.is_empty());
        if any_inherits {
            grace.push(("locket.kill_grace".to_string(), l.kill_grace));
        }
        for (name, c) in &self.classes {
            if let (Some(kg), false) = (c.kill_grace, plans.get(name).locks.is_empty()) {
                grace.push((format!("classes.{name:?}.kill_grace"), kg));
            }
        }
        for (setting, kg) in grace {
            let before_stop = local.saturating_sub(kg.get());
            if heartbeat + kg.get() >= local {
                return Err(invalid(
                    &setting,
                    format!(
                        "locket.heartbeat_interval ({}) + kill_grace ({kg}) must be shorter than \
                         locket.lock_ttl ({}) less L-9's margin (1% + 2ms): when renewals fail, \
                         the handler is stopped kill_grace before the lease ends, so that it is \
                         dead before another holder can start; with these values that stop \
                         comes before the first renewal",
                        Secs(heartbeat),
                        l.lock_ttl
                    ),
                ));
            }
            if heartbeat * 2 > before_stop {
                warnings.push(format!(
                    "{setting} ({kg}) with locket.lock_ttl ({}) and locket.heartbeat_interval \
                     ({}): a single failed renewal stops the job; leave room for two \
                     (heartbeat_interval at most (lock_ttl - kill_grace) / 2)",
                    l.lock_ttl,
                    Secs(heartbeat)
                ));
            }
        }
        Ok(())
    }

    /// The `[schedule.<name>]` tables compiled (SC-10, SC-11); the error names the schedule
    /// and what is wrong with it (a bad cron, duration or zone).
    pub fn schedules(&self) -> Result<Vec<super::Schedule>, ConfigError> {
        self.schedule
            .iter()
            .map(|(name, c)| {
                if name.is_empty() {
                    return Err(invalid("schedule", "a schedule name is empty"));
                }
                super::Schedule::compile(name, c)
                    .map_err(|e| invalid(&format!("schedule.{name:?}"), e))
            })
            .collect()
    }

    /// The `[handlers]` tables (H-2): a command each; persistent limits in range.
    fn check_handlers(&self, warnings: &mut Vec<String>) -> Result<(), ConfigError> {
        for (name, h) in &self.handlers {
            let setting = format!("handlers.{name:?}");
            if name.is_empty() {
                return Err(invalid("handlers", "a handler name is empty"));
            }
            if h.command.is_empty() || h.command[0].is_empty() {
                return Err(invalid(
                    &format!("{setting}.command"),
                    "must name a program: [\"path\", \"arg\", ...]",
                ));
            }
            if h.mode == HandlerMode::Exec {
                continue;
            }
            if h.boot_timeout.get() < Duration::from_millis(100) {
                return Err(invalid(
                    &format!("{setting}.boot_timeout"),
                    format!("{} is below 100ms", h.boot_timeout),
                ));
            }
            if h.start_timeout.get() < Duration::from_millis(100) {
                return Err(invalid(
                    &format!("{setting}.start_timeout"),
                    format!("{} is below 100ms", h.start_timeout),
                ));
            }
            if let Some(f) = h.max_frame_bytes {
                if f.0 < 4096 {
                    return Err(invalid(
                        &format!("{setting}.max_frame_bytes"),
                        "is below 4096 bytes",
                    ));
                }
                if f.0 < self.max_payload_bytes as u64 + 1024 {
                    warnings.push(format!(
                        "{setting}.max_frame_bytes ({}) is smaller than max_payload_bytes: a \
                         large job's reply may not fit",
                        f.0
                    ));
                }
            }
            if h.threads == 0 || h.threads > super::handlers::MAX_THREADS {
                return Err(invalid(
                    &format!("{setting}.threads"),
                    format!(
                        "{} is out of range (1..={})",
                        h.threads,
                        super::handlers::MAX_THREADS
                    ),
                ));
            }
            if h.threads > 1 && h.command.iter().any(|a| a == "--fork") {
                return Err(invalid(
                    &format!("{setting}.threads"),
                    "threads > 1 and --fork are exclusive: a forked child runs one job, so \
                     the process would still hold one app per job (drop --fork, or set \
                     threads = 1)",
                ));
            }
            if h.threads > 1 && !h.command.iter().any(|a| names_threaded_adapter(a)) {
                warnings.push(format!(
                    "{setting}.threads = {} takes effect only if the handler says \"threads\" in \
                     its ready (the shipped Ruby, Node and Python adapters do); any other runs \
                     one job per process, as the log says at each boot",
                    h.threads
                ));
            }
            if h.max_rss.is_some_and(|b| b.0 < 1024 * 1024) {
                return Err(invalid(&format!("{setting}.max_rss"), "is below 1MiB"));
            }
            if h.max_lifetime.is_some_and(|t| t.get().is_zero()) {
                return Err(invalid(
                    &format!("{setting}.max_lifetime"),
                    "must be above 0",
                ));
            }
            if h.idle_timeout.is_some_and(|t| t.get().is_zero()) {
                return Err(invalid(
                    &format!("{setting}.idle_timeout"),
                    "must be above 0",
                ));
            }
            if !self
                .classes
                .values()
                .any(|c| c.handler.as_deref() == Some(name.as_str()))
            {
                warnings.push(format!("{setting} is not used by any class"));
            }
        }
        Ok(())
    }
}

/// `127.0.0.1`, `::1`, `[::1]`, `localhost` and the rest of 127/8.
fn is_loopback(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost")
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether an argument of a handler's command names one of the adapters shipped in
/// `adapters/`, each of which says "threads" in its `ready` when `LOCKETD_THREADS` > 1 (H-18).
fn names_threaded_adapter(arg: &str) -> bool {
    let file = arg.rsplit('/').next().unwrap_or(arg);
    matches!(
        file,
        "locketd-ruby" | "locketd-handler.js" | "locketd_handler.py" | "locketd_handler"
    )
}

#[cfg(test)]
mod tests {
    use super::super::{Config, Secret};

    fn with(http: Option<&str>, metrics: Option<&str>) -> Config {
        let mut c = Config::parse("queues = \"q\"\n", "test").unwrap();
        c.http = http.map(str::to_string);
        c.metrics = metrics.map(str::to_string);
        c
    }

    /// Issue 16: `http` names the metrics listener; a bare port is loopback; another address is
    /// taken as told, with a warning; the two settings may not disagree.
    #[test]
    fn the_http_listener_is_loopback_unless_told_otherwise() {
        assert_eq!(
            with(Some("9187"), None).listen().as_deref(),
            Some("127.0.0.1:9187")
        );
        assert_eq!(
            with(None, Some("[::1]:9")).listen().as_deref(),
            Some("[::1]:9")
        );
        assert_eq!(with(None, None).listen(), None);
        for quiet in [
            "9187",
            "127.0.0.1:0",
            "localhost:1",
            "[::1]:2",
            "127.1.2.3:4",
        ] {
            let w = with(Some(quiet), None).check().unwrap();
            assert!(w.iter().all(|w| !w.contains("loopback")), "{quiet}: {w:?}");
        }
        let w = with(Some("0.0.0.0:9187"), None).check().unwrap();
        assert!(
            w.iter().any(|w| w.contains("not a loopback address")),
            "{w:?}"
        );
        assert!(with(Some("127.0.0.1:1"), Some("127.0.0.1:2"))
            .check()
            .is_err());
        assert!(with(Some("127.0.0.1:1"), Some("127.0.0.1:1"))
            .check()
            .is_ok());
        assert!(with(Some("nope"), None).check().is_err());
        let mut c = with(Some("9187"), None);
        c.http_admin_token = Some(Secret("short".into()));
        assert!(c.check().is_err());
        c.http_admin_token = Some(Secret("0123456789abcdef".into()));
        assert!(c.check().is_ok());
        assert!(!format!("{c:?}").contains("0123456789abcdef"));
        c.http_allowed_hosts = vec!["metrics.example.com".into(), "10.0.0.5:9187".into()];
        assert!(c.check().is_ok());
        for bad in [
            "http://metrics.example.com",
            "*.example.com",
            "",
            "host:99999",
        ] {
            c.http_allowed_hosts = vec![bad.into()];
            let e = c.check().unwrap_err().to_string();
            assert!(e.contains("http_allowed_hosts"), "{bad:?}: {e}");
        }
    }

    /// `[queue.<q>] concurrency` names the capped queues; 0 is refused; an unknown key
    /// in the table is a config error.
    #[test]
    fn queue_tables_give_the_caps() {
        let c = Config::parse(
            "queues = \"a,b\"\n[queue.a]\nconcurrency = 3\n[queue.b]\n",
            "test",
        )
        .unwrap();
        assert_eq!(c.queue_caps(), [("a".to_string(), 3)]);
        assert!(c.check().is_ok());
        let zero = Config::parse("queues = \"a\"\n[queue.a]\nconcurrency = 0\n", "test").unwrap();
        let e = zero.check().unwrap_err().to_string();
        assert!(e.contains("queue.a.concurrency"), "{e}");
        assert!(Config::parse("queues = \"a\"\n[queue.a]\nconcurency = 2\n", "test").is_err());
    }

    /// H-18: `threads` is 1..=1024, and above 1 it refuses a `--fork` adapter.
    #[test]
    fn threads_are_in_range_and_exclude_fork() {
        let conf = |threads: &str, fork: bool| {
            let fork = if fork { ", \"--fork\"" } else { "" };
            Config::parse(
                &format!(
                    "queues = \"q\"\n[handlers.app]\nmode = \"persistent\"\n\
                     command = [\"adapters/ruby/locketd-ruby\", \"app.rb\"{fork}]\n{threads}\n\
                     [classes.\"*\"]\nhandler = \"app\"\n"
                ),
                "test",
            )
            .unwrap()
        };
        assert_eq!(conf("", false).handlers["app"].threads, 1, "default");
        let w = conf("threads = 25", false).check().unwrap();
        assert!(w.iter().all(|w| !w.contains("takes effect only")), "{w:?}");
        let mut other = conf("threads = 4", false);
        other.handlers.get_mut("app").unwrap().command = vec!["./my-adapter".into()];
        let w = other.check().unwrap();
        assert!(
            w.iter()
                .any(|w| w.contains("threads = 4 takes effect only")),
            "{w:?}"
        );
        assert!(conf("", true).check().is_ok(), "fork with one thread");
        let e = conf("threads = 2", true).check().unwrap_err().to_string();
        assert!(e.contains("threads") && e.contains("--fork"), "{e}");
        for bad in ["threads = 0", "threads = 1025"] {
            let e = conf(bad, false).check().unwrap_err().to_string();
            assert!(e.contains("out of range"), "{bad}: {e}");
        }
    }
}
