//! Resque queue lists: parsing `QUEUES`/`QUEUE` values and expanding wildcard patterns
//! against `SMEMBERS queues`, exactly as Ruby Resque 3.0's `Worker#queues=`, `#queues` and
//! `#glob_match` do (resque-protocol.md §3, §13 item 6).
//!
//! ```text
//! QUEUES='critical,*,!low'   patterns = [critical, *]   skips = [low]   id part = "critical,*"
//! redis> SMEMBERS resque:queues
//! 1) "low"  2) "critical"  3) "mail"  4) "Beta"
//! order tried: critical, Beta, mail
//! ```
//!
//! Matching is Ruby's `File.fnmatch?(pattern, name)` with no flags, reimplemented in
//! [`fnmatch`] after `dir.c` (`fnmatch_helper` and `bracket`).

use std::collections::HashSet;

/// Characters whose presence in any configured pattern turns on dynamic mode
/// (Resque's `WILDCARDS`). Braces count even though `fnmatch` treats them literally.
const WILDCARDS: [char; 6] = ['*', '?', '{', '}', '[', ']'];

/// Why a queue list was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueSpecError {
    /// The list had no entries at all after splitting and trimming.
    #[error("queue list is empty")]
    Empty,
    /// The list had only `!skip` entries, so there is no queue to work.
    #[error("queue list has only skip patterns")]
    OnlySkips,
}

/// A parsed Resque queue list: the configured patterns in order and the `!skip` patterns.
///
/// Static mode (no wildcard, no skip) uses the patterns verbatim as queue names; dynamic mode
/// re-expands them against the known queues on every reservation (see [`QueueSpec::expand`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSpec {
    patterns: Vec<String>,
    skips: Vec<String>,
}

impl QueueSpec {
    /// Parses a comma-separated list such as the `QUEUES` environment value.
    ///
    /// Entries are trimmed (Ruby `String#strip`: ASCII whitespace and NUL), empty entries are
    /// dropped, and entries starting with `!` become skip patterns (stored without the `!`).
    /// Unlike Ruby, which keeps an empty entry from `a,,b` in the list and worker id, empty
    /// entries are dropped here; they could never name a real queue.
    pub fn parse(list: &str) -> Result<QueueSpec, QueueSpecError> {
        Self::from_entries(list.split(','))
    }

    /// Parses several list items (for example repeated `--queue` flags); each item may itself
    /// contain commas and follows the same rules as [`QueueSpec::parse`].
    pub fn from_list(items: &[String]) -> Result<QueueSpec, QueueSpecError> {
        Self::from_entries(items.iter().flat_map(|item| item.split(',')))
    }

    fn from_entries<'a>(
        entries: impl Iterator<Item = &'a str>,
    ) -> Result<QueueSpec, QueueSpecError> {
        let mut patterns = Vec::new();
        let mut skips = Vec::new();
        for entry in entries {
            let entry = ruby_strip(entry);
            if entry.is_empty() {
                continue;
            }
            match entry.strip_prefix('!') {
                Some(skip) => skips.push(skip.to_owned()),
                None => patterns.push(entry.to_owned()),
            }
        }
        if patterns.is_empty() {
            return Err(if skips.is_empty() {
                QueueSpecError::Empty
            } else {
                QueueSpecError::OnlySkips
            });
        }
        Ok(QueueSpec { patterns, skips })
    }

    /// Whether the list must be expanded against `SMEMBERS queues` on every reservation:
    /// any pattern contains one of `* ? { } [ ]`, or any skip pattern exists.
    pub fn is_dynamic(&self) -> bool {
        !self.skips.is_empty()
            || self
                .patterns
                .iter()
                .any(|p| p.contains(|c: char| WILDCARDS.contains(&c)))
    }

    /// The queue part of the Resque worker id (`host:pid:<id_part>`): the configured patterns
    /// joined by `,`, without the `!` entries (`*,!low` gives `*`).
    pub fn id_part(&self) -> String {
        self.patterns.join(",")
    }

    /// The configured (non-skip) patterns, in order.
    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }

    /// The skip patterns, without their leading `!`.
    pub fn skips(&self) -> &[String] {
        &self.skips
    }

    /// The queues to try, in order, given the current members of the `queues` set.
    ///
    /// Static mode returns the patterns verbatim (they need not be in `known`). Dynamic mode
    /// replaces each pattern by the known queues it matches and no skip pattern matches,
    /// sorted bytewise; a pattern without wildcards therefore yields its name only when the
    /// queue is known. The per-pattern lists are concatenated keeping the first occurrence of
    /// each name.
    pub fn expand(&self, known: &[String]) -> Vec<String> {
        if !self.is_dynamic() {
            return self.patterns.clone();
        }
        let mut seen: HashSet<&str> = HashSet::new();
        let mut out = Vec::new();
        for pattern in &self.patterns {
            let mut matches: Vec<&String> = known
                .iter()
                .filter(|q| fnmatch(pattern, q) && !self.skips.iter().any(|s| fnmatch(s, q)))
                .collect();
            matches.sort();
            for q in matches {
                if seen.insert(q.as_str()) {
                    out.push(q.clone());
                }
            }
        }
        out
    }
}

/// Ruby `String#strip`: removes leading and trailing ASCII whitespace and NUL, nothing else
/// (Rust's `str::trim` would also remove Unicode spaces such as U+00A0).
fn ruby_strip(s: &str) -> &str {
    s.trim_matches(|c: char| matches!(c, '\0' | '\t' | '\n' | '\u{0b}' | '\u{0c}' | '\r' | ' '))
}

/// Ruby `File.fnmatch?(pattern, name)` with no flags.
///
/// - `*` matches any run of characters, including `/` and `:` (no `FNM_PATHNAME`);
/// - `?` matches one character; `[...]` one character from a set with ranges `a-z` and
///   negation by a leading `!` or `^`; an unterminated `[` never matches;
/// - a name starting with `.` only matches a pattern starting with a literal (possibly
///   escaped) `.` (no `FNM_DOTMATCH`);
/// - `\` escapes the next character; braces are literal (no `FNM_EXTGLOB`);
/// - matching is case-sensitive and works on Unicode scalar values.
///
/// Ruby raises on a NUL in either argument; here that is simply no match.
pub fn fnmatch(pattern: &str, name: &str) -> bool {
    if pattern.contains('\0') || name.contains('\0') {
        return false;
    }
    let p: Vec<char> = pattern.chars().collect();
    let s: Vec<char> = name.chars().collect();
    Matcher { p: &p, s: &s }.run()
}

/// The matcher state of Ruby's `fnmatch_helper`. Indexing past the end reads `'\0'`, like
/// the C code reading the terminator, which keeps the translation close and panic-free.
struct Matcher<'a> {
    p: &'a [char],
    s: &'a [char],
}

impl Matcher<'_> {
    fn pat(&self, i: usize) -> char {
        self.p.get(i).copied().unwrap_or('\0')
    }

    /// Ruby's `UNESCAPE(p)`: skip a backslash so the next character is taken literally.
    fn unescape(&self, i: usize) -> usize {
        if self.pat(i) == '\\' {
            i + 1
        } else {
            i
        }
    }

    fn run(&self) -> bool {
        let (plen, slen) = (self.p.len(), self.s.len());
        // Leading period: only a literal '.' in the pattern may match it.
        if self.s.first() == Some(&'.') && self.pat(self.unescape(0)) != '.' {
            return false;
        }
        let (mut pi, mut si) = (0usize, 0usize);
        // Position after the last '*' and the name position it currently absorbs up to.
        let mut star: Option<(usize, usize)> = None;
        loop {
            match self.pat(pi) {
                '*' => {
                    while self.pat(pi) == '*' {
                        pi += 1;
                    }
                    if self.unescape(pi) >= plen {
                        return true;
                    }
                    if si >= slen {
                        return false;
                    }
                    star = Some((pi, si));
                    continue;
                }
                '?' => {
                    if si >= slen {
                        return false;
                    }
                    pi += 1;
                    si += 1;
                    continue;
                }
                '[' => {
                    let Some(&c) = self.s.get(si) else {
                        return false;
                    };
                    if let Some(next) = self.bracket(pi + 1, c) {
                        pi = next;
                        si += 1;
                        continue;
                    }
                }
                _ => {
                    let q = self.unescape(pi);
                    let Some(&c) = self.s.get(si) else {
                        return q >= plen;
                    };
                    if q < plen && self.p[q] == c {
                        pi = q + 1;
                        si += 1;
                        continue;
                    }
                }
            }
            // Failed here: let the last '*' absorb one more character and retry.
            match star {
                Some((sp, ss)) if ss < slen => {
                    star = Some((sp, ss + 1));
                    pi = sp;
                    si = ss + 1;
                }
                _ => return false,
            }
        }
    }

    /// Ruby's `bracket`: matches `c` against the set starting at `start` (just after `[`).
    /// Returns the pattern index after the closing `]`, or `None` for no match or an
    /// unterminated set. A `]` right after `[` or `[!` closes the set (so `[]` matches
    /// nothing and `[!]` matches any one character), as in Ruby.
    fn bracket(&self, start: usize, c: char) -> Option<usize> {
        let plen = self.p.len();
        let mut i = start;
        if i >= plen {
            return None;
        }
        let negate = matches!(self.p[i], '!' | '^');
        if negate {
            i += 1;
        }
        let mut ok = false;
        while self.pat(i) != ']' {
            let t1 = self.unescape(i);
            let lo = *self.p.get(t1)?;
            i = t1 + 1;
            if i >= plen {
                return None;
            }
            if self.p[i] == '-' && self.pat(i + 1) != ']' {
                let t2 = self.unescape(i + 1);
                let hi = *self.p.get(t2)?;
                i = t2 + 1;
                if !ok && (c == lo || c == hi || (lo <= c && c <= hi)) {
                    ok = true;
                }
            } else if !ok && c == lo {
                ok = true;
            }
        }
        if ok == negate {
            None
        } else {
            Some(i + 1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known() -> Vec<String> {
        ["zeta", "alpha", "b1", ".hidden", "critical", "Beta"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    fn order(list: &str) -> Vec<String> {
        QueueSpec::parse(list).unwrap().expand(&known())
    }

    // resque-protocol.md §13 item 6 (table in §3)
    #[test]
    fn star_expands_to_all_queues_sorted_bytewise_without_dot_names() {
        assert_eq!(order("*"), ["Beta", "alpha", "b1", "critical", "zeta"]);
    }

    // resque-protocol.md §13 item 6 (table in §3)
    #[test]
    fn literal_before_star_keeps_its_first_position() {
        assert_eq!(
            order("critical,*"),
            ["critical", "Beta", "alpha", "b1", "zeta"]
        );
    }

    // resque-protocol.md §13 item 6 (table in §3)
    #[test]
    fn skip_pattern_excludes_matching_queues() {
        assert_eq!(order("*,!b*"), ["Beta", "alpha", "critical", "zeta"]);
    }

    // resque-protocol.md §13 item 6 (table in §3)
    #[test]
    fn question_mark_and_bracket_patterns_expand_in_pattern_order() {
        assert_eq!(order("b?,[az]*"), ["b1", "alpha", "zeta"]);
    }

    // resque-protocol.md §13 item 6 (table in §3)
    #[test]
    fn braces_are_split_by_commas_and_match_nothing() {
        let spec = QueueSpec::parse("{alpha,zeta}").unwrap();
        assert_eq!(spec.patterns(), ["{alpha", "zeta}"]);
        assert!(spec.is_dynamic());
        assert!(spec.expand(&known()).is_empty());
        // Braces are literal characters to fnmatch.
        assert!(fnmatch("{alpha,zeta}", "{alpha,zeta}"));
        assert!(!fnmatch("{alpha,zeta}", "alpha"));
    }

    // resque-protocol.md §13 item 6: the literal in a dynamic list only yields known queues
    #[test]
    fn literal_pattern_in_dynamic_mode_needs_a_known_queue() {
        assert_eq!(order("missing,b*"), ["b1"]);
        assert_eq!(order("alpha,!zeta"), ["alpha"]);
        assert!(order("missing,!zeta").is_empty());
    }

    // resque-protocol.md §3: without wildcards the list is used verbatim
    #[test]
    fn static_list_is_used_verbatim() {
        let spec = QueueSpec::parse(" high , low,missing,high ").unwrap();
        assert!(!spec.is_dynamic());
        assert_eq!(spec.expand(&known()), ["high", "low", "missing", "high"]);
        assert_eq!(spec.expand(&[]), ["high", "low", "missing", "high"]);
    }

    // resque-protocol.md §13 item 6: duplicates keep their first position
    #[test]
    fn overlapping_patterns_do_not_repeat_queues() {
        assert_eq!(
            order("z*,*,a*"),
            ["zeta", "Beta", "alpha", "b1", "critical"]
        );
    }

    // resque-protocol.md §13 item 6: a leading dot needs a literal dot
    #[test]
    fn dot_queue_needs_literal_leading_dot() {
        assert_eq!(order(".*"), [".hidden"]);
        assert_eq!(order("\\.hid*"), [".hidden"]);
        assert!(order("?hidden,[.]hidden,*hidden").is_empty());
        assert!(fnmatch("a*", "a.b"));
        assert!(fnmatch("a?b", "a.b"));
    }

    // resque-protocol.md §13 item 11
    #[test]
    fn id_part_leaves_out_skip_entries() {
        let spec = QueueSpec::parse("*,!low").unwrap();
        assert_eq!(spec.id_part(), "*");
        assert_eq!(spec.skips(), ["low"]);
        assert!(spec.is_dynamic());
        assert_eq!(
            QueueSpec::parse("slow, high").unwrap().id_part(),
            "slow,high"
        );
    }

    // resque-protocol.md §3: skip entries alone turn on dynamic mode
    #[test]
    fn skip_entries_make_a_literal_list_dynamic() {
        let spec = QueueSpec::parse("alpha,!beta").unwrap();
        assert!(spec.is_dynamic());
        assert_eq!(spec.patterns(), ["alpha"]);
    }

    // resque-protocol.md §3: an empty list raises NoQueueError in Ruby
    #[test]
    fn empty_or_skip_only_lists_are_rejected() {
        assert_eq!(QueueSpec::parse(""), Err(QueueSpecError::Empty));
        assert_eq!(QueueSpec::parse(" , ,, "), Err(QueueSpecError::Empty));
        assert_eq!(QueueSpec::parse("!low"), Err(QueueSpecError::OnlySkips));
        assert_eq!(QueueSpec::parse("!a, !b"), Err(QueueSpecError::OnlySkips));
        assert_eq!(QueueSpec::from_list(&[]), Err(QueueSpecError::Empty));
        assert_eq!(
            QueueSpecError::OnlySkips.to_string(),
            "queue list has only skip patterns"
        );
    }

    // resque-protocol.md §3: each list item is split on commas too
    #[test]
    fn from_list_splits_each_item() {
        let items = vec![
            "high,*".to_string(),
            " !low ".to_string(),
            "mail".to_string(),
        ];
        let spec = QueueSpec::from_list(&items).unwrap();
        assert_eq!(spec.patterns(), ["high", "*", "mail"]);
        assert_eq!(spec.skips(), ["low"]);
        assert_eq!(spec.id_part(), "high,*,mail");
    }

    // resque-protocol.md §3: `*` also matches `/` and `:`; matching is case-sensitive
    #[test]
    fn star_crosses_slashes_and_colons() {
        assert!(fnmatch("*", "a/b:c"));
        assert!(fnmatch("a*c", "a/b:c"));
        assert!(fnmatch("mail:*", "mail:high"));
        assert!(!fnmatch("beta", "Beta"));
        assert!(!fnmatch("[a-z]*", "Beta"));
    }

    #[test]
    fn bracket_sets_support_ranges_negation_and_escapes() {
        assert!(fnmatch("q[0-9]", "q7"));
        assert!(!fnmatch("q[0-9]", "qa"));
        assert!(fnmatch("q[!0-9]", "qa"));
        assert!(fnmatch("q[^0-9]", "qa"));
        assert!(!fnmatch("q[^0-9]", "q1"));
        assert!(fnmatch("q[a-]", "q-"));
        assert!(fnmatch("q[\\]]", "q]"));
        assert!(
            fnmatch("q[z-a]", "qz"),
            "reversed range still matches its ends"
        );
        assert!(!fnmatch("q[z-a]", "qm"));
        assert!(fnmatch("q[é-ö]", "qñ"));
        assert!(fnmatch("\\*", "*"));
        assert!(!fnmatch("\\*", "x"));
        assert!(fnmatch("a\\?", "a?"));
    }

    #[test]
    fn star_backtracks_to_find_a_match() {
        assert!(fnmatch("*a*b", "xaxxab"));
        assert!(fnmatch("a*b*c", "abbbc"));
        assert!(!fnmatch("a*b*c", "abbb"));
        assert!(fnmatch("**", ""));
        assert!(!fnmatch("?", ""));
        assert!(fnmatch("", ""));
        assert!(!fnmatch("", "a"));
    }

    #[test]
    fn odd_patterns_never_panic() {
        let patterns = [
            "[",
            "[!",
            "[^",
            "[]",
            "[!]",
            "[a-",
            "[a-\\",
            "[\\",
            "\\",
            "a\\",
            "*\\",
            "[a",
            "]",
            "[]]",
            "[!]]",
            "*[",
            "?[",
            "[-]",
            "[--]",
            "**\\",
            "\0",
            "[\u{10FFFF}-\u{0}]",
        ];
        let names = ["", "a", "[", "\\", "]", ".", "-", "ab", "😀", "\0", "a]"];
        for p in patterns {
            for n in names {
                let _ = fnmatch(p, n);
            }
        }
        // Results that follow from Ruby's dir.c.
        assert!(!fnmatch("[", "["), "unterminated set never matches");
        assert!(
            !fnmatch("[]", "]"),
            "`]` right after `[` closes an empty set"
        );
        assert!(
            fnmatch("[!]", "x"),
            "an empty negated set matches any one char"
        );
        assert!(!fnmatch("[!]", ""));
        assert!(fnmatch("a\\", "a"), "a trailing backslash escapes the end");
        assert!(fnmatch("\\", ""));
        assert!(fnmatch("*\\", "abc"));
        assert!(fnmatch("]", "]"));
        assert!(
            !fnmatch("a\0", "a\0"),
            "NUL is an error in Ruby, no match here"
        );
    }
}
