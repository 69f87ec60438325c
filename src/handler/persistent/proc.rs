//! One persistent handler process (H-3): spawned with the request pipe on fd 3 and the reply
//! pipe on fd 4, fd 0 on `/dev/null`, stdout and stderr logged line by line under the current
//! job's class and queue; its exit watched by a task of its own (H-10: death is seen by the
//! exit, not by the end of fd 4).

use super::frame::{read_frames, Frame, ProtocolError};
use crate::handler::command::{base_command, GroupGuard};
use crate::handler::lines::{for_each_line, STDERR_TAIL_LINES};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, watch, Notify};

/// What a frame read gives: a frame, or the protocol error that ended the reading.
pub(super) type FrameResult = Result<Frame, ProtocolError>;

/// The class and queue the handler's output lines are logged under (`handler` while idle).
#[derive(Debug, Clone)]
pub(super) struct Tag {
    pub(super) class: String,
    pub(super) queue: String,
}

impl Tag {
    fn idle() -> Tag {
        Tag {
            class: "handler".to_string(),
            queue: String::new(),
        }
    }
}

/// Whether the handler has a request outstanding, shared by the slot and the reader of fd 4:
/// a frame read while none is (H-5: a frame while idle) wakes [`Idle::frame`]'s waiter,
/// which ends the process.
#[derive(Debug)]
pub(super) struct Idle {
    busy: AtomicBool,
    pub(super) frame: Notify,
}

impl Idle {
    /// After the reader handed a frame over.
    fn frame_sent(&self) {
        if !self.busy.load(Ordering::SeqCst) {
            self.frame.notify_one();
        }
    }

    pub(super) fn busy(&self) -> bool {
        self.busy.load(Ordering::SeqCst)
    }
}

/// What spawning needs.
pub(super) struct SpawnSpec<'a> {
    pub(super) name: &'a str,
    pub(super) argv: &'a [String],
    pub(super) dir: Option<&'a std::path::Path>,
    pub(super) env: &'a [(String, String)],
    pub(super) max_frame: usize,
}

/// A live (or just exited) handler process.
pub(super) struct Proc {
    pub(super) pid: u32,
    /// Its process group (= pid).
    pgid: i32,
    /// The write end of the request pipe (fd 3 in the handler); `None` once closed.
    requests: Option<pipe::Sender>,
    /// Frames read from fd 4, one at a time (H-5).
    pub(super) frames: mpsc::Receiver<FrameResult>,
    /// Whether a request is outstanding; a frame while none is.
    pub(super) idle: Arc<Idle>,
    /// Its exit status, once it exited.
    exit: watch::Receiver<Option<ExitStatus>>,
    tag: Arc<Mutex<Tag>>,
    tail: Arc<Mutex<VecDeque<String>>>,
    /// Whether locketd signalled the group (a death by signal is then not a DirtyExit).
    pub(super) signalled: bool,
    pub(super) spawned_at: Instant,
    /// Jobs served by this incarnation.
    pub(super) jobs: u64,
    /// `max_jobs` plus this incarnation's jitter (0: unlimited).
    pub(super) max_jobs: u64,
    /// The `ready` frame's features (`fork`: memory is the parent's PSS).
    pub(super) fork: bool,
    pub(super) ready_at: Option<Instant>,
    /// The handler said `bye`: it exits after this job.
    pub(super) bye: bool,
    /// When its memory was last read for `status`.
    memory_read: Option<Instant>,
    /// `ns_last_pid` when its group was last found to hold only the handler, and when.
    quiet: Option<(i32, Instant)>,
    /// The handler's own processes, spared by [`Proc::kill_others`]: the spawned one, and
    /// once it is ready, the one that said so and those between them (a wrapper that forks).
    handler_pids: Vec<i32>,
    logs: [tokio::task::JoinHandle<()>; 2],
    reader: tokio::task::JoinHandle<()>,
    guard: GroupGuard,
}

impl Drop for Proc {
    fn drop(&mut self) {
        // GroupGuard's own drop SIGKILLs the group; the readers go with it.
        self.logs.iter().for_each(|t| t.abort());
        self.reader.abort();
    }
}

fn pipe_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into `fds`; each is owned exactly once below.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are not owned elsewhere.
    unsafe { Ok((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))) }
}

/// In a forked child before exec: the protocol pipes' ends `child_in` and `child_out` become
/// fds 3 and 4. Only fcntl, dup2 and close run, all async-signal-safe; the copies above 10
/// keep a descriptor that happens to be 3 or 4 from being overwritten before it is moved.
pub fn protocol_fds_in_child(child_in: RawFd, child_out: RawFd) -> std::io::Result<()> {
    // SAFETY: plain descriptor calls on descriptors the child has; no allocation.
    unsafe {
        let a = libc::fcntl(child_in, libc::F_DUPFD, 10);
        let b = libc::fcntl(child_out, libc::F_DUPFD, 10);
        if a < 0 || b < 0 || libc::dup2(a, 3) < 0 || libc::dup2(b, 4) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        libc::close(a);
        libc::close(b);
    }
    Ok(())
}

impl Proc {
    /// Spawns the handler. Its fds 3 and 4 are the only pipe ends it inherits: every other
    /// descriptor of the worker is close-on-exec.
    pub(super) fn spawn(spec: &SpawnSpec<'_>) -> std::io::Result<Proc> {
        let (req_r, req_w) = pipe_pair()?;
        let (rep_r, rep_w) = pipe_pair()?;
        let mut cmd = base_command(spec.argv, spec.dir, spec.env);
        cmd.env("LOCKETD_PROTOCOL", "1")
            .env("LOCKETD_PROTOCOL_FDS", "3,4")
            .env("LOCKETD_HANDLER", spec.name)
            .stdin(Stdio::null());
        let (child_in, child_out) = (req_r.as_raw_fd(), rep_w.as_raw_fd());
        // SAFETY: protocol_fds_in_child is async-signal-safe, on descriptors that exist in the
        // child.
        unsafe {
            cmd.pre_exec(move || protocol_fds_in_child(child_in, child_out));
        }
        let mut child = cmd.spawn()?;
        // The child has its copies; the worker keeps only its own ends.
        drop(req_r);
        drop(rep_w);
        let pid = child.id().unwrap_or(0);
        let requests = pipe::Sender::from_owned_fd(req_w)?;
        let replies = pipe::Receiver::from_owned_fd(rep_r)?;
        // Room for one frame: the reader reads the next only once this one was received.
        let (tx, frames) = mpsc::channel(1);
        // Booting: `ready` is expected.
        let idle = Arc::new(Idle {
            busy: AtomicBool::new(true),
            frame: Notify::new(),
        });
        let reader = tokio::spawn(read_frames(replies, spec.max_frame, tx, {
            let idle = idle.clone();
            move || idle.frame_sent()
        }));
        let tag = Arc::new(Mutex::new(Tag::idle()));
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let logs = [
            log_lines(child.stdout.take(), spec.name, tag.clone(), None),
            log_lines(
                child.stderr.take(),
                spec.name,
                tag.clone(),
                Some(tail.clone()),
            ),
        ];
        let (exit_tx, exit) = watch::channel(None);
        tokio::spawn(async move {
            if let Ok(status) = child.wait().await {
                exit_tx.send_replace(Some(status));
            }
        });
        let pgid = i32::try_from(pid).unwrap_or(0);
        Ok(Proc {
            pid,
            pgid,
            requests: Some(requests),
            frames,
            idle,
            exit,
            tag,
            tail,
            signalled: false,
            spawned_at: Instant::now(),
            jobs: 0,
            max_jobs: 0,
            fork: false,
            ready_at: None,
            bye: false,
            memory_read: None,
            quiet: None,
            handler_pids: vec![pgid],
            logs,
            reader,
            guard: GroupGuard {
                pgid: Some(pgid).filter(|p| *p > 0),
            },
        })
    }

    pub(super) fn pgid(&self) -> i32 {
        self.pgid
    }

    /// Signals the whole process group.
    pub(super) fn signal(&mut self, sig: i32) {
        self.signalled = true;
        self.guard.signal(sig);
    }

    /// Its exit status, if it has exited.
    pub(super) fn exited(&self) -> Option<ExitStatus> {
        *self.exit.borrow()
    }

    /// Waits for the exit (cancel-safe).
    pub(super) async fn wait_exit(&mut self) -> ExitStatus {
        exited(&mut self.exit).await
    }

    /// A receiver of the exit status, to wait on beside other borrows of the process.
    pub(super) fn exit_watch(&self) -> watch::Receiver<Option<ExitStatus>> {
        self.exit.clone()
    }

    /// Writes one frame line. A cancelled write leaves the pipe in an unknown state: the
    /// caller then ends the process.
    pub(super) async fn send(&mut self, line: &[u8]) -> std::io::Result<()> {
        match self.requests.as_mut() {
            Some(w) => w.write_all(line).await,
            None => Err(std::io::ErrorKind::BrokenPipe.into()),
        }
    }

    /// Takes the request pipe out, for a write that runs beside reads of the process.
    pub(super) fn take_requests(&mut self) -> Option<pipe::Sender> {
        self.requests.take()
    }

    /// Puts the request pipe back after [`Proc::take_requests`].
    pub(super) fn put_requests(&mut self, w: Option<pipe::Sender>) {
        self.requests = w;
    }

    /// Closes fd 3: the handler reads its end and exits (H-12, H-13).
    pub(super) fn close_requests(&mut self) {
        self.requests = None;
    }

    pub(super) fn set_tag(&self, class: &str, queue: &str) {
        *self.tag.lock().unwrap_or_else(|p| p.into_inner()) = Tag {
            class: class.to_string(),
            queue: queue.to_string(),
        };
    }

    /// A request goes out: frames are expected.
    pub(super) fn set_busy(&self) {
        self.idle.busy.store(true, Ordering::SeqCst);
    }

    /// No request is outstanding: a frame from now on ends the process (H-5). One that came
    /// in just before is seen here (the reader checks after it sent, this after it stored).
    pub(super) fn set_idle(&self) {
        *self.tag.lock().unwrap_or_else(|p| p.into_inner()) = Tag::idle();
        self.idle.busy.store(false, Ordering::SeqCst);
        if !self.frames.is_empty() {
            self.idle.frame.notify_one();
        }
    }

    /// The last stderr lines.
    pub(super) fn tail(&self) -> Vec<String> {
        let t = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        t.iter().cloned().collect()
    }

    pub(super) fn clear_tail(&self) {
        self.tail.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Whether a second has passed since the memory was last read for `status`.
    pub(super) fn memory_read_due(&mut self) -> bool {
        let due = self
            .memory_read
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
        if due {
            self.memory_read = Some(Instant::now());
        }
        due
    }

    /// The handler's memory: resident size, or in fork mode the parent's proportional share
    /// (PSS), which does not count the pages its forked children share with it.
    pub(super) fn memory(&self) -> Option<u64> {
        let (file, field) = if self.fork {
            (format!("/proc/{}/smaps_rollup", self.pid), "Pss:")
        } else {
            (format!("/proc/{}/status", self.pid), "VmRSS:")
        };
        let text = std::fs::read_to_string(file).ok()?;
        let line = text.lines().find(|l| l.starts_with(field))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }

    /// SIGKILLs the group, waits for the handler's exit, and then until no process of the
    /// group is left (bounded: orphans are reaped by the master, the child subreaper). Gives
    /// the log readers a moment to pass on the last lines.
    pub(super) async fn kill_and_reap(&mut self) -> ExitStatus {
        self.signal(libc::SIGKILL);
        let status = self.wait_exit().await;
        let deadline = Instant::now() + Duration::from_secs(2);
        while group_alive(self.pgid) && Instant::now() < deadline {
            self.signal(libc::SIGKILL);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if group_alive(self.pgid) {
            tracing::warn!(target: super::LOG_TARGET, pgid = self.pgid, "a handler's process group still has members 2s after SIGKILL (unkillable or unreaped)");
        }
        self.drain_logs().await;
        status
    }

    /// Kills every other process of the handler's group (what a job or a hook started: a
    /// child, or a daemonized grandchild the master adopted) and waits until each is gone or
    /// a zombie, which can no longer act: a job's subprocesses do not outlive its `done`, as
    /// in exec mode (H-9). Bounded like [`Proc::kill_and_reap`]. Zombies are reaped by their
    /// parent: the handler for its own children, the master (the subreaper) for orphans.
    ///
    /// A group has no index, so finding its members takes a pass over `/proc`. The pass is
    /// skipped when no process (or thread) was created anywhere since the last one found the
    /// group empty, less than a second ago: the pid namespace's `ns_last_pid` did not move.
    /// (The second bounds the case of the pid counter wrapping around to the same value.)
    pub(super) async fn kill_others(&mut self) {
        let (pgid, keep) = (self.pgid, self.handler_pids.clone());
        if pgid <= 0 {
            return;
        }
        let last_pid = ns_last_pid();
        if let (Some(now), Some((then, at))) = (last_pid, self.quiet) {
            if now == then && at.elapsed() < QUIET_FOR {
                return;
            }
        }
        let confirmed = tokio::task::spawn_blocking(move || kill_group_but(pgid, keep))
            .await
            .unwrap_or(false);
        self.quiet = last_pid.filter(|_| confirmed).map(|l| (l, Instant::now()));
        if !confirmed {
            tracing::warn!(target: super::LOG_TARGET, pgid, "a job's subprocess in the handler's group is still alive 2s after SIGKILL (unkillable)");
        }
    }

    /// Records the pid its `ready` frame gave: that process, and each between it and the
    /// spawned one (a wrapper shell that forks the adapter instead of exec'ing it), are the
    /// handler. A pid outside the spawned one's descendants (or in another group) is ignored.
    pub(super) fn ready_pid(&mut self, pid: Option<u64>) {
        let spawned = self.pgid;
        let Some(mut pid) = pid.and_then(|p| i32::try_from(p).ok()) else {
            return;
        };
        let mut chain = Vec::new();
        // A few levels at most (sh -> bundle -> ruby); deeper is not a wrapper.
        for _ in 0..8 {
            // SAFETY: getpgid(2) only reads.
            if pid <= 1 || pid == spawned || unsafe { libc::getpgid(pid) } != self.pgid {
                break;
            }
            chain.push(pid);
            pid = parent_of(pid).unwrap_or(0);
        }
        if pid == spawned {
            self.handler_pids.extend(chain);
        }
    }

    /// Closes fd 3 and gives the handler `grace` to exit by itself, then kills what is left.
    pub(super) async fn retire(&mut self, grace: Duration) {
        self.close_requests();
        if self.exited().is_none() {
            let _ = tokio::time::timeout(grace, self.wait_exit()).await;
        }
        self.kill_and_reap().await;
    }

    async fn drain_logs(&mut self) {
        let [out, err] = &mut self.logs;
        let _ = tokio::time::timeout(Duration::from_millis(500), async {
            let _ = out.await;
            let _ = err.await;
        })
        .await;
    }
}

/// Waits until `exit` holds a status (cancel-safe).
pub(super) async fn exited(exit: &mut watch::Receiver<Option<ExitStatus>>) -> ExitStatus {
    loop {
        if let Some(s) = *exit.borrow_and_update() {
            return s;
        }
        if exit.changed().await.is_err() {
            // The waiter ended without a status (wait failed): treat it as killed.
            use std::os::unix::process::ExitStatusExt;
            return ExitStatus::from_raw(libc::SIGKILL);
        }
    }
}

/// Writes a short frame if the pipe takes it at once; never waits.
pub(super) fn try_send(w: Option<&pipe::Sender>, line: &[u8]) {
    if let Some(w) = w {
        let _ = w.try_write(line);
    }
}

/// A process's parent, from `/proc/<pid>/stat`.
fn parent_of(pid: i32) -> Option<i32> {
    // "S ppid ...": what follows the command name.
    let rest = crate::host::stat_fields(u32::try_from(pid).ok()?)?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The live (not zombie) processes of group `pgid` but those in `keep`. A group has no index:
/// every pid in `/proc` is asked its group with getpgid(2), one cheap system call (reading
/// each `/proc/<pid>/stat` costs 20 times more); only members get their `stat` read, for the
/// state letter.
fn other_members(pgid: i32, keep: &[i32]) -> Vec<i32> {
    let mut found = Vec::new();
    for pid in crate::host::pids() {
        let Ok(pid) = i32::try_from(pid) else {
            continue;
        };
        // SAFETY: getpgid(2) only reads.
        if keep.contains(&pid) || unsafe { libc::getpgid(pid) } != pgid {
            continue;
        }
        // A zombie is still in its group until reaped, but can no longer act; a process gone
        // meanwhile has no state.
        let state = crate::host::stat_fields(pid.unsigned_abs())
            .and_then(|rest| rest.split_whitespace().next().map(str::to_string));
        if !matches!(state.as_deref(), Some("Z" | "X") | None) {
            found.push(pid);
        }
    }
    found
}

/// SIGKILLs process `pid` if it is (still) in group `pgid`. Through a pidfd where the kernel
/// has them (5.3+): the pidfd pins the process, and the group is checked after it was
/// opened, so a pid reused by an unrelated process meanwhile is never signalled.
fn kill_member(pid: i32, pgid: i32) {
    // SAFETY: pidfd_open(2) with a pid and no flags; the descriptor is closed below.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: getpgid(2) reads; kill(2), pidfd_send_signal(2) and close(2) touch no memory
    // of ours (the siginfo pointer is null).
    unsafe {
        if fd >= 0 {
            let fd = i32::try_from(fd).unwrap_or(-1);
            if libc::getpgid(pid) == pgid {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    fd,
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                );
            }
            libc::close(fd);
        } else if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS)
            && libc::getpgid(pid) == pgid
        {
            // An old kernel: the check and the kill are two steps (a pid reused in between
            // by another member of the group is still the group's).
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

/// Kills the members of group `pgid` but those in `keep` until none is left alive (2 s at
/// most); whether that was confirmed. The common case, no other member, is one `/proc` pass.
fn kill_group_but(pgid: i32, keep: Vec<i32>) -> bool {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let members = other_members(pgid, &keep);
        if members.is_empty() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        for pid in members {
            kill_member(pid, pgid);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// How long a group found empty stays trusted while no process is created ([`Proc::kill_others`]).
const QUIET_FOR: Duration = Duration::from_secs(1);

/// The last pid handed out in this pid namespace (processes and threads alike), if readable.
/// Read once per job: the file stays open, and each read is one `pread` at offset 0 (procfs
/// formats the value anew for every read from the start).
fn ns_last_pid() -> Option<i32> {
    use std::os::unix::fs::FileExt;
    static FILE: std::sync::OnceLock<Option<std::fs::File>> = std::sync::OnceLock::new();
    let file = FILE
        .get_or_init(|| std::fs::File::open("/proc/sys/kernel/ns_last_pid").ok())
        .as_ref()?;
    let mut buf = [0u8; 32];
    let n = file.read_at(&mut buf, 0).ok()?;
    std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()
}

/// Whether any process of group `pgid` still exists (zombies count until reaped).
fn group_alive(pgid: i32) -> bool {
    if pgid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(-pgid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

fn log_lines<R>(
    r: Option<R>,
    name: &str,
    tag: Arc<Mutex<Tag>>,
    tail: Option<Arc<Mutex<VecDeque<String>>>>,
) -> tokio::task::JoinHandle<()>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    let name = name.to_string();
    tokio::spawn(async move {
        let Some(r) = r else { return };
        for_each_line(r, |line| {
            let t = tag.lock().unwrap_or_else(|p| p.into_inner()).clone();
            match &tail {
                None => {
                    tracing::info!(target: "locketd::handler", class = %t.class, queue = %t.queue, handler = %name, stream = "stdout", "{}", line)
                }
                Some(tail) => {
                    tracing::warn!(target: "locketd::handler", class = %t.class, queue = %t.queue, handler = %name, stream = "stderr", "{}", line);
                    let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
                    if tail.len() == STDERR_TAIL_LINES {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            }
        })
        .await;
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::Command;

    // The kept-open file gives the current value on every read, not the first one again: a
    // process started in between moves it (kill_others' shortcut depends on that).
    #[test]
    fn ns_last_pid_is_read_anew_each_time() {
        let Some(before) = super::ns_last_pid() else {
            return; // no /proc/sys here: kill_others then always looks at /proc
        };
        let mut child = Command::new("true").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let after = super::ns_last_pid().unwrap();
        child.wait().unwrap();
        assert_ne!(after, before);
        assert!(
            after >= pid || after < before,
            "{before} -> {after}, child {pid}"
        );
    }

    #[test]
    fn the_other_members_of_a_group_are_killed_and_its_leader_kept() {
        let mut leader = Command::new("sleep")
            .arg("60")
            .process_group(0)
            .spawn()
            .unwrap();
        let pgid = i32::try_from(leader.id()).unwrap();
        let mut members: Vec<_> = (0..2)
            .map(|_| {
                Command::new("sleep")
                    .arg("60")
                    .process_group(pgid)
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut outsider = Command::new("sleep").arg("60").spawn().unwrap();
        assert_eq!(super::other_members(pgid, &[pgid]).len(), 2);
        assert!(super::kill_group_but(pgid, vec![pgid]));
        for m in &mut members {
            assert_eq!(m.wait().unwrap().signal(), Some(libc::SIGKILL));
        }
        assert!(leader.try_wait().unwrap().is_none(), "the leader is kept");
        assert!(
            outsider.try_wait().unwrap().is_none(),
            "another group is not touched"
        );
        assert!(super::other_members(pgid, &[pgid]).is_empty());
        for c in [&mut leader, &mut outsider] {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }
}
