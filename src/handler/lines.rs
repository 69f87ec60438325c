//! Reading a handler's output streams line by line, bounded.

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// The stderr lines kept for a failure record.
pub(super) const STDERR_TAIL_LINES: usize = 20;
/// The longest line kept; the rest of a longer line is read and dropped.
pub(super) const LINE_LIMIT: usize = 2000;

/// Calls `f` with each line `r` gives until its end (or a read error), without the line end.
/// A line is kept to its first [`LINE_LIMIT`] bytes: the rest is read and dropped as it comes,
/// so a handler that writes without newlines costs bounded memory. Bytes that are not UTF-8
/// become U+FFFD: ending the read there would close the pipe, and the handler's next write
/// would kill it with SIGPIPE.
pub(super) async fn for_each_line<R: AsyncRead + Unpin>(r: R, mut f: impl FnMut(String)) {
    let mut reader = BufReader::new(r);
    let mut line: Vec<u8> = Vec::new();
    let mut pending = false;
    while let Ok(buf) = reader.fill_buf().await {
        if buf.is_empty() {
            break;
        }
        let newline = buf.iter().position(|&b| b == b'\n');
        let chunk = &buf[..newline.unwrap_or(buf.len())];
        let room = LINE_LIMIT.saturating_sub(line.len());
        line.extend_from_slice(&chunk[..chunk.len().min(room)]);
        pending = true;
        let used = newline.map_or(buf.len(), |i| i + 1);
        reader.consume(used);
        if newline.is_some() {
            f(decode_line(&line));
            line.clear();
            pending = false;
        }
    }
    if pending {
        f(decode_line(&line));
    }
}

fn decode_line(line: &[u8]) -> String {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    trim_line(String::from_utf8_lossy(line).into_owned())
}

fn trim_line(mut line: String) -> String {
    if line.len() > LINE_LIMIT {
        let mut cut = LINE_LIMIT;
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        line.truncate(cut);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn lines_of(input: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        for_each_line(input, |l| out.push(l)).await;
        out
    }

    // A handler's output is read to its end whatever it holds: bytes that are not UTF-8 do not
    // stop the read (the handler would get SIGPIPE), and a long line costs LINE_LIMIT bytes.
    #[tokio::test]
    async fn output_lines_survive_bad_bytes_and_long_lines() {
        let long = "x".repeat(3 * LINE_LIMIT);
        let input = format!("ok\n\u{1}\nafter\r\n{long}\nlast");
        let mut bytes = input.into_bytes();
        bytes.splice(3..4, [0xff, 0xfe]);
        let lines = lines_of(&bytes).await;
        assert_eq!(lines.len(), 5, "{lines:?}");
        assert_eq!(lines[0], "ok");
        assert_eq!(lines[1], "\u{fffd}\u{fffd}");
        assert_eq!(lines[2], "after");
        assert_eq!(lines[3], "x".repeat(LINE_LIMIT));
        assert_eq!(lines[4], "last");
        assert!(lines_of(b"").await.is_empty());
        assert_eq!(lines_of(b"\n").await, [""]);
    }
}
