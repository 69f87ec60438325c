//! Starting the command handler's process for one job without copying the worker.
//!
//! std's `Command` starts a child with `posix_spawn` (glibc's `clone(CLONE_VM|CLONE_VFORK)`:
//! the child borrows the parent's memory until it calls `execve`) unless a `pre_exec` closure is
//! set; then it falls back to `fork`, which copies the worker's page tables and makes the worker
//! take a copy-on-write fault on every page it writes until the child has exec'd. The command
//! handler needs one step that `posix_spawn` cannot do, `PR_SET_PDEATHSIG` (a handler dies with
//! its worker, so none outlives its lock), so it did pay for the fork on every job: a `perf`
//! profile of `command /bin/true --workers 4` put 10% of all samples under `_Fork`, 3% in
//! copy-on-write faults and 2% in TLB shootdowns (docs/dev/performance-log.md, "Exec per job").
//!
//! [`Program::spawn`] does what glibc's `posix_spawn` does, plus that one step: everything the
//! child needs (argv, environment, the candidate paths of a `PATH` search, the directory, the
//! three pipe ends) is built before the `clone`, so the child only makes system calls:
//! `dup2`, `setpgid`, `chdir`, `sigaction` and `sigprocmask`, `prctl`, `getppid`, `execve`,
//! `_exit`. The child is waited for through a pidfd (`CLONE_PIDFD`) on the runtime's reactor;
//! on a kernel without pidfds a blocking thread waits instead.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::net::unix::pipe;

/// The child's stack. The child runs a handful of system calls on it and nothing else.
const CHILD_STACK: usize = 64 * 1024;

/// glibc's `PATH` when the environment has none.
const DEFAULT_PATH: &[u8] = b"/bin:/usr/bin";

/// What every job of one handler starts: built once, when the handler is.
#[derive(Debug)]
pub(super) struct Program {
    argv: Vec<CString>,
    /// The paths `execve` is tried on, in order: the program itself when it names a path,
    /// otherwise each `PATH` directory joined with it (`execvp`'s search).
    candidates: Vec<CString>,
    dir: Option<CString>,
    /// `NAME=value` of the inherited environment, with the table's `env` applied.
    env: Vec<CString>,
}

fn cstring(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "nul byte found in provided data",
        )
    })
}

/// `NAME=value` as a C string.
pub(super) fn env_entry(name: &str, value: &[u8]) -> io::Result<CString> {
    let mut s = Vec::with_capacity(name.len() + 1 + value.len());
    s.extend_from_slice(name.as_bytes());
    s.push(b'=');
    s.extend_from_slice(value);
    cstring(&s)
}

impl Program {
    /// `argv` run in `dir` with this process's environment minus the names in `inherited_out`,
    /// then `env` set over it, and none of the names in `reserved` (set per job). The
    /// environment is read now: a variable this process sets later is not seen by the handler.
    pub(super) fn new(
        argv: &[String],
        dir: Option<&std::path::Path>,
        env: &[(String, String)],
        inherited_out: &[&str],
        reserved: &[&str],
    ) -> io::Result<Program> {
        let named = |names: &[&str], k: &OsStr| names.iter().any(|n| OsStr::new(n) == k);
        let mut vars: Vec<(OsString, OsString)> = std::env::vars_os()
            .filter(|(k, _)| !named(inherited_out, k) && !named(reserved, k))
            .filter(|(k, _)| !env.iter().any(|(n, _)| OsStr::new(n) == k))
            .collect();
        vars.extend(
            env.iter()
                .filter(|(k, _)| !named(reserved, OsStr::new(k)))
                .map(|(k, v)| (OsString::from(k), OsString::from(v))),
        );
        let path = vars
            .iter()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| v.as_bytes().to_vec())
            .unwrap_or_else(|| DEFAULT_PATH.to_vec());
        let env = vars
            .iter()
            .map(|(k, v)| {
                let mut s = k.as_bytes().to_vec();
                s.push(b'=');
                s.extend_from_slice(v.as_bytes());
                cstring(&s)
            })
            .collect::<io::Result<Vec<_>>>()?;
        let program = argv.first().map(String::as_str).unwrap_or_default();
        let candidates = if program.contains('/') {
            vec![cstring(program.as_bytes())?]
        } else if program.is_empty() {
            Vec::new()
        } else {
            path.split(|b| *b == b':')
                .map(|d| {
                    // An empty entry is the current directory, as for execvp.
                    let mut p = if d.is_empty() {
                        b".".to_vec()
                    } else {
                        d.to_vec()
                    };
                    p.push(b'/');
                    p.extend_from_slice(program.as_bytes());
                    cstring(&p)
                })
                .collect::<io::Result<Vec<_>>>()?
        };
        Ok(Program {
            argv: argv
                .iter()
                .map(|a| cstring(a.as_bytes()))
                .collect::<io::Result<_>>()?,
            candidates,
            dir: dir.map(|d| cstring(d.as_os_str().as_bytes())).transpose()?,
            env,
        })
    }

    /// Starts the program in a process group of its own with the extra `NAME=value` entries
    /// (which no inherited entry of the same name shadows: [`Program::new`] removes them),
    /// `payload` on its stdin, stdout and stderr piped, and `PR_SET_PDEATHSIG` = SIGKILL.
    pub(super) fn spawn(&self, extra_env: &[CString], payload: &[u8]) -> io::Result<Child> {
        if self.candidates.is_empty() {
            return Err(io::Error::from_raw_os_error(libc::ENOENT));
        }
        let (stdin_r, stdin_w) = pipe_pair()?;
        let (stdout_r, stdout_w) = pipe_pair()?;
        let (stderr_r, stderr_w) = pipe_pair()?;
        // The payload goes into the pipe now when it fits (a pipe holds 64 KiB): the handler
        // reads it and then the end of its stdin, and no task has to feed it.
        let written = prefill(&stdin_w, payload);
        let stdin_w = if written == payload.len() {
            drop(stdin_w);
            None
        } else {
            Some(stdin_w)
        };

        let ptrs = |v: &[CString]| -> Vec<*const libc::c_char> {
            v.iter()
                .map(|c| c.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect()
        };
        let argv = ptrs(&self.argv);
        let candidates: Vec<*const libc::c_char> =
            self.candidates.iter().map(|c| c.as_ptr()).collect();
        let envp: Vec<*const libc::c_char> = self
            .env
            .iter()
            .chain(extra_env)
            .map(|c| c.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect();
        // `/bin/sh path args…` for a file without `#!` (ENOEXEC), as execvp does; the child
        // puts the path in slot 1.
        let mut sh_argv: Vec<*const libc::c_char> = Vec::with_capacity(argv.len() + 1);
        sh_argv.push(SH.as_ptr());
        sh_argv.push(std::ptr::null());
        sh_argv.extend_from_slice(&argv[1..]);

        let mut args = ChildArgs {
            argv: argv.as_ptr(),
            sh_argv: sh_argv.as_mut_ptr(),
            candidates: candidates.as_ptr(),
            n_candidates: candidates.len(),
            envp: envp.as_ptr(),
            dir: self.dir.as_ref().map_or(std::ptr::null(), |d| d.as_ptr()),
            fds: [
                stdin_r.as_raw_fd(),
                stdout_w.as_raw_fd(),
                stderr_w.as_raw_fd(),
            ],
            // SAFETY: getpid has no preconditions.
            parent: unsafe { libc::getpid() },
            err: 0,
        };
        let mut stack: Vec<u8> = Vec::with_capacity(CHILD_STACK);
        // The stack grows down from its end, 16-byte aligned as the ABI wants.
        let top = ((stack.as_mut_ptr() as usize + CHILD_STACK) & !15) as *mut libc::c_void;
        let mut pidfd: libc::c_int = -1;

        // SAFETY: every signal is blocked in this thread while the child shares its memory, so
        // no handler of this process runs in the child before the child has reset them all;
        // sigfillset and pthread_sigmask only write the sets given.
        let mut old_mask: libc::sigset_t = unsafe { std::mem::zeroed() };
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old_mask);
        }
        let flags = libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD;
        let arg = &mut args as *mut ChildArgs as *mut libc::c_void;
        // SAFETY: CLONE_VM|CLONE_VFORK suspends this thread until the child has exec'd or
        // exited, so `args`, the pointer arrays, the C strings they point to and `stack` all
        // outlive the child's use of them. `child_main` only makes async-signal-safe system
        // calls through libc (no allocation, no lock, no unwinding) and writes nothing shared
        // but `args.err` and `sh_argv[1]`, which this thread reads only after the clone
        // returns. Without CLONE_SETTLS the child keeps this thread's TLS; the only TLS it
        // touches is errno, which this thread reads only when the clone failed and no child ran.
        let mut pid = unsafe {
            libc::clone(
                child_main,
                top,
                flags | libc::CLONE_PIDFD,
                arg,
                &mut pidfd as *mut libc::c_int,
            )
        };
        if pid < 0 && errno() == libc::EINVAL {
            // A kernel without CLONE_PIDFD: the same without it (the safety argument above
            // holds unchanged), waited for by pid.
            pidfd = -1;
            // SAFETY: as above.
            pid = unsafe { libc::clone(child_main, top, flags, arg) };
        }
        let clone_err = io::Error::last_os_error();
        // SAFETY: restores this thread's mask saved above.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &old_mask, std::ptr::null_mut());
        }
        drop(stack);
        drop((stdin_r, stdout_w, stderr_w));
        if pid < 0 {
            return Err(clone_err);
        }
        // SAFETY: a pidfd the kernel wrote is a new descriptor that nothing else owns.
        let pidfd = (pidfd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(pidfd) });
        if args.err != 0 {
            // The child exited without exec'ing: reap it and report why.
            let mut status = 0;
            // SAFETY: waitpid on our own child, which has already exited.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            return Err(io::Error::from_raw_os_error(args.err));
        }
        let waiter = match pidfd.or_else(|| pidfd_open(pid)) {
            // SAFETY: the AsyncFd owns the OwnedFd, which stays open, the same descriptor,
            // until the AsyncFd is dropped.
            Some(fd) => match unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
                Ok(fd) => Waiter::Pidfd(Some(fd)),
                Err(_) => Waiter::Thread(tokio::task::spawn_blocking(move || wait_blocking(pid))),
            },
            None => Waiter::Thread(tokio::task::spawn_blocking(move || wait_blocking(pid))),
        };
        let mut child = Child {
            pid,
            waiter,
            status: None,
            stdin: None,
            stdout: None,
            stderr: None,
        };
        child.stdin = match stdin_w {
            Some(w) => Some((pipe::Sender::from_owned_fd(w)?, written)),
            None => None,
        };
        child.stdout = Some(pipe::Receiver::from_owned_fd(stdout_r)?);
        child.stderr = Some(pipe::Receiver::from_owned_fd(stderr_r)?);
        Ok(child)
    }
}

static SH: &CStr = c"/bin/sh";

/// A pipe, both ends close-on-exec (the child's end loses the flag in `dup2`).
fn pipe_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two new descriptors into the array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both are new descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Writes what fits of `payload` into the empty pipe `w` without blocking; returns how much.
fn prefill(w: &OwnedFd, payload: &[u8]) -> usize {
    let fd = w.as_raw_fd();
    // SAFETY: fcntl on our own descriptor; O_NONBLOCK is per open file, so the read end the
    // child gets stays blocking.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
    let mut done = 0;
    while done < payload.len() {
        // SAFETY: writes from a live slice to our own descriptor.
        let n = unsafe {
            libc::write(
                fd,
                payload[done..].as_ptr() as *const libc::c_void,
                payload.len() - done,
            )
        };
        if n > 0 {
            done += n as usize;
        } else if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        } else {
            break;
        }
    }
    done
}

fn pidfd_open(pid: libc::pid_t) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a new descriptor that nothing else owns.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// What the child reads (and the two things it writes) in the parent's memory.
#[repr(C)]
struct ChildArgs {
    argv: *const *const libc::c_char,
    sh_argv: *mut *const libc::c_char,
    candidates: *const *const libc::c_char,
    n_candidates: usize,
    envp: *const *const libc::c_char,
    dir: *const libc::c_char,
    fds: [RawFd; 3],
    parent: libc::pid_t,
    /// The errno of the step that failed, 0 if the child exec'd.
    err: libc::c_int,
}

fn errno() -> libc::c_int {
    // SAFETY: reads this thread's errno.
    unsafe { *libc::__errno_location() }
}

/// The child, between `clone` and `execve`, on its own stack in the parent's memory.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the parent's `ChildArgs`, alive while the parent is suspended.
    let a = unsafe { &mut *(arg as *mut ChildArgs) };
    // SAFETY: see `exec_child`; `_exit` ends only this child.
    unsafe {
        let err = exec_child(a);
        a.err = if err == 0 { libc::EINVAL } else { err };
        libc::_exit(127)
    }
}

/// The child's steps; returns the errno of the one that failed (an `execve` that succeeds does
/// not return).
///
/// # Safety
/// Only in the child of `Program::spawn`'s clone, with `a` pointing to live arrays as built
/// there. Every call here is a plain system call wrapper, async-signal-safe, and allocates
/// nothing: the parent may have been holding the allocator's lock when it cloned.
unsafe fn exec_child(a: &mut ChildArgs) -> libc::c_int {
    // stdin, stdout and stderr. A pipe end that already has its number keeps it, but loses
    // close-on-exec.
    for (target, fd) in a.fds.iter().enumerate() {
        let target = target as RawFd;
        if *fd == target {
            if libc::fcntl(target, libc::F_SETFD, 0) < 0 {
                return errno();
            }
        } else if libc::dup2(*fd, target) < 0 {
            return errno();
        }
    }
    // A process group of its own, so a stop signals everything the handler started.
    if libc::setpgid(0, 0) != 0 {
        return errno();
    }
    if !a.dir.is_null() && libc::chdir(a.dir) != 0 {
        return errno();
    }
    // Every handler this process installed goes back to the default (the child must not run
    // the parent's handlers in the parent's memory, and the program expects defaults);
    // ignored signals stay ignored, except SIGPIPE, which Rust ignores for itself.
    let mut sa: libc::sigaction = std::mem::zeroed();
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        if libc::sigaction(sig, std::ptr::null(), &mut sa) != 0 {
            continue;
        }
        let ignored = sa.sa_sigaction == libc::SIG_IGN && sig != libc::SIGPIPE;
        if sa.sa_sigaction == libc::SIG_DFL || ignored {
            continue;
        }
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &dfl, std::ptr::null_mut());
    }
    let mut none: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut none);
    libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
    // Killed when the worker dies. If the worker died before this point, the signal will
    // never come: give up instead of running a handler nobody supervises.
    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
        return errno();
    }
    if libc::getppid() != a.parent {
        return libc::ESRCH;
    }
    // execve on each candidate in turn, as execvp searches PATH.
    let mut err = libc::ENOENT;
    let mut denied = false;
    for i in 0..a.n_candidates {
        let path = *a.candidates.add(i);
        libc::execve(path, a.argv, a.envp);
        err = errno();
        match err {
            libc::ENOEXEC => {
                *a.sh_argv.add(1) = path;
                libc::execve(SH.as_ptr(), a.sh_argv, a.envp);
                return errno();
            }
            libc::EACCES => denied = true,
            libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => {}
            _ => return err,
        }
    }
    if denied {
        libc::EACCES
    } else {
        err
    }
}

/// Waits for `pid` on a thread of its own (kernels without pidfds).
fn wait_blocking(pid: libc::pid_t) -> io::Result<ExitStatus> {
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            return Ok(ExitStatus::from_raw(status));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Reaps `pid` if it has exited.
fn try_reap(pid: libc::pid_t) -> io::Result<Option<ExitStatus>> {
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child, without blocking.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return Ok(Some(ExitStatus::from_raw(status)));
        }
        if r == 0 {
            return Ok(None);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

enum Waiter {
    /// Readable once the process has exited.
    Pidfd(Option<AsyncFd<OwnedFd>>),
    /// A blocking waitpid on a thread.
    Thread(tokio::task::JoinHandle<io::Result<ExitStatus>>),
}

/// A started handler process. Dropped before it was waited for, it is killed and reaped in
/// the background.
pub(super) struct Child {
    pid: libc::pid_t,
    waiter: Waiter,
    status: Option<ExitStatus>,
    /// The stdin pipe and how much of the payload is in it already, when it did not all fit.
    pub(super) stdin: Option<(pipe::Sender, usize)>,
    pub(super) stdout: Option<pipe::Receiver>,
    pub(super) stderr: Option<pipe::Receiver>,
}

impl Child {
    pub(super) fn id(&self) -> u32 {
        self.pid as u32
    }

    /// The exit status, once the process has ended. Cancel-safe.
    pub(super) async fn wait(&mut self) -> io::Result<ExitStatus> {
        if let Some(s) = self.status {
            return Ok(s);
        }
        let status = match &mut self.waiter {
            Waiter::Pidfd(Some(fd)) => loop {
                let mut ready = fd.readable().await?;
                match try_reap(self.pid)? {
                    Some(s) => break s,
                    None => ready.clear_ready(),
                }
            },
            Waiter::Pidfd(None) => return Err(io::Error::other("handler already reaped")),
            Waiter::Thread(h) => h.await.map_err(io::Error::other)??,
        };
        self.status = Some(status);
        Ok(status)
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if self.status.is_some() {
            return;
        }
        match &mut self.waiter {
            Waiter::Pidfd(fd) => {
                let Some(fd) = fd.take() else { return };
                // SAFETY: signals the process the pidfd refers to, never a reused pid.
                unsafe {
                    libc::syscall(
                        libc::SYS_pidfd_send_signal,
                        fd.as_raw_fd(),
                        libc::SIGKILL,
                        std::ptr::null::<libc::siginfo_t>(),
                        0,
                    );
                }
                let pid = self.pid;
                match tokio::runtime::Handle::try_current() {
                    Ok(rt) => {
                        rt.spawn(async move {
                            while let Ok(mut ready) = fd.readable().await {
                                if !matches!(try_reap(pid), Ok(None)) {
                                    break;
                                }
                                ready.clear_ready();
                            }
                        });
                    }
                    Err(_) => {
                        let _ = wait_blocking(pid);
                    }
                }
            }
            Waiter::Thread(h) => {
                if !h.is_finished() {
                    // SAFETY: kill(2) of our unreaped child (its waiter has not returned).
                    unsafe { libc::kill(self.pid, libc::SIGKILL) };
                }
            }
        }
    }
}
