//! The renderings of the reference: the markdown page and the two commented configs.

use super::{sections, settings, spec_file, Absent, Kind, Section, Setting};
use std::fmt::Write;

/// What `locketd config reference` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// The reference page, docs/reference/config.md.
    Markdown,
    /// The commented example config, config/locketd.toml.
    Toml,
    /// The commented defaults the Debian package installs, debian/locketd.toml.
    Deb,
}

/// The whole rendering in `format`.
pub fn render(format: Format) -> String {
    match format {
        Format::Markdown => markdown(),
        Format::Toml => toml(false),
        Format::Deb => toml(true),
    }
}

/// Longest line of the TOML comments.
const WIDTH: usize = 100;

const TOML_HEAD: &str = include_str!("head.toml");
const TOML_TAIL: &str = include_str!("tail.toml");
const DEB_HEAD: &str = include_str!("head.deb.toml");
const DEB_TAIL: &str = include_str!("tail.deb.toml");

/// Appends `text` as `# ` comment lines of at most [`WIDTH`] characters, the lines after the
/// first indented by `hang`.
fn comment(out: &mut String, text: &str, hang: &str) {
    let mut line = String::from("#");
    let mut empty = true;
    for word in text.split_whitespace() {
        if !empty && line.len() + 1 + word.len() > WIDTH {
            out.push_str(&line);
            out.push('\n');
            line = format!("#{hang}");
        }
        line.push(' ');
        line.push_str(word);
        empty = false;
    }
    if !empty {
        out.push_str(&line);
        out.push('\n');
    }
}

fn rules_note(rules: &[&str]) -> String {
    if rules.is_empty() {
        String::new()
    } else {
        format!(" (spec {})", rules.join(", "))
    }
}

/// What a setting is when absent, as a sentence for a comment.
fn absent_note(s: &Setting) -> String {
    match s.absent {
        Absent::Value(v) => format!("Default: {v}."),
        Absent::Means(m) => format!("Default: {m}."),
        Absent::Required => "Required.".to_string(),
    }
}

/// A commented config. `deb`: the packaged one, whose settings with a default are commented
/// out (`#key = value`) so that it runs on the defaults of the binary it came with.
fn toml(deb: bool) -> String {
    let mut out = String::from(if deb { DEB_HEAD } else { TOML_HEAD });
    let all = settings();
    for sec in sections() {
        let mine: Vec<&Setting> = all
            .iter()
            .copied()
            .filter(|s| s.section == sec.path)
            .collect();
        out.push('\n');
        match sec.kind {
            Kind::Top => {}
            Kind::Table => {
                comment(
                    &mut out,
                    &format!("{}{}", sec.meaning, rules_note(sec.rules)),
                    "",
                );
                out.push_str(if deb { "#" } else { "" });
                out.push_str(sec.header);
                out.push('\n');
            }
            Kind::Named => {
                comment(
                    &mut out,
                    &format!("{}{}", sec.meaning, rules_note(sec.rules)),
                    "",
                );
                out.push_str("# ");
                out.push_str(sec.header);
                out.push('\n');
            }
            Kind::Entry => {
                comment(
                    &mut out,
                    &format!("{}: {}{}", sec.header, sec.meaning, rules_note(sec.rules)),
                    "",
                );
                for s in &mine {
                    let note = match s.absent {
                        Absent::Value(v) => format!("default {v}"),
                        Absent::Means(m) => format!("default {m}"),
                        Absent::Required => "required".to_string(),
                    };
                    let text = format!("{} ({}; {}): {}", s.key, s.ty, note, s.meaning);
                    comment(&mut out, &format!("{text}{}", rules_note(s.rules)), "  ");
                }
                continue;
            }
        }
        for s in mine {
            toml_setting(&mut out, sec, s, deb);
        }
    }
    out.push('\n');
    out.push_str(if deb { DEB_TAIL } else { TOML_TAIL });
    out
}

/// One setting of a commented config: its meaning, then its line. In a plain table a setting
/// with a default value is set to it (commented out, `#key`, in the packaged config), one the
/// table says to set is set to its example, and any other example is a commented line; in a
/// table per name every line is commented.
fn toml_setting(out: &mut String, sec: &Section, s: &Setting, deb: bool) {
    let live = matches!(sec.kind, Kind::Top | Kind::Table);
    let note = match (live, s.absent) {
        (true, Absent::Value(v)) if s.example_set => format!(" Example; default: {v}."),
        // The line shows the default.
        (true, Absent::Value(_)) => String::new(),
        _ => format!(" {}", absent_note(s)),
    };
    let text = format!("{}{}{}", s.meaning, note.trim_end(), rules_note(s.rules));
    comment(out, &text, "");
    let key = s.key;
    match (live, s.absent, s.example) {
        (true, _, Some(e)) if s.example_set => {
            let _ = writeln!(out, "{key} = {e}");
        }
        (true, Absent::Value(v), example) => {
            let _ = writeln!(out, "{}{key} = {v}", if deb { "#" } else { "" });
            if let Some(e) = example {
                let _ = writeln!(out, "# {key} = {e}");
            }
        }
        _ => {
            if let Some(v) = s.shown() {
                let _ = writeln!(out, "# {key} = {v}");
            }
        }
    }
}

/// Markdown text outside code spans with the characters that would be read as markup escaped.
fn md(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut code = false;
    for c in text.chars() {
        match c {
            '`' => {
                code = !code;
                out.push(c);
            }
            '|' => out.push_str("\\|"),
            '<' if !code => out.push_str("&lt;"),
            '>' if !code => out.push_str("&gt;"),
            '*' | '_' | '\\' if !code => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

fn md_rules(rules: &[&str]) -> String {
    rules
        .iter()
        .map(|r| format!("[{r}](../spec/{})", spec_file(r)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn md_title(sec: &Section) -> String {
    match sec.kind {
        Kind::Top => "Top level".to_string(),
        Kind::Table | Kind::Named => format!("`[{}]`", sec.path),
        Kind::Entry => {
            let (table, entry) = sec.path.rsplit_once('.').unwrap_or(("", sec.path));
            format!("`{entry}` entries of `[{table}]`")
        }
    }
}

fn markdown() -> String {
    let mut out = String::from(include_str!("head.md"));
    let all = settings();
    for sec in sections() {
        let _ = write!(out, "\n## {}\n\n{}", md_title(sec), md(sec.meaning));
        if !sec.rules.is_empty() {
            let _ = write!(out, " Spec: {}.", md_rules(sec.rules));
        }
        out.push('\n');
        if sec.kind != Kind::Top {
            let _ = writeln!(out, "\nWritten as `{}`.", sec.header);
        }
        out.push_str("\n| Setting | Type | Default | Meaning | Spec |\n|---|---|---|---|---|\n");
        for s in all.iter().filter(|s| s.section == sec.path) {
            let default = match s.absent {
                Absent::Value(v) => format!("`{v}`"),
                Absent::Means(m) => md(m),
                Absent::Required => "required".to_string(),
            };
            let mut meaning = md(s.meaning);
            if let Some(e) = s.example {
                let _ = write!(meaning, " Example: `{}`.", e.replace('|', "\\|"));
            }
            let _ = writeln!(
                out,
                "| `{}` | {} | {} | {} | {} |",
                s.key,
                md(s.ty),
                default,
                meaning,
                md_rules(s.rules)
            );
        }
    }
    out
}
