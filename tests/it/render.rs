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

/// A deterministic xorshift64* generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

/// Whitespace between tokens: none mostly, pyres's single spaces, or anything JSON allows.
fn ws(rng: &mut Rng, style: usize) -> &'static str {
    match style {
        0 => "",
        1 => " ",
        _ => ["", " ", "\n", "\t", "  ", "\r\n "][rng.below(6)],
    }
}

fn number(rng: &mut Rng) -> String {
    const FIXED: &[&str] = &[
        "0",
        "1",
        "-1",
        "1.0",
        "1.50",
        "1e2",
        "1E+2",
        "1.0e2",
        "-0",
        "-0.0",
        "0.0",
        "0e0",
        "2.5",
        "0.1",
        "1e300",
        "-1.5e-7",
        "0.00001",
        "0.000001",
        "1e16",
        "1e20",
        "1e21",
        "9007199254740992",
        "9007199254740993",
        "9007199254740992.0",
        "9007199254740994.0",
        "18014398509481984.0",
        "-9007199254740992.0",
        "1394865425023536.25",
        "123456789012345678901234567890",
        "-123456789012345678901234567890",
        "18446744073709551616",
        "1e400",
        "-1E400",
        "1E+400",
        "2.5e999",
        "1e-400",
        "5e-324",
        "1.7976931348623157e308",
        "3.141592653589793238",
        "1000000000000000.5",
        "123.456",
        "4.9406564584124654e-324",
        "2.2250738585072014e-308",
        "1e-7",
        "100.0e-2",
    ];
    match rng.below(6) {
        0 | 1 => rng.pick(FIXED).to_string(),
        2 => format!("{}", rng.next() as i64 >> rng.below(60)),
        3 => {
            // Any finite double, in one of the spellings producers use.
            let x = loop {
                let x = f64::from_bits(rng.next());
                if x.is_finite() {
                    break x;
                }
            };
            match rng.below(3) {
                0 => format!("{x:e}"),
                1 => format!("{x:?}"),
                _ => format!("{x:.17e}"),
            }
        }
        4 => {
            // Powers of two: where the interval of texts that read back is lopsided.
            let k = rng.below(2098) as i32 - 1074;
            let x = 2f64.powi(k) * if rng.chance(50) { 1.0 } else { -1.0 };
            if x == 0.0 || !x.is_finite() {
                "0.5".to_string()
            } else {
                format!("{x:.16e}")
            }
        }
        _ => {
            let int = rng.below(100_000);
            let frac = rng.below(1000);
            format!("{int}.{frac:03}e{}", rng.below(40) as i32 - 20)
        }
    }
}

fn string(rng: &mut Rng, valid: bool) -> String {
    const PIECES: &[&str] = &[
        "a",
        "id",
        "user id",
        " ",
        "é",
        "ü",
        "😀",
        "ｱ",
        "日本",
        "\\u00e9",
        "\\ud83d\\ude00",
        "\\n",
        "\\t",
        "\\\"",
        "\\\\",
        "\\/",
        "\\u0000",
        "\\u001f",
        "\u{7f}",
        "\\b",
        "\\f",
        "\\r",
        "\\u00E9",
        "x",
        "Z",
        "_",
        "0",
        "\\uFFFF",
        "\\u2028",
        "\u{10FFFF}",
        "a\\\"b",
        "é ü",
    ];
    let mut s = String::from("\"");
    for _ in 0..rng.below(5) {
        s.push_str(rng.pick(PIECES));
    }
    if !valid {
        s.push_str(rng.pick(&["\\ud800", "\\udc00x", "\u{1}", "\\x", "\\u12"]));
    }
    s.push('"');
    s
}

const NAMES: &[&str] = &[
    "\"id\"",
    "\"account\"",
    "\"user id\"",
    "\"é ü\"",
    "\"a\\\"b\"",
    "\"\"",
    "\"list\"",
    "\"_x9\"",
    "\"Z\"",
    "\"z\"",
    "\"é\"",
    "\"😀\"",
    "\"\\uff61\"",
    "\"a\"",
    "\"b\"",
];

fn value(rng: &mut Rng, depth: usize, style: usize) -> String {
    let pick = if depth >= 4 {
        rng.below(5)
    } else {
        rng.below(8)
    };
    match pick {
        0 => number(rng),
        1 => string(rng, true),
        2 => rng.pick(&["true", "false", "null"]).to_string(),
        3 | 4 => number(rng),
        5 => {
            let n = rng.below(4);
            let items: Vec<String> = (0..n).map(|_| value(rng, depth + 1, style)).collect();
            let sep = format!("{},{}", ws(rng, style), ws(rng, style));
            format!("[{}{}]", items.join(&sep), ws(rng, style))
        }
        _ => object(rng, depth, style),
    }
}

fn object(rng: &mut Rng, depth: usize, style: usize) -> String {
    let n = rng.below(5);
    let mut members = Vec::new();
    for _ in 0..n {
        let name = if rng.chance(85) {
            rng.pick(NAMES).to_string()
        } else {
            string(rng, true)
        };
        members.push(format!(
            "{name}{}:{}{}",
            ws(rng, style),
            ws(rng, style),
            value(rng, depth + 1, style)
        ));
    }
    let sep = format!("{},{}", ws(rng, style), ws(rng, style));
    format!("{{{}{}}}", members.join(&sep), ws(rng, style))
}

/// An args array shaped for the templates: an object with the members they name (often),
/// scalars and arrays after it.
fn args(rng: &mut Rng, style: usize) -> String {
    let mut items = Vec::new();
    let n = rng.below(5);
    for i in 0..n {
        let v = if i == 0 && rng.chance(60) {
            let mut members = vec![format!("\"id\":{}", value(rng, 3, style))];
            if rng.chance(50) {
                members.push(format!("\"account\":{{\"id\":{}}}", value(rng, 3, style)));
            }
            if rng.chance(40) {
                members.push(format!("\"user id\":{}", string(rng, true)));
            }
            if rng.chance(30) {
                members.push(format!("\"é ü\":{}", value(rng, 3, style)));
            }
            if rng.chance(30) {
                members.push(format!(
                    "\"list\":[[{}],{}]",
                    value(rng, 3, style),
                    value(rng, 2, style)
                ));
            }
            if rng.chance(20) {
                members.push(format!("\"a\\\"b\":{}", value(rng, 3, style)));
            }
            if rng.chance(20) {
                members.push(format!("\"\":{}", number(rng)));
            }
            if rng.chance(20) {
                // A repeated member: the last one wins.
                members.push(format!("\"id\":{}", value(rng, 3, style)));
            }
            // Producers write members in any order.
            for j in (1..members.len()).rev() {
                let k = rng.below(j + 1);
                members.swap(j, k);
            }
            format!("{{{}}}", members.join(&format!(",{}", ws(rng, style))))
        } else if i == 1 && rng.chance(30) {
            // A long string: ids past 200 bytes are hashed (T-5).
            format!("\"{}\"", "x".repeat(150 + rng.below(100)))
        } else {
            value(rng, 1, style)
        };
        items.push(v);
    }
    let sep = format!("{},{}", ws(rng, style), ws(rng, style));
    format!("[{}{}]", items.join(&sep), ws(rng, style))
}

/// A payload as one of the producers writes it, sometimes broken on purpose.
fn payload(rng: &mut Rng) -> String {
    let class = rng
        .pick(&[
            "\"Mailer::Send\"",
            "\"Webhook::Receive\"",
            "\"jobName\"",
            "\"módulo.Clase\"",
            "\"m\\u00f3dulo.Clase\"",
            "\"A\"",
        ])
        .to_string();
    let kind = rng.below(12);
    let style = match kind {
        0..=3 => 0, // Ruby resque, node-resque
        4..=6 => 1, // pyres (json.dumps: ", " and ": ")
        _ => 2,
    };
    let a = args(rng, style);
    let s = ws(rng, style);
    let p = match kind {
        0 | 1 => format!("{{\"class\":{class},\"args\":{a}}}"),
        2 | 3 => format!("{{\"class\":{class},\"queue\":\"q\",\"args\":{a}}}"),
        4 | 5 => format!(
            "{{\"class\": {class}, \"queue\": \"q\", \"args\": {a}, \"enqueue_timestamp\": 1700000000.123}}"
        ),
        6 => format!("{{\"args\": {a}, \"class\": {class}}}"),
        7 => format!(
            "{s}{{{s}\"meta\"{s}:{s}{}{s},\"class\":{class},{s}\"args\":{a}{s},\"id\":\"abc\"}}{s}",
            object(rng, 2, 2)
        ),
        8 => match rng.below(4) {
            0 => format!("{{\"class\":{class}}}"),
            1 => format!("{{\"class\":{class},\"args\":null}}"),
            2 => format!("{{\"class\":{class},\"args\":[1],\"class\":\"Other\",\"args\":{a}}}"),
            _ => format!("{{\"class\":{class},\"x\":\"\\ud800\",\"args\":{a}}}"),
        },
        9 => {
            let valid = rng.chance(50);
            format!(
                "{{\"class\":{class},\"args\":[{},{}]}}",
                string(rng, valid),
                value(rng, 1, 2)
            )
        }
        10 => {
            // Broken payloads: both renderers must refuse them.
            let good = format!("{{\"class\":{class},\"args\":{a}}}");
            match rng.below(12) {
                0 => good[..good.len() - 1].to_string(),
                1 => format!("{good},"),
                2 => good.replace("\"args\":[", "\"args\":[01,"),
                3 => "{\"args\":[1]}".to_string(),
                4 => format!("{{\"class\":1,\"args\":{a}}}"),
                5 => format!("{{\"class\":{class},\"args\":{{\"a\":1}}}}"),
                6 => format!("[{good}]"),
                7 => format!("{{\"class\":\"\",\"args\":{a}}}"),
                8 => good.replace("\"args\":[", "\"args\":[1.,"),
                9 => good.replace("\"args\":[", "\"args\":[-,"),
                10 => format!("{good} x"),
                _ => format!("\u{feff}{good}"),
            }
        }
        _ => format!(
            "{{\"class\":\"ActiveJob::QueueAdapters::ResqueAdapter::JobWrapper\",\"args\":[{{\"job_class\":\"HelloJob\",\"arguments\":{a},\"id\":{}}}]}}",
            value(rng, 2, 0)
        ),
    };
    p
}

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
