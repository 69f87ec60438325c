//! Redis URLs as the daemon shows them: with every password hidden.

/// A Redis URL with any password replaced by `***`: the user-info's (`redis://user:pw@host`)
/// and a socket URL's `pass` parameter (`redis+unix:///run/redis.sock?pass=pw`).
///
/// Written for passwords that are not URL-safe, since users paste them raw: the user-info
/// ends at the last `@` of a TCP URL (so a `?`, `#`, `/` or `@` inside the password stays
/// hidden), and in a socket URL's query everything after `pass=` up to the next known
/// parameter (`db`, `user`, `username`, `protocol`) is the password, `&` included. Only a
/// final `#insecure` is kept as a fragment.
pub fn redact(url: &str) -> String {
    const KNOWN: [&str; 4] = ["db", "user", "username", "protocol"];
    let Some(s) = url.find("://") else {
        return url.to_string();
    };
    let (scheme, rest) = url.split_at(s + 3);
    let mut out = scheme.to_string();
    let unix = scheme.contains("unix");
    let tail = match rest.rfind('@').filter(|_| !unix) {
        Some(at) => {
            let creds = &rest[..at];
            match creds.find(':') {
                Some(c) => {
                    out.push_str(&creds[..c]);
                    out.push_str(":***");
                }
                None => out.push_str("***"),
            }
            &rest[at..]
        }
        None => rest,
    };
    let (tail, fragment) = match tail.strip_suffix("#insecure") {
        Some(t) => (t, "#insecure"),
        None => (tail, ""),
    };
    let Some((path, query)) = tail.split_once('?') else {
        out.push_str(tail);
        out.push_str(fragment);
        return out;
    };
    out.push_str(path);
    let mut params: Vec<String> = Vec::new();
    let mut in_password = false;
    for p in query.split('&') {
        let key = p.split_once('=').map_or(p, |(k, _)| k);
        if key == "pass" || key == "password" {
            params.push(format!("{key}=***"));
            in_password = true;
        } else if in_password && !KNOWN.contains(&key) {
            // An `&` inside the password: still the password.
        } else {
            in_password = false;
            params.push(p.to_string());
        }
    }
    out.push('?');
    out.push_str(&params.join("&"));
    out.push_str(fragment);
    out
}

#[cfg(test)]
mod tests {
    use super::redact;

    // Redis URLs are logged and shown by `status`: no form of password may get through.
    #[test]
    fn redact_hides_every_form_of_password() {
        assert_eq!(
            redact("redis://user:pw@h:6379/0"),
            "redis://user:***@h:6379/0"
        );
        assert_eq!(redact("redis://:pw@h/0"), "redis://:***@h/0");
        assert_eq!(redact("rediss://pw@h/0"), "rediss://***@h/0");
        assert_eq!(
            redact("redis+unix:///run/r.sock?db=1&pass=pw"),
            "redis+unix:///run/r.sock?db=1&pass=***"
        );
        assert_eq!(
            redact("unix:///run/r.sock?user=u&password=pw"),
            "unix:///run/r.sock?user=u&password=***"
        );
        assert_eq!(redact("redis://h:6379/0"), "redis://h:6379/0");
        assert_eq!(
            redact("redis+sentinel://:pw@h1:26379,h2:26379/mymaster/0"),
            "redis+sentinel://:***@h1:26379,h2:26379/mymaster/0"
        );
    }

    // Issue 11, finding 9: passwords that are not URL-safe, as users paste them.
    #[test]
    fn redact_hides_passwords_that_are_not_url_safe() {
        for (url, want) in [
            ("redis://:se?cr@t@h:6379/0", "redis://:***@h:6379/0"),
            ("redis://u:a/b#c?d@h/0", "redis://u:***@h/0"),
            (
                "rediss://:p%40ss@h/0#insecure",
                "rediss://:***@h/0#insecure",
            ),
            (
                "rediss://:p#ss@h/0?protocol=resp3",
                "rediss://:***@h/0?protocol=resp3",
            ),
            (
                "redis+unix:///run/r.sock?pass=ab&cd&db=1",
                "redis+unix:///run/r.sock?pass=***&db=1",
            ),
            (
                "redis+unix:///run/r.sock?db=2&password=x@y?z=w",
                "redis+unix:///run/r.sock?db=2&password=***",
            ),
            ("unix:///run/r.sock?pass=a#b", "unix:///run/r.sock?pass=***"),
        ] {
            let got = redact(url);
            assert_eq!(got, want, "{url}");
            for secret in ["se?cr", "a/b", "p%40ss", "p#ss", "cd", "x@y", "a#b"] {
                if url.contains(secret) {
                    assert!(!got.contains(secret), "{url} -> {got}");
                }
            }
        }
    }
}
