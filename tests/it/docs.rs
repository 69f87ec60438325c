//! Tested examples: every TOML block and every `locketd` command line that `README.md` and the
//! pages under `docs/` show must work, and a failure names the file and line.
//!
//! - Files: `README.md` and every `*.md` below `docs/`, except `docs/spec/` and `docs/dev/`
//!   (developer material: they quote Redis keys, Lua and fragments of the design, not configs a
//!   user copies).
//! - A ```` ```toml ```` block is written to a temp file and checked with the real binary,
//!   `locketd check-config --config FILE`, which must exit 0. A block whose first line is
//!   `# fragment: <names>` (comma- or space-separated) gets the parts it names filled in first:
//!   `queues` puts `queues = ["default"]` before it, `handlers.app` puts a `[handlers.app]`
//!   persistent handler table after it. An unknown name is a failure, so the convention stays
//!   written down here and in docs/guide/README.md ("For contributors").
//! - A heredoc written to a `*.toml` file in a shell block (`cat > x.toml <<'TOML'`) is checked
//!   the same way.
//! - In ```` ```sh ````, ```` ```bash ````, ```` ```shell ```` and ```` ```console ```` blocks,
//!   every command that runs `locketd` (after `$ `, `sudo `, `sudo -u USER `, `VAR=value `
//!   prefixes; or `cargo run [...] -- ARGS` of the locketd binary) is parsed with the real
//!   parser, `locketd::cli::Cli::try_parse_from`. Lines ending in `\` are joined first; a
//!   `# comment` and a redirection end the command; `|`, `;`, `&&`, `||` and `&` separate
//!   commands. In `console` blocks only lines starting with `$ ` are commands.
//!
//! - Relative links must reach an existing file, and an `#anchor` into a Markdown file one of
//!   its headings (GitHub's anchors).
//!
//! `check-config` compares the file's class plans with those published in Redis when it can
//! reach Redis: the checks point `REDIS_URL` at a redis-server of their own (never port 6379),
//! which also means a `redis = "..."` URL inside a block is not what gets checked.

use crate::support::{manifest_dir, RedisServer};
use clap::Parser;
use locketd::cli::Cli;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One fenced code block: the file's 1-based line of each content line.
struct Block {
    lang: String,
    lines: Vec<(usize, String)>,
}

/// The fenced blocks of a Markdown text (backtick fences, CommonMark's rule: an info string
/// holds no backtick; a closing fence is at least as long as the opening one). Indented fences
/// (inside a list item) lose their indentation.
fn blocks(text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<(usize, usize, Block)> = None; // (fence length, indent, block)
    for (i, raw) in text.lines().enumerate() {
        let lineno = i + 1;
        let trimmed = raw.trim_start();
        let indent = raw.len() - trimmed.len();
        let ticks = trimmed.chars().take_while(|&c| c == '`').count();
        if let Some((len, ind, mut block)) = open.take() {
            if ticks >= len && trimmed[ticks..].trim().is_empty() {
                out.push(block);
            } else {
                let cut = raw
                    .char_indices()
                    .find(|&(k, c)| k >= ind || !c.is_whitespace())
                    .map_or(raw.len(), |(k, _)| k);
                block.lines.push((lineno, raw[cut..].to_string()));
                open = Some((len, ind, block));
            }
            continue;
        }
        if ticks >= 3 && !trimmed[ticks..].contains('`') {
            let lang = trimmed[ticks..]
                .split_whitespace()
                .next()
                .unwrap_or("")
                .to_string();
            open = Some((
                ticks,
                indent,
                Block {
                    lang,
                    lines: Vec::new(),
                },
            ));
        }
    }
    out
}

/// Shell-like words and operators of one line: quotes and backslashes as sh reads them, `#` at
/// the start of a word ends the line. Operators come out as `Tok::Op`.
#[derive(Debug, PartialEq)]
enum Tok {
    Word(String),
    Op(String),
}

fn tokens(line: &str) -> Vec<Tok> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                in_word = true;
                for d in chars.by_ref() {
                    if d == '\'' {
                        break;
                    }
                    word.push(d);
                }
            }
            '"' => {
                in_word = true;
                while let Some(d) = chars.next() {
                    match d {
                        '"' => break,
                        '\\' if matches!(chars.peek(), Some('"' | '\\' | '$' | '`')) => {
                            word.push(chars.next().unwrap_or('\\'))
                        }
                        _ => word.push(d),
                    }
                }
            }
            '\\' => {
                in_word = true;
                if let Some(d) = chars.next() {
                    word.push(d);
                }
            }
            '#' if !in_word => break,
            c if c.is_whitespace() => {
                if in_word {
                    out.push(Tok::Word(std::mem::take(&mut word)));
                    in_word = false;
                }
            }
            '|' | '&' | ';' | '<' | '>' => {
                // `2>`: a file descriptor number glued to a redirection is part of it.
                let fd = in_word && !word.is_empty() && word.chars().all(|d| d.is_ascii_digit());
                if in_word && !fd {
                    out.push(Tok::Word(std::mem::take(&mut word)));
                }
                word.clear();
                in_word = false;
                let mut op = c.to_string();
                while let Some(&d) = chars.peek() {
                    if d == c || (c == '<' && d == '<') || d == '&' || d == '-' {
                        op.push(d);
                        chars.next();
                    } else {
                        break;
                    }
                }
                out.push(Tok::Op(op));
            }
            _ => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        out.push(Tok::Word(word));
    }
    out
}

/// The argv of `locketd` a command runs, when it runs it: the words after the prefixes, up to a
/// redirection.
fn locketd_argv(words: &[String]) -> Option<Vec<String>> {
    let mut w = words;
    loop {
        match w.first().map(String::as_str) {
            Some("$") => w = &w[1..],
            Some("sudo") => {
                w = &w[1..];
                while let Some(opt) = w.first().filter(|o| o.starts_with('-')) {
                    let takes_value = matches!(opt.as_str(), "-u" | "-g" | "-D");
                    w = &w[if takes_value { 2 } else { 1 }.min(w.len())..];
                }
            }
            Some("env") => w = &w[1..],
            Some(a) if is_assignment(a) => w = &w[1..],
            _ => break,
        }
    }
    match w.first().map(String::as_str) {
        Some("locketd") => Some(w.to_vec()),
        Some("cargo") if w.get(1).is_some_and(|s| s == "run") => {
            let dash = w.iter().position(|s| s == "--")?;
            let opts = &w[2..dash];
            let other_bin = opts
                .windows(2)
                .any(|p| p[0] == "--bin" && p[1] != "locketd")
                || opts.iter().any(|o| o == "--example");
            if other_bin {
                return None;
            }
            let mut argv = vec!["locketd".to_string()];
            argv.extend(w[dash + 1..].iter().cloned());
            Some(argv)
        }
        _ => None,
    }
}

fn is_assignment(word: &str) -> bool {
    match word.split_once('=') {
        Some((name, _)) => {
            !name.is_empty()
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !name.starts_with(|c: char| c.is_ascii_digit())
        }
        None => false,
    }
}

/// What to check in a document: TOML texts and command lines, each with its line.
#[derive(Default)]
struct Examples {
    toml: Vec<(usize, String)>,
    commands: Vec<(usize, Vec<String>)>,
}

fn examples(text: &str) -> Examples {
    let mut ex = Examples::default();
    for b in blocks(text) {
        match b.lang.as_str() {
            "toml" => {
                if let Some(&(first, _)) = b.lines.first() {
                    let body: Vec<&str> = b.lines.iter().map(|(_, l)| l.as_str()).collect();
                    ex.toml.push((first, body.join("\n") + "\n"));
                }
            }
            "sh" | "bash" | "shell" | "console" => shell_examples(&b, &mut ex),
            _ => {}
        }
    }
    ex
}

fn shell_examples(b: &Block, ex: &mut Examples) {
    let console = b.lang == "console";
    let mut i = 0;
    while i < b.lines.len() {
        let (lineno, first) = &b.lines[i];
        let mut line = first.clone();
        i += 1;
        if console {
            match line.trim_start().strip_prefix("$ ") {
                Some(rest) => line = rest.to_string(),
                None => continue,
            }
        }
        while line.ends_with('\\') && i < b.lines.len() {
            line.pop();
            line.push(' ');
            line.push_str(&b.lines[i].1);
            i += 1;
        }
        let toks = tokens(&line);
        // A heredoc: its lines are data, not commands; one written to a .toml file is a config.
        if let Some(k) = toks
            .iter()
            .position(|t| matches!(t, Tok::Op(o) if o.starts_with("<<")))
        {
            let Some(Tok::Word(end)) = toks.get(k + 1) else {
                continue;
            };
            let to_toml = toks.windows(2).any(|p| {
                matches!((&p[0], &p[1]), (Tok::Op(o), Tok::Word(f)) if o.starts_with('>') && f.ends_with(".toml"))
            });
            let start = i;
            while i < b.lines.len() && b.lines[i].1.trim() != end {
                i += 1;
            }
            if to_toml && start < b.lines.len() {
                let body: Vec<&str> = b.lines[start..i].iter().map(|(_, l)| l.as_str()).collect();
                ex.toml.push((b.lines[start].0, body.join("\n") + "\n"));
            }
            i += 1;
        }
        let mut words = Vec::new();
        let mut redirected = false;
        for t in toks.into_iter().chain([Tok::Op(";".into())]) {
            match t {
                Tok::Word(w) if !redirected => words.push(w),
                Tok::Word(_) => {}
                Tok::Op(o) if o.starts_with('>') || o.starts_with('<') => redirected = true,
                Tok::Op(_) => {
                    if let Some(argv) = locketd_argv(&words) {
                        ex.commands.push((*lineno, argv));
                    }
                    words.clear();
                    redirected = false;
                }
            }
        }
    }
}

/// The TOML a block stands for, its fragment names filled in.
fn whole_config(text: &str) -> Result<String, String> {
    let first = text.lines().next().unwrap_or("").trim();
    let Some(names) = first.strip_prefix("# fragment:") else {
        return Ok(text.to_string());
    };
    let (mut before, mut after) = (String::new(), String::new());
    for name in names.split([',', ' ']).filter(|n| !n.is_empty()) {
        match name {
            "queues" => before.push_str("queues = [\"default\"]\n"),
            "handlers.app" => after.push_str(
                "\n[handlers.app]\nmode = \"persistent\"\ncommand = [\"bin/app-handler\"]\n",
            ),
            other => {
                return Err(format!(
                    "unknown fragment name {other:?} (known: queues, handlers.app; see tests/it/docs.rs)"
                ))
            }
        }
    }
    Ok(format!("{before}{text}{after}"))
}

/// Checks every example of the Markdown files `files` (paths relative to `root`) and returns
/// the number checked and the failures, each `file:line: what`.
fn check(root: &Path, files: &[PathBuf], redis_url: &str) -> (usize, Vec<String>) {
    let tmp = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_locketd");
    let mut checked = 0;
    let mut failures = Vec::new();
    for rel in files {
        let text = std::fs::read_to_string(root.join(rel)).unwrap();
        let ex = examples(&text);
        for (line, toml) in ex.toml {
            checked += 1;
            let at = format!("{}:{line}", rel.display());
            let config = match whole_config(&toml) {
                Ok(c) => c,
                Err(e) => {
                    failures.push(format!("{at}: {e}"));
                    continue;
                }
            };
            let file = tmp.path().join(format!("block-{checked}.toml"));
            std::fs::write(&file, &config).unwrap();
            let out = Command::new(bin)
                .arg("check-config")
                .arg("--config")
                .arg(&file)
                .current_dir(tmp.path())
                .env("REDIS_URL", redis_url)
                .env_remove("QUEUES")
                .env_remove("QUEUE")
                .env_remove("INTERVAL")
                .env_remove("RESQUE_TERM_TIMEOUT")
                .env_remove("GRACEFUL_TERM")
                .env_remove("RUST_LOG")
                .output()
                .unwrap();
            if !out.status.success() {
                failures.push(format!(
                    "{at}: check-config refused this TOML block ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        for (line, argv) in ex.commands {
            let at = format!("{}:{line}", rel.display());
            checked += 1;
            if let Err(e) = Cli::try_parse_from(&argv) {
                use clap::error::ErrorKind::*;
                if !matches!(e.kind(), DisplayHelp | DisplayVersion) {
                    let msg = e.to_string();
                    let msg = msg.lines().next().unwrap_or("").trim();
                    failures.push(format!(
                        "{at}: the command line does not parse: `{}`: {msg}",
                        argv.join(" ")
                    ));
                }
            }
        }
    }
    (checked, failures)
}

/// GitHub's anchor of a heading: lower case, punctuation dropped but `-` and `_`, spaces to `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks).
fn anchors(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.push(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

/// Relative links `](path)` and `](path#anchor)` of the Markdown files `files`: the file must
/// exist, and an anchor into a Markdown file must name one of its headings. Returns failures
/// as `file:line: what`.
fn check_links(root: &Path, files: &[PathBuf]) -> Vec<String> {
    let mut failures = Vec::new();
    for rel in files {
        let text = std::fs::read_to_string(root.join(rel)).unwrap();
        let dir = rel.parent().unwrap_or(Path::new(""));
        for (i, line) in text.lines().enumerate() {
            let mut rest = line;
            while let Some(k) = rest.find("](") {
                rest = &rest[k + 2..];
                let Some(end) = rest.find(')') else { break };
                let target = &rest[..end];
                rest = &rest[end..];
                if target.contains("://") || target.starts_with("mailto:") || target.contains(' ') {
                    continue;
                }
                let (path, frag) = target.split_once('#').unwrap_or((target, ""));
                let file = if path.is_empty() {
                    rel.clone()
                } else {
                    normalize(&dir.join(path))
                };
                let at = format!("{}:{}", rel.display(), i + 1);
                if !root.join(&file).exists() {
                    failures.push(format!("{at}: the link target {target} does not exist"));
                    continue;
                }
                if !frag.is_empty() && file.extension().is_some_and(|x| x == "md") {
                    let there = std::fs::read_to_string(root.join(&file)).unwrap();
                    if !anchors(&there).iter().any(|a| a == frag) {
                        failures.push(format!("{at}: {} has no heading #{frag}", file.display()));
                    }
                }
            }
        }
    }
    failures
}

/// `a/b/../c` → `a/c`, without touching the file system.
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// README.md and docs/**/*.md but docs/spec/ and docs/dev/, relative to `root`, sorted.
fn doc_files(root: &Path) -> Vec<PathBuf> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_path_buf();
            if rel.starts_with("docs/spec") || rel.starts_with("docs/dev") {
                continue;
            }
            if p.is_dir() {
                walk(root, &p, out);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(rel);
            }
        }
    }
    let mut out = vec![PathBuf::from("README.md")];
    walk(root, &root.join("docs"), &mut out);
    out.sort();
    out
}

#[test]
fn every_toml_block_and_locketd_command_in_the_docs_works() {
    let redis = RedisServer::start();
    let root = manifest_dir();
    let files = doc_files(&root);
    assert!(files.len() > 10, "found only {files:?}");
    let (checked, mut failures) = check(&root, &files, &redis.url());
    eprintln!("{checked} examples checked in {} files", files.len());
    failures.extend(check_links(&root, &files));
    assert!(
        failures.is_empty(),
        "{} failures in {checked} examples and the links:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The README alone shows a dozen; a walk that finds few has lost its way.
    assert!(checked > 60, "only {checked} examples found");
}

/// A deliberately broken copy of the real README fails, naming the file and the lines broken,
/// and nothing else.
#[test]
fn a_broken_copy_of_the_readme_fails_naming_file_and_line() {
    let redis = RedisServer::start();
    let readme = std::fs::read_to_string(manifest_dir().join("README.md")).unwrap();
    let mut lines: Vec<String> = readme.lines().map(str::to_string).collect();
    let find = |lines: &[String], needle: &str| {
        lines
            .iter()
            .position(|l| l.starts_with(needle))
            .unwrap_or_else(|| panic!("README.md has no line starting {needle:?}"))
    };
    // A misspelt policy in a TOML block, an unknown flag, an unknown fragment name.
    let bad_toml = find(&lines, "on_conflict = \"discard\"");
    lines[bad_toml] = "on_conflict = \"discardd\"".to_string();
    let bad_cmd = find(&lines, "locketd locks ");
    lines[bad_cmd] = "locketd locks --no-such-flag".to_string();
    let bad_fragment = find(&lines, "[classes.\"Feed::Drain\"]") - 1;
    assert_eq!(lines[bad_fragment], "# fragment: queues");
    lines[bad_fragment] = "# fragment: queues, everything".to_string();

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("README.md"), lines.join("\n") + "\n").unwrap();
    let (_, failures) = check(dir.path(), &[PathBuf::from("README.md")], &redis.url());

    // A TOML failure names the block's first line.
    let block_start = |at: usize| {
        (0..=at)
            .rev()
            .find(|&k| lines[k].starts_with("```"))
            .unwrap()
            + 2
    };
    let expect = [
        format!("README.md:{}: check-config refused", block_start(bad_toml)),
        format!("README.md:{}: the command line does not parse", bad_cmd + 1),
        format!(
            "README.md:{}: unknown fragment name \"everything\"",
            block_start(bad_fragment)
        ),
    ];
    for e in &expect {
        assert!(
            failures.iter().any(|f| f.starts_with(e.as_str())),
            "no failure starting {e:?} in {failures:#?}"
        );
    }
    assert_eq!(failures.len(), 3, "{failures:#?}");
    assert!(
        failures.iter().any(|f| f.contains("discardd")),
        "the refusal names the bad value: {failures:#?}"
    );
}

#[test]
fn the_extractor_reads_blocks_commands_and_heredocs_as_documented() {
    let md = "\
Text with ```` ```toml ```` inline is no fence.

```sh
$ sudo -u locketd locketd check-config /etc/locketd/locketd.toml   # comment
REDIS_URL=redis://h:1/0 locketd status --json | jq .queues
cargo run --release -- --config config/demo.toml \\
  --queues high,low
cargo run --bin locketd-bench -- all
systemctl reload locketd && locketd locks 2>/dev/null
cat > x.toml <<'TOML'
queues = \"q\"
locketd not-a-command-here
TOML
```

```console
$ locketd status
locketd output line, not a command
```

  ```toml
  # fragment: queues
  [classes.\"A\"]
  ```
";
    let ex = examples(md);
    let cmds: Vec<(usize, String)> = ex.commands.iter().map(|(l, a)| (*l, a.join(" "))).collect();
    assert_eq!(
        cmds,
        vec![
            (
                4,
                "locketd check-config /etc/locketd/locketd.toml".to_string()
            ),
            (5, "locketd status --json".to_string()),
            (
                6,
                "locketd --config config/demo.toml --queues high,low".to_string()
            ),
            (9, "locketd locks".to_string()),
            (17, "locketd status".to_string()),
        ]
    );
    assert_eq!(
        ex.toml,
        vec![
            (
                11,
                "queues = \"q\"\nlocketd not-a-command-here\n".to_string()
            ),
            (22, "# fragment: queues\n[classes.\"A\"]\n".to_string()),
        ]
    );
    assert_eq!(
        whole_config("# fragment: queues\n[classes.\"A\"]\n").unwrap(),
        "queues = [\"default\"]\n# fragment: queues\n[classes.\"A\"]\n"
    );
    assert!(whole_config("# fragment: nope\n").is_err());
    assert_eq!(
        anchor(" Parked waits: `park` beside `requeue`"),
        "parked-waits-park-beside-requeue"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("docs/guide")).unwrap();
    std::fs::write(
        dir.path().join("docs/guide/a.md"),
        "# A\n\n## Is it working?\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("README.md"),
        "[ok](docs/guide/a.md#is-it-working) [gone](docs/guide/b.md)\n[bad](docs/guide/a.md#nope)\n",
    )
    .unwrap();
    assert_eq!(
        check_links(dir.path(), &[PathBuf::from("README.md")]),
        vec![
            "README.md:1: the link target docs/guide/b.md does not exist".to_string(),
            "README.md:2: docs/guide/a.md has no heading #nope".to_string(),
        ]
    );
    assert!(Cli::try_parse_from(["locketd", "--no-such-flag"]).is_err());
}
