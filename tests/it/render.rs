//! The Lua renderer (src/store/lua/render.lua) against the Rust one (src/locks/template.rs,
//! canonical.rs, resque/payload.rs), in a real redis-server: every template form the config
//! accepts over a few thousand generated payloads, written as Ruby resque, node-resque and
//! pyres write them, plus fixed cases naming the T-rules (locking-semantics.md §1.1, T-1..T-7,
//! D-3a). The two must render the same ids and full texts, and refuse the same payloads.

use locketd::locks::canonical;
use locketd::locks::template::{RenderInput, Template};
use locketd::resque::payload::Job;
use locketd::store::scripts::RENDER_LUA;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::support::RedisServer;

mod generate;
use generate::{payload, Rng};

/// Renders every template for every payload in Lua: one row per payload, `["E", why]` for a
/// payload the renderer refuses, else `["OK", id, source, ...]` with `"E"`, why for a template
/// it cannot render.
const WRAPPER: &str = r#"
local tpls = cjson.decode(ARGV[1])
local function why(e) if type(e) == 'table' then return tostring(e.err) end return tostring(e) end
local out = {}
for i = 2, #ARGV do
  local ok, job = pcall(render_payload, ARGV[i], 'q')
  local row
  if not ok then
    row = {'E', why(job)}
  else
    row = {'OK'}
    for _, t in ipairs(tpls) do
      local ok2, id, src = pcall(render_template, t, job)
      if ok2 then row[#row + 1] = id; row[#row + 1] = src
      else row[#row + 1] = 'E'; row[#row + 1] = why(id) end
    end
  end
  out[#out + 1] = row
end
return out
"#;

/// Every template form T-1 accepts.
const TEMPLATES: &[&str] = &[
    "{class}:{args_digest}",
    "{class}",
    "{queue}/{class}",
    "{digest}",
    "{args}",
    "{args_digest}",
    "user:{args[0]}",
    "{args[1]}",
    "{args[2]}",
    "a:{args[0].id}",
    "{args[0].account.id}",
    "{args[0][\"user id\"]}",
    "{args[0][\"é ü\"]}",
    "{args[0][\"a\\\"b\"]}",
    "{args[0][\"\"]}",
    "{args[0].list[1]}",
    "{args[0].list[0][0]}",
    "{args[1][0]}",
    "{{lit}}:{args[0]}:{{x}}",
    "héllo {class} 😀 {args[1]}",
    "k:{args[0]}:{args[1]}:{args[2]}",
    "{args[3]}",
    "{args[0]._x9}",
    "{args[0].id}{args[0].id}{args}",
];

/// What Rust renders for `payload`: None when the worker refuses the payload, else per
/// template `Ok((id, source))` or `Err(())`.
type Row = Option<Vec<Result<(String, String), String>>>;

fn rust_row(payload: &str, templates: &[Template]) -> Row {
    let job = Job::decode(payload.as_bytes(), "q", 0).ok()?;
    let digest = canonical::digest(&job.class, &job.args);
    let input = RenderInput {
        class: &job.class,
        queue: "q",
        digest: &digest,
        args: &job.args,
    };
    Some(
        templates
            .iter()
            .map(|t| {
                t.render(&input)
                    .map(|r| (r.id, r.source))
                    .map_err(|e| e.to_string())
            })
            .collect(),
    )
}

fn lua_rows(conn: &mut redis::Connection, templates: &[Template], payloads: &[String]) -> Vec<Row> {
    let compiled = Value::Array(templates.iter().map(Template::compiled).collect());
    let script = format!("{RENDER_LUA}\n{WRAPPER}");
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(&script).arg(0).arg(compiled.to_string());
    for p in payloads {
        cmd.arg(p.as_bytes());
    }
    let rows: Vec<Vec<String>> = cmd.query(conn).expect("EVAL of the renderer");
    rows.into_iter()
        .map(|row| {
            if row[0] == "E" {
                return None;
            }
            Some(
                row[1..]
                    .chunks(2)
                    .map(|c| {
                        if c[0] == "E" {
                            Err(c[1].clone())
                        } else {
                            Ok((c[0].clone(), c[1].clone()))
                        }
                    })
                    .collect(),
            )
        })
        .collect()
}

/// Compares the two renderers on `payloads`; returns (payloads rendered, ids compared).
fn compare(conn: &mut redis::Connection, payloads: &[String]) -> (usize, usize) {
    let templates: Vec<Template> = TEMPLATES
        .iter()
        .map(|t| Template::parse(t).unwrap())
        .collect();
    let (mut rendered, mut ids) = (0, 0);
    for chunk in payloads.chunks(250) {
        let lua = lua_rows(conn, &templates, chunk);
        for (p, l) in chunk.iter().zip(lua) {
            let r = rust_row(p, &templates);
            match (&r, &l) {
                (None, None) => {}
                (Some(rs), Some(ls)) => {
                    rendered += 1;
                    for ((t, a), b) in TEMPLATES.iter().zip(rs).zip(ls) {
                        match (a, b) {
                            (Ok(x), Ok(y)) => {
                                assert_eq!(x, y, "template {t} payload {p}");
                                ids += 1;
                            }
                            (Err(_), Err(_)) => {}
                            _ => panic!("template {t} payload {p}: Rust {a:?}, Lua {b:?}"),
                        }
                    }
                }
                _ => panic!("payload {p}: Rust {r:?}, Lua {l:?}"),
            }
        }
    }
    (rendered, ids)
}

// locking-semantics.md D-3a, T-1..T-7, §1.1: the Lua renderer renders what the Rust one does.
#[test]
fn lua_and_rust_render_the_same_ids_for_generated_payloads() {
    let redis = RedisServer::start();
    let mut conn = redis.sync_conn();
    let mut rng = Rng(0x5eed_0001_d1ff_7e57);
    let payloads: Vec<String> = (0..4000).map(|_| payload(&mut rng)).collect();
    let (rendered, ids) = compare(&mut conn, &payloads);
    // The generator must exercise both sides: most payloads readable, many ids rendered.
    assert!(rendered > 2500, "only {rendered} payloads rendered");
    assert!(ids > 25_000, "only {ids} ids compared");
}

// T-2, T-3, T-5, T-6, §1.1: fixed cases, with the ids Rust gives written out.
#[test]
fn lua_renders_the_t_rule_cases() {
    let redis = RedisServer::start();
    let mut conn = redis.sync_conn();
    let one = |conn: &mut redis::Connection, t: &str, p: &str| -> Result<String, String> {
        let tpl = [Template::parse(t).unwrap()];
        let rows = lua_rows(conn, &tpl, &[p.to_string()]);
        match &rows[0] {
            None => Err("payload refused".into()),
            Some(r) => r[0].clone().map(|(id, _)| id),
        }
    };
    let c = &mut conn;
    // T-2: 1.0 is 1, member order and spacing do not matter, big integers keep every digit.
    let ruby = r#"{"class":"A","args":[1.0,{"b":1,"a":2}]}"#;
    let node = r#"{"class": "A", "queue": "q", "args": [1, {"a": 2, "b": 1}]}"#;
    assert_eq!(one(c, "{args}", ruby).unwrap(), r#"[1,{"a":2,"b":1}]"#);
    assert_eq!(one(c, "{digest}", ruby), one(c, "{digest}", node));
    assert_eq!(
        one(
            c,
            "u:{args[0]}",
            r#"{"class":"A","args":[9007199254740993]}"#
        )
        .unwrap(),
        "u:9007199254740993"
    );
    assert_eq!(
        one(
            c,
            "{args[0]}",
            r#"{"class":"A","args":[[1e400,1E+400,1e-400,-0.0,1394865425023536.25]]}"#
        )
        .unwrap(),
        "[1e400,1e400,0,0,1394865425023536.2]"
    );
    // §1.1: printf '%s' '{"args":[1],"class":"A"}' | sha256sum
    assert_eq!(
        one(c, "{digest}", r#"{"class":"A","args":[1]}"#).unwrap(),
        "17a031120094bf98de4fd524c8c72e46a7232217dece7de7f0c7c50fe13c90e8"
    );
    // T-3: strings raw, escapes decoded, surrogate pairs joined.
    assert_eq!(
        one(
            c,
            "{args[0]}",
            r#"{"class":"A","args":["a\u00e9\ud83d\ude00\"b"]}"#
        )
        .unwrap(),
        "aé😀\"b"
    );
    // T-5: past 200 bytes, h: and the SHA-256 of the text.
    let long = "é".repeat(101);
    let id = one(
        c,
        "{args[0]}",
        &format!(r#"{{"class":"A","args":["{long}"]}}"#),
    )
    .unwrap();
    assert_eq!(id, format!("h:{}", canonical::sha256_hex(long.as_bytes())));
    // T-6: a missing path is an error naming template and path; so is an empty id.
    let e = one(c, "u:{args[1]}", r#"{"class":"A","args":[1]}"#).unwrap_err();
    assert!(e.contains("u:{args[1]}") && e.contains("args[1]"), "{e}");
    assert!(one(c, "{args[0]}", r#"{"class":"A","args":[""]}"#).is_err());
    // Refused payloads: lone surrogate in args, not an object, no class, args not an array.
    for p in [
        r#"{"class":"A","args":["\ud800"]}"#,
        r#"[1]"#,
        r#"{"args":[]}"#,
        r#"{"class":"A","args":{}}"#,
        "{\"class\":\"A\",\"args\":[\"\u{1}\"]}",
    ] {
        assert_eq!(one(c, "{class}", p), Err("payload refused".into()), "{p}");
        assert!(Job::decode(p.as_bytes(), "q", 0).is_err(), "{p}");
    }
    // serde_json's depth limit for args: 127 levels read, 128 refused, on both sides.
    for (levels, ok) in [(127usize, true), (128, false)] {
        let p = format!(
            r#"{{"class":"A","args":{}{}}}"#,
            "[".repeat(levels),
            "]".repeat(levels)
        );
        assert_eq!(Job::decode(p.as_bytes(), "q", 0).is_ok(), ok, "{levels}");
        assert_eq!(one(c, "{class}", &p).is_ok(), ok, "{levels}");
    }
}

// The Lua SHA-256 against the sha2 crate, across the padding boundaries.
#[test]
fn lua_sha256_matches_known_vectors() {
    let redis = RedisServer::start();
    let mut conn = redis.sync_conn();
    let mut inputs: Vec<Vec<u8>> = vec![b"".to_vec(), b"abc".to_vec()];
    for n in [55, 56, 57, 63, 64, 65, 119, 120, 128, 1000] {
        inputs.push((0..n).map(|i| (i * 7 + 3) as u8).collect());
    }
    let script = format!(
        "{RENDER_LUA}\nlocal out = {{}}\nfor i = 1, #ARGV do out[i] = render_sha256(ARGV[i]) end\nreturn out"
    );
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(&script).arg(0);
    for i in &inputs {
        cmd.arg(i.as_slice());
    }
    let got: Vec<String> = cmd.query(&mut conn).unwrap();
    assert_eq!(
        got[1],
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    for (i, g) in inputs.iter().zip(got) {
        assert_eq!(
            g,
            canonical::lower_hex(&Sha256::digest(i)),
            "{} bytes",
            i.len()
        );
    }
}

// D-3a, T-2 (render_cjson.lua): a payload cjson would read otherwise than JSON is left to
// render.lua's own reader, and one cjson reads renders as Rust renders it.
#[test]
fn payloads_read_by_cjson_render_as_rust_does() {
    let redis = RedisServer::start();
    let mut conn = redis.sync_conn();
    let deep = format!(
        r#"{{"class":"A","args":[{}1{}]}}"#,
        "[".repeat(130),
        "]".repeat(130)
    );
    // (payload, whether cjson reads it)
    let cases: Vec<(String, bool)> = [
        (r#"{"class":"A","args":[12345]}"#, true),
        (
            r#"{"class":"A","args":[-7,"x y",{"id":42,"list":[1,[2]],"":"e"}],"queue":"q"}"#,
            true,
        ),
        (r#"{"class":"A","args":[-0,0,10,100]}"#, true),
        (r#"{"class":"A","args":[999999999999999]}"#, true),
        (r#"{"args":[1],"class":"A","args":[2]}"#, true),
        (r#"{"class":"A"}"#, true),
        (r#"{"class":"A","args":[1000000000000000]}"#, false),
        (r#"{"class":"A","args":[9007199254740993]}"#, false),
        (r#"{"class":"A","args":[01]}"#, false),
        (r#"{"class":"A","args":[-01]}"#, false),
        (r#"{"class":"A","args":[1,00]}"#, false),
        (r#"{"class":"A","args":[nan]}"#, false),
        (r#"{"class":"A","args":[inf]}"#, false),
        (r#"{"class":"A","args":[0x10]}"#, false),
        (r#"{"class":"A","args":[+1]}"#, false),
        (r#"{"class":"A","args":[1.]}"#, false),
        (r#"{"class":"A","args":[1.5]}"#, false),
        (r#"{"class":"A","args":[1e5]}"#, false),
        (r#"{"class":"A","args":[1-2]}"#, false),
        (r#"{"class":"A","args":[true,null]}"#, false),
        (r#"{"class":"A","args":null}"#, false),
        (r#"{"class":"A","args":[[]]}"#, false),
        (r#"{"class":"A","args":[{}]}"#, false),
        (r#"{"class":"A","args":[]}"#, false),
        (r#"{"class":"A","args":{"a":1}}"#, false),
        (r#"{"class": "A","args":[1]}"#, false),
        ("{\"class\":\"A\",\"args\":[\"a\\u00e9\"]}", false),
        ("{\"class\":\"A\",\"args\":[\"\u{e9}\"]}", false),
        ("{\"class\":\"A\",\"args\":[\"a\tb\"]}", false),
        ("{\"class\":\"A\",\"args\":[\"a\u{1}b\"]}", false),
        ("{\"class\":\"A\",\"args\":[\"a\u{7f}b\"]}", false),
        (r#"{"class":"A","args":[1]}x"#, false),
        (r#"{"class":"A","args":[1]"#, false),
        (r#"[1]"#, false),
        (r#"{"class":"","args":[1]}"#, false),
        (r#"{"class":1,"args":[1]}"#, false),
        (r#"{"class":"A","args":"x"}"#, false),
        (deep.as_str(), false),
    ]
    .iter()
    .map(|(p, c)| (p.to_string(), *c))
    .collect();
    let script = format!(
        "{RENDER_LUA}\nlocal out = {{}}\nfor i = 1, #ARGV do out[i] = render_cjson_payload(ARGV[i], 'q') and 1 or 0 end\nreturn out"
    );
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(&script).arg(0);
    for (p, _) in &cases {
        cmd.arg(p.as_str());
    }
    let read: Vec<i64> = cmd.query(&mut conn).expect("EVAL of render_cjson_payload");
    for ((p, want), got) in cases.iter().zip(&read) {
        assert_eq!(*got == 1, *want, "read by cjson: {p}");
    }
    let payloads: Vec<String> = cases.into_iter().map(|(p, _)| p).collect();
    let (rendered, _) = compare(&mut conn, &payloads);
    assert!(rendered >= 12, "only {rendered} payloads rendered");
}
