//! A producer-side client: pushes jobs in Resque's exact format together with their
//! enqueue-time dependency holds, in one atomic step (locking-semantics.md D-3, D-3a).
//!
//! The push goes through PUSH, the enqueue function in Redis (src/store/lua/push.lua): the hold
//! names are rendered there from the payload and the class plans the daemons publish, so this
//! client, `locketd enqueue` and a client in any other language take the same path. The
//! client's own configuration only fills in the plans no daemon has published yet (a push
//! before the first daemon starts); a daemon's publish replaces them.
//!
//! ```no_run
//! # async fn demo() -> locketd::Result<()> {
//! use locketd::{client::Client, config::Config};
//! let config = Config::parse(r#"
//! [classes."Orders::Ship"]
//! holds = [ { name = "order:{args[0]}", when = "enqueue" } ]
//! "#, "inline")?;
//! let mut client = Client::connect(&config).await?;
//! client.enqueue("orders", "Orders::Ship", &[serde_json::json!(42)]).await?;
//! # Ok(()) }
//! ```
//!
//! Clients in other languages call the same function: `FCALL locketd_<build>_push 3 ...` where
//! the daemon's library is loaded, else the same script by EVALSHA (printed by
//! `locketd enqueue --print-script`); `src/store/lua/push.lua`'s header lists its keys and
//! arguments. [`Client::enqueue_at`] schedules a job in resque-scheduler's delayed queue through
//! PUSH's delayed form, PUSH_AT (`src/store/lua/push_at.lua`), its holds placed at once.

use crate::config::plans::Plans;
use crate::config::published::publish_all;
use crate::config::Config;
use crate::conn::Manager;
use crate::error::{Error, Result};
use crate::locks::canonical;
use crate::resque::keys::Keys;
use crate::store::plans::{push, push_at};
use serde_json::Value;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What one enqueue did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enqueued {
    /// The payload pushed, byte for byte.
    pub payload: String,
    /// Its digest (§1.1).
    pub digest: String,
    /// Hold names added with the push (rendered in Redis from the published plan).
    pub holds: Vec<String>,
    /// Queue length after the push (or now, when not pushed).
    pub queue_length: u64,
    /// False for a duplicate that the class's `unique` refused (U-1): nothing was written.
    pub pushed: bool,
    /// For [`enqueue_at`](Client::enqueue_at) with a time in the future: the Unix second it is
    /// scheduled for (`payload` is then resque-scheduler's item and `queue_length` the length
    /// of `delayed:<ts>`). None for a job pushed to its queue.
    pub scheduled_at: Option<i64>,
}

/// Pushes jobs with their holds.
#[derive(Clone)]
pub struct Client {
    conn: Manager,
    keys: Keys,
    plans: Arc<Plans>,
    /// FCALL or EVALSHA, found on the first push.
    mode: Arc<crate::store::FcallMode>,
    /// The configuration's plans were offered for the classes no daemon published.
    offered: Arc<AtomicBool>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("namespace", &self.keys.ns())
            .finish()
    }
}

/// Resque's payload: `{"class":"<Class>","args":[...]}` (class first, as Ruby writes it), with
/// every argument's number text kept exactly.
pub fn resque_payload(class: &str, args: &[Value]) -> String {
    format!(
        "{{\"class\":{},\"args\":{}}}",
        Value::from(class),
        Value::Array(args.to_vec())
    )
}

/// The payload `locketd enqueue QUEUE CLASS ARG_JSON...` pushes, byte for byte (class first,
/// each argument as written minus whitespace), and its args as a JSON array; an argument that
/// is not JSON is refused, naming it. `locketd why QUEUE CLASS ARGS` finds a job by these bytes.
pub fn payload_json(class: &str, args_json: &[String]) -> Result<(Value, String)> {
    let (args, texts) = parse_args(args_json)?;
    let payload = format!(
        "{{\"class\":{},\"args\":[{}]}}",
        Value::from(class),
        texts.join(",")
    );
    Ok((args, payload))
}

/// JSON text without insignificant whitespace, member order and number text kept (what Ruby's
/// `JSON.generate` writes for the same value).
pub fn minify_json(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let (mut in_str, mut escaped) = (false, false);
    for c in text.chars() {
        if in_str {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_str = false;
            }
        } else if c == '"' {
            in_str = true;
            out.push(c);
        } else if !c.is_whitespace() {
            out.push(c);
        }
    }
    out
}

/// Arguments given as JSON text: their values (for the digest) and their texts, kept as
/// written minus insignificant whitespace.
fn parse_args(args_json: &[String]) -> Result<(Value, Vec<String>)> {
    let mut args = Vec::with_capacity(args_json.len());
    let mut texts = Vec::with_capacity(args_json.len());
    for (i, t) in args_json.iter().enumerate() {
        let v: Value = serde_json::from_str(t)
            .map_err(|e| Error::Enqueue(format!("argument {} is not JSON ({e}): {t}", i + 1)))?;
        args.push(v);
        texts.push(minify_json(t));
    }
    Ok((Value::Array(args), texts))
}

/// The script a client in another language loads to enqueue with holds: PUSH, the same Lua
/// as the daemon's library function (the shared helpers, the renderer, PUSH, and the write of
/// its O-3 counts). Keys: `<ns>:queue:<q>`, `<ns>:queues`, `<ns>:locket:plans`; arguments:
/// the queue, the payload, `<ns>:locket:`.
pub fn enqueue_script() -> &'static str {
    crate::store::scripts::PUSH_SOURCE
}

impl Client {
    /// Connects to the configured Redis; the configuration's class tables say which holds each
    /// class places.
    pub async fn connect(config: &Config) -> Result<Client> {
        let conn = crate::conn::connect(&config.redis, config.redis_connect_timeout.get()).await?;
        Client::with_connection(conn, config)
    }

    /// A client over an existing connection (a [`Manager`], or a redis `ConnectionManager`).
    pub fn with_connection(conn: impl Into<Manager>, config: &Config) -> Result<Client> {
        Ok(Client {
            conn: conn.into(),
            keys: Keys::new(&config.namespace),
            plans: Arc::new(Plans::compile(config)?),
            mode: Arc::default(),
            offered: Arc::default(),
        })
    }

    /// Pushes one job to the tail of `queue` and adds its enqueue-time holds in the same step.
    /// A hold template that cannot be rendered for these args is an error and nothing is pushed.
    pub async fn enqueue(&mut self, queue: &str, class: &str, args: &[Value]) -> Result<Enqueued> {
        let payload = resque_payload(class, args);
        self.push(queue, class, Value::Array(args.to_vec()), payload, None)
            .await
    }

    /// [`enqueue`](Self::enqueue) with each argument given as JSON text, kept as written (member
    /// order, number text) minus insignificant whitespace.
    pub async fn enqueue_json(
        &mut self,
        queue: &str,
        class: &str,
        args_json: &[String],
    ) -> Result<Enqueued> {
        let (args, payload) = payload_json(class, args_json)?;
        self.push(queue, class, args, payload, None).await
    }

    /// Schedules one job for Unix second `at` as resque-scheduler's `Resque.enqueue_at` does
    /// (its delayed queue, its item format: scheduler-protocol.md SC-1, SC-2), with the
    /// enqueue-time holds and `unique` key of its class placed now, in the same step (PUSH_AT,
    /// D-3b); the scheduler (locketd's or the gem's) delivers it. A time not in the future
    /// pushes at once, as `enqueue_at` does.
    pub async fn enqueue_at(
        &mut self,
        queue: &str,
        class: &str,
        args: &[Value],
        at: i64,
    ) -> Result<Enqueued> {
        let texts: Vec<String> = args.iter().map(Value::to_string).collect();
        self.enqueue_json_at(queue, class, &texts, at).await
    }

    /// [`enqueue_at`](Self::enqueue_at) with each argument given as JSON text, kept as written
    /// minus insignificant whitespace.
    pub async fn enqueue_json_at(
        &mut self,
        queue: &str,
        class: &str,
        args_json: &[String],
        at: i64,
    ) -> Result<Enqueued> {
        if at <= crate::scheduler::unix_now() {
            return self.enqueue_json(queue, class, args_json).await;
        }
        let (args, texts) = parse_args(args_json)?;
        let item = format!(
            "{{\"class\":{},\"args\":[{}],\"queue\":{}}}",
            Value::from(class),
            texts.join(","),
            Value::from(queue)
        );
        self.push(queue, class, args, item, Some(at)).await
    }

    async fn push(
        &mut self,
        queue: &str,
        class: &str,
        args_value: Value,
        payload: String,
        at: Option<i64>,
    ) -> Result<Enqueued> {
        if queue.is_empty() || class.is_empty() {
            return Err(Error::Enqueue("queue and class must not be empty".into()));
        }
        if !self.offered.load(Ordering::Relaxed) {
            self.offer_plans().await?;
        }
        let digest = canonical::digest(class, &args_value);
        let (conn, mode, keys) = (&mut self.conn, &self.mode, &self.keys);
        let done = match at {
            Some(ts) => push_at(conn, mode, keys, queue, &payload, ts).await,
            None => push(conn, mode, keys, queue, &payload).await,
        };
        let done = done.map_err(|e| match e.code() {
            Some("LOCKET_RENDER") | Some("LOCKET_PLAN") => Error::Enqueue(e.detail().map_or_else(
                || e.to_string(),
                |d| format!("{}: {d}", e.code().unwrap_or_default()),
            )),
            _ => Error::from(e),
        })?;
        Ok(Enqueued {
            payload,
            digest,
            holds: done.holds,
            queue_length: done.queue_length,
            pushed: done.pushed,
            scheduled_at: at,
        })
    }

    /// Publishes this configuration's class plans where Redis has none yet (`HSETNX`): a push
    /// made before any daemon published still places the holds its configuration names. A
    /// daemon's publish (D-3a) replaces them.
    async fn offer_plans(&mut self) -> Result<()> {
        // KEYS[1] plans, KEYS[2] holding_plans; ARGV: field, JSON, holding (1/0), repeated.
        const OFFER: &str = "for i = 1, #ARGV, 3 do\n\
             if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 and ARGV[i + 2] == '1' then\n\
             redis.call('SADD', KEYS[2], ARGV[i])\n\
             end\n\
             end\n\
             return 0";
        let script = redis::Script::new(OFFER);
        let mut inv = script.prepare_invoke();
        inv.key(self.keys.plans()).key(self.keys.holding_plans());
        for p in publish_all(&self.plans) {
            inv.arg(p.field).arg(p.json).arg(u8::from(p.holding));
        }
        inv.invoke_async::<()>(&mut self.conn).await?;
        self.offered.store(true, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_payload_is_resques_format_with_exact_numbers() {
        let args: Vec<Value> = ["12345678901234567890123", "1.0", "[\"é\"]"]
            .iter()
            .map(|t| serde_json::from_str(t).unwrap())
            .collect();
        assert_eq!(
            resque_payload("A::B", &args),
            r#"{"class":"A::B","args":[12345678901234567890123,1.0,["é"]]}"#
        );
        assert_eq!(
            minify_json("{ \"b\" : 1,\n \"a\": \"x y\\\" z\" }"),
            r#"{"b":1,"a":"x y\" z"}"#
        );
    }

    // resque-protocol.md: Ruby's Resque::Job.destroy(queue, klass, *args) finds a job by its
    // encoded payload, in the member order Ruby wrote it; args built or parsed in Rust keep
    // theirs too (serde_json's preserve_order), while the digest stays order-free (T-2).
    #[test]
    fn object_args_keep_their_member_order_and_the_digest_ignores_it() {
        let built = serde_json::json!({"zeta": 1, "alpha": {"y": 2, "b": 3}});
        let parsed: Value = serde_json::from_str(r#"{"zeta":1,"alpha":{"y":2,"b":3}}"#).unwrap();
        for v in [&built, &parsed] {
            assert_eq!(
                resque_payload("A", std::slice::from_ref(v)),
                r#"{"class":"A","args":[{"zeta":1,"alpha":{"y":2,"b":3}}]}"#
            );
        }
        let sorted: Value = serde_json::from_str(r#"{"alpha":{"b":3,"y":2},"zeta":1}"#).unwrap();
        assert_eq!(
            canonical::digest("A", &Value::Array(vec![built])),
            canonical::digest("A", &Value::Array(vec![sorted]))
        );
    }
}
