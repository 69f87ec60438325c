//! The job path's Redis connection. In the multi-slot mode, the calls of the job-path scripts
//! (RESERVE, ACQUIRE+START, FINISH, FINISH+RESERVE) that the slots of one process make at the
//! same moment go to Redis as one `batch.lua` call; every other command passes straight
//! through to the shared multiplexed connection.
//!
//! Why: most of a job's Redis CPU is spent per script call and per `redis.call`, not on the
//! data (docs/dev/performance-log.md). A batch pays the call, the lib prefix and one `MGET` of what its
//! calls read (the pause flag, the leases, the counters, the limit-1 locks) for all its jobs.
//! It changes no rule: each call of a batch runs the same script body in the same order as it
//! would alone, and the batch is one atomic step, which is stronger, not weaker.
//!
//! Every job-path call on this connection, batched or alone, runs the script's tallied
//! variant: its O-3 counts come back with the reply and go to the connection's [`Tally`],
//! which the worker writes at most once per second (src/store/tally.rs).
//!
//! A one-slot process sends its job-path scripts on a [`Plain`] connection of their own
//! where its URL allows one (src/conn/plain.rs): one call at a time is all it makes.
//!
//! Batching is group commit without a timer: a call waits only while an earlier batch is on
//! the wire (at most [`IN_FLIGHT`] at once); whatever arrived meanwhile leaves in the next
//! batch. A lone call therefore goes out at once.

use super::fcall::Mode;
use super::scripts::scripts;
use super::tally::Tally;
use crate::conn::{Manager, Plain};
use redis::aio::ConnectionLike;
use redis::{Arg, Cmd, ErrorKind, RedisError, RedisFuture, RedisResult, Value};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot, Semaphore};

/// Most calls per batch.
pub const MAX_BATCH: usize = 64;
/// Batches on the wire at once.
pub const IN_FLIGHT: usize = 2;

/// Marks a call of a batch that raised (batch.lua).
const CALL_ERROR: &[u8] = b"__locket_batch_error__";

/// A Redis connection that batches the job-path scripts of the slots sharing it.
#[derive(Clone)]
pub struct Conn {
    inner: Manager,
    batcher: Option<mpsc::UnboundedSender<Call>>,
    tally: Arc<Tally>,
    /// FCALL or EVALSHA (fcall.rs).
    mode: Arc<Mode>,
    /// The job path's own connection of a one-slot process ([`Conn::with_plain`]).
    plain: Option<Arc<tokio::sync::Mutex<Plain>>>,
    /// How full the recent batches were ([`Fill`]); stays 0 on a connection that does not batch.
    fill: Arc<Fill>,
}

/// The mean number of calls in the connection's recent batches, as a moving average over
/// about the last 8 batches (in sixteenths of a call, written by the batching task alone).
///
/// Calls gather in a batch while earlier batches are on the wire, so a full batch means the
/// slots spend their time waiting on Redis, and a batch of one or two that each job's own
/// path (its handler, its frames) takes longer than a round trip: the worker's TAKE choice in
/// the multi-slot mode reads it (src/worker/take.rs, `take_fits`).
#[derive(Debug, Default)]
pub struct Fill(AtomicU32);

impl Fill {
    /// Folds in one batch of `calls` calls.
    fn record(&self, calls: usize) {
        let old = i64::from(self.0.load(Ordering::Relaxed));
        let new = i64::try_from(calls.min(MAX_BATCH)).unwrap_or(0) * 16;
        let next = old + (new - old) / 8;
        self.0
            .store(u32::try_from(next).unwrap_or(0), Ordering::Relaxed);
    }

    /// The mean calls per batch (0 before the first batch).
    pub fn calls(&self) -> f64 {
        f64::from(self.0.load(Ordering::Relaxed)) / 16.0
    }
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("batched", &self.batcher.is_some())
            .finish()
    }
}

/// One script call waiting for its batch: the caller's `EVALSHA` command, kept whole (one
/// buffer) and read again when the batch is packed.
struct Call {
    op: &'static str,
    cmd: Cmd,
    numkeys: usize,
    reply: oneshot::Sender<RedisResult<Value>>,
}

impl Call {
    /// The keys (`true`) or the arguments (`false`) of the call.
    fn part(&self, keys: bool) -> impl Iterator<Item = &[u8]> {
        let (skip, take) = if keys {
            (3, self.numkeys)
        } else {
            (3 + self.numkeys, usize::MAX)
        };
        self.cmd
            .args_iter()
            .skip(skip)
            .take(take)
            .filter_map(|a| match a {
                Arg::Simple(b) => Some(b),
                _ => None,
            })
    }
}

impl Conn {
    /// Every command goes straight to `inner` (one slot per process).
    pub fn direct(inner: impl Into<Manager>) -> Conn {
        Conn {
            inner: inner.into(),
            batcher: None,
            tally: Arc::default(),
            mode: Arc::default(),
            plain: None,
            fill: Arc::default(),
        }
    }

    /// A direct connection whose job-path scripts go out on a [`Plain`] connection to `url`
    /// when it is a plain TCP or Unix socket URL (else on `inner`, like everything else).
    pub fn with_plain(inner: impl Into<Manager>, url: &str) -> Conn {
        Conn {
            plain: Plain::for_url(url).map(|p| Arc::new(tokio::sync::Mutex::new(p))),
            ..Conn::direct(inner)
        }
    }

    /// Job-path scripts are batched; needs a Tokio runtime. The batching task ends when the
    /// last clone of the returned connection is dropped.
    pub fn batched(inner: impl Into<Manager>) -> Conn {
        let inner = inner.into();
        let (tx, rx) = mpsc::unbounded_channel();
        let tally = Arc::<Tally>::default();
        let mode = Arc::<Mode>::default();
        let fill = Arc::<Fill>::default();
        tokio::spawn(run(
            inner.clone(),
            rx,
            tally.clone(),
            mode.clone(),
            fill.clone(),
        ));
        Conn {
            inner,
            batcher: Some(tx),
            tally,
            mode,
            plain: None,
            fill,
        }
    }

    /// How full this connection's recent batches were (always 0 when it does not batch).
    pub fn batch_fill(&self) -> f64 {
        self.fill.calls()
    }

    /// Records its FUNCTION library's loads in `key` (`<ns>:locket:functions`) and deletes
    /// other builds' libraries not loaded for a day (fcall.rs); a connection not told so
    /// does neither.
    pub fn record_libraries_in(&self, key: String) {
        self.mode.record_libraries_in(key);
    }

    /// Whether its job-path calls go out as FCALL of the locketd library (after the first
    /// call; false where Redis has no FUNCTION).
    pub fn uses_functions(&self) -> bool {
        self.mode.functions()
    }

    /// The O-3 counts of the job-path scripts sent on this connection, to be flushed
    /// (src/store/tally.rs).
    pub fn tally(&self) -> &Arc<Tally> {
        &self.tally
    }

    /// The underlying connection, for what is never batched.
    pub fn manager(&self) -> &Manager {
        &self.inner
    }
}

/// The batch.lua name of a job-path script, by its SHA1.
fn op_of(sha: &[u8]) -> Option<&'static str> {
    let s = &scripts().direct;
    [
        (&s.reserve, "reserve"),
        (&s.acquire, "acquire"),
        (&s.finish, "finish"),
        (&s.finish_reserve, "finish_reserve"),
        (&s.take, "take"),
    ]
    .into_iter()
    .find(|(script, _)| script.get_hash().as_bytes() == sha)
    .map(|(_, op)| op)
}

/// `EVALSHA <sha> <numkeys> key... arg...` of a job-path script: its batch.lua name and its
/// number of keys.
fn split(cmd: &Cmd) -> Option<(&'static str, usize)> {
    let mut args = cmd.args_iter().map(|a| match a {
        Arg::Simple(b) => Some(b),
        _ => None,
    });
    if !args.next()??.eq_ignore_ascii_case(b"EVALSHA") {
        return None;
    }
    let op = op_of(args.next()??)?;
    let numkeys: usize = std::str::from_utf8(args.next()??).ok()?.parse().ok()?;
    let mut rest = 0;
    for a in args {
        a?;
        rest += 1;
    }
    (rest >= numkeys).then_some((op, numkeys))
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        if let Some(tx) = &self.batcher {
            if let Some((op, numkeys)) = split(cmd) {
                let (reply, rx) = oneshot::channel();
                if tx
                    .send(Call {
                        op,
                        cmd: cmd.clone(),
                        numkeys,
                        reply,
                    })
                    .is_ok()
                {
                    return Box::pin(async move {
                        rx.await.unwrap_or_else(|_| {
                            Err(RedisError::from((
                                ErrorKind::Io,
                                "batched call dropped: the connection's batching task ended",
                            )))
                        })
                    });
                }
            }
        }
        if let Some((op, _)) = split(cmd) {
            // Alone: the same call to the tallied variant (the library's function, or the
            // tallied script), its counts kept here.
            let (mut inner, tally, mode) =
                (self.inner.clone(), self.tally.clone(), self.mode.clone());
            let plain = self.plain.clone();
            return Box::pin(async move {
                let copy_args = |out: &mut Cmd| {
                    for a in cmd.args_iter().skip(2) {
                        if let Arg::Simple(b) = a {
                            out.arg(b);
                        }
                    }
                };
                let v = match plain {
                    Some(plain) => mode.call_plain(&mut *plain.lock().await, op, cmd).await?,
                    None => mode.call(&mut inner, op, copy_args).await?,
                };
                tally.split_reply(v)
            });
        }
        self.inner.req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.inner.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

/// Gathers calls into batches until every sender is gone.
async fn run(
    conn: Manager,
    mut rx: mpsc::UnboundedReceiver<Call>,
    tally: Arc<Tally>,
    mode: Arc<Mode>,
    fill: Arc<Fill>,
) {
    let permits = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        // Waiting for a free permit is what lets calls gather.
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let mut calls = vec![first];
        while calls.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(c) => calls.push(c),
                Err(_) => break,
            }
        }
        fill.record(calls.len());
        let mut c = conn.clone();
        let (tally, mode) = (tally.clone(), mode.clone());
        tokio::spawn(async move {
            send(&mut c, calls, &tally, &mode).await;
            drop(permit);
        });
    }
}

/// One batch.lua call; every call gets its own reply, or the batch's error.
async fn send(conn: &mut Manager, calls: Vec<Call>, tally: &Tally, mode: &Mode) {
    let numkeys: usize = calls.iter().map(|c| c.numkeys).sum();
    let result = mode
        .call(conn, "batch", |cmd| {
            cmd.arg(numkeys);
            for c in &calls {
                for k in c.part(true) {
                    cmd.arg(k);
                }
            }
            cmd.arg(calls.len());
            for c in &calls {
                let nargs = c.part(false).count();
                cmd.arg(c.op).arg(c.numkeys).arg(nargs);
            }
            for c in &calls {
                for a in c.part(false) {
                    cmd.arg(a);
                }
            }
        })
        .await;
    // The batch's counts go to the connection's sums (tally.rs); each call gets its reply with
    // no counts, in the shape a lone call's has.
    let result = result.and_then(|v| tally.split_reply(v));
    match result {
        Ok(Value::Array(replies)) if replies.len() == calls.len() => {
            for (c, v) in calls.into_iter().zip(replies) {
                let _ = c.reply.send(call_result(v));
            }
        }
        Ok(other) => {
            for c in calls {
                let _ = c.reply.send(Err(RedisError::from((
                    ErrorKind::UnexpectedReturnType,
                    "unexpected batch reply",
                    format!("{other:?}"),
                ))));
            }
        }
        Err(e) => {
            // Each call gets the batch's error itself: its kind and its code (OOM, BUSY,
            // NOAUTH, ... have no kind of their own) are what classify reads.
            for c in calls {
                let _ = c.reply.send(Err(e.clone()));
            }
        }
    }
}

/// A call's reply, or its error as batch.lua reported it.
fn call_result(v: Value) -> RedisResult<Value> {
    if let Value::Array(items) = &v {
        if let [Value::BulkString(mark), msg] = items.as_slice() {
            if mark == CALL_ERROR {
                let msg = match msg {
                    Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                    other => format!("{other:?}"),
                };
                return Err(RedisError::from((
                    ErrorKind::Server(redis::ServerErrorKind::ResponseError),
                    "script error",
                    msg,
                )));
            }
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evalsha(sha: &str, keys: &[&str], args: &[&str]) -> Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(sha).arg(keys.len()).arg(keys).arg(args);
        cmd
    }

    #[test]
    fn job_path_scripts_are_taken_apart_and_others_pass_through() {
        let s = scripts();
        let cmd = evalsha(
            s.direct.acquire.get_hash(),
            &["k1", "k2"],
            &["a1", "a2", "a3"],
        );
        let (op, numkeys) = split(&cmd).expect("acquire is batched");
        assert_eq!((op, numkeys), ("acquire", 2));
        let call = Call {
            op,
            cmd,
            numkeys,
            reply: oneshot::channel().0,
        };
        assert_eq!(call.part(true).collect::<Vec<_>>(), [b"k1", b"k2"]);
        assert_eq!(call.part(false).collect::<Vec<_>>(), [b"a1", b"a2", b"a3"]);

        // Not on the job path: the janitor's scripts, plain commands, bad key counts.
        assert!(split(&evalsha(s.purge.get_hash(), &["k"], &[])).is_none());
        assert!(split(redis::cmd("GET").arg("k")).is_none());
        assert!(split(&evalsha(s.direct.finish.get_hash(), &["k"], &[])).is_some());
        let mut short = redis::cmd("EVALSHA");
        short
            .arg(s.direct.finish.get_hash())
            .arg(3)
            .arg("only-one-key");
        assert!(split(&short).is_none());
    }

    #[test]
    fn a_call_that_raised_becomes_its_own_error() {
        let failed = Value::Array(vec![
            Value::BulkString(CALL_ERROR.to_vec()),
            Value::BulkString(b"WRONGTYPE Operation against a key".to_vec()),
        ]);
        let e = call_result(failed).expect_err("marked as failed");
        assert!(e.to_string().contains("WRONGTYPE"), "{e}");
        let ok = Value::Array(vec![
            Value::BulkString(b"job".to_vec()),
            Value::BulkString(b"q".to_vec()),
        ]);
        assert_eq!(call_result(ok.clone()).expect("a reply"), ok);
    }

    #[test]
    fn fill_is_a_moving_mean_of_the_batch_sizes() {
        let f = Fill::default();
        assert_eq!(f.calls(), 0.0);
        for _ in 0..64 {
            f.record(32);
        }
        assert!((f.calls() - 32.0).abs() < 1.0, "{}", f.calls());
        // A run of single calls brings it down within a few dozen batches.
        for _ in 0..40 {
            f.record(1);
        }
        assert!(f.calls() < 2.0, "{}", f.calls());
        // A batch is counted at most as MAX_BATCH calls.
        for _ in 0..200 {
            f.record(10_000);
        }
        assert!(f.calls() <= MAX_BATCH as f64, "{}", f.calls());
    }
}
