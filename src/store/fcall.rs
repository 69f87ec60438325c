//! How the job path's connection (batch.rs) calls a job-path script: as `FCALL` of the locketd
//! FUNCTION library where Redis has FUNCTION (7.0 and later), else as `EVALSHA` of the tallied
//! script. Both run the same Lua (scripts.rs, [`JobLibrary`](super::scripts::JobLibrary)); the
//! function skips the per-call cost of running the script's whole chunk again.
//!
//! The library is loaded on a connection's first job-path call. A Redis without FUNCTION
//! (`unknown command`), or a user the ACL does not let load one (`NOPERM`), turns the
//! connection to EVALSHA for good, with one log line. A library gone later (a restarted Redis
//! without persistence, `FUNCTION FLUSH`) is loaded again on the `Function not found` reply,
//! as a script is on `NOSCRIPT`.
//!
//! Each build has its own library (`locketd_<hash>`), so they would pile up in Redis, one per
//! build. A worker's connection (given its record key, `<ns>:locket:functions`:
//! [`Mode::record_libraries_in`]) records its library's load time there (before the load),
//! then deletes the other builds' libraries that no connection of its namespace has loaded for
//! [`STALE_SECS`]; one without a record (an older build's, or one of another namespace only) is
//! given one, so it is kept that long too. A library deleted while a daemon of its build still
//! runs costs that daemon one load (the `Function not found` path above), never a call: a
//! rolling upgrade is safe whatever its length.

use super::scripts::scripts;
use crate::conn::{is_refusal, Plain};
use redis::aio::ConnectionLike;
use redis::{Arg, Cmd, ErrorKind, RedisResult, ServerErrorKind, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;
use tracing::{debug, info, warn};

/// Another build's library not loaded for this long is deleted by the next load.
pub(super) const STALE_SECS: i64 = 86_400;

const UNKNOWN: u8 = 0;
const FUNCTIONS: u8 = 1;
const SCRIPTS: u8 = 2;

/// Whether this connection's Redis runs the library (shared by a connection's clones), where
/// its loads are recorded, and the list of TAKE's keys and arguments the library holds for the
/// one-slot job path's connection (take_args.rs).
#[derive(Debug, Default)]
pub(crate) struct Mode(
    AtomicU8,
    OnceLock<String>,
    std::sync::Mutex<super::take_args::Lists>,
);

impl Mode {
    fn get(&self) -> u8 {
        self.0.load(Ordering::Relaxed)
    }

    /// Records the library's loads in `key` (a HASH, `<ns>:locket:functions`: library name →
    /// Unix seconds of its last load, Redis's clock) and deletes other builds' stale libraries
    /// at each load. Without it (a connection of a test, a tool), neither.
    pub(crate) fn record_libraries_in(&self, key: String) {
        let _ = self.1.set(key);
    }

    /// Whether job-path calls go out as FCALL (false until the first call has loaded the
    /// library).
    pub(crate) fn functions(&self) -> bool {
        self.get() == FUNCTIONS
    }

    /// Calls job-path script `op` ("reserve", "acquire", "finish", "finish_reserve",
    /// "batch", "push", or "push_at"); `fill` writes what follows the function's name or the script's SHA1 (the
    /// number of keys, the keys, the arguments). A refusal comes back as an error.
    pub(crate) async fn call<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        op: &str,
        fill: impl Fn(&mut Cmd),
    ) -> RedisResult<Value> {
        if self.get() == UNKNOWN {
            self.load(conn).await?;
        }
        if self.get() == FUNCTIONS {
            let mut cmd = redis::cmd("FCALL");
            cmd.arg(scripts().library.function(op));
            fill(&mut cmd);
            match send(conn, &cmd).await {
                Err(e) if function_missing(&e) => {
                    self.load(conn).await?;
                    if self.get() == FUNCTIONS {
                        return send(conn, &cmd).await;
                    }
                }
                other => return other,
            }
        }
        let script = tallied_script(op);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash());
        fill(&mut cmd);
        match send(conn, &cmd).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                script.prepare_invoke().load_async(conn).await?;
                send(conn, &cmd).await
            }
            other => other,
        }
    }

    /// [`Mode::call`] of `evalsha`, an `EVALSHA <sha> <numkeys> key... arg...` of job-path
    /// script `op`, on the one-slot job path's own connection: where the library loads, the
    /// call goes out as `FCALL` packed straight from `evalsha` (the command is built once, not
    /// copied into a second one); where Redis has no FUNCTION, as [`Mode::call`] sends it.
    pub(crate) async fn call_plain(
        &self,
        conn: &mut Plain,
        op: &str,
        evalsha: &Cmd,
    ) -> RedisResult<Value> {
        if self.get() == UNKNOWN {
            self.load(conn).await?;
        }
        if self.get() == FUNCTIONS && op == "take" {
            if let Some(reply) = self.take_by_changes(conn, evalsha).await {
                return reply;
            }
        }
        if self.get() == FUNCTIONS {
            let function = scripts().library.function(op);
            let head = [b"FCALL".as_slice(), function.as_bytes()];
            let fcall = conn.call_with_head(head, evalsha).await;
            match fcall.and_then(Value::extract_error) {
                // The library is gone (a restarted Redis): loaded again, and the call resent.
                Err(e) if function_missing(&e) => {
                    self.load(conn).await?;
                    if self.get() == FUNCTIONS {
                        let fcall = conn.call_with_head(head, evalsha).await;
                        return fcall.and_then(Value::extract_error);
                    }
                }
                other => return other,
            }
        }
        // Redis runs no FUNCTION: EVALSHA of the tallied script.
        self.call(conn, op, |out| {
            for a in evalsha.args_iter().skip(2) {
                if let Arg::Simple(b) = a {
                    out.arg(b);
                }
            }
        })
        .await
    }

    /// TAKE by the library's `take_args` (take_args.rs): its keys and arguments as the changes
    /// from the list the library holds for the slot, or whole when it holds none (its
    /// `LOCKET_ARGS_MISS`, answered before anything is done, sends them whole at once). None
    /// when the library cannot be loaded any more: the caller sends EVALSHA.
    async fn take_by_changes(&self, conn: &mut Plain, evalsha: &Cmd) -> Option<RedisResult<Value>> {
        // EVALSHA <sha> <numkeys> <keys...> <args...>
        let mut it = evalsha.args_iter().skip(2).filter_map(|a| match a {
            Arg::Simple(b) => Some(b),
            _ => None,
        });
        let nkeys: usize = std::str::from_utf8(it.next()?).ok()?.parse().ok()?;
        let entries: Vec<&[u8]> = it.collect();
        let function = scripts().library.function("take_args");
        let lists = || self.2.lock().unwrap_or_else(|e| e.into_inner());
        let mut whole = false;
        let mut loaded = false;
        loop {
            let (cmd, version) = lists().command(&function, nkeys, &entries, whole);
            let reply = send(conn, &cmd).await;
            match &reply {
                Err(e) if !whole && args_missed(e) => whole = true,
                Err(e) if !loaded && function_missing(e) => {
                    lists().settled(version, nkeys, &entries, false);
                    if let Err(e) = self.load(conn).await {
                        return Some(Err(e));
                    }
                    if self.get() != FUNCTIONS {
                        return None;
                    }
                    (whole, loaded) = (true, true);
                }
                _ => {
                    lists().settled(version, nkeys, &entries, reply.is_ok());
                    return Some(reply);
                }
            }
        }
    }

    /// Loads the library unless this connection's Redis was tried already: whether job-path
    /// calls (and the clients' PUSH, PUSH_AT) can go out as FCALL. False on a Redis without
    /// FUNCTION (Redis 6, a `rename-command FUNCTION ""`) or an ACL that refuses it.
    pub(crate) async fn ensure_loaded<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> RedisResult<bool> {
        if self.get() == UNKNOWN {
            self.load(conn).await?;
        }
        Ok(self.functions())
    }

    /// `FUNCTION LOAD` of the library: FCALL from now on when it loads (or was loaded by
    /// another process), EVALSHA for good when Redis refuses FUNCTION; an outage is returned
    /// (the caller retries the call as any other).
    async fn load<C: ConnectionLike + Send>(&self, conn: &mut C) -> RedisResult<()> {
        let lib = &scripts().library;
        // Recorded before it is loaded: another build's clean-up never finds it loaded and
        // unrecorded. Best effort: a Redis that refuses the write gets no clean-up.
        let mut now = None;
        if let Some(key) = self.1.get() {
            if let Ok(secs) = redis_secs(conn).await {
                let recorded = send(
                    conn,
                    redis::cmd("HSET").arg(key).arg(lib.name.as_str()).arg(secs),
                )
                .await;
                now = recorded.ok().map(|_| (key, secs));
            }
        }
        let loaded = send(
            conn,
            redis::cmd("FUNCTION").arg("LOAD").arg(lib.source.as_str()),
        )
        .await;
        let mode = match loaded {
            Ok(_) => FUNCTIONS,
            Err(e) if e.to_string().contains("already exists") => FUNCTIONS,
            Err(e) if !is_refusal(&e) => return Err(e),
            Err(e) => {
                // Redis 6, or an ACL without FUNCTION: expected. Anything else is a bug of
                // the library's, worth a warning (the scripts still do the work).
                let expected =
                    e.code() == Some("NOPERM") || e.to_string().contains("unknown command");
                if expected {
                    info!(target: "locketd::store", library = %lib.name, error = %e,
                        "Redis does not load the job-path FUNCTION library: the job path runs its scripts by EVALSHA");
                } else {
                    warn!(target: "locketd::store", library = %lib.name, error = %e,
                        "the job-path FUNCTION library did not load: the job path runs its scripts by EVALSHA");
                }
                SCRIPTS
            }
        };
        self.0.store(mode, Ordering::Relaxed);
        if let (FUNCTIONS, Some((key, now))) = (mode, now) {
            if let Err(e) = clean_up(conn, key, &lib.name, now).await {
                debug!(target: "locketd::store", error = %e, "other builds' FUNCTION libraries not cleaned up");
            }
        }
        Ok(())
    }
}

/// Redis's clock, in Unix seconds.
async fn redis_secs<C: ConnectionLike + Send>(conn: &mut C) -> RedisResult<i64> {
    let (secs, _micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await?;
    Ok(secs)
}

/// Deletes the other builds' libraries (`locketd_*`, not `ours`) whose last load is older
/// than [`STALE_SECS`], and their records; records one that has none (now).
async fn clean_up<C: ConnectionLike + Send>(
    conn: &mut C,
    records: &str,
    ours: &str,
    now: i64,
) -> RedisResult<()> {
    let listed = send(
        conn,
        redis::cmd("FUNCTION")
            .arg("LIST")
            .arg("LIBRARYNAME")
            .arg("locketd_*"),
    )
    .await?;
    let names = library_names(&listed);
    let seen: HashMap<String, i64> = redis::cmd("HGETALL").arg(records).query_async(conn).await?;
    for name in names
        .iter()
        .filter(|n| *n != ours && n.starts_with("locketd_"))
    {
        match seen.get(name) {
            None => {
                send(conn, redis::cmd("HSETNX").arg(records).arg(name).arg(now)).await?;
            }
            Some(at) if now - at > STALE_SECS => {
                send(conn, redis::cmd("FUNCTION").arg("DELETE").arg(name)).await?;
                send(conn, redis::cmd("HDEL").arg(records).arg(name)).await?;
                info!(target: "locketd::store", library = %name, last_loaded = at,
                    "deleted another build's FUNCTION library, not loaded for a day");
            }
            Some(_) => {}
        }
    }
    // The records of libraries gone (a FUNCTION FLUSH, a restart), once stale.
    for (name, at) in &seen {
        if name != ours && !names.contains(name) && now - at > STALE_SECS {
            send(conn, redis::cmd("HDEL").arg(records).arg(name)).await?;
        }
    }
    Ok(())
}

/// The `library_name` of each library in a `FUNCTION LIST` reply (RESP2 arrays of fields and
/// values, or RESP3 maps).
fn library_names(listed: &Value) -> Vec<String> {
    let Value::Array(libs) = listed else {
        return Vec::new();
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    libs.iter()
        .filter_map(|lib| match lib {
            Value::Array(fields) => fields
                .chunks(2)
                .find(|kv| text(&kv[0]).as_deref() == Some("library_name"))
                .and_then(|kv| kv.get(1).and_then(text)),
            Value::Map(pairs) => pairs
                .iter()
                .find(|(k, _)| text(k).as_deref() == Some("library_name"))
                .and_then(|(_, v)| text(v)),
            _ => None,
        })
        .collect()
}

/// One command; a refusal in the reply becomes an error.
async fn send<C: ConnectionLike + Send>(conn: &mut C, cmd: &Cmd) -> RedisResult<Value> {
    conn.req_packed_command(cmd)
        .await
        .and_then(Value::extract_error)
}

/// The library holds no list of the version a TAKE's changes were sent against.
fn args_missed(e: &redis::RedisError) -> bool {
    e.code() == Some(super::take_args::MISS) || e.to_string().contains(super::take_args::MISS)
}

/// `ERR Function not found`: the library is not (or no longer) loaded.
fn function_missing(e: &redis::RedisError) -> bool {
    e.code() == Some("ERR") && e.to_string().contains("Function not found")
}

/// The tallied script of job-path call `op` (src/store/tally.rs).
pub(crate) fn tallied_script(op: &str) -> &'static redis::Script {
    let s = &scripts().tallied;
    match op {
        "reserve" => &s.reserve,
        "acquire" => &s.acquire,
        "finish" => &s.finish,
        "take" => &s.take,
        "batch" => &s.batch,
        "push" => &scripts().push,
        "push_at" => &scripts().push_at,
        _ => &s.finish_reserve,
    }
}
