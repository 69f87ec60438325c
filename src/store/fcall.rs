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

use super::scripts::scripts;
use crate::conn::is_refusal;
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{Cmd, ErrorKind, RedisResult, ServerErrorKind, Value};
use std::sync::atomic::{AtomicU8, Ordering};
use tracing::{info, warn};

const UNKNOWN: u8 = 0;
const FUNCTIONS: u8 = 1;
const SCRIPTS: u8 = 2;

/// Whether this connection's Redis runs the library (shared by a connection's clones).
#[derive(Debug, Default)]
pub(crate) struct Mode(AtomicU8);

impl Mode {
    fn get(&self) -> u8 {
        self.0.load(Ordering::Relaxed)
    }

    /// Whether job-path calls go out as FCALL (false until the first call has loaded the
    /// library).
    pub(crate) fn functions(&self) -> bool {
        self.get() == FUNCTIONS
    }

    /// Calls job-path script `op` ("reserve", "acquire", "finish", "finish_reserve" or
    /// "batch"); `fill` writes what follows the function's name or the script's SHA1 (the
    /// number of keys, the keys, the arguments). A refusal comes back as an error.
    pub(crate) async fn call(
        &self,
        conn: &mut ConnectionManager,
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

    /// `FUNCTION LOAD` of the library: FCALL from now on when it loads (or was loaded by
    /// another process), EVALSHA for good when Redis refuses FUNCTION; an outage is returned
    /// (the caller retries the call as any other).
    async fn load(&self, conn: &mut ConnectionManager) -> RedisResult<()> {
        let lib = &scripts().library;
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
        Ok(())
    }
}

/// One command; a refusal in the reply becomes an error.
async fn send(conn: &mut ConnectionManager, cmd: &Cmd) -> RedisResult<Value> {
    conn.req_packed_command(cmd)
        .await
        .and_then(Value::extract_error)
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
        "batch" => &s.batch,
        _ => &s.finish_reserve,
    }
}
