//! RESERVE, alone or carrying the slot's last FINISH (`finish_reserve.lua`).

use super::finish::finish_parts;
use super::scripts::scripts;
use super::{text, unexpected, FinishHolds, FinishRequest, Reserved, SlotRef};
use crate::conn::evalsha;
use redis::aio::ConnectionLike;
use redis::{Cmd, RedisResult, Value};

/// RESERVE's keys, written into `cmd` (as [`evalsha`] fills it).
pub(super) fn reserve_keys(cmd: &mut Cmd, slot: &SlotRef<'_>) {
    cmd.arg(slot.keys.inflight(slot.slot_key))
        .arg(slot.keys.pause_all());
}

/// What a RESERVE is told besides its queues (reserve.lua's flags). A `bool` converts to the
/// flags of a RESERVE that clears counters or not and looks at every key's type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReserveFlags {
    /// Clear the counters of skipped queues when nothing was reserved (`clear_counters_when_idle`).
    pub clear_counters_when_idle: bool,
    /// The worker looked at the types of the pause and cap keys less than a second ago, so a
    /// RESERVE fused with its slot's FINISH may take its `MGET` of them as the whole answer
    /// a key of another type is then seen by the worker's next look, within a second).
    pub guard_types_seen: bool,
}

impl From<bool> for ReserveFlags {
    fn from(clear_counters_when_idle: bool) -> Self {
        ReserveFlags {
            clear_counters_when_idle,
            guard_types_seen: false,
        }
    }
}

impl ReserveFlags {
    fn arg(self) -> &'static str {
        match (self.clear_counters_when_idle, self.guard_types_seen) {
            (false, false) => "0",
            (true, false) => "1",
            (false, true) => "2",
            (true, true) => "3",
        }
    }
}

/// RESERVE's arguments: the queue keys are built from the names in the script.
pub(super) fn reserve_args(
    cmd: &mut Cmd,
    slot: &SlotRef<'_>,
    rid: &str,
    queues: &[String],
    flags: ReserveFlags,
) {
    cmd.arg(rid)
        .arg(slot.worker_id)
        .arg(flags.arg())
        .arg(slot.keys.locket_prefix())
        .arg(slot.keys.queue(""))
        .arg(super::wall_ms());
    for q in queues {
        cmd.arg(q.as_str());
    }
}

/// Marks the RESERVE part of a FINISH+RESERVE that raised (finish_reserve.lua).
const RESERVE_ERROR: &[u8] = b"__locket_reserve_error__";

/// The RESERVE part of a call that carried a FINISH: its reply, or the error it raised after
/// the FINISH landed (finish_reserve.lua's marker).
pub(super) fn parse_after_finish(reserved: Vec<Value>) -> RedisResult<Reserved> {
    match reserved.as_slice() {
        [Value::BulkString(mark), msg] if mark == RESERVE_ERROR => Err(redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "RESERVE failed after its FINISH landed",
            text(msg),
        ))),
        _ => parse_reserved(reserved),
    }
}

pub(super) fn parse_reserved(reply: Vec<Value>) -> RedisResult<Reserved> {
    match reply.first().map(text).as_deref() {
        Some("job") if reply.len() == 4 || reply.len() == 5 => Ok(Reserved::Job {
            queue: text(&reply[1]),
            payload: match &reply[2] {
                Value::BulkString(b) => b.clone(),
                other => text(other).into_bytes(),
            },
            rid: text(&reply[3]),
            odd_guards: reply.get(4).is_some_and(|v| text(v) == "1"),
        }),
        Some("nothing") => {
            let names = |v: Option<&Value>| match v {
                Some(Value::Array(a)) => a.iter().map(text).collect(),
                _ => Vec::new(),
            };
            Ok(Reserved::Nothing {
                skipped: names(reply.get(1)),
                unreadable: names(reply.get(2)),
                paused: names(reply.get(3)),
                capped: names(reply.get(4)),
                refused: names(reply.get(5)),
            })
        }
        Some("paused") => Ok(Reserved::Paused),
        Some("busy") => Ok(Reserved::Busy),
        Some("dead") => Ok(Reserved::Dead),
        _ => unexpected("reserve", &Value::Array(reply)),
    }
}

/// RESERVE: pop the first job whose queue is not skipped, into the slot's inflight record.
pub async fn reserve<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    rid: &str,
    queues: &[String],
    flags: impl Into<ReserveFlags>,
) -> RedisResult<Reserved> {
    let flags = flags.into();
    let reply: Value = evalsha(conn, &scripts().direct.reserve, 2, |cmd| {
        reserve_keys(cmd, slot);
        reserve_args(cmd, slot, rid, queues, flags);
    })
    .await?;
    match reply {
        Value::Array(reply) => parse_reserved(reply),
        other => unexpected("reserve", &other),
    }
}

/// FINISH of the slot's job and RESERVE of its next one in one round trip. Returns whether the
/// FINISH found its reservation (as [`super::finish_with`]) and the reservation. An `Ok` means the
/// FINISH landed, even when the RESERVE failed (the inner error): the FINISH must then not be
/// sent again, as a second one would release the job's holds twice (D-8).
#[allow(clippy::too_many_arguments)]
pub async fn finish_and_reserve<C: ConnectionLike + Send>(
    conn: &mut C,
    slot: &SlotRef<'_>,
    req: &FinishRequest<'_>,
    holds: &FinishHolds<'_>,
    rid: &str,
    queues: &[String],
    flags: impl Into<ReserveFlags>,
) -> RedisResult<(bool, RedisResult<Reserved>)> {
    let flags = flags.into();
    let (fkeys, fargs) = finish_parts(slot, req, holds);
    let numkeys = fkeys.len() + 2;
    let reply: Value = evalsha(conn, &scripts().direct.finish_reserve, numkeys, |cmd| {
        for k in &fkeys {
            cmd.arg(k.as_str());
        }
        reserve_keys(cmd, slot);
        cmd.arg(fkeys.len()).arg(fargs.len());
        for a in &fargs {
            cmd.arg(a.as_str());
        }
        reserve_args(cmd, slot, rid, queues, flags);
    })
    .await?;
    let Value::Array(reply) = reply else {
        return unexpected("finish_reserve", &Value::Nil);
    };
    match <[Value; 2]>::try_from(reply) {
        Ok([finished, Value::Array(reserved)]) => {
            Ok((text(&finished) == "ok", parse_after_finish(reserved)))
        }
        Ok(other) => unexpected("finish_reserve", &Value::Array(other.to_vec())),
        Err(v) => unexpected("finish_reserve", &Value::Array(v)),
    }
}
