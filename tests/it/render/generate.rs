//! Payloads for the differential renderer test (tests/it/render.rs), written as Ruby resque,
//! node-resque and pyres write them: key order, spacing, extra members, numbers of every
//! spelling, strings with escapes and non-ASCII text, and some broken on purpose.

/// A deterministic xorshift64* generator.
pub(super) struct Rng(pub(super) u64);

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
pub(super) fn payload(rng: &mut Rng) -> String {
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
