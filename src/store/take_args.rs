//! TAKE's keys and arguments sent as the changes from the slot's last TAKE (take_args.lua,
//! locking-semantics.md A-7a "the arguments"): most of a TAKE's 50-odd entries are the same
//! call after call, and each costs Redis about 1.5 k instructions to take in, so the job
//! path's own connection sends the whole list once and then the entries that changed, against
//! the version of the list the library keeps for the slot. The library answers a version it
//! does not hold with `LOCKET_ARGS_MISS`, before doing anything, and the list goes out whole.

use redis::Cmd;

/// The most entries a list sent as changes may have: a position is one byte.
const MOST_ENTRIES: usize = 255;

/// The error the library answers a version it does not hold with.
pub(super) const MISS: &str = "LOCKET_ARGS_MISS";

/// The last list the library took for a stream (the slot's inflight key, the list's first
/// entry), as it holds it.
#[derive(Debug, Default)]
pub(super) struct Sent {
    /// The version the library was told.
    version: u64,
    /// Its number of keys.
    nkeys: usize,
    /// Its entries, one after the other, and where each ends.
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl Sent {
    fn entry(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.bytes[start..self.ends[i]]
    }

    /// Whether `entries` of `nkeys` keys may go out as changes from this list.
    fn fits(&self, nkeys: usize, entries: &[&[u8]]) -> bool {
        self.nkeys == nkeys
            && self.ends.len() == entries.len()
            && !entries.is_empty()
            && entries.len() <= MOST_ENTRIES
            && entries[0] == self.entry(0)
    }
}

/// A stream's state on the worker's side: the list the library holds, if known, and the
/// version counter.
#[derive(Debug, Default)]
pub(super) struct Lists {
    sent: Option<Sent>,
    version: u64,
}

impl Lists {
    /// The next call of `function` for `entries` (a TAKE's keys, then its arguments; `nkeys`
    /// keys): as changes from the list the library holds when it fits, else whole (`whole`).
    /// Returns the command and the version it makes.
    pub(super) fn command(
        &mut self,
        function: &str,
        nkeys: usize,
        entries: &[&[u8]],
        whole: bool,
    ) -> (Cmd, u64) {
        self.version += 1;
        let version = self.version;
        let stream = entries.first().copied().unwrap_or_default();
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(function).arg(0).arg(stream);
        match self
            .sent
            .as_ref()
            .filter(|s| !whole && s.fits(nkeys, entries))
        {
            Some(sent) => {
                let changed: Vec<usize> = (0..entries.len())
                    .filter(|&i| sent.entry(i) != entries[i])
                    .collect();
                // Positions from 1, one byte each (fits: at most 255 entries).
                let at: Vec<u8> = changed.iter().map(|&i| (i + 1) as u8).collect();
                cmd.arg(sent.version).arg(version).arg(at);
                for &i in &changed {
                    cmd.arg(entries[i]);
                }
            }
            None => {
                cmd.arg("").arg(version).arg(nkeys);
                for e in entries {
                    cmd.arg(*e);
                }
            }
        }
        (cmd, version)
    }

    /// What the call of `version` left in the library: the list, when it was taken (a reply),
    /// else nothing known (an error, or no reply: the next call goes whole).
    pub(super) fn settled(&mut self, version: u64, nkeys: usize, entries: &[&[u8]], took: bool) {
        if !took || entries.len() > MOST_ENTRIES {
            self.sent = None;
            return;
        }
        let mut sent = self.sent.take().unwrap_or_default();
        sent.version = version;
        sent.nkeys = nkeys;
        sent.bytes.clear();
        sent.ends.clear();
        for e in entries {
            sent.bytes.extend_from_slice(e);
            sent.ends.push(sent.bytes.len());
        }
        self.sent = Some(sent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Arg;

    fn args(cmd: &Cmd) -> Vec<Vec<u8>> {
        cmd.args_iter()
            .map(|a| match a {
                Arg::Simple(b) => b.to_vec(),
                _ => Vec::new(),
            })
            .collect()
    }

    fn v(items: &[&str]) -> Vec<Vec<u8>> {
        items.iter().map(|s| s.as_bytes().to_vec()).collect()
    }

    #[test]
    fn a_list_goes_whole_first_then_as_its_changes_and_whole_again_after_an_error() {
        let mut l = Lists::default();
        let first: Vec<&[u8]> = vec![b"inflight", b"k2", b"a1", b"a2", b"a3"];
        let (cmd, ver) = l.command("f", 2, &first, false);
        assert_eq!(
            args(&cmd),
            v(&["FCALL", "f", "0", "inflight", "", "1", "2", "inflight", "k2", "a1", "a2", "a3"])
        );
        l.settled(ver, 2, &first, true);

        let second: Vec<&[u8]> = vec![b"inflight", b"k2", b"b1", b"a2", b"b3"];
        let (cmd, ver) = l.command("f", 2, &second, false);
        let mut want = v(&["FCALL", "f", "0", "inflight", "1", "2"]);
        want.push(vec![3, 5]);
        want.extend(v(&["b1", "b3"]));
        assert_eq!(args(&cmd), want);
        l.settled(ver, 2, &second, true);

        // Nothing changed: no positions, no values.
        let (cmd, ver) = l.command("f", 2, &second, false);
        let mut want = v(&["FCALL", "f", "0", "inflight", "2", "3"]);
        want.push(Vec::new());
        assert_eq!(args(&cmd), want);
        // No reply: the library's list is not known, so the next goes whole.
        l.settled(ver, 2, &second, false);
        let (cmd, _) = l.command("f", 2, &second, false);
        assert_eq!(args(&cmd)[4], b"");
    }

    #[test]
    fn another_shape_another_stream_or_a_miss_goes_whole() {
        let mut l = Lists::default();
        let a: Vec<&[u8]> = vec![b"s1", b"x", b"y"];
        let (_, ver) = l.command("f", 1, &a, false);
        l.settled(ver, 1, &a, true);
        for (nkeys, list) in [
            (1, vec![b"s1".as_slice(), b"x", b"y", b"z"]),
            (2, vec![b"s1".as_slice(), b"x", b"y"]),
            (1, vec![b"s2".as_slice(), b"x", b"y"]),
        ] {
            let (cmd, _) = l.command("f", nkeys, &list, false);
            assert_eq!(args(&cmd)[4], b"", "{list:?}");
        }
        // `whole`: the library missed the version.
        let (cmd, _) = l.command("f", 1, &a, true);
        assert_eq!(args(&cmd)[4], b"");
        // Over 255 entries: always whole, and nothing kept.
        let long: Vec<Vec<u8>> = (0..300).map(|i| format!("e{i}").into_bytes()).collect();
        let long: Vec<&[u8]> = long.iter().map(Vec::as_slice).collect();
        let (_, ver) = l.command("f", 1, &long, false);
        l.settled(ver, 1, &long, true);
        let (cmd, _) = l.command("f", 1, &long, false);
        assert_eq!(args(&cmd)[4], b"");
    }
}
