//! Key templates (locking-semantics.md §4, T-1..T-7): `"user:{args[0]}"`,
//! `"render:{args[0].tenant}"`, `"{class}:{args_digest}"`.
//!
//! A template is parsed once, when the configuration is loaded (T-7), into literal text and
//! placeholders; rendering walks the decoded payload. The same template and payload render the
//! same id everywhere because values are written in canonical JSON (T-2, T-3).

use super::canonical::{self, canonical_json};
use serde_json::Value;
use std::fmt;

/// The default lock template (T-4): class and canonical args, not the queue.
pub const DEFAULT_TEMPLATE: &str = "{class}:{args_digest}";

/// One step of an `{args[i]...}` path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    /// `[j]`: array index.
    Index(usize),
    /// `.name` or `["name"]`: object member.
    Member(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    Class,
    Queue,
    Digest,
    ArgsDigest,
    Args,
    /// `args[i]` followed by steps; the first step is always an index into args.
    Path(Vec<Step>),
}

/// A parsed key template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

/// What a template is rendered against.
#[derive(Debug, Clone, Copy)]
pub struct RenderInput<'a> {
    /// Job class.
    pub class: &'a str,
    /// Queue the job came from (or goes to).
    pub queue: &'a str,
    /// Payload digest (§1.1).
    pub digest: &'a str,
    /// Decoded `args` (an array; exact number text kept).
    pub args: &'a Value,
}

/// A template that cannot be rendered for one payload (T-6, E-2): the job fails with
/// `Locket::BadLockKey`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderError {
    /// The template's text.
    pub template: String,
    /// The placeholder path that failed, e.g. `args[0].id`.
    pub path: String,
    /// Why.
    pub reason: String,
}

impl fmt::Display for RenderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "key template {:?}: {}", self.template, self.reason)
        } else {
            write!(
                f,
                "key template {:?}: {} {}",
                self.template, self.path, self.reason
            )
        }
    }
}

impl std::error::Error for RenderError {}

/// A rendered id (T-5): `id` is what names the Redis resource, `source` the full rendering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The id, at most 200 bytes (`h:<sha256>` for longer renderings).
    pub id: String,
    /// The full rendered text (equal to `id` unless it was hashed).
    pub source: String,
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

impl Template {
    /// Parses a template (T-1). The error names the position and what was expected.
    pub fn parse(source: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut text = String::new();
        let chars: Vec<char> = source.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            match chars[i] {
                '{' if chars.get(i + 1) == Some(&'{') => {
                    text.push('{');
                    i += 2;
                }
                '}' if chars.get(i + 1) == Some(&'}') => {
                    text.push('}');
                    i += 2;
                }
                '}' => {
                    return Err(format!(
                        "unmatched '}}' at character {} (write '}}}}' for a literal brace)",
                        i + 1
                    ))
                }
                '{' => {
                    let end = chars[i + 1..]
                        .iter()
                        .position(|c| *c == '}')
                        .map(|p| p + i + 1)
                        .ok_or_else(|| format!("unclosed '{{' at character {}", i + 1))?;
                    // A `}` inside a quoted member name: find the real end.
                    let (inner, end) = placeholder_text(&chars, i + 1)
                        .unwrap_or_else(|| (chars[i + 1..end].iter().collect::<String>(), end));
                    if !text.is_empty() {
                        parts.push(Part::Text(std::mem::take(&mut text)));
                    }
                    parts.push(
                        parse_placeholder(&inner)
                            .map_err(|e| format!("placeholder {{{inner}}}: {e}"))?,
                    );
                    i = end + 1;
                }
                c => {
                    text.push(c);
                    i += 1;
                }
            }
        }
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        if parts.is_empty() {
            return Err("the template is empty".to_string());
        }
        Ok(Template {
            source: source.to_string(),
            parts,
        })
    }

    /// The template's text as configured.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether rendering needs a SHA-256 of the job (`{digest}`, `{args_digest}`).
    pub fn needs_digest(&self) -> bool {
        self.parts
            .iter()
            .any(|p| matches!(p, Part::Digest | Part::ArgsDigest))
    }

    /// The parsed template as the Lua renderer takes it (src/store/lua/render.lua):
    /// `{"src": <text>, "parts": [...]}`, each part a literal string or a placeholder array
    /// (`["class"]`, `["queue"]`, `["digest"]`, `["args_digest"]`, `["args"]`, or
    /// `["path", i, step...]` with numbers for indexes and strings for member names). Rust
    /// parses every template (T-1, T-7); Redis only walks this list.
    pub fn compiled(&self) -> Value {
        let parts = self
            .parts
            .iter()
            .map(|p| match p {
                Part::Text(t) => Value::from(t.as_str()),
                Part::Class => serde_json::json!(["class"]),
                Part::Queue => serde_json::json!(["queue"]),
                Part::Digest => serde_json::json!(["digest"]),
                Part::ArgsDigest => serde_json::json!(["args_digest"]),
                Part::Args => serde_json::json!(["args"]),
                Part::Path(steps) => {
                    let mut v = vec![Value::from("path")];
                    v.extend(steps.iter().map(|s| match s {
                        Step::Index(j) => Value::from(*j),
                        Step::Member(n) => Value::from(n.as_str()),
                    }));
                    Value::Array(v)
                }
            })
            .collect();
        serde_json::json!({"src": self.source, "parts": Value::Array(parts)})
    }

    /// Renders the template for one payload (T-3), capped by T-5.
    pub fn render(&self, input: &RenderInput<'_>) -> Result<Rendered, RenderError> {
        let mut out = String::new();
        for part in &self.parts {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::Class => out.push_str(input.class),
                Part::Queue => out.push_str(input.queue),
                Part::Digest => out.push_str(input.digest),
                Part::ArgsDigest => out.push_str(&canonical::args_digest(input.args)),
                Part::Args => out.push_str(&canonical_json(input.args)),
                Part::Path(steps) => {
                    let v = self.walk(input.args, steps)?;
                    match v {
                        Value::String(s) => out.push_str(s),
                        other => out.push_str(&canonical_json(other)),
                    }
                }
            }
        }
        if out.is_empty() {
            return Err(RenderError {
                template: self.source.clone(),
                path: String::new(),
                reason: "rendered an empty id".to_string(),
            });
        }
        let id = canonical::cap_lock_id(out.clone());
        Ok(Rendered { id, source: out })
    }

    fn walk<'v>(&self, args: &'v Value, steps: &[Step]) -> Result<&'v Value, RenderError> {
        let mut path = String::from("args");
        let mut cur = args;
        for step in steps {
            let next = match (step, cur) {
                (Step::Index(j), Value::Array(items)) => {
                    path.push_str(&format!("[{j}]"));
                    items.get(*j).ok_or_else(|| {
                        format!("does not exist (the array has {} items)", items.len())
                    })
                }
                (Step::Member(name), Value::Object(map)) => {
                    path.push_str(&member_text(name));
                    map.get(name)
                        .ok_or_else(|| "does not exist in the payload".to_string())
                }
                (step, other) => {
                    let kind = match other {
                        Value::Null => "null",
                        Value::Bool(_) => "a boolean",
                        Value::Number(_) => "a number",
                        Value::String(_) => "a string",
                        Value::Array(_) => "an array",
                        Value::Object(_) => "an object",
                    };
                    let what = path.clone();
                    match step {
                        Step::Index(j) => path.push_str(&format!("[{j}]")),
                        Step::Member(n) => path.push_str(&member_text(n)),
                    }
                    Err(format!("does not exist ({what} is {kind})"))
                }
            };
            cur = next.map_err(|reason| RenderError {
                template: self.source.clone(),
                path: path.clone(),
                reason,
            })?;
        }
        Ok(cur)
    }
}

fn member_text(name: &str) -> String {
    if name.chars().next().is_some_and(is_ident_start) && name.chars().all(is_ident) {
        format!(".{name}")
    } else {
        format!("[{}]", serde_json::to_string(name).unwrap_or_default())
    }
}

/// The text of a placeholder starting at `start` (just after `{`), honouring JSON strings in
/// `["..."]` steps, and the index of its closing `}`.
fn placeholder_text(chars: &[char], start: usize) -> Option<(String, usize)> {
    let mut i = start;
    let mut in_str = false;
    while i < chars.len() {
        let c = chars[i];
        if in_str {
            if c == '\\' {
                i += 2;
                continue;
            }
            if c == '"' {
                in_str = false;
            }
        } else if c == '"' {
            in_str = true;
        } else if c == '}' {
            return Some((chars[start..i].iter().collect(), i));
        }
        i += 1;
    }
    None
}

fn parse_placeholder(inner: &str) -> Result<Part, String> {
    match inner {
        "class" => return Ok(Part::Class),
        "queue" => return Ok(Part::Queue),
        "digest" => return Ok(Part::Digest),
        "args_digest" => return Ok(Part::ArgsDigest),
        "args" => return Ok(Part::Args),
        _ => {}
    }
    let rest = inner.strip_prefix("args").ok_or_else(|| {
        "unknown placeholder (use class, queue, digest, args_digest, args or args[i]...)"
            .to_string()
    })?;
    let chars: Vec<char> = rest.chars().collect();
    let mut steps = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '.' => {
                let start = i + 1;
                let mut j = start;
                while j < chars.len() && is_ident(chars[j]) {
                    j += 1;
                }
                if j == start || !is_ident_start(chars[start]) {
                    return Err(format!(
                        "expected a member name after '.' at {:?}",
                        rest[..].chars().skip(i).collect::<String>()
                    ));
                }
                steps.push(Step::Member(chars[start..j].iter().collect()));
                i = j;
            }
            '[' => {
                if chars.get(i + 1) == Some(&'"') {
                    // JSON string up to the closing quote, then ']'.
                    let mut j = i + 2;
                    while j < chars.len() && chars[j] != '"' {
                        if chars[j] == '\\' {
                            j += 1;
                        }
                        j += 1;
                    }
                    if j >= chars.len() || chars.get(j + 1) != Some(&']') {
                        return Err("unterminated [\"name\"] step".to_string());
                    }
                    let lit: String = chars[i + 1..=j].iter().collect();
                    let name: String = serde_json::from_str(&lit)
                        .map_err(|e| format!("bad member name {lit}: {e}"))?;
                    steps.push(Step::Member(name));
                    i = j + 2;
                } else {
                    let close = chars[i..]
                        .iter()
                        .position(|c| *c == ']')
                        .map(|p| p + i)
                        .ok_or_else(|| "unterminated [index] step".to_string())?;
                    let digits: String = chars[i + 1..close].iter().collect();
                    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
                        return Err(format!(
                            "[{digits}] is not an index (use [0], [1], ... or [\"name\"])"
                        ));
                    }
                    let j: usize = digits
                        .parse()
                        .map_err(|_| format!("index {digits} is too large"))?;
                    steps.push(Step::Index(j));
                    i = close + 1;
                }
            }
            c => return Err(format!("unexpected {c:?} (expected '.' or '[')")),
        }
    }
    if !matches!(steps.first(), Some(Step::Index(_))) {
        return Err("args must be followed by an index, e.g. {args[0]}".to_string());
    }
    Ok(Part::Path(steps))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Renders `t` for class C, queue q, digest d1 and the args parsed from `args_text`.
    fn render_json(t: &str, args_text: &str) -> Result<String, RenderError> {
        let args: Value = serde_json::from_str(args_text).unwrap();
        Template::parse(t)
            .unwrap()
            .render(&RenderInput {
                class: "C",
                queue: "q",
                digest: "d1",
                args: &args,
            })
            .map(|r| r.id)
    }

    fn render(t: &str, args: Value) -> Result<String, RenderError> {
        render_json(t, &args.to_string())
    }

    fn render_text(t: &str, args_text: &str) -> String {
        render_json(t, args_text).unwrap()
    }

    // locking-semantics.md T-1
    #[test]
    fn t1_placeholders_paths_and_literal_braces() {
        let args = json!([{"account": {"id": 7}}, {"user id": "u"}, [["x", 9]]]);
        assert_eq!(
            render("a:{args[0].account.id}", args.clone()).unwrap(),
            "a:7"
        );
        assert_eq!(render("{args[1][\"user id\"]}", args.clone()).unwrap(), "u");
        assert_eq!(render("{args[2][0][1]}", args.clone()).unwrap(), "9");
        assert_eq!(
            render("{class}/{queue}/{digest}", json!([])).unwrap(),
            "C/q/d1"
        );
        assert_eq!(render("{{lit}}:{args[2][0][0]}", args).unwrap(), "{lit}:x");
        assert_eq!(
            render("{class}:{args_digest}", json!([1])).unwrap(),
            canonical::default_lock_id("C", &json!([1]))
        );
        for bad in [
            "{nope}",
            "{args[x]}",
            "{args.x}",
            "x}",
            "{args[0]",
            "",
            "{args[0]..a}",
            "{args}}",
        ] {
            assert!(Template::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    // locking-semantics.md T-2, T-3: strings raw, numbers canonical, composites canonical JSON
    #[test]
    fn t3_values_render_canonically() {
        assert_eq!(render_text("{args[0]}", r#"["a b"]"#), "a b");
        assert_eq!(render_text("{args[0]}", "[1.0]"), "1");
        assert_eq!(render_text("{args[0]}", "[1]"), "1");
        assert_eq!(render_text("{args[0]}", "[true]"), "true");
        assert_eq!(render_text("{args[0]}", "[null]"), "null");
        assert_eq!(
            render_text("{args[0]}", r#"[{"b":1,"a":[2.0]}]"#),
            r#"{"a":[2],"b":1}"#
        );
        assert_eq!(
            render_text("{args}", r#"[{"b":1,"a":"é"}]"#),
            r#"[{"a":"é","b":1}]"#
        );
        assert_eq!(
            render_text("{args_digest}", r#"[{"b":1,"a":2}]"#),
            render_text("{args_digest}", r#"[{"a":2.0,"b":1}]"#)
        );
    }

    // locking-semantics.md T-2: IDs beyond 2^53 stay distinct
    #[test]
    fn t2_big_integers_give_distinct_ids() {
        let a = render_text("user:{args[0]}", "[9007199254740993]");
        let b = render_text("user:{args[0]}", "[9007199254740992]");
        let c = render_text("user:{args[0]}", "[123456789012345678901234567890]");
        assert_eq!(a, "user:9007199254740993");
        assert_ne!(a, b);
        assert_eq!(c, "user:123456789012345678901234567890");
    }

    // locking-semantics.md T-4: the default template is class and canonical args, not the queue
    #[test]
    fn t4_the_default_template_ignores_queue_and_member_order() {
        let t = Template::parse(DEFAULT_TEMPLATE).unwrap();
        let a1: Value = serde_json::from_str(r#"[{"b":1,"a":2}]"#).unwrap();
        let a2: Value = serde_json::from_str(r#"[{"a":2.0,"b":1}]"#).unwrap();
        let r1 = t
            .render(&RenderInput {
                class: "C",
                queue: "high",
                digest: "x",
                args: &a1,
            })
            .unwrap();
        let r2 = t
            .render(&RenderInput {
                class: "C",
                queue: "low",
                digest: "y",
                args: &a2,
            })
            .unwrap();
        assert_eq!(r1, r2);
        assert_eq!(r1.id, canonical::default_lock_id("C", &a1));
    }

    // locking-semantics.md T-5
    #[test]
    fn t5_long_ids_are_hashed_and_empty_ones_rejected() {
        let long = "x".repeat(300);
        let args = json!([long]);
        let r = Template::parse("{args[0]}")
            .unwrap()
            .render(&RenderInput {
                class: "C",
                queue: "q",
                digest: "d",
                args: &args,
            })
            .unwrap();
        assert!(r.id.starts_with("h:") && r.id.len() == 66, "{}", r.id);
        assert_eq!(r.source, long);
        assert!(render("{args[0]}", json!([""])).is_err());
    }

    // locking-semantics.md T-6
    #[test]
    fn t6_missing_paths_are_errors_naming_template_and_path() {
        let e = render("u:{args[1]}", json!([1])).unwrap_err();
        assert_eq!(e.path, "args[1]");
        assert!(e.to_string().contains("u:{args[1]}"), "{e}");
        let e = render("{args[0].id}", json!(["s"])).unwrap_err();
        assert_eq!(e.path, "args[0].id");
        assert!(e.reason.contains("string"), "{e}");
        let e = render("{args[0][\"a b\"]}", json!([{}])).unwrap_err();
        assert_eq!(e.path, "args[0][\"a b\"]");
        assert!(render("{args[0][2]}", json!([[1]])).is_err());
    }

    // locking-semantics.md T-7: parsed once, same id every time
    #[test]
    fn t7_rendering_is_deterministic() {
        let t = Template::parse("k:{args[0]}:{args[1]}").unwrap();
        let a1: Value = serde_json::from_str(r#"[{"y":1,"x":2}, 1.50]"#).unwrap();
        let a2: Value = serde_json::from_str(r#"[{"x":2.0, "y":1.0}, 1.5]"#).unwrap();
        let inp = |a| RenderInput {
            class: "C",
            queue: "q",
            digest: "d",
            args: a,
        };
        assert_eq!(t.render(&inp(&a1)).unwrap(), t.render(&inp(&a2)).unwrap());
        assert_eq!(t.render(&inp(&a1)).unwrap().id, r#"k:{"x":2,"y":1}:1.5"#);
    }
}
