//! H-18: the frames of a threaded handler's process: its `ready` at boot, then each frame
//! routed by id to the job (or failure-hooks request) waiting for it.

use super::frame::Frame;
use super::pool::{Kill, PProc, Pool};
use super::proc::{self, FrameResult, Proc};
use super::*;
use tokio::sync::mpsc;

/// Routes each frame of `p` to the job it names (H-18). A frame for no outstanding job (but
/// a late `group`), a second `ready`, or a bad frame is a protocol error (H-5): the process
/// is killed.
pub(super) async fn demux(pool: Arc<Pool>, p: Arc<PProc>, mut frames: mpsc::Receiver<FrameResult>) {
    // SAFETY: getpgrp(2) only reads.
    let own = unsafe { libc::getpgrp() };
    while let Some(f) = frames.recv().await {
        let error = match f {
            Ok(Frame::Started { id, child_pid }) => {
                let tx = p.route(&id);
                match tx {
                    Some(tx) => {
                        let _ = tx.send(Frame::Started { id, child_pid });
                        continue;
                    }
                    None => format!("a started frame for no running job ({id})"),
                }
            }
            Ok(Frame::Done {
                id,
                outcome,
                recorded,
            }) => {
                let tx = p.route(&id);
                match tx {
                    Some(tx) => {
                        let _ = tx.send(Frame::Done {
                            id,
                            outcome,
                            recorded,
                        });
                        continue;
                    }
                    None => format!("a done frame for no running job ({id})"),
                }
            }
            Ok(Frame::Group { id, pgid }) => {
                if pgid != p.pgid && pgid != own {
                    p.add_group(&id, pgid);
                }
                continue;
            }
            Ok(Frame::Bye { reason }) => {
                debug!(target: LOG_TARGET, handler = %pool.spec.name, pid = p.pid, reason = %reason, "handler said bye");
                p.state(|s| s.bye = true);
                pool.retire(&p, "bye");
                continue;
            }
            Ok(other) => format!("a frame out of turn: {other:?}"),
            Err(e) => e.to_string(),
        };
        warn!(target: LOG_TARGET, handler = %pool.spec.name, pid = p.pid, error = %error, "handler broke the protocol; killing it");
        p.kill(Kill::Protocol(error));
        return;
    }
}

/// The first frame must be `ready`, within `boot_timeout` (H-8).
pub(super) async fn ready_frame(
    p: &mut Proc,
    boot_timeout: Duration,
    stopping: &CancellationToken,
) -> Result<(Vec<String>, Option<u64>), String> {
    let deadline = tokio::time::Instant::now() + boot_timeout;
    let mut exit = p.exit_watch();
    let mut frames_open = true;
    loop {
        tokio::select! {
            f = p.frames.recv(), if frames_open => match f {
                Some(Ok(Frame::Ready { features, pid, .. })) => return Ok((features, pid)),
                Some(Ok(other)) => return Err(format!("sent {other:?} before ready")),
                Some(Err(e)) => return Err(format!("protocol error before ready: {e}")),
                None => frames_open = false,
            },
            status = proc::exited(&mut exit) => {
                return Err(format!("exited before ready ({})", describe(status)));
            }
            _ = tokio::time::sleep_until(deadline) => {
                return Err(format!("no ready within boot_timeout ({}s)", boot_timeout.as_secs_f64()));
            }
            _ = stopping.cancelled() => return Err("the worker is stopping".to_string()),
        }
    }
}
