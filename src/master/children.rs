//! The master's children: starting a worker process, its exit, the restart delay, and the
//! exact recovery of a dead worker's process id (§1.1).

use super::*;

/// The target of this file's log lines: the module they came from before the layout of
/// issue 12, so that log lines and `RUST_LOG` directives stay as they were.
const LOG_TARGET: &str = "locketd::master";

impl Master {
    pub(super) async fn spawn(&mut self, index: u32) {
        let incarnation = crate::store::random_hex(4);
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.args(&self.args)
            .env(ROLE_ENV, "worker")
            .env(INCARNATION_ENV, &incarnation)
            .env(PAUSED_ENV, if self.paused { "1" } else { "0" })
            .env(WORKER_INDEX_ENV, index.to_string())
            // The master alone talks to systemd.
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID")
            .stdin(Stdio::piped())
            .process_group(0)
            .kill_on_drop(false);
        // The worker writes metrics snapshots to fd 3; the master reads the other end.
        let pipe = metrics_pipe();
        let child_fd = pipe.as_ref().map(|(_, w)| w.as_raw_fd());
        if child_fd.is_some() {
            cmd.env(metrics::METRICS_FD_ENV, "3");
        }
        // The pickup link is fd 4 (`pickup.rs`).
        let link = self.pickup.as_ref().and_then(|_| pickup_pair());
        let link_fd = link.as_ref().map(|(_, w)| w.as_raw_fd());
        if link_fd.is_some() {
            cmd.env(crate::process::PICKUP_FD_ENV, "4");
        }
        let parent_death = crate::process::parent_death_signal();
        // SAFETY: prctl, fcntl and dup2 only, between fork and exec; all async-signal-safe. If
        // the master dies (even SIGKILL), each worker gets `parent_death` and stops its job as
        // on a first TERM, releasing its locks, instead of running on unsupervised. Both descriptors are first copied
        // above 4, so that placing one cannot overwrite the other; dup2 leaves fds 3 and 4
        // without FD_CLOEXEC.
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, parent_death);
                for (fd, to) in [(child_fd, 3), (link_fd, 4)] {
                    let Some(fd) = fd else { continue };
                    let high = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 5);
                    if high < 0 || libc::dup2(high, to) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                error!(target: LOG_TARGET, index, error = %e, "cannot start a worker process");
                self.schedule_restart(index, Duration::ZERO);
                return;
            }
        };
        let pid = child.id().unwrap_or(0);
        if let Some((read, write)) = pipe {
            drop(write);
            match tokio::net::unix::pipe::Receiver::from_owned_fd(read) {
                Ok(rx) => {
                    tokio::spawn(metrics::read_reports(rx, pid, self.aggregate.clone()));
                }
                Err(e) => warn!(target: LOG_TARGET, error = %e, "cannot read the worker's metrics"),
            }
        }
        if let Some((mine, theirs)) = link {
            drop(theirs);
            let stream = std::os::unix::net::UnixStream::from(mine);
            let attached = stream
                .set_nonblocking(true)
                .and_then(|()| tokio::net::UnixStream::from_std(stream));
            match (attached, self.pickup.as_ref()) {
                (Ok(s), Some(p)) => p.attach(pid, s),
                (Err(e), _) => {
                    warn!(target: LOG_TARGET, error = %e, "cannot watch the worker's queues; it polls every interval")
                }
                _ => {}
            }
        }
        if let Some(mut stdin) = child.stdin.take() {
            let text = self.current.text.clone().into_bytes();
            tokio::spawn(async move {
                let _ = stdin.write_all(&text).await;
                let _ = stdin.shutdown().await;
            });
        }
        let tx = self.events_tx.clone();
        tokio::spawn(async move {
            if let Ok(status) = child.wait().await {
                let _ = tx.send(Event::Exited { pid, status });
            }
        });
        info!(target: LOG_TARGET, index, pid, "worker started");
        self.slots.insert(
            pid,
            Slot {
                config: Arc::new(self.current.config.clone()),
                index,
                generation: self.generation,
                pid,
                incarnation,
                started: Instant::now(),
                retiring: false,
            },
        );
        self.update_health();
    }

    pub(super) fn schedule_restart(&mut self, index: u32, ran: Duration) {
        let delay = if ran >= STABLE_RUN {
            // A worker that had been running fine starts its backoff afresh.
            self.backoff.remove(&index);
            Duration::from_millis(100)
        } else {
            let last = self.backoff.get(&index).copied().unwrap_or_default();
            let next = if last.is_zero() {
                Duration::from_secs(1)
            } else {
                (last * 2).min(MAX_RESTART_DELAY)
            };
            self.backoff.insert(index, next);
            next
        };
        let (tx, generation) = (self.events_tx.clone(), self.generation);
        info!(target: LOG_TARGET,
            index,
            delay_secs = delay.as_secs_f64(),
            "restarting the worker"
        );
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = tx.send(Event::Restart { index, generation });
        });
    }

    pub(super) async fn on_exit(&mut self, pid: u32, status: ExitStatus) {
        let Some(slot) = self.slots.remove(&pid) else {
            return;
        };
        let ran = slot.started.elapsed();
        let clean = status.code() == Some(0);
        let why = describe(&status);
        let drained = clean && self.current.config.interval.get().is_zero();
        if drained {
            self.drained = true;
        }
        if clean && (slot.retiring || self.stopping.is_some() || drained) {
            info!(target: LOG_TARGET, index = slot.index, pid, "worker stopped");
        } else if clean {
            warn!(target: LOG_TARGET, index = slot.index, pid, "worker exited unexpectedly: {why}");
        } else {
            error!(target: LOG_TARGET,
                index = slot.index,
                pid,
                ran_secs = ran.as_secs(),
                "worker died: {why}"
            );
        }
        if !clean {
            // Its handler (re-parented to us) dies before its locks are released.
            kill_orphans(&self.worker_pids()).await;
            self.recover(
                pid,
                &slot.incarnation,
                &slot.config,
                format!("died ({why})"),
            );
        }
        if self.stopping.is_none()
            && !self.drained
            && slot.generation == self.generation
            && !slot.retiring
        {
            self.schedule_restart(slot.index, ran);
        }
        self.set_title();
        self.update_health();
    }

    /// R-4 for a worker we know is dead: delete its lease and recover its slots now, instead
    /// of waiting `process_ttl` for the janitor. Retried in the background while Redis is
    /// away (bounded: about two minutes), after which the janitor's lease rule takes over.
    /// It runs against the namespace and Redis the worker was started with.
    pub(super) fn recover(
        &mut self,
        pid: u32,
        incarnation: &str,
        config: &Arc<Config>,
        why: String,
    ) {
        let cfg = Config::clone(config);
        let keys = Keys::new(&cfg.namespace);
        let process = format!("{}:{pid}:{incarnation}", self.host);
        let mut conn = if cfg.redis == self.current.config.redis {
            self.conn.clone()
        } else {
            None
        };
        self.recoveries.retain(|t| !t.is_finished());
        self.recoveries.push(tokio::spawn(async move {
            let mut delay = Duration::from_millis(100);
            for attempt in 0..40 {
                if conn.is_none() {
                    conn = crate::conn::connect(&cfg.redis, Duration::from_secs(2))
                        .await
                        .ok();
                }
                if let Some(c) = conn.as_mut() {
                    match recover_exactly(c, &keys, &cfg, &process, &why).await {
                        Ok(r) => {
                            for (slot, result) in &r.recovered {
                                info!(target: LOG_TARGET, slot = %slot, result = %result, "recovered the dead worker's slot");
                            }
                            return;
                        }
                        Err(e) if crate::conn::is_refusal(&e) => {
                            // Not resent in a loop (E-3): the janitor tries it once a pass.
                            warn!(target: LOG_TARGET, error = %e, "recovering a dead worker: redis refused it; left to the janitor");
                            return;
                        }
                        Err(e) if attempt == 0 => {
                            warn!(target: LOG_TARGET, error = %e, "recovering a dead worker: redis error; retrying");
                        }
                        Err(e) => debug!(target: LOG_TARGET, error = %e, "recovering a dead worker: still failing"),
                    }
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            warn!(target: LOG_TARGET,
                pid,
                "could not recover the dead worker; the janitor will once its lease lapses"
            );
        }));
    }

    /// Waits (at most 30 s) for the recoveries still running: a worker killed at the stop
    /// deadline, or one that crashed during a stop, is recovered before the master exits
    /// instead of being left to a janitor that may never come.
    pub(super) async fn finish_recoveries(&mut self) {
        let pending: Vec<_> = self.recoveries.drain(..).collect();
        if pending.is_empty() {
            return;
        }
        let all = futures::future::join_all(pending);
        if tokio::time::timeout(Duration::from_secs(30), all)
            .await
            .is_err()
        {
            warn!(target: LOG_TARGET, "recoveries of dead workers did not finish in 30 s; the janitor will do them");
        }
    }
}

/// Recovers the dead worker's process id, exactly: its lease is deleted first, since the
/// process is known dead.
pub(super) async fn recover_exactly(
    conn: &mut Manager,
    keys: &Keys,
    config: &Config,
    process: &str,
    why: &str,
) -> redis::RedisResult<JanitorReport> {
    let mut report = JanitorReport {
        ran: true,
        ..JanitorReport::default()
    };
    let _: () = redis::cmd("DEL")
        .arg(keys.alive(process))
        .query_async(conn)
        .await?;
    worker::recover_process(conn, keys, config, process, why, &mut report).await?;
    Ok(report)
}

/// A close-on-exec pipe (read end, write end) for a worker's metrics, or `None` (logged).
pub(super) fn metrics_pipe() -> Option<(OwnedFd, OwnedFd)> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        warn!(target: LOG_TARGET, error = %std::io::Error::last_os_error(), "cannot create a metrics pipe");
        return None;
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    unsafe { Some((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))) }
}

/// A close-on-exec stream socket pair (master's end, worker's end) for a worker's pickup
/// link, or `None` (logged: the worker then waits on its own BLMOVE).
fn pickup_pair() -> Option<(OwnedFd, OwnedFd)> {
    let mut fds = [0i32; 2];
    // SAFETY: socketpair fills two descriptors we then own.
    let r = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if r != 0 {
        warn!(target: LOG_TARGET, error = %std::io::Error::last_os_error(), "cannot create a pickup link");
        return None;
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    unsafe { Some((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))) }
}

pub(super) fn describe(status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(0), _) => "exit status 0".into(),
        (Some(3), _) => "exit status 3 (presumed dead: its lease lapsed)".into(),
        (Some(69), _) => "exit status 69 (redis unreachable at start)".into(),
        (Some(78), _) => "exit status 78 (config error)".into(),
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!(
            "killed by {}",
            crate::resque::failure::signal_status_text(0, s).trim_start_matches("pid 0 ")
        ),
        _ => "unknown status".into(),
    }
}
