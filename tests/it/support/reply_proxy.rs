//! A TCP proxy between the daemon and a real `redis-server` that tampers with the reply to a
//! matching command: what a misbehaving proxy or peer in the path does (issue 37 findings
//! 3–5). Everything else goes through unchanged, in both directions.
//!
//! Each client connection gets its own connection to the server and two threads: one reads
//! the client's commands (RESP arrays, or inline lines) and notes, in order, which replies to
//! tamper with, before passing the bytes on; the other cuts the server's byte stream into
//! replies and writes each one, or its replacement. A connection that switches to RESP3
//! (`HELLO 3`: the master's client tracking, with push messages that answer no command) is
//! passed through untouched. At most `times` replies are tampered with in all.
//!
//! Dropping the proxy shuts every connection down and joins its threads.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::RedisServer;

/// What becomes of a matching command's reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tamper {
    /// Replaced by a line that is not RESP at all.
    Garbage,
    /// Replaced by a RESP3 map (`%1 +ok :1`), as a proxy speaking RESP3 would send.
    Resp3,
    /// Passed on, followed in the same write by a reply nobody asked for (`+OK`).
    ExtraReply,
    /// Replaced by arrays nested this deep around an integer.
    Nested(usize),
}

impl Tamper {
    fn apply(self, reply: &[u8], out: &mut Vec<u8>) {
        match self {
            Tamper::Garbage => out.extend_from_slice(b"?garbage that is not RESP\r\n"),
            Tamper::Resp3 => out.extend_from_slice(b"%1\r\n+ok\r\n:1\r\n"),
            Tamper::ExtraReply => {
                out.extend_from_slice(reply);
                out.extend_from_slice(b"+OK\r\n");
            }
            Tamper::Nested(depth) => {
                out.reserve(depth * 4 + 4);
                for _ in 0..depth {
                    out.extend_from_slice(b"*1\r\n");
                }
                out.extend_from_slice(b":1\r\n");
            }
        }
    }
}

type Matcher = dyn Fn(&[Vec<u8>]) -> bool + Send + Sync;

struct Shared {
    upstream: u16,
    tamper: Tamper,
    matches: Box<Matcher>,
    /// Replies chosen for tampering (at most `times`), and those written.
    chosen: AtomicUsize,
    times: usize,
    tampered: AtomicUsize,
    stop: AtomicBool,
    sockets: Mutex<Vec<TcpStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// A tampering proxy on a free loopback port (see the module's text).
pub struct ReplyProxy {
    port: u16,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl ReplyProxy {
    /// Proxies to `redis`; the first `times` replies to a command for which `matches(args)`
    /// holds are tampered with as `tamper` says.
    pub fn start(
        redis: &RedisServer,
        tamper: Tamper,
        times: usize,
        matches: impl Fn(&[Vec<u8>]) -> bool + Send + Sync + 'static,
    ) -> ReplyProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let port = listener.local_addr().expect("proxy address").port();
        let shared = Arc::new(Shared {
            upstream: redis.port(),
            tamper,
            matches: Box::new(matches),
            chosen: AtomicUsize::new(0),
            times,
            tampered: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            sockets: Mutex::new(Vec::new()),
            threads: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        let accept = std::thread::spawn(move || accept_loop(listener, s));
        ReplyProxy {
            port,
            shared,
            accept: Some(accept),
        }
    }

    /// `redis://127.0.0.1:PORT/0` of the proxy.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// How many replies were tampered with so far.
    pub fn tampered(&self) -> usize {
        self.shared.tampered.load(Ordering::SeqCst)
    }
}

impl Drop for ReplyProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        for s in self.shared.sockets.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        let threads: Vec<_> = self.shared.threads.lock().unwrap().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }
}

/// Whether `args` is an `FCALL` of the locketd library's function `op` (the job path's calls
/// on Redis 7: `FCALL locketd_<hash>_<op> ...`), or a `batch` call that carries `op`.
pub fn is_fcall_of(args: &[Vec<u8>], op: &str) -> bool {
    let Some((cmd, rest)) = args.split_first() else {
        return false;
    };
    if !cmd.eq_ignore_ascii_case(b"FCALL") {
        return false;
    }
    let Some(name) = rest.first() else {
        return false;
    };
    if !name.starts_with(b"locketd_") {
        return false;
    }
    name.ends_with(format!("_{op}").as_bytes())
        || (name.ends_with(b"_batch") && rest.iter().any(|a| a.as_slice() == op.as_bytes()))
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((client, _)) => {
                let _ = client.set_nonblocking(false);
                let Ok(server) = TcpStream::connect(("127.0.0.1", shared.upstream)) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let pending = Arc::new(Mutex::new(VecDeque::<bool>::new()));
                let raw = Arc::new(AtomicBool::new(false));
                let clones = (
                    client.try_clone().expect("clone"),
                    server.try_clone().expect("clone"),
                );
                {
                    let mut sockets = shared.sockets.lock().unwrap();
                    sockets.push(client.try_clone().expect("clone"));
                    sockets.push(server.try_clone().expect("clone"));
                }
                let (s1, p1, r1) = (shared.clone(), pending.clone(), raw.clone());
                let up = std::thread::spawn(move || requests(client, clones.1, &s1, &p1, &r1));
                let (s2, p2, r2) = (shared.clone(), pending, raw);
                let down = std::thread::spawn(move || replies(server, clones.0, &s2, &p2, &r2));
                shared.threads.lock().unwrap().extend([up, down]);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Client → server: notes each command's tampering, then passes its bytes on.
fn requests(
    mut from: TcpStream,
    mut to: TcpStream,
    shared: &Shared,
    pending: &Mutex<VecDeque<bool>>,
    raw: &AtomicBool,
) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 64 * 1024];
    let mut parsed = 0;
    loop {
        let n = match from.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        while let Some((args, end)) = command(&buf, parsed) {
            parsed = end;
            if args.len() >= 2
                && args[0].eq_ignore_ascii_case(b"HELLO")
                && args[1].as_slice() != b"2"
            {
                raw.store(true, Ordering::SeqCst);
            }
            let tamper = !raw.load(Ordering::SeqCst)
                && (shared.matches)(&args)
                && shared
                    .chosen
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| {
                        (c < shared.times).then_some(c + 1)
                    })
                    .is_ok();
            pending.lock().unwrap().push_back(tamper);
        }
        // Noted before the server can answer: the bytes go on only now.
        if to.write_all(&chunk[..n]).is_err() {
            break;
        }
        if parsed == buf.len() {
            buf.clear();
            parsed = 0;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// Server → client: each reply, or its replacement.
fn replies(
    mut from: TcpStream,
    mut to: TcpStream,
    shared: &Shared,
    pending: &Mutex<VecDeque<bool>>,
    raw: &AtomicBool,
) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 64 * 1024];
    let mut out = Vec::new();
    loop {
        let n = match from.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        out.clear();
        let mut at = 0;
        while at < buf.len() {
            if raw.load(Ordering::SeqCst) {
                out.extend_from_slice(&buf[at..]);
                at = buf.len();
                break;
            }
            let Some(end) = reply_end(&buf, at) else {
                break;
            };
            let reply = &buf[at..end];
            if pending.lock().unwrap().pop_front() == Some(true) {
                shared.tamper.apply(reply, &mut out);
                shared.tampered.fetch_add(1, Ordering::SeqCst);
            } else {
                out.extend_from_slice(reply);
            }
            at = end;
        }
        buf.drain(..at);
        if !out.is_empty() && to.write_all(&out).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// The line that starts at `at` (without CRLF) and where the next starts.
fn line(b: &[u8], at: usize) -> Option<(&[u8], usize)> {
    let rel = b.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
    Some((&b[at..at + rel], at + rel + 2))
}

fn number(s: &[u8]) -> Option<i64> {
    std::str::from_utf8(s).ok()?.trim().parse().ok()
}

/// The command (its arguments) that starts at `at` and where it ends, once it has all arrived.
fn command(b: &[u8], at: usize) -> Option<(Vec<Vec<u8>>, usize)> {
    let (head, mut pos) = line(b, at)?;
    let Some(count) = head.strip_prefix(b"*") else {
        // An inline command.
        let args = head
            .split(|c| *c == b' ')
            .filter(|a| !a.is_empty())
            .map(<[u8]>::to_vec)
            .collect();
        return Some((args, pos));
    };
    let n = number(count)?.max(0) as usize;
    let mut args = Vec::with_capacity(n);
    for _ in 0..n {
        let (len, next) = line(b, pos)?;
        let len = number(len.strip_prefix(b"$")?)? as usize;
        if b.len() < next + len + 2 {
            return None;
        }
        args.push(b[next..next + len].to_vec());
        pos = next + len + 2;
    }
    Some((args, pos))
}

/// Where the reply (RESP2 or RESP3) that starts at `at` ends, once it has all arrived.
fn reply_end(b: &[u8], at: usize) -> Option<usize> {
    let (head, next) = line(b, at)?;
    let (&kind, rest) = head.split_first()?;
    match kind {
        b'$' | b'!' | b'=' => {
            let n = number(rest)?;
            if n < 0 {
                return Some(next);
            }
            let end = next + n as usize + 2;
            (b.len() >= end).then_some(end)
        }
        b'*' | b'~' | b'>' | b'%' | b'|' => {
            let n = number(rest)?;
            let items = if matches!(kind, b'%' | b'|') {
                n * 2
            } else {
                n
            };
            let mut pos = next;
            for _ in 0..items.max(0) {
                pos = reply_end(b, pos)?;
            }
            if kind == b'|' {
                // Attributes precede the reply they describe.
                return reply_end(b, pos);
            }
            Some(pos)
        }
        _ => Some(next),
    }
}
