//! The configuration reference: one table of every setting (key, type, default, meaning, the
//! spec rules it belongs to), printed by `locketd config reference` and rendered into
//! `docs/reference/config.md` and the two commented configs (`config/locketd.toml`, and
//! `debian/locketd.toml`, shipped as `/etc/locketd/locketd.toml`).
//!
//! The serde structs in `config/` parse; this table describes. The tests below tie the two
//! both ways: every key here is accepted by the parser with its documented default producing
//! the parser's own value, and every field the parser accepts is here. A test in
//! `tests/it/reference.rs` fails when a committed rendering is stale.

mod classes;
mod daemon;
mod render;
mod tables;

pub use render::{render, Format};

/// How a setting behaves when the file does not give it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Absent {
    /// The parser's value, written as TOML (`"35s"`, `true`, `[]`).
    Value(&'static str),
    /// No value; what that means (`"none: no endpoint"`).
    Means(&'static str),
    /// The table is refused without it.
    Required,
}

/// One setting.
#[derive(Debug, Clone, Copy)]
pub struct Setting {
    /// The [`Section`] path it belongs to (`""`, `"locket"`, `"classes.<name>"`, ...).
    pub section: &'static str,
    /// Its key in that table.
    pub key: &'static str,
    /// The value's type, as a user writes it.
    pub ty: &'static str,
    /// Its default.
    pub absent: Absent,
    /// A value to show, as TOML: the commented configs show it as a commented line.
    pub example: Option<&'static str>,
    /// The commented configs set the setting to `example` rather than show it commented
    /// (`queues`, which check-config refuses to go without).
    pub example_set: bool,
    /// Spec rules the setting belongs to (`"L-9"`, `"RL-4"`).
    pub rules: &'static [&'static str],
    /// What it does.
    pub meaning: &'static str,
}

impl Setting {
    /// The same setting with an example value.
    pub(crate) const fn ex(mut self, example: &'static str) -> Setting {
        self.example = Some(example);
        self
    }

    /// The same setting with an example value the commented configs set.
    pub(crate) const fn set_to(mut self, example: &'static str) -> Setting {
        self.example = Some(example);
        self.example_set = true;
        self
    }

    /// The TOML value a rendering shows on the setting's line: the example if any, else the
    /// default value.
    pub fn shown(&self) -> Option<&'static str> {
        match (self.example, self.absent) {
            (Some(e), _) => Some(e),
            (None, Absent::Value(v)) => Some(v),
            _ => None,
        }
    }
}

/// A setting of `section` (a short constructor for the tables).
pub(crate) const fn set(
    section: &'static str,
    key: &'static str,
    ty: &'static str,
    absent: Absent,
    rules: &'static [&'static str],
    meaning: &'static str,
) -> Setting {
    Setting {
        section,
        key,
        ty,
        absent,
        example: None,
        example_set: false,
        rules,
        meaning,
    }
}

/// What kind of TOML table a section is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The file's top level.
    Top,
    /// One fixed table (`[locket]`).
    Table,
    /// A table per name (`[classes."<name>"]`).
    Named,
    /// An inline table inside another (`rate = { ... }`).
    Entry,
}

/// A group of settings: one TOML table, or the shape of an inline table.
#[derive(Debug, Clone, Copy)]
pub struct Section {
    /// Its path: `""`, `"locket"`, `"classes.<name>"`, `"classes.<name>.rate"`.
    pub path: &'static str,
    /// What kind of table it is.
    pub kind: Kind,
    /// Its header as a config writes it, with an example name for a named table.
    pub header: &'static str,
    /// Spec rules of the whole section.
    pub rules: &'static [&'static str],
    /// What it is for.
    pub meaning: &'static str,
}

/// Every section, in the order the renderings show them.
pub fn sections() -> &'static [Section] {
    tables::SECTIONS
}

/// Every setting, grouped by section in [`sections`]' order.
pub fn settings() -> Vec<&'static Setting> {
    sections()
        .iter()
        .flat_map(|s| {
            daemon::SETTINGS
                .iter()
                .chain(classes::SETTINGS)
                .filter(move |x| x.section == s.path)
        })
        .collect()
}

/// The spec file (under `docs/spec/`) that defines a rule, by its prefix.
pub fn spec_file(rule: &str) -> &'static str {
    match rule.split('-').next().unwrap_or("") {
        "H" => "persistent-handlers.md",
        "RL" => "rate-limits.md",
        "SC" => "scheduler-protocol.md",
        _ => "locking-semantics.md",
    }
}

/// `locketd config ...`.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum ConfigCommand {
    /// Print every setting: key, type, default, meaning and spec rules (the same table the
    /// docs/reference/config.md page and the commented config/locketd.toml are made from).
    Reference {
        /// What to print.
        #[arg(long, value_enum, default_value = "markdown", value_name = "FORMAT")]
        format: Format,
    },
}

impl ConfigCommand {
    /// Prints what was asked on stdout.
    pub fn run(&self) -> std::process::ExitCode {
        match self {
            ConfigCommand::Reference { format } => {
                use std::io::Write;
                let text = render(*format);
                // A closed stdout (`| head`) is not an error worth a message.
                let _ = std::io::stdout().lock().write_all(text.as_bytes());
                std::process::ExitCode::SUCCESS
            }
        }
    }
}

#[cfg(test)]
mod tests;
