//! HTTP(S) origins: where else than the coordinator a device may fetch an artifact's bytes
//! (a CDN, an object store's public or presigned URL, a plain web server; decision 0062).
//!
//! A location is not part of the signed release manifest: locations change, and every block a
//! device fetches from one is checked against the block list the release key signed, so the
//! source of the bytes does not matter to trust. The coordinator names the locations in the
//! desired action it signs (`ActionBody::InstallFromOrigins`); the agent speaks only
//! `http` and `https` to them ([`OriginUrl::parse`]) and treats every byte as untrusted.
//!
//! ```
//! use flotilla_protocol::origin::OriginUrl;
//! let url = OriginUrl::parse("https://cdn.example.com/fw/app-2.4.bin").unwrap();
//! assert_eq!((url.host.as_str(), url.port, url.path.as_str()), ("cdn.example.com", 443, "/fw/app-2.4.bin"));
//! assert!(OriginUrl::parse("file:///etc/shadow").is_err());
//! ```

use serde::{Deserialize, Serialize};

/// Most bytes a location may have: a URL longer than this is refused, whoever sends it.
pub const MAX_URL_LEN: usize = 2048;

/// The name under which bytes from an HTTP origin are counted in `ByteCounts::peers`: not a valid device id (it has parentheses), so it
/// never collides with a peer, and an older coordinator shows it as one more source instead of
/// misreading the report.
pub const HTTP_SOURCE: &str = "(http)";

/// One artifact's HTTP(S) location, named by the artifact's digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// The artifact's sha256 (a `Digest`).
    pub sha256: [u8; 32],
    pub url: String,
}

/// An `http` or `https` URL, split for a client that speaks HTTP/1.1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OriginUrl {
    pub https: bool,
    /// Host name or IP address (an IPv6 address without its brackets).
    pub host: String,
    pub port: u16,
    /// Path and query, starting with `/`.
    pub path: String,
}

/// Why a location was refused; every variant names the URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OriginUrlError {
    #[error("location {url:?}: only http:// and https:// URLs are allowed")]
    Scheme { url: String },
    #[error("location {url:?}: longer than {MAX_URL_LEN} bytes")]
    TooLong { url: String },
    #[error("location {url:?}: {reason}")]
    Invalid { url: String, reason: &'static str },
}

impl OriginUrl {
    /// Parses and checks a location: `http` or `https` only, a host, an optional port, no
    /// user name or password, and nothing but visible ASCII (so nothing can be smuggled into
    /// the request line or the headers).
    pub fn parse(url: &str) -> Result<OriginUrl, OriginUrlError> {
        let invalid = |reason| OriginUrlError::Invalid {
            url: url.to_owned(),
            reason,
        };
        if url.len() > MAX_URL_LEN {
            return Err(OriginUrlError::TooLong {
                url: url.chars().take(64).collect(),
            });
        }
        let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
        let (https, rest) = if lower.starts_with("https://") {
            (true, &url[8..])
        } else if lower.starts_with("http://") {
            (false, &url[7..])
        } else {
            return Err(OriginUrlError::Scheme {
                url: url.to_owned(),
            });
        };
        if !url.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid(
                "has spaces, control characters or non-ASCII bytes (percent-encode them)",
            ));
        }
        let rest = rest.split('#').next().unwrap_or_default();
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) if rest.as_bytes()[i] == b'/' => (&rest[..i], rest[i..].to_owned()),
            Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
            None => (rest, "/".to_owned()),
        };
        if authority.contains('@') {
            return Err(invalid("has a user name or password, which is not sent"));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, after) = v6.split_once(']').ok_or_else(|| invalid("unclosed '['"))?;
            (host, after.strip_prefix(':'))
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(invalid("has no host"));
        }
        let port = match port {
            None => {
                if https {
                    443
                } else {
                    80
                }
            }
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| invalid("the port is not a number from 1 to 65535"))?,
        };
        Ok(OriginUrl {
            https,
            host: host.to_owned(),
            port,
            path,
        })
    }

    /// The `Host` header's value.
    pub fn host_header(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        match (self.https, self.port) {
            (true, 443) | (false, 80) => host,
            _ => format!("{host}:{}", self.port),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_and_https_urls_split_into_host_port_and_path() {
        let u = OriginUrl::parse("http://127.0.0.1:8080/a/b.bin?sig=x#frag").expect("valid");
        assert_eq!(
            u,
            OriginUrl {
                https: false,
                host: "127.0.0.1".into(),
                port: 8080,
                path: "/a/b.bin?sig=x".into()
            }
        );
        assert_eq!(u.host_header(), "127.0.0.1:8080");
        let u = OriginUrl::parse("HTTPS://[::1]/x").expect("valid");
        assert_eq!((u.https, u.host.as_str(), u.port), (true, "::1", 443));
        assert_eq!(u.host_header(), "[::1]");
        let u = OriginUrl::parse("http://cdn.example?x=1").expect("valid");
        assert_eq!(u.path, "/?x=1");
    }

    #[test]
    fn other_schemes_credentials_and_header_smuggling_are_refused_by_name() {
        for (url, says) in [
            ("file:///etc/passwd", "only http:// and https://"),
            ("gopher://x/", "only http:// and https://"),
            ("ftp://x/", "only http:// and https://"),
            ("http://u:p@host/x", "user name or password"),
            ("http://host/x\r\nX-Evil: 1", "control characters"),
            ("http:///x", "no host"),
            ("http://host:99999/x", "port"),
            ("http://host:0/x", "port"),
        ] {
            let e = OriginUrl::parse(url).expect_err(url).to_string();
            assert!(e.contains(says), "{url}: {e}");
        }
        let long = format!("http://h/{}", "a".repeat(MAX_URL_LEN));
        assert!(matches!(
            OriginUrl::parse(&long),
            Err(OriginUrlError::TooLong { .. })
        ));
    }
}
