//! Which `Host` the HTTP listener answers for (issue 23): a DNS-rebinding page in an
//! operator's browser reaches the listener under the attacker's name, so the listener answers
//! only for names it knows and refuses the rest before reading anything.
//!
//! A request's host (its `Host`, or an `Origin`'s authority) is allowed when it is
//!
//! - `localhost`, `127.0.0.1` or `[::1]`, on any port (an SSH tunnel's local port differs from
//!   the listener's);
//! - an IP address equal to the connection's local address (the address the client reached:
//!   the bound one, or on a listener bound to `0.0.0.0`/`[::]` the interface's), on any port.
//!   Other addresses of the machine are not guessed: a listener behind NAT or a container's
//!   port mapping is reached under an address it does not have, which goes in the list;
//! - the machine's host name (gethostname(2), not resolved to an FQDN), on any port;
//! - a name of `http_allowed_hosts`: an entry without a port matches the name on any port, one
//!   with a port only that port (a `Host` without a port is port 80).
//!
//! An attacker can point a name of its own at the listener, but cannot make the browser send
//! any of these for it: a browser sends the name of the page's origin.

use std::net::{IpAddr, Ipv6Addr};

/// A parsed `host[:port]`: a `Host` value, an `Origin`'s authority or an entry of
/// `http_allowed_hosts`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    /// The name, lowercased and without a trailing dot, or an address.
    pub name: Name,
    /// The port, if given.
    pub port: Option<u16>,
}

/// A host: an IP address or a DNS name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Name {
    /// An IPv4 or IPv6 address (IPv4-mapped IPv6 addresses read as IPv4).
    Ip(IpAddr),
    /// A DNS name, lowercased, without a trailing dot.
    Dns(String),
}

impl HostPort {
    /// Reads `host`, `host:port`, `[v6]` or `[v6]:port` (and a bare IPv6 address, without a
    /// port). Refuses anything else: a scheme, a path, user info, wildcards, spaces, an empty
    /// or out-of-range port, a label that is empty or has characters DNS names do not.
    pub fn parse(s: &str) -> Result<HostPort, String> {
        if s.is_empty() {
            return Err("empty".into());
        }
        if let Some(rest) = s.strip_prefix('[') {
            let (inside, after) = rest
                .split_once(']')
                .ok_or_else(|| format!("{s:?}: no closing ]"))?;
            let ip: Ipv6Addr = inside
                .parse()
                .map_err(|_| format!("{s:?}: not an IPv6 address in brackets"))?;
            let port = match after {
                "" => None,
                p => Some(port(s, p.strip_prefix(':').ok_or_else(|| garbage(s))?)?),
            };
            return Ok(HostPort {
                name: Name::Ip(canonical(IpAddr::V6(ip))),
                port,
            });
        }
        if let Ok(ip) = s.parse::<Ipv6Addr>() {
            return Ok(HostPort {
                name: Name::Ip(canonical(IpAddr::V6(ip))),
                port: None,
            });
        }
        let (name, port) = match s.split_once(':') {
            Some((n, p)) => (n, Some(port(s, p)?)),
            None => (s, None),
        };
        let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
        if let Ok(ip) = name.parse::<IpAddr>() {
            return Ok(HostPort {
                name: Name::Ip(canonical(ip)),
                port,
            });
        }
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if name.len() > 253 || !name.split('.').all(label_ok) {
            return Err(garbage(s));
        }
        Ok(HostPort {
            name: Name::Dns(name),
            port,
        })
    }

    /// An `Origin` header's host: `http://host[:port]` or `https://...` (a missing port is
    /// the scheme's). None for `null`, another scheme, or anything unreadable.
    pub fn from_origin(origin: &str) -> Option<HostPort> {
        let origin = origin.trim();
        let lower = origin.to_ascii_lowercase();
        let (rest, default) = if lower.starts_with("http://") {
            (&origin["http://".len()..], 80)
        } else if lower.starts_with("https://") {
            (&origin["https://".len()..], 443)
        } else {
            return None;
        };
        let mut h = HostPort::parse(rest.strip_suffix('/').unwrap_or(rest)).ok()?;
        h.port.get_or_insert(default);
        Some(h)
    }

    /// Whether the listener answers for this host on a connection that reached `local`, on a
    /// machine called `hostname`, with `allowed` (the parsed `http_allowed_hosts`).
    pub fn is_allowed(&self, local: IpAddr, hostname: Option<&str>, allowed: &[HostPort]) -> bool {
        let own = match &self.name {
            Name::Ip(ip) => {
                *ip == IpAddr::from([127, 0, 0, 1])
                    || *ip == IpAddr::V6(Ipv6Addr::LOCALHOST)
                    || *ip == canonical(local)
            }
            Name::Dns(n) => n == "localhost" || hostname.is_some_and(|h| h.eq_ignore_ascii_case(n)),
        };
        own || allowed
            .iter()
            .any(|a| a.name == self.name && a.port.is_none_or(|p| p == self.port.unwrap_or(80)))
    }
}

/// The entries of `http_allowed_hosts` that parse (the config check refuses the others).
pub fn parse_list(list: &[String]) -> Vec<HostPort> {
    list.iter()
        .filter_map(|e| HostPort::parse(e.trim()).ok())
        .collect()
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

fn garbage(s: &str) -> String {
    format!("{s:?} is not a host name or address with an optional :port")
}

fn port(s: &str, p: &str) -> Result<u16, String> {
    if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
        return Err(garbage(s));
    }
    p.parse().map_err(|_| format!("{s:?}: port out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(s: &str) -> HostPort {
        HostPort::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn hosts_parse_with_and_without_ports() {
        assert_eq!(
            hp("Metrics.Example.:9100"),
            HostPort {
                name: Name::Dns("metrics.example".into()),
                port: Some(9100)
            }
        );
        assert_eq!(hp("[::1]:80").name, Name::Ip("::1".parse().unwrap()));
        assert_eq!(hp("::1").port, None);
        assert_eq!(hp("[::ffff:10.0.0.1]").name, hp("10.0.0.1").name);
        assert_eq!(hp("web_1").port, None);
        for bad in [
            "",
            "http://x",
            "x/y",
            "a@b",
            "*.example",
            "a b",
            "x:",
            "x:99999",
            "x:-1",
            "a..b",
            "[::1",
            "[x]:1",
            "[::1]x",
            "x:1:2",
        ] {
            assert!(HostPort::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn only_own_names_and_the_list_are_allowed() {
        let local: IpAddr = "10.1.2.3".parse().unwrap();
        let list = parse_list(&["metrics.example".into(), "pinned.example:9100".into()]);
        let ok = |h: &str| hp(h).is_allowed(local, Some("Box1"), &list);
        for yes in [
            "localhost",
            "localhost:1234",
            "LOCALHOST.",
            "127.0.0.1:9",
            "[::1]:9",
            "10.1.2.3:9187",
            "[::ffff:10.1.2.3]",
            "box1:9187",
            "metrics.example:1",
            "pinned.example:9100",
        ] {
            assert!(ok(yes), "{yes} refused");
        }
        for no in [
            "evil.example",
            "evil.example:9187",
            "127.0.0.2",
            "10.1.2.4",
            "box1.evil.example",
            "localhost.evil.example",
            "pinned.example",
            "pinned.example:9101",
        ] {
            assert!(!ok(no), "{no} allowed");
        }
        // Bound to loopback: the local address is loopback; another loopback address too.
        assert!(hp("127.0.0.2:1").is_allowed("127.0.0.2".parse().unwrap(), None, &[]));
    }

    #[test]
    fn origins_read_their_authority() {
        assert_eq!(
            HostPort::from_origin("http://localhost:9187"),
            Some(hp("localhost:9187"))
        );
        assert_eq!(
            HostPort::from_origin("HTTPS://Pinned.Example"),
            Some(hp("pinned.example:443"))
        );
        assert_eq!(HostPort::from_origin("null"), None);
        assert_eq!(HostPort::from_origin("file://x"), None);
        assert_eq!(HostPort::from_origin("http://a@b"), None);
    }
}
