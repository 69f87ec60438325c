//! The table and the parser, tied both ways.

use super::*;
use crate::config::{
    ClassConfig, Config, HandlerConfig, HoldEntry, LockEntry, Locket, QueueConfig, RateEntry,
    ScheduleConfig, SchedulerConfig,
};
use serde::de::{self, Deserialize, Deserializer, Visitor};
use std::cell::Cell;
use std::collections::BTreeSet;

/// A deserializer that only records the field names a derived struct asks for.
struct Probe<'a>(&'a Cell<&'static [&'static str]>);

impl<'de> Deserializer<'de> for Probe<'_> {
    type Error = de::value::Error;
    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a struct"))
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.set(fields);
        Err(de::Error::custom("probed"))
    }
    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// The keys serde accepts in a table of type `T` (its fields and their aliases).
fn fields_of<T: for<'de> Deserialize<'de>>() -> BTreeSet<&'static str> {
    let cell = Cell::new(&[][..]);
    let _ = T::deserialize(Probe(&cell));
    assert!(
        !cell.get().is_empty(),
        "{} is not a struct",
        std::any::type_name::<T>()
    );
    cell.get().iter().copied().collect()
}

/// Every section the parser has, with the keys it accepts there.
fn parser_sections() -> Vec<(&'static str, BTreeSet<&'static str>)> {
    vec![
        ("", fields_of::<Config>()),
        ("locket", fields_of::<Locket>()),
        ("queue.<name>", fields_of::<QueueConfig>()),
        ("classes.<name>", fields_of::<ClassConfig>()),
        ("classes.<name>.locks", fields_of::<LockEntry>()),
        ("classes.<name>.holds", fields_of::<HoldEntry>()),
        ("classes.<name>.rate", fields_of::<RateEntry>()),
        ("handlers.<name>", fields_of::<HandlerConfig>()),
        ("scheduler", fields_of::<SchedulerConfig>()),
        ("schedule.<name>", fields_of::<ScheduleConfig>()),
    ]
}

/// Keys the parser takes under a second name, with the table's setting they spell.
const ALIASES: &[(&str, &str, &str)] = &[("classes.<name>", "max_runtime", "timeout")];

#[test]
fn every_key_the_parser_accepts_is_in_the_table_and_no_other() {
    let table: BTreeSet<(&str, &str)> = settings().iter().map(|s| (s.section, s.key)).collect();
    assert_eq!(table.len(), settings().len(), "a setting is listed twice");
    let mut parser = BTreeSet::new();
    for (section, fields) in parser_sections() {
        assert!(
            sections().iter().any(|s| s.path == section),
            "the parser's section {section:?} has no Section in the table"
        );
        for f in fields {
            // A top-level field holding a table is a section, not a setting.
            let is_table = section.is_empty()
                && sections()
                    .iter()
                    .any(|s| s.path.split('.').next() == Some(f) && !s.path.is_empty());
            let is_alias = ALIASES.iter().any(|(s, a, _)| *s == section && *a == f);
            if !is_table && !is_alias {
                parser.insert((section, f));
            }
        }
    }
    let missing: Vec<_> = parser.difference(&table).collect();
    let unknown: Vec<_> = table.difference(&parser).collect();
    assert!(
        missing.is_empty(),
        "settings the parser accepts but src/config/reference/ does not list: {missing:?}"
    );
    assert!(
        unknown.is_empty(),
        "settings src/config/reference/ lists but the parser refuses: {unknown:?}"
    );
    for s in sections() {
        assert!(
            parser_sections().iter().any(|(p, _)| *p == s.path),
            "the table's section {:?} is not one the test knows the parser type of",
            s.path
        );
    }
}

/// A config that sets `key = value` in `section`, with what that section requires.
fn config_with(section: &str, key: &str, value: Option<&str>) -> String {
    let required = |path: &str| -> Vec<String> {
        settings()
            .iter()
            .filter(|s| s.section == path && s.absent == Absent::Required && s.key != key)
            .map(|s| {
                format!(
                    "{} = {}",
                    s.key,
                    s.example.expect("a required key's example")
                )
            })
            .collect()
    };
    let mut fields = required(section);
    fields.extend(value.map(|v| format!("{key} = {v}")));
    let kind = sections()
        .iter()
        .find(|s| s.path == section)
        .map(|s| s.kind)
        .unwrap();
    match kind {
        Kind::Top => fields.join("\n"),
        Kind::Table => format!("[{section}]\n{}", fields.join("\n")),
        Kind::Named => format!(
            "[{}.\"X\"]\n{}",
            section.trim_end_matches(".<name>"),
            fields.join("\n")
        ),
        Kind::Entry => {
            let (table, entry) = section.rsplit_once('.').unwrap();
            let inline = format!("{{ {} }}", fields.join(", "));
            let inline = if entry == "rate" {
                inline
            } else {
                format!("[ {inline} ]")
            };
            format!(
                "[{}.\"X\"]\n{entry} = {inline}",
                table.trim_end_matches(".<name>")
            )
        }
    }
}

#[test]
fn every_key_in_the_table_parses_and_its_default_is_the_parsers() {
    for s in settings() {
        let shown = s
            .shown()
            .unwrap_or_else(|| panic!("{}.{}: no default value and no example", s.section, s.key));
        let with = config_with(s.section, s.key, Some(shown));
        Config::parse(&with, "reference")
            .unwrap_or_else(|e| panic!("{}.{} = {shown}: {e}\n{with}", s.section, s.key));
        if let Absent::Value(v) = s.absent {
            let with = config_with(s.section, s.key, Some(v));
            let without = config_with(s.section, s.key, None);
            let given = Config::parse(&with, "given").unwrap();
            let absent = Config::parse(&without, "absent").unwrap();
            assert_eq!(
                format!("{given:#?}"),
                format!("{absent:#?}"),
                "{}.{}: the table's default {v} is not the parser's",
                s.section,
                s.key
            );
        }
    }
}

// A second name the parser takes spells the same setting, and the table's meaning names it.
#[test]
fn each_alias_is_its_setting_under_another_name() {
    for (section, alias, key) in ALIASES {
        let s = settings()
            .into_iter()
            .find(|s| s.section == *section && s.key == *key)
            .unwrap();
        assert!(
            s.meaning.contains(alias),
            "{key}'s meaning does not name {alias}"
        );
        let value = s.shown().unwrap();
        let by_key = Config::parse(&config_with(section, key, Some(value)), "key").unwrap();
        let text = config_with(section, key, None) + &format!("\n{alias} = {value}");
        let by_alias = Config::parse(&text, "alias").unwrap();
        assert_eq!(format!("{by_key:#?}"), format!("{by_alias:#?}"), "{alias}");
    }
}

#[test]
fn the_rules_cited_are_defined_in_the_spec() {
    let spec = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/spec");
    let rules = sections()
        .iter()
        .flat_map(|s| s.rules)
        .chain(settings().into_iter().flat_map(|s| s.rules));
    for rule in rules {
        let file = spec.join(spec_file(rule));
        let text = std::fs::read_to_string(&file).unwrap();
        let needle = format!("**{rule}");
        let defined = text.match_indices(&needle).any(|(i, _)| {
            text[i + needle.len()..]
                .chars()
                .next()
                .is_some_and(|c| !c.is_ascii_alphanumeric())
        });
        assert!(defined, "{rule} is not defined in {}", file.display());
    }
}

#[test]
fn both_commented_configs_parse_and_check() {
    for format in [Format::Toml, Format::Deb] {
        let text = render(format);
        let c = Config::parse(&text, "rendered").unwrap_or_else(|e| panic!("{format:?}: {e}"));
        c.check().unwrap_or_else(|e| panic!("{format:?}: {e}"));
    }
}
