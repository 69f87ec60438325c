//! Process title (the command line shown by `ps -o command` and `/proc/<pid>/cmdline`).
//!
//! Co-located Ruby Resque workers prune every registered worker of their host whose pid
//! does not show up in
//! `ps -A -o pid,command | grep -E "[r]esque:work|[r]esque: Starting|[r]esque-[0-9]" | grep -v "resque-web"`,
//! and php-resque prunes pids not matching `ps -A -o pid,args | grep [r]esque`
//! (see `resque-protocol.md` §4). A locketd worker process therefore has to show a command
//! line such as `resque-0.1.0-locketd: Waiting for high,low` and keep it up to date.
//!
//! `prctl(PR_SET_NAME)` only changes `comm` (what `ps -o comm` shows), which those greps
//! never see. The command line is the memory holding the process's own `argv` strings, so
//! this module:
//!
//! 1. [`ensure_title_space`]: at the very start of `main`, re-executes the current binary
//!    once with an `argv[0]` of [`TITLE_CAPACITY`] bytes (`resque-<version>-locketd: Starting`
//!    padded with spaces), so that there is room for titles and the process already matches
//!    the greps from its first instruction on. The pid does not change across `exec`.
//! 2. [`set_title`]: overwrites that `argv` area in place with the new title.
//!
//! Callers must read and parse their arguments (`std::env::args`/`args_os`, clap, ...)
//! **before** the first [`set_title`]: Rust's std does not copy `argv` at startup, it keeps
//! the pointer and reads the strings each time `std::env::args` is called, so after
//! [`set_title`] those functions return the title instead of the original arguments.
//!
//! Note for clap users: clap takes the binary name shown in usage and error messages from
//! `argv[0]` unless `bin_name` is set explicitly, so set `#[command(bin_name = "locketd")]`.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

/// Number of bytes reserved for process titles by [`ensure_title_space`].
///
/// A title passed to [`set_title`] is cut to the space actually available (this capacity,
/// plus whatever the remaining original arguments occupied, minus one trailing NUL).
pub const TITLE_CAPACITY: usize = 240;

/// Prefix of `argv[0]` marking a process that has already been re-executed with room for a
/// title. Shared with Ruby's process titles (`resque-3.0.0: ...`).
const MARKER: &[u8] = b"resque-";

/// Name written to `comm` (at most 15 bytes are kept by the kernel).
const COMM_NAME: &[u8] = b"locketd";

/// Serialises [`set_title`] calls so that two threads never write the `argv` area at once.
static TITLE_LOCK: Mutex<()> = Mutex::new(());

/// Set by [`ensure_title_space`]: only a program that asked for titles gets its argv memory
/// rewritten, so embedding the library never changes the host program's command line.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// The fixed start of every locketd process title: `resque-<crate version>-locketd`.
///
/// It contains `resque-` followed by a digit, so a title `"{prefix}: <state>"` matches the
/// process greps of Ruby Resque and php-resque.
pub fn title_prefix() -> String {
    format!("resque-{}-locketd", env!("CARGO_PKG_VERSION"))
}

/// Makes sure the process has [`TITLE_CAPACITY`] bytes of `argv` space for [`set_title`].
///
/// Call it once, first thing in `main`, before anything else reads or parses the
/// arguments and before any thread is started.
///
/// - If `argv[0]` already starts with `resque-` (the process was already re-executed),
///   it sets `comm` to `locketd` (an `exec` of `/proc/self/exe` leaves `comm` as `exe`) and
///   returns `Ok(())`.
/// - Otherwise it re-executes `/proc/self/exe` with `argv[0]` =
///   `resque-<version>-locketd: Starting` padded with spaces to [`TITLE_CAPACITY`] bytes,
///   the other arguments unchanged and the same environment. On success this never
///   returns (the pid stays the same and `main` starts again in the new image).
///
/// # Errors
///
/// Returns the error of the failed `exec`. The caller may log it and continue; the process
/// then runs without a usable title (titles are cut to the original `argv` size).
pub fn ensure_title_space() -> io::Result<()> {
    // Even if the re-exec below fails, titles are still set (cut to the original argv size).
    ENABLED.store(true, Ordering::Relaxed);
    let mut args = std::env::args_os();
    let argv0 = args.next();
    if argv0
        .as_ref()
        .is_some_and(|a| a.as_bytes().starts_with(MARKER))
    {
        set_comm();
        return Ok(());
    }
    let mut first = format!("{}: Starting", title_prefix()).into_bytes();
    if first.len() < TITLE_CAPACITY {
        first.resize(TITLE_CAPACITY, b' ');
    }
    let err = Command::new("/proc/self/exe")
        .arg0(OsString::from_vec(first))
        .args(args)
        .exec();
    Err(err)
}

/// Replaces the process's command line (as shown by `ps -o command`) with `title`; does
/// nothing unless [`ensure_title_space`] was called first.
///
/// The `argv` area `[arg_start, arg_end)` reported by `/proc/self/stat` is overwritten in
/// place: `title` (cut at a character boundary to leave at least one trailing NUL; NUL
/// bytes inside `title` become spaces) followed by NUL bytes up to `arg_end`.
/// It also names the process (`comm`) `locketd`.
///
/// Safe to call from any thread and any number of times; calls are serialised. Any failure
/// (no `/proc`, unexpected format, area not mapped writable) leaves the title unchanged;
/// this function never panics.
///
/// Arguments must have been read (`std::env::args`) before the first call, see the
/// module documentation.
pub fn set_title(title: &str) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    let _guard = match TITLE_LOCK.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    };
    set_comm();
    let Some((start, end)) = title_area() else {
        return;
    };
    let bytes = title_bytes(title, end - start);
    // SAFETY: [start, end) is this process's own argv string area as reported by the
    // kernel (`arg_start`/`arg_end` of /proc/self/stat). It lies on the initial process
    // stack, which stays mapped and writable for the life of the process; we additionally
    // checked (in title_area, once) that one read-write mapping of /proc/self/maps
    // covers the whole range. `bytes.len() == end - start`, so nothing is written outside it. Nothing in
    // this process holds Rust references into that memory: std keeps only the raw argv
    // pointer and reads the strings on demand in std::env::args, which callers must have
    // done before the first call (documented); concurrent set_title calls are excluded by
    // TITLE_LOCK.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), start as *mut u8, bytes.len());
    }
}

/// The argv area `[arg_start, arg_end)`, once it was found inside one writable mapping.
/// Neither changes for the life of the process, so the two /proc reads are done once
/// (they cost more than the rest of a job's client-side work; docs/dev/performance-log.md).
static AREA: OnceLock<(usize, usize)> = OnceLock::new();

fn title_area() -> Option<(usize, usize)> {
    if let Some(area) = AREA.get() {
        return Some(*area);
    }
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let (start, end) = parse_arg_range(&stat)?;
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    if !range_in_writable_mapping(&maps, start, end) {
        return None;
    }
    Some(*AREA.get_or_init(|| (start, end)))
}

/// Builds exactly `area` bytes: `title` cut at a char boundary to at most `area - 1`
/// bytes, inner NULs replaced by spaces, then NUL padding.
fn title_bytes(title: &str, area: usize) -> Vec<u8> {
    let room = area.saturating_sub(1);
    let mut cut = title.len().min(room);
    while cut > 0 && !title.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out: Vec<u8> = title.as_bytes()[..cut]
        .iter()
        .map(|&b| if b == 0 { b' ' } else { b })
        .collect();
    out.resize(area, 0);
    out
}

/// Sets `comm` to `locketd`.
///
/// `prctl(PR_SET_NAME)` names the calling thread only, so on the main thread it is used
/// directly; from any other thread `/proc/self/comm` (the thread group leader's name) is
/// written instead, leaving the calling thread's own name (e.g. a tokio worker) alone.
fn set_comm() {
    // The name stays until the next exec (which starts with this flag clear), and a forked
    // child inherits it: once per process is enough. Before, each title change (two a job)
    // made three system calls for a name that was already set.
    static DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if DONE.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    // SAFETY: getpid and the gettid syscall take no pointers and cannot fail.
    let (pid, tid) = unsafe {
        (
            libc::getpid() as libc::c_long,
            libc::syscall(libc::SYS_gettid),
        )
    };
    if pid == tid {
        let mut name = [0u8; 16];
        let n = COMM_NAME.len().min(15);
        name[..n].copy_from_slice(&COMM_NAME[..n]);
        // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes from the
        // pointer; `name` is a 16-byte buffer whose last byte is always 0.
        unsafe {
            libc::prctl(libc::PR_SET_NAME, name.as_ptr() as libc::c_ulong, 0, 0, 0);
        }
    } else {
        let _ = std::fs::write("/proc/self/comm", COMM_NAME);
    }
}

/// Parses `arg_start` and `arg_end` (fields 48 and 49, 1-based) from the contents of
/// `/proc/<pid>/stat`. Field 2 (`comm`, in parentheses) may contain spaces and `)`, so the
/// fields are counted from after the **last** `)`. Returns `None` unless the result is a
/// non-empty range at a non-null address.
fn parse_arg_range(stat: &str) -> Option<(usize, usize)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // `rest` starts with field 3 (state).
    let mut fields = rest.split_ascii_whitespace().skip(48 - 3);
    let start: usize = fields.next()?.parse().ok()?;
    let end: usize = fields.next()?.parse().ok()?;
    (start != 0 && start < end).then_some((start, end))
}

/// True if one read-write mapping listed in `maps` (contents of `/proc/self/maps`)
/// covers the whole range `[start, end)`.
fn range_in_writable_mapping(maps: &str, start: usize, end: usize) -> bool {
    maps.lines().any(|line| {
        let mut parts = line.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (parts.next(), parts.next()) else {
            return false;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            return false;
        };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        else {
            return false;
        };
        perms.starts_with("rw") && lo <= start && end <= hi
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a stat line with the given comm and arg range, 52 fields in total.
    fn stat_line(comm: &str, arg_start: u64, arg_end: u64) -> String {
        let mut fields: Vec<String> = vec!["4242".into(), format!("({comm})"), "S".into()];
        for n in 4..=52u64 {
            fields.push(match n {
                48 => arg_start.to_string(),
                49 => arg_end.to_string(),
                _ => n.to_string(),
            });
        }
        fields.join(" ") + "\n"
    }

    #[test]
    fn parses_plain_comm() {
        let s = stat_line("locketd", 140_737_488_347_000, 140_737_488_347_300);
        assert_eq!(
            parse_arg_range(&s),
            Some((140_737_488_347_000, 140_737_488_347_300))
        );
    }

    #[test]
    fn parses_comm_with_spaces_and_parens() {
        let s = stat_line("a) b (c)) 7 8", 1000, 1240);
        assert_eq!(parse_arg_range(&s), Some((1000, 1240)));
        let s = stat_line(") ) )", 5, 6);
        assert_eq!(parse_arg_range(&s), Some((5, 6)));
    }

    #[test]
    fn rejects_bad_stat() {
        assert_eq!(parse_arg_range(""), None);
        assert_eq!(parse_arg_range("1 (x) S 1 2 3"), None);
        assert_eq!(parse_arg_range(&stat_line("x", 0, 10)), None);
        assert_eq!(parse_arg_range(&stat_line("x", 10, 10)), None);
        assert_eq!(parse_arg_range(&stat_line("x", 20, 10)), None);
        let bad = stat_line("x", 10, 20).replace(" 10 20 ", " 10 zz ");
        assert_eq!(parse_arg_range(&bad), None);
    }

    #[test]
    fn parses_own_stat() {
        let stat = std::fs::read_to_string("/proc/self/stat").expect("read /proc/self/stat");
        let (start, end) = parse_arg_range(&stat).expect("own arg range");
        let cmdline = std::fs::read("/proc/self/cmdline").expect("read cmdline");
        assert_eq!(end - start, cmdline.len());
        let maps = std::fs::read_to_string("/proc/self/maps").expect("read maps");
        assert!(range_in_writable_mapping(&maps, start, end));
    }

    #[test]
    fn writable_mapping_check() {
        let maps = "00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/x\n\
                    7ffd0000-7ffd2000 rw-p 00000000 00:00 0 [stack]\n";
        assert!(range_in_writable_mapping(maps, 0x7ffd_0100, 0x7ffd_0200));
        assert!(range_in_writable_mapping(maps, 0x7ffd_0000, 0x7ffd_2000));
        assert!(!range_in_writable_mapping(maps, 0x7ffd_1f00, 0x7ffd_2001));
        assert!(!range_in_writable_mapping(maps, 0x0040_0000, 0x0040_0010));
        assert!(!range_in_writable_mapping("garbage\n", 1, 2));
    }

    #[test]
    fn title_bytes_fit_the_area() {
        assert_eq!(title_bytes("abc", 6), b"abc\0\0\0");
        assert_eq!(title_bytes("abcdef", 4), b"abc\0");
        assert_eq!(title_bytes("abc", 1), b"\0");
        assert_eq!(title_bytes("a\0b", 5), b"a b\0\0");
        // "é" is two bytes: never cut in the middle of it.
        assert_eq!(title_bytes("aé", 3), b"a\0\0");
        assert!(title_bytes("x", 0).is_empty());
    }

    #[test]
    fn prefix_matches_ruby_grep() {
        let p = title_prefix();
        assert!(p.starts_with("resque-"));
        assert!(p.as_bytes()[7].is_ascii_digit());
        assert!(p.ends_with("-locketd"));
    }
}
