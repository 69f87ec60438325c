//! A connection for one caller that sends one command and reads its reply before the next:
//! the job path's scripts of a one-slot worker (src/store/batch.rs). A worker's job path is
//! strictly sequential, so the multiplexed connection's machinery (a driver task, a channel
//! and a oneshot per call, the generic reply parser) is pure cost there: this type writes the
//! command from a reused buffer and reads the RESP2 reply into a [`Value`] itself, a fifth of
//! the worker's instructions per job (docs/dev/performance-log.md).
//!
//! It serves plain TCP URLs and Unix socket URLs (`redis+unix://`, `unix://`;
//! [`Plain::for_url`]): not TLS, not a sentinel's URL, whose calls stay on the
//! [`super::Manager`]. It connects on first use and after any failure, with the password and
//! database of the URL. A call that fails, times out or is dropped half-way leaves the
//! connection to be replaced at the next call, so that no reply is ever read as another
//! command's; the failed call's error is an I/O error or a timeout, which [`super::classify`]
//! calls an outage, as the manager's are.
//!
//! Only one call is ever on the wire, so a byte that no call asked for (a second reply, bytes
//! after a reply, bytes that arrive while no call waits) is a protocol error: the connection
//! is dropped. So is a reply that cannot be read (not RESP2, nested deeper than
//! [`MAX_DEPTH`]). The call then fails with a parse error, which [`super::classify`] calls
//! [`super::Failure::Unknown`]: Redis may have run it.

use redis::aio::ConnectionLike;
use redis::{Cmd, ConnectionAddr, ErrorKind, RedisError, RedisFuture, RedisResult, Value};
use std::io;
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

/// How deep a reply's arrays may nest: the job path's replies nest a few deep; the redis
/// crate's own parser (the manager's) stops at 100 as well. Deeper is a parse error, not a
/// recursion that overflows the worker's stack.
const MAX_DEPTH: usize = 100;

/// The manager's bounds (src/conn/mod.rs, `connect_from`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the server is: a TCP host and port, or a Unix socket's path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Addr {
    Tcp(String, u16),
    Unix(PathBuf),
}

/// Where and how to connect: the URL's address, credentials and database (no `Debug`:
/// it holds the password).
struct Target {
    addr: Addr,
    username: Option<String>,
    password: Option<String>,
    db: i64,
}

/// The open connection: over TCP (no Nagle delay) or a Unix socket.
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Reads what has arrived without waiting (`WouldBlock` when nothing has).
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.try_read(buf),
            Stream::Unix(s) => s.try_read(buf),
        }
    }

    async fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.write_all(bytes).await,
            Stream::Unix(s) => s.write_all(bytes).await,
        }
    }

    /// Appends what the next read gives to `buf`; 0 at end of stream.
    async fn read_buf(&mut self, buf: &mut Vec<u8>) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read_buf(buf).await,
            Stream::Unix(s) => s.read_buf(buf).await,
        }
    }
}

/// One request at a time over its own connection (see the module's text).
pub struct Plain {
    target: Target,
    stream: Option<Stream>,
    /// Set while a call is on the wire: a call dropped half-way leaves it set, and the next
    /// call then starts on a new connection.
    busy: bool,
    out: Vec<u8>,
    /// Bytes of the reply read so far.
    input: Vec<u8>,
}

impl std::fmt::Debug for Plain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plain")
            .field("addr", &self.target.addr)
            .field("connected", &self.stream.is_some())
            .finish()
    }
}

impl Plain {
    /// A connection for `url` if it is a plain `redis://` TCP URL or a Unix socket's URL (not
    /// TLS, not sentinels), else None. It does not connect yet.
    pub fn for_url(url: &str) -> Option<Plain> {
        if super::is_sentinel(url) {
            return None;
        }
        let info = super::client(url).ok()?.get_connection_info().clone();
        let addr = match info.addr() {
            ConnectionAddr::Tcp(host, port) => Addr::Tcp(host.clone(), *port),
            ConnectionAddr::Unix(path) => Addr::Unix(path.clone()),
            _ => return None,
        };
        let settings = info.redis_settings();
        Some(Plain {
            target: Target {
                addr,
                username: settings.username().map(str::to_string),
                password: settings.password().map(str::to_string),
                db: settings.db(),
            },
            stream: None,
            busy: false,
            out: Vec::with_capacity(4096),
            input: Vec::with_capacity(16 * 1024),
        })
    }

    /// Sends `cmd` and reads its reply (a server's error reply comes back as a
    /// [`Value::ServerError`], as from the manager).
    pub async fn call(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        self.call_packed(|out| cmd.write_packed_command(out)).await
    }

    /// Sends `cmd` with its first two arguments replaced by `head` (`FCALL <function>` for an
    /// `EVALSHA <sha>`: the rest, the key count, keys and arguments, is the same), and reads its
    /// reply. The command is packed once, straight from `cmd`, with no second [`Cmd`] built.
    pub async fn call_with_head(&mut self, head: [&[u8]; 2], cmd: &Cmd) -> RedisResult<Value> {
        self.call_packed(|out| pack_with_head(out, head, cmd)).await
    }

    /// [`Plain::call`] of the command `write` packs into the connection's output buffer.
    async fn call_packed(&mut self, write: impl FnOnce(&mut Vec<u8>)) -> RedisResult<Value> {
        if self.busy {
            self.drop_stream();
        }
        self.busy = true;
        let reply = match tokio::time::timeout(RESPONSE_TIMEOUT, self.round_trip(write)).await {
            Ok(reply) => reply,
            Err(_) => {
                Err(io::Error::new(io::ErrorKind::TimedOut, "no reply from Redis in 30 s").into())
            }
        };
        match &reply {
            Ok(_) => self.busy = false,
            Err(_) => self.drop_stream(),
        }
        reply
    }

    fn drop_stream(&mut self) {
        self.stream = None;
        self.input.clear();
        self.busy = false;
    }

    async fn round_trip(&mut self, write: impl FnOnce(&mut Vec<u8>)) -> RedisResult<Value> {
        if self.stream.is_some() && self.unrequested() {
            self.drop_stream();
            self.busy = true;
        }
        if self.stream.is_none() {
            self.connect().await?;
        }
        self.send(write).await
    }

    /// Whether the idle connection has bytes no call asked for, or was closed by the server:
    /// then it is replaced before the next call goes out (that call has not been sent, so its
    /// outcome is not in doubt). Only what the runtime has seen arrive is looked at (no
    /// system call while nothing has).
    fn unrequested(&self) -> bool {
        let Some(stream) = self.stream.as_ref() else {
            return false;
        };
        let mut byte = [0u8; 1];
        match stream.try_read(&mut byte) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
            Ok(0) => {
                tracing::debug!(target: super::LOG_TARGET, "the job path's connection was closed by Redis while idle; reconnecting");
                true
            }
            Ok(_) => {
                tracing::warn!(target: super::LOG_TARGET, "Redis sent bytes no call asked for on the job path's connection; reconnecting");
                true
            }
            Err(e) => {
                tracing::debug!(target: super::LOG_TARGET, error = %e, "the job path's connection failed while idle; reconnecting");
                true
            }
        }
    }

    /// Writes the command `write` packs on the open connection and reads its reply.
    async fn send(&mut self, write: impl FnOnce(&mut Vec<u8>)) -> RedisResult<Value> {
        self.out.clear();
        write(&mut self.out);
        let stream = self.stream.as_mut().expect("connected before sending");
        stream.write_all(&self.out).await?;
        self.read_reply().await
    }

    async fn connect(&mut self) -> RedisResult<()> {
        let connecting = async {
            match &self.target.addr {
                Addr::Tcp(host, port) => {
                    let stream = TcpStream::connect((host.as_str(), *port)).await?;
                    stream.set_nodelay(true)?;
                    Ok::<_, io::Error>(Stream::Tcp(stream))
                }
                Addr::Unix(path) => Ok(Stream::Unix(UnixStream::connect(path).await?)),
            }
        };
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
            .await
            .map_err(|_| {
                io::Error::new(io::ErrorKind::TimedOut, "connecting to Redis timed out")
            })??;
        self.stream = Some(stream);
        self.input.clear();
        let mut setup = Vec::new();
        if let Some(password) = self.target.password.clone() {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = &self.target.username {
                auth.arg(user);
            }
            setup.push(auth.arg(password).clone());
        }
        if self.target.db != 0 {
            setup.push(redis::cmd("SELECT").arg(self.target.db).clone());
        }
        for cmd in setup {
            let auth = cmd.args_iter().next() == Some(redis::Arg::Simple(b"AUTH".as_slice()));
            match self
                .send(|out| cmd.write_packed_command(out))
                .await?
                .extract_error()
            {
                // As the redis crate reports a refused AUTH (the manager's): the same kind,
                // so that both connections' calls are classified alike (classify).
                Err(e) if auth => {
                    return Err(RedisError::from((
                        ErrorKind::AuthenticationFailed,
                        "Password authentication failed",
                        e.to_string(),
                    )))
                }
                other => {
                    other?;
                }
            }
        }
        Ok(())
    }

    async fn read_reply(&mut self) -> RedisResult<Value> {
        loop {
            if let Some((value, end)) = parse(&self.input, 0, 0)? {
                if end != self.input.len() {
                    // One call on the wire, one reply: more is not ours to read, and reading
                    // it as the next call's reply would put every call one reply behind.
                    return Err(bad("bytes after the reply that no call asked for"));
                }
                self.input.clear();
                return Ok(value);
            }
            if self.input.capacity() - self.input.len() < 4096 {
                self.input.reserve(16 * 1024);
            }
            let stream = self.stream.as_mut().expect("connected before reading");
            if stream.read_buf(&mut self.input).await? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "Redis closed the connection",
                )
                .into());
            }
        }
    }
}

impl ConnectionLike for Plain {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.call(cmd))
    }

    /// Never used on this connection (the job path sends single commands); refused.
    fn req_packed_commands<'a>(
        &'a mut self,
        _: &'a redis::Pipeline,
        _: usize,
        _: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async {
            Err(RedisError::from((
                ErrorKind::Client,
                "a plain connection sends no pipelines",
            )))
        })
    }

    fn get_db(&self) -> i64 {
        self.target.db
    }
}

/// Packs `cmd` as RESP with its first two arguments replaced by `head`, as
/// [`Cmd::write_packed_command`] packs a command.
fn pack_with_head(out: &mut Vec<u8>, head: [&[u8]; 2], cmd: &Cmd) {
    // Only plain arguments (a job-path call has no other kind; the cursor of a SCAN is not one).
    let rest = || {
        cmd.args_iter().skip(2).filter_map(|a| match a {
            redis::Arg::Simple(b) => Some(b),
            _ => None,
        })
    };
    out.push(b'*');
    push_decimal(out, 2 + rest().count());
    out.extend_from_slice(b"\r\n");
    for bytes in head.into_iter().chain(rest()) {
        out.push(b'$');
        push_decimal(out, bytes.len());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(bytes);
        out.extend_from_slice(b"\r\n");
    }
}

/// Appends `n` in decimal (no `write!`: its formatting machinery cost more than the rest of
/// the packing).
fn push_decimal(out: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

fn bad(what: &'static str) -> RedisError {
    RedisError::from((
        ErrorKind::Parse,
        "unreadable reply from Redis",
        what.to_string(),
    ))
}

/// The line that starts at `at` (without its CRLF) and where the next one starts, or None
/// while its end has not arrived.
fn line(b: &[u8], at: usize) -> Option<(&[u8], usize)> {
    let mut i = at;
    loop {
        let cr = i + b.get(i..)?.iter().position(|&c| c == b'\r')?;
        match b.get(cr + 1) {
            Some(b'\n') => return Some((&b[at..cr], cr + 2)),
            Some(_) => i = cr + 1,
            None => return None,
        }
    }
}

fn integer(s: &[u8]) -> RedisResult<i64> {
    std::str::from_utf8(s)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("a length or an integer that is not a number"))
}

/// The RESP2 value that starts at `b[at..]` and where it ends, or None while it has not all
/// arrived. `depth`: how many arrays it is inside (at most [`MAX_DEPTH`]).
fn parse(b: &[u8], at: usize, depth: usize) -> RedisResult<Option<(Value, usize)>> {
    let Some((head, next)) = line(b, at) else {
        return Ok(None);
    };
    let Some((&kind, rest)) = head.split_first() else {
        return Err(bad("an empty line"));
    };
    let value = match kind {
        b'$' => {
            let Ok(n) = usize::try_from(integer(rest)?) else {
                return Ok(Some((Value::Nil, next)));
            };
            let end = next
                .checked_add(n)
                .ok_or_else(|| bad("a bulk string longer than memory"))?;
            if b.len() < end.saturating_add(2) {
                return Ok(None);
            }
            if &b[end..end + 2] != b"\r\n" {
                return Err(bad("a bulk string without its CRLF"));
            }
            return Ok(Some((Value::BulkString(b[next..end].to_vec()), end + 2)));
        }
        b':' => Value::Int(integer(rest)?),
        b'+' => Value::SimpleString(String::from_utf8_lossy(rest).into_owned()),
        // The crate's own parser makes the error value (its code and kind) from the line.
        b'-' => redis::parse_redis_value(&b[at..next])?,
        b'*' => {
            let Ok(n) = usize::try_from(integer(rest)?) else {
                return Ok(Some((Value::Nil, next)));
            };
            if n > 0 && depth >= MAX_DEPTH {
                return Err(bad("arrays nested deeper than any reply of the job path"));
            }
            let mut items = Vec::with_capacity(n.min(1024));
            let mut pos = next;
            for _ in 0..n {
                let Some((item, end)) = parse(b, pos, depth + 1)? else {
                    return Ok(None);
                };
                items.push(item);
                pos = end;
            }
            return Ok(Some((Value::Array(items), pos)));
        }
        _ => return Err(bad("a reply of an unknown type")),
    };
    Ok(Some((value, next)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(b: &[u8]) -> Value {
        let (v, end) = parse(b, 0, 0).unwrap().expect("complete");
        assert_eq!(end, b.len());
        v
    }

    #[test]
    fn a_command_with_its_head_replaced_packs_as_that_command_built_whole() {
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha
            .arg("0123456789abcdef0123456789abcdef01234567")
            .arg(2)
            .arg("k:1")
            .arg("k:2")
            .arg("")
            .arg(b"caf\xc3\xa9\r\n".as_slice())
            .arg("x".repeat(1234));
        let mut fcall = redis::cmd("FCALL");
        fcall
            .arg("locketd_abc_finish")
            .arg(2)
            .arg("k:1")
            .arg("k:2")
            .arg("")
            .arg(b"caf\xc3\xa9\r\n".as_slice())
            .arg("x".repeat(1234));
        let mut out = Vec::new();
        pack_with_head(&mut out, [b"FCALL", b"locketd_abc_finish"], &evalsha);
        assert_eq!(out, fcall.get_packed_command());
    }

    #[test]
    fn parses_every_resp2_reply_the_job_path_gets() {
        let b = b"*5\r\n$2\r\nok\r\n:-12\r\n$-1\r\n*2\r\n+OK\r\n$0\r\n\r\n*0\r\n";
        assert_eq!(
            whole(b),
            Value::Array(vec![
                Value::BulkString(b"ok".to_vec()),
                Value::Int(-12),
                Value::Nil,
                Value::Array(vec![
                    Value::SimpleString("OK".into()),
                    Value::BulkString(Vec::new()),
                ]),
                Value::Array(Vec::new()),
            ])
        );
        // A bulk string may hold CR, LF and CRLF: its length, not a line end, bounds it.
        assert_eq!(
            whole(b"$6\r\na\r\nb\rc\r\n"),
            Value::BulkString(b"a\r\nb\rc".to_vec())
        );
        assert_eq!(whole(b"*-1\r\n"), Value::Nil);
    }

    #[test]
    fn an_error_reply_keeps_its_code() {
        let v = whole(b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n");
        let e = v.extract_error().unwrap_err();
        assert_eq!(e.code(), Some("WRONGTYPE"));
        let v = whole(b"-READONLY You can't write against a read only replica.\r\n");
        assert_eq!(
            super::super::classify(&v.extract_error().unwrap_err()),
            super::super::Failure::Outage
        );
    }

    #[test]
    fn a_reply_cut_anywhere_is_incomplete_not_wrong() {
        let b: &[u8] = b"*3\r\n$5\r\nhello\r\n:7\r\n*1\r\n$2\r\nhi\r\n";
        for cut in 0..b.len() {
            assert!(parse(&b[..cut], 0, 0).unwrap().is_none(), "cut at {cut}");
        }
        assert!(parse(b, 0, 0).unwrap().is_some());
        // Two replies in one read: the first ends where the second starts.
        let two = b"+OK\r\n:1\r\n";
        let (first, end) = parse(two, 0, 0).unwrap().unwrap();
        assert_eq!(first, Value::SimpleString("OK".into()));
        assert_eq!(parse(two, end, 0).unwrap().unwrap().0, Value::Int(1));
    }

    #[test]
    fn garbage_is_a_parse_error() {
        assert!(parse(b"?what\r\n", 0, 0).is_err());
        assert!(parse(b"$3\r\nabcXY", 0, 0).is_err());
        assert!(parse(b":12x\r\n", 0, 0).is_err());
    }

    // A reply nested deeper than any of the job path's is a parse error (the outcome of its
    // call unknown), not a recursion that overflows the worker's stack and aborts it.
    #[test]
    fn a_deeply_nested_reply_is_a_parse_error_not_a_stack_overflow() {
        let nested = |n: usize| {
            let mut b = b"*1\r\n".repeat(n);
            b.extend_from_slice(b":1\r\n");
            b
        };
        let mut v = whole(&nested(MAX_DEPTH));
        for _ in 0..MAX_DEPTH {
            let Value::Array(mut items) = v else {
                panic!("not an array: {v:?}")
            };
            v = items.pop().expect("one item");
        }
        assert_eq!(v, Value::Int(1));
        let e = parse(&nested(MAX_DEPTH + 1), 0, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Parse);
        assert_eq!(super::super::classify(&e), super::super::Failure::Unknown);
        // What a hostile peer sends: a million levels, whole or still arriving, on a thread
        // whose stack is small.
        let deep = nested(1_000_000);
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                assert!(parse(&deep, 0, 0).is_err());
                assert!(parse(&deep[..deep.len() / 2], 0, 0).is_err());
            })
            .unwrap()
            .join()
            .expect("no stack overflow");
    }

    // A RESP3 reply (a proxy that speaks RESP3 to us) is unreadable here: a parse error, whose
    // call's outcome is unknown.
    #[test]
    fn a_resp3_reply_is_unreadable() {
        for b in [
            &b"%1\r\n+a\r\n:1\r\n"[..],
            b"_\r\n",
            b"#t\r\n",
            b",1.5\r\n",
            b"~1\r\n:1\r\n",
            b"*2\r\n:1\r\n_\r\n",
        ] {
            let e = parse(b, 0, 0).unwrap_err();
            assert_eq!(
                super::super::classify(&e),
                super::super::Failure::Unknown,
                "{}",
                String::from_utf8_lossy(b)
            );
        }
    }

    #[test]
    fn plain_tcp_and_unix_socket_urls_get_one() {
        let p = Plain::for_url("redis://:secret@127.0.0.1:6390/3").expect("a TCP URL");
        assert_eq!(p.target.addr, Addr::Tcp("127.0.0.1".into(), 6390));
        assert_eq!(p.target.db, 3);
        assert_eq!(p.target.password.as_deref(), Some("secret"));
        let u = Plain::for_url("redis+unix:///tmp/redis.sock?db=2&pass=pw").expect("a socket");
        assert_eq!(u.target.addr, Addr::Unix("/tmp/redis.sock".into()));
        assert_eq!(u.target.db, 2);
        assert_eq!(u.target.password.as_deref(), Some("pw"));
        assert!(Plain::for_url("unix:///tmp/redis.sock").is_some());
        assert!(Plain::for_url("rediss://127.0.0.1:6390/0").is_none());
        assert!(Plain::for_url("redis+sentinel://127.0.0.1:26379/mymaster/0").is_none());
    }
}
