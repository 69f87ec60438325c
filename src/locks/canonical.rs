//! Canonical JSON and payload identity (locking-semantics.md T-2, T-4, T-5, §1.1).
//!
//! Two producers that enqueue "the same job" rarely write the same bytes: Ruby writes
//! `{"class":"A","args":[1.0]}`, node-resque `{"class":"A","queue":"q","args":[1]}`, pyres adds
//! spaces. Lock ids are computed from a canonical form instead, so the same class and args give
//! the same id on every host and version:
//!
//! - object members sorted by the UTF-8 bytes of their names, no whitespace;
//! - strings escaped exactly as serde_json escapes them (`"`, `\`, control characters;
//!   non-ASCII and `/` stay raw);
//! - integers as written, whatever their size (serde_json's `arbitrary_precision` keeps the
//!   text), with `-0` written `0`;
//! - floats with an integral value within ±2^53 as integers (`1.0`, `1.0e2` → `1`, `100`),
//!   other floats in the shortest round-trip form, laid out as the `ryu` crate does
//!   (`2.5`, `1e300`, `-1.5e-7`, `0.00001`, `9007199254740994.0`, `1.8014398509481984e16`);
//! - a float literal too large for `f64` (`1e400`) has no finite value to normalise: it keeps
//!   its digits, with the exponent written as `e` and no `+` (`1E+400` → `1e400`). A literal
//!   that underflows (`1e-400`) becomes `0`, the value Ruby and JavaScript read.
//!
//! The float layout is produced here from the standard library's shortest digits rather
//! than by serde_json's formatter, because that formatter is not stable across serde_json
//! releases (1.0.154 uses `zmij` and prints `1e+300`; releases using `ryu` printed `1e300`),
//! and a lock id must not change when a dependency is upgraded (T-7).

use serde_json::{Map, Number, Value};
use sha2::{Digest, Sha256};

/// Rendered lock ids longer than this many bytes are replaced by a hash (T-5).
pub const MAX_LOCK_ID_BYTES: usize = 200;

/// Largest magnitude (2^53) up to which an integral float is written as an integer.
const MAX_EXACT_INTEGER: f64 = 9_007_199_254_740_992.0;

/// The canonical JSON text of `v` (T-2).
pub fn canonical_json(v: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, v);
    out
}

/// Lowercase hex SHA-256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    lower_hex(&Sha256::digest(data))
}

/// SHA-1 hex of `data`: the key a parked job's handed unit is kept for, the SHA1 of its
/// payload's exact bytes (locking-semantics.md PK-3; Redis's `redis.sha1hex` in the scripts).
pub fn sha1_hex(data: &[u8]) -> String {
    lower_hex(&sha1::Sha1::digest(data))
}

/// `bytes` as lowercase hex, two digits a byte. (`hex::encode` collects a char iterator, a few
/// times slower; two digests a job go through here.)
pub fn lower_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = Vec::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)]);
        out.push(DIGITS[usize::from(b & 0xf)]);
    }
    String::from_utf8(out).expect("ASCII digits")
}

/// The payload digest (§1.1): SHA-256 hex of the canonical JSON of
/// `{"args":args,"class":class}`. Queue and extra payload keys are not part of it, so it
/// survives a Resque retry.
pub fn digest(class: &str, args: &Value) -> String {
    // "args" sorts before "class", so this is the canonical form of the two-member object.
    let mut out = String::from("{\"args\":");
    write_value(&mut out, args);
    out.push_str(",\"class\":");
    write_str(&mut out, class);
    out.push('}');
    sha256_hex(out.as_bytes())
}

/// SHA-256 hex of the canonical JSON of `args` (the `{args_digest}` placeholder).
pub fn args_digest(args: &Value) -> String {
    sha256_hex(canonical_json(args).as_bytes())
}

/// The lock id of the default template `{class}:{args_digest}` (T-4).
pub fn default_lock_id(class: &str, args: &Value) -> String {
    format!("{class}:{}", args_digest(args))
}

/// Bounds a rendered lock id (T-5): text longer than [`MAX_LOCK_ID_BYTES`] bytes becomes
/// `h:` + SHA-256 hex of the text; shorter text is returned unchanged. The caller keeps the
/// full text as `lock_id_source`.
pub fn cap_lock_id(rendered: String) -> String {
    if rendered.len() > MAX_LOCK_ID_BYTES {
        format!("h:{}", sha256_hex(rendered.as_bytes()))
    } else {
        rendered
    }
}

fn write_value(out: &mut String, v: &Value) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => out.push_str(&canonical_number(n)),
        Value::String(s) => write_str(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item);
            }
            out.push(']');
        }
        Value::Object(members) => write_object(out, members),
    }
}

fn write_object(out: &mut String, members: &Map<String, Value>) {
    // Sort explicitly: the map's own order depends on serde_json's `preserve_order` feature.
    let mut sorted: Vec<(&String, &Value)> = members.iter().collect();
    sorted.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    out.push('{');
    for (i, (name, value)) in sorted.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        write_str(out, name);
        out.push(':');
        write_value(out, value);
    }
    out.push('}');
}

/// The canonical text of a number, from its original JSON text.
fn canonical_number(n: &Number) -> String {
    let text = n.to_string();
    if !text.contains(['.', 'e', 'E']) {
        // An integer literal: keep every digit, even beyond 64 bits.
        return if text == "-0" { "0".to_owned() } else { text };
    }
    match text.parse::<f64>() {
        Ok(x) if x.is_finite() => {
            if x.fract() == 0.0 && x.abs() <= MAX_EXACT_INTEGER {
                // Exact: |x| <= 2^53. `-0.0 as i64` is 0, so no "-0".
                (x as i64).to_string()
            } else {
                shortest_float(x)
            }
        }
        // Out of f64 range: keep the digits, normalise only the exponent marker.
        _ => text.replace('E', "e").replace("e+", "e"),
    }
}

/// The shortest round-trip text of a finite, non-zero `x`, in `ryu`'s layout: plain
/// decimal when the decimal point falls within 16 digits left of the end or 5 zeros right
/// of the point, else `d.ddde<exp>` (no `+`, no trailing `.0` on the mantissa).
fn shortest_float(x: f64) -> String {
    let sci = shortest_scientific(x);
    let Some((mantissa, exp)) = sci.split_once('e') else {
        return sci;
    };
    let Ok(exp) = exp.parse::<i64>() else {
        return sci;
    };
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let len = digits.len() as i64; // at most 17
    let kk = exp + 1; // 10^(kk-1) <= |x| < 10^kk
    let k = kk - len; // decimal exponent of the last digit
    let zeros = |n: i64| "0".repeat(usize::try_from(n).unwrap_or(0));
    let body = if 0 <= k && kk <= 16 {
        format!("{digits}{}.0", zeros(k))
    } else if 0 < kk && kk <= 16 {
        let (int, frac) = digits.split_at(usize::try_from(kk).unwrap_or(0));
        format!("{int}.{frac}")
    } else if -5 < kk && kk <= 0 {
        format!("0.{}{digits}", zeros(-kk))
    } else if len == 1 {
        format!("{digits}e{}", kk - 1)
    } else {
        let (first, rest) = digits.split_at(1);
        format!("{first}.{rest}e{}", kk - 1)
    };
    format!("{sign}{body}")
}

/// The shortest round-trip digits of `x` in `{:e}` form ("-1.5e-7", "1e300"), choosing the
/// candidate nearest to `x` with ties to even, as `ryu`, JavaScript and Python do.
///
/// `{:e}` alone finds the shortest length but may break an exact tie upwards
/// (1394865425023536.25 gives `...536.3`, where ryu gives `...536.2`). `{:.Ne}` rounds the
/// exact value correctly with ties to even; when that result still round-trips it is the
/// nearest candidate of that length.
fn shortest_scientific(x: f64) -> String {
    let sci = format!("{x:e}");
    let digits = sci
        .split('e')
        .next()
        .map_or(0, |m| m.bytes().filter(u8::is_ascii_digit).count());
    if digits < 2 {
        return sci;
    }
    let nearest = format!("{x:.prec$e}", prec = digits - 1);
    if nearest
        .parse::<f64>()
        .is_ok_and(|y| y.to_bits() == x.to_bits())
    {
        nearest
    } else {
        sci
    }
}

/// Writes `s` as a JSON string the way serde_json's compact serializer does: `"` and `\`
/// backslash-escaped, `\b \t \n \f \r` short escapes, other control characters below U+0020
/// as `\u00xx` (lowercase hex), everything else raw. Written here rather than calling
/// `serde_json::to_string` so the function is infallible; a test compares the two over the
/// whole Basic Multilingual Plane.
fn write_str(out: &mut String, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{08}' => out.push_str("\\b"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\u{0c}' => out.push_str("\\f"),
            '\r' => out.push_str("\\r"),
            c if u32::from(c) < 0x20 => {
                let b = u32::from(c) as usize;
                out.push_str("\\u00");
                out.push(char::from(HEX[b >> 4]));
                out.push(char::from(HEX[b & 0xf]));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn canon(text: &str) -> String {
        canonical_json(&serde_json::from_str(text).unwrap())
    }

    // locking-semantics.md T-2
    #[test]
    fn member_order_does_not_matter() {
        assert_eq!(
            canon(r#"{"b":1,"a":2,"c":{"z":[],"y":null}}"#),
            r#"{"a":2,"b":1,"c":{"y":null,"z":[]}}"#
        );
        assert_eq!(canon(r#"{"b":1,"a":2}"#), canon(r#"{ "a" : 2 , "b" : 1 }"#));
    }

    // locking-semantics.md T-2: names sort by UTF-8 bytes, not by UTF-16 or locale
    #[test]
    fn member_names_sort_by_utf8_bytes() {
        assert_eq!(
            canon(r#"{"é":1,"z":2,"Z":3,"😀":4,"\uff61":5,"":6}"#),
            r#"{"":6,"Z":3,"z":2,"é":1,"｡":5,"😀":4}"#
        );
    }

    // locking-semantics.md T-2
    #[test]
    fn integral_floats_within_2_pow_53_are_integers() {
        assert_eq!(
            canon("[1.0, 1, 1.0e2, 1E2, -3.000, 0.0, -0.0, -0, 9007199254740992.0]"),
            "[1,1,100,100,-3,0,0,0,9007199254740992]"
        );
        assert_eq!(canon("[-9007199254740992.0]"), "[-9007199254740992]");
        assert_eq!(canon("[1.0]"), canon("[1]"));
    }

    // locking-semantics.md T-2: shortest round-trip form, in ryu's layout
    #[test]
    fn other_floats_use_shortest_round_trip_form() {
        assert_eq!(
            canon("[2.5, 2.50, 0.1, 1e300, 1.0E+300, -1.5e-7, -0.00000015, 3.141592653589793238]"),
            "[2.5,2.5,0.1,1e300,1e300,-1.5e-7,-1.5e-7,3.141592653589793]"
        );
        assert_eq!(
            canon(
                "[0.00001, 0.000001, 1000000000000000.5, 123.456, 5e-324, 1.7976931348623157e308]"
            ),
            "[0.00001,1e-6,1000000000000000.5,123.456,5e-324,1.7976931348623157e308]"
        );
        // An exact tie between two shortest candidates goes to the even digit.
        assert_eq!(canon("[1394865425023536.25]"), "[1394865425023536.2]");
        // Beyond 2^53 an integral float stays a float.
        assert_eq!(
            canon("[9007199254740994.0, 1e16, 18014398509481984.0, 1e20, -1.5e300]"),
            "[9007199254740994.0,1e16,1.8014398509481984e16,1e20,-1.5e300]"
        );
    }

    // locking-semantics.md T-7: pins how our layout relates to serde_json's own formatter,
    // so a serde_json upgrade that changes it shows up here and not in lock ids.
    #[test]
    fn float_layout_matches_serde_json_apart_from_the_exponent_plus() {
        assert_eq!(Number::from_f64(1e300).unwrap().to_string(), "1e+300");
        assert_eq!(Number::from_f64(2.5).unwrap().to_string(), "2.5");
        assert_eq!(Number::from_f64(-1.5e-7).unwrap().to_string(), "-1.5e-7");
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut checked = 0;
        while checked < 300_000 {
            // xorshift64*: covers every exponent and mantissa pattern.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let x = f64::from_bits(state.wrapping_mul(0x2545_f491_4f6c_dd1d));
            if !x.is_finite() || (x.fract() == 0.0 && x.abs() <= MAX_EXACT_INTEGER) {
                continue;
            }
            let ours = shortest_float(x);
            let theirs = Number::from_f64(x).unwrap().to_string().replace("e+", "e");
            assert_eq!(ours, theirs, "{x:e}");
            assert_eq!(
                ours.parse::<f64>().unwrap().to_bits(),
                x.to_bits(),
                "{ours}"
            );
            checked += 1;
        }
        for x in [
            0.1,
            1e-5,
            1e-6,
            1e15 + 0.5,
            9007199254740994.0,
            1e16,
            1e21,
            5e-324,
            f64::MAX,
            -f64::MIN_POSITIVE,
        ] {
            assert_eq!(
                shortest_float(x),
                Number::from_f64(x).unwrap().to_string().replace("e+", "e")
            );
        }
    }

    // locking-semantics.md T-2: documented choice for literals outside f64
    #[test]
    fn floats_outside_f64_range_are_deterministic() {
        assert_eq!(
            canon("[1e400, -1E400, 1E+400, 2.5e999]"),
            "[1e400,-1e400,1e400,2.5e999]"
        );
        assert_eq!(canon("[1e-400]"), "[0]");
    }

    // locking-semantics.md T-2: integers in decimal, exact
    #[test]
    fn big_integers_keep_every_digit() {
        assert_eq!(
            canon("[123456789012345678901234567890]"),
            "[123456789012345678901234567890]"
        );
        assert_eq!(
            canon("[-123456789012345678901234567890]"),
            "[-123456789012345678901234567890]"
        );
        assert_ne!(canon("[9007199254740993]"), canon("[9007199254740992]"));
        assert_eq!(canon("[9007199254740993]"), "[9007199254740993]");
        assert_ne!(
            args_digest(&json!([9007199254740993u64])),
            args_digest(&json!([9007199254740992u64]))
        );
        assert_eq!(canon("[18446744073709551616]"), "[18446744073709551616]");
    }

    // locking-semantics.md T-2: strings escaped the way serde_json escapes them
    #[test]
    fn strings_escape_like_serde_json() {
        assert_eq!(
            canonical_json(&json!("é😀/\"\\\u{0}\u{1f}\u{7f}\n\t\u{8}\u{c}\r")),
            "\"é😀/\\\"\\\\\\u0000\\u001f\u{7f}\\n\\t\\b\\f\\r\""
        );
        let mut all = String::new();
        for cp in (0u32..0x1_0000).chain([0x1_F600, 0x10_FFFF]) {
            if let Some(c) = char::from_u32(cp) {
                let s = c.to_string();
                assert_eq!(
                    canonical_json(&json!(s)),
                    serde_json::to_string(&s).unwrap(),
                    "U+{cp:04X}"
                );
                all.push(c);
            }
        }
        assert_eq!(
            canonical_json(&Value::String(all.clone())),
            serde_json::to_string(&all).unwrap()
        );
    }

    // locking-semantics.md T-2
    #[test]
    fn nested_values_are_canonical_all_the_way_down() {
        let text =
            r#"[ {"k": [ {"y": 2.0, "x": [true, false, null]} ], "a": "s"}, [[], {}], "x" ]"#;
        assert_eq!(
            canon(text),
            r#"[{"a":"s","k":[{"x":[true,false,null],"y":2}]},[[],{}],"x"]"#
        );
    }

    #[test]
    fn lower_hex_writes_two_lowercase_digits_a_byte() {
        assert_eq!(lower_hex(&[0x00, 0x0f, 0x10, 0xa5, 0xff]), "000f10a5ff");
        assert_eq!(lower_hex(&[]), "");
    }

    // PK-3: the handoff key is Redis's redis.sha1hex of the payload's bytes.
    #[test]
    fn sha1_hex_matches_the_standard_vector() {
        // printf '%s' abc | sha1sum
        assert_eq!(sha1_hex(b"abc"), "a9993e364706816aba3e25717850c26c9cd0d89d");
    }

    // locking-semantics.md §1.1: digest of {"args":A,"class":C}
    #[test]
    fn digest_matches_an_independent_sha256() {
        // printf '%s' '{"args":[1],"class":"A"}' | sha256sum
        assert_eq!(
            digest("A", &json!([1])),
            "17a031120094bf98de4fd524c8c72e46a7232217dece7de7f0c7c50fe13c90e8"
        );
        // printf '%s' '{"args":[{"a":1,"b":[2.5,"é"]},100],"class":"Mailer::Send"}' | sha256sum
        let args: Value = serde_json::from_str(r#"[{"b":[2.50,"é"],"a":1.0},1e2]"#).unwrap();
        assert_eq!(
            digest("Mailer::Send", &args),
            "b9cc3bf50240c44c39fe7b44c59156d3d17fc81605e1a5b38910e0eb186f42af"
        );
        assert_eq!(
            digest("Mailer::Send", &args),
            sha256_hex(canonical_json(&json!({"class": "Mailer::Send", "args": args})).as_bytes())
        );
    }

    // locking-semantics.md §1.1: Ruby and JavaScript producers agree
    #[test]
    fn digest_ignores_producer_formatting() {
        let ruby: Value =
            serde_json::from_str(r#"{"class":"A","args":[1.0,{"b":1,"a":2}]}"#).unwrap();
        let node: Value =
            serde_json::from_str(r#"{"class": "A", "queue": "q", "args": [1, {"a": 2, "b": 1}]}"#)
                .unwrap();
        assert_eq!(digest("A", &ruby["args"]), digest("A", &node["args"]));
        assert_ne!(digest("A", &ruby["args"]), digest("B", &ruby["args"]));
    }

    // locking-semantics.md T-4
    #[test]
    fn default_lock_id_is_class_and_args_digest() {
        // printf '%s' '[1]' | sha256sum
        assert_eq!(
            sha256_hex(b"[1]"),
            "080a9ed428559ef602668b4c00f114f1a11c3f6b02a435f0bdc154578e4d7f22"
        );
        assert_eq!(
            default_lock_id("A", &json!([1])),
            "A:080a9ed428559ef602668b4c00f114f1a11c3f6b02a435f0bdc154578e4d7f22"
        );
        let args: Value = serde_json::from_str(r#"[{"a":1,"b":[2.5,"é"]},100]"#).unwrap();
        assert_eq!(
            default_lock_id("Mailer::Send", &args),
            "Mailer::Send:81eb9b312048dd5e07ead89507ec114ddf28d57b720974e890d45387d943bbc8"
        );
    }

    // locking-semantics.md T-5
    #[test]
    fn long_lock_ids_are_hashed() {
        let exact = "x".repeat(MAX_LOCK_ID_BYTES);
        assert_eq!(cap_lock_id(exact.clone()), exact);
        let long = "é".repeat(101); // 202 bytes, 101 chars
        let capped = cap_lock_id(long.clone());
        assert_eq!(capped, format!("h:{}", sha256_hex(long.as_bytes())));
        assert_eq!(capped.len(), 66);
        assert_eq!(cap_lock_id(String::new()), "");
    }
}
