//! The one escaping function of the web page: every text that reaches the HTML goes through
//! [`html`], in element content and in quoted attribute values alike.

/// `s` safe inside HTML text and inside a `"`- or `'`-quoted attribute value: `& < > " '`
/// become character references, and control characters other than tab and newline are
/// dropped (a NUL or an escape sequence in a queue name has no place in a page).
pub fn html(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + s.len() / 8);
    push_html(&mut out, s);
    out
}

/// [`html`], appended to `out`.
pub fn push_html(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            '\t' | '\n' => out.push(c),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::html;

    #[test]
    fn names_from_redis_cannot_open_a_tag_or_leave_an_attribute() {
        assert_eq!(
            html("<script>alert(1)</script>"),
            "&lt;script&gt;alert(1)&lt;/script&gt;"
        );
        assert_eq!(
            html(r#"q"uo'te" onmouseover="x"#),
            "q&quot;uo&#39;te&quot; onmouseover=&quot;x"
        );
        assert_eq!(html("a&amp;b"), "a&amp;amp;b");
        assert_eq!(html("nul\0esc\x1b[31m\u{7f}"), "nulesc[31m");
        assert_eq!(html("tab\tnl\n é ✓"), "tab\tnl\n é ✓");
        for bad in ["<", ">", "\"", "'"] {
            assert!(!html(&format!("x{bad}y")).contains(bad));
        }
    }
}
