//! Keys a reader could not read as it needs them: a key another tool gave another type (a
//! `failed` hash, a `locket:locks` string), a set member that is not a UTF-8 name. `status`,
//! the web page and its API show what they could read and name such a key in the part that
//! reads it, instead of failing whole; only Redis not answering fails them.

use redis::aio::ConnectionLike;
use redis::{FromRedisValue, RedisError, Value};
use serde::Serialize;

/// One key a part of an answer could not read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Unreadable {
    /// The part it belongs to: a section of the page (`queues`, `workers`, `locks`, `holds`,
    /// `rates`, `delayed`, `schedules`, `failures`, `chart`) or `totals` (`stat:*`).
    pub section: String,
    /// The key (or, when no one key could be told, the keys the part reads).
    pub key: String,
    /// Why, as Redis said it.
    pub error: String,
}

impl Unreadable {
    /// `<key>: <error>`, as the page and `status` print it.
    pub fn line(&self) -> String {
        format!("{}: {}", self.key, self.error)
    }
}

/// Whether `e` means Redis itself did not answer (the connection: I/O, dropped, refused,
/// timed out) rather than one key refusing a command: then the whole answer fails.
pub fn is_connection(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout()
}

/// Redis's reply as it said it: `WRONGTYPE Operation against a key holding the wrong kind of
/// value`, or the client's own text for anything else.
pub fn error_text(e: &RedisError) -> String {
    match (e.code(), e.detail()) {
        (Some(code), Some(detail)) => format!("{code} {detail}"),
        _ => e.to_string(),
    }
}

/// One reply of a pipeline sent with `ignore_errors`, as `T`; a refusal or a reply of another
/// shape gives its text.
pub fn reply<T: FromRedisValue>(v: Value) -> Result<T, String> {
    match v {
        Value::ServerError(e) => Err(match e.details() {
            Some(d) => format!("{} {d}", e.code()),
            None => e.code().to_string(),
        }),
        other => redis::from_redis_value(other).map_err(|e| e.to_string()),
    }
}

/// The members of a set reply that are UTF-8 names; the others are left out and counted in
/// `u` under `key`, as is a refused reply (the set reads as empty).
pub fn names(v: Value, section: &str, key: &str, u: &mut Vec<Unreadable>) -> Vec<String> {
    let raw: Vec<Vec<u8>> = match reply(v) {
        Ok(r) => r,
        Err(error) => {
            u.push(Unreadable {
                section: section.into(),
                key: key.into(),
                error,
            });
            return Vec::new();
        }
    };
    let (names, left_out) = utf8_names(raw);
    if let Some(error) = left_out {
        u.push(Unreadable {
            section: section.into(),
            key: key.into(),
            error,
        });
    }
    names
}

/// The members of a set that are UTF-8 names, and, when some are not, why they were left out.
pub fn utf8_names(raw: Vec<Vec<u8>>) -> (Vec<String>, Option<String>) {
    let total = raw.len();
    let names: Vec<String> = raw
        .into_iter()
        .filter_map(|b| String::from_utf8(b).ok())
        .collect();
    let left_out = (names.len() < total).then(|| {
        format!(
            "{} of its {total} members are not UTF-8 names: left out",
            total - names.len()
        )
    });
    (names, left_out)
}

/// Names the key behind `e`, a read of `section` that failed: the first of `expected`
/// (`(key, type)`; an empty type is not checked) that exists with another type; else the keys
/// of `expected` with Redis's reply (a value that is not UTF-8, for one).
pub async fn name_key<C: ConnectionLike + Send>(
    conn: &mut C,
    section: &str,
    expected: &[(String, &str)],
    e: &RedisError,
) -> Unreadable {
    for (key, want) in expected.iter().filter(|(_, want)| !want.is_empty()) {
        let kind: String = redis::cmd("TYPE")
            .arg(key)
            .query_async(conn)
            .await
            .unwrap_or_else(|_| "none".into());
        if kind != "none" && kind != *want {
            return Unreadable {
                section: section.into(),
                key: key.clone(),
                error: format!("a {kind} where a {want} is expected"),
            };
        }
    }
    Unreadable {
        section: section.into(),
        key: expected
            .iter()
            .map(|(k, _)| k.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        error: error_text(e),
    }
}
