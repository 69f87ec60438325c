//! Facts about this host and its processes, as Resque sees them.
//!
//! - [`hostname`] is the host part of worker ids (`host:pid:queues`), like Ruby's
//!   `Socket.gethostname` (gethostname(2), not resolved to an FQDN).
//! - [`pid_alive`], [`pid_looks_like_resque_worker`] and [`resque_worker_pids`] implement the
//!   process checks of Resque's host-local pruning rule (`resque-protocol.md` §4): Ruby keeps a
//!   registered worker of its own host only if its pid shows up in
//!   `ps -A -o pid,command | grep -E "[r]esque:work|[r]esque: Starting|[r]esque-[0-9]" | grep -v "resque-web"`.

use std::collections::HashSet;

/// This host's name from gethostname(2), exactly as Ruby's `Socket.gethostname` returns it
/// (no DNS lookup, no FQDN). Invalid UTF-8 is replaced lossily; if the call fails or the
/// name is empty, returns `"localhost"`.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the pointer and length describe `buf`, which is writable for its whole
    // length; gethostname writes at most `len` bytes into it.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast::<libc::c_char>(), buf.len()) };
    if rc != 0 {
        return "localhost".to_owned();
    }
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..len]).into_owned();
    if name.is_empty() {
        "localhost".to_owned()
    } else {
        name
    }
}

/// True if a process with this pid exists: `kill(pid, 0)` succeeds or fails with `EPERM`
/// (the process exists but belongs to another user).
///
/// Pid 0 and pids above `i32::MAX` are never alive (they would address process groups).
/// A zombie (exited, not yet reaped) still counts as alive, as with `kill -0`.
pub fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 sends nothing; it only performs the existence and
    // permission checks. `pid` is positive, so it names a single process.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// The command line of `pid` the way `ps -o command` shows it: `/proc/<pid>/cmdline` with
/// NUL bytes turned into spaces (trailing ones trimmed), invalid UTF-8 replaced lossily.
/// A process with an empty command line (kernel thread, zombie) is shown by `ps` as
/// `[<comm>]`, and so it is here. `None` if the process does not exist (or `/proc` cannot
/// be read).
pub fn command_line(pid: u32) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let text = String::from_utf8_lossy(&raw).replace('\0', " ");
    let text = text.trim_end_matches(' ');
    if !text.is_empty() {
        return Some(text.to_owned());
    }
    let comm = std::fs::read(format!("/proc/{pid}/comm")).ok()?;
    let comm = String::from_utf8_lossy(&comm);
    Some(format!("[{}]", comm.trim_end_matches('\n')))
}

/// True if `command` (a process command line) passes Ruby Resque's prune filter
/// `grep -E "[r]esque:work|[r]esque: Starting|[r]esque-[0-9]" | grep -v "resque-web"`:
/// it contains `resque:work`, `resque: Starting` or `resque-` followed by an ASCII digit,
/// and does not contain `resque-web`. Case-sensitive, like the grep.
pub fn command_matches_resque_worker(command: &str) -> bool {
    if command.contains("resque-web") {
        return false;
    }
    if command.contains("resque:work") || command.contains("resque: Starting") {
        return true;
    }
    command.match_indices("resque-").any(|(i, m)| {
        command
            .as_bytes()
            .get(i + m.len())
            .is_some_and(u8::is_ascii_digit)
    })
}

/// True if the process `pid` exists and its command line (see [`command_line`]) passes
/// Ruby Resque's prune filter (see [`command_matches_resque_worker`]), i.e. a co-located
/// Ruby worker would consider it a live worker and not prune its registration.
pub fn pid_looks_like_resque_worker(pid: u32) -> bool {
    command_line(pid).is_some_and(|c| command_matches_resque_worker(&c))
}

/// True if the process `pid` is a locketd process: its command line or its `comm` names
/// locketd (a master `locketd master: …`, a worker `resque-<v>-locketd: …`, an operator
/// command `locketd status`).
pub fn pid_is_locketd(pid: u32) -> bool {
    let comm = std::fs::read(format!("/proc/{pid}/comm")).unwrap_or_default();
    String::from_utf8_lossy(&comm).starts_with("locketd")
        || command_line(pid).is_some_and(|c| c.contains("locketd"))
}

/// All pids of this host (one pass over `/proc`) for which [`pid_looks_like_resque_worker`]
/// is true. Processes that exit during the scan are simply left out.
pub fn resque_worker_pids() -> HashSet<u32> {
    pids()
        .into_iter()
        .filter(|&pid| pid_looks_like_resque_worker(pid))
        .collect()
}

/// Every pid of this host's `/proc` (one pass; a process that starts or exits meanwhile may
/// be missed or listed).
pub fn pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .collect()
}

/// A small `/proc` file in one `read` (open, read, close): `read_to_string` first asks for
/// the size (`statx`, which procfs answers with 0) and then reads in growing pieces, six reads
/// for a `stat` line. Files larger than the buffer are read whole the usual way.
pub fn read_proc(path: &str) -> Option<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut buf = [0u8; 1024];
    let n = f.read(&mut buf).ok()?;
    if n < buf.len() {
        return String::from_utf8(buf[..n].to_vec()).ok();
    }
    let mut text = String::from_utf8(buf.to_vec()).ok()?;
    f.read_to_string(&mut text).ok()?;
    Some(text)
}

/// The fields of `/proc/<pid>/stat` after the command name (`state ppid pgrp …`, the name
/// itself may hold spaces and parentheses); `None` when the process is gone.
pub fn stat_fields(pid: u32) -> Option<String> {
    let stat = read_proc(&format!("/proc/{pid}/stat"))?;
    let close = stat.rfind(')')?;
    Some(stat[close + 1..].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_proc_reads_a_stat_line_whole_and_a_long_file_past_its_buffer() {
        let me = std::process::id();
        let stat = read_proc(&format!("/proc/{me}/stat")).unwrap();
        assert!(stat.starts_with(&format!("{me} (")), "{stat}");
        assert!(stat.ends_with('\n'), "{stat}");
        assert!(stat_fields(me).unwrap().split_whitespace().count() > 40);
        // /proc/self/maps of a test binary is far longer than the 1 KiB buffer.
        let maps = read_proc("/proc/self/maps").unwrap();
        assert!(maps.len() > 1024, "{}", maps.len());
        assert!(maps.ends_with('\n'));
        assert!(read_proc("/proc/0/stat").is_none());
    }

    #[test]
    fn own_pid_is_alive() {
        assert!(pid_alive(std::process::id()));
    }

    #[test]
    fn bogus_pids_are_not_alive() {
        assert!(!pid_alive(0x7fff_fff0));
        assert!(!pid_alive(0));
        assert!(!pid_alive(u32::MAX));
        assert!(!pid_alive(0x8000_0000));
    }

    #[test]
    fn hostname_is_not_empty() {
        let h = hostname();
        assert!(!h.is_empty());
        assert!(!h.contains('\0'));
    }

    #[test]
    fn ruby_prune_grep() {
        for yes in [
            "resque-3.0.0: Waiting for slow,high",
            "resque-0.1.0-locketd: Processing high since 1795263509 [Billing::Sync]",
            "resque-1.27.4: Forked 9461 at 1795263509",
            "resque: Starting",
            "ruby /usr/bin/rake resque:work",
            "resque-pool-master[app]: managing [1, 2] resque-2.6.0: x",
        ] {
            assert!(command_matches_resque_worker(yes), "{yes}");
        }
        for no in [
            "locketd: Waiting for slow",
            "resque-web -p 8282",
            "resque-3.0.0: Waiting resque-web",
            "resque-scheduler-4.10.0",
            "resque-",
            "Resque-3.0.0: Waiting",
            "resque:Starting",
            "",
        ] {
            assert!(!command_matches_resque_worker(no), "{no}");
        }
    }

    #[test]
    fn own_command_line_is_readable() {
        let own = command_line(std::process::id()).expect("own cmdline");
        assert!(!own.is_empty());
        assert!(!own.contains('\0'));
        assert_eq!(command_line(0x7fff_fff0), None);
    }

    #[test]
    fn worker_pid_scan_runs() {
        // The test binary's own command line normally has no `resque-<digit>`.
        let own = std::process::id();
        let found = resque_worker_pids();
        assert_eq!(found.contains(&own), pid_looks_like_resque_worker(own));
        assert!(!found.contains(&0));
    }
}
