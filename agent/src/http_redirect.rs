//! Redirects from an HTTP(S) origin (decision 0064): which `Location` a block request may
//! follow, without I/O, so every rule is tested without a socket.
//!
//! ```text
//! start ── 301/302/303/307/308 + Location ──> hop 1 ──> hop 2 ──> hop 3 ──> (a 4th: refused)
//!           resolved against the URL that answered, checked like any location
//! ```
//!
//! - At most [`MAX_REDIRECTS`] hops per block request; a location already visited in the same
//!   chain is a loop. Either is a failure of the block, and the fetcher falls back as for any
//!   other failure (decision 0062).
//! - Only `http` and `https` URLs, checked by [`OriginUrl::parse`] as the coordinator checks a
//!   location (no other scheme, no credentials, nothing but visible ASCII); and never from
//!   `https` to `http`: a downgrade would let anyone on the path read and stall the download.
//! - Integrity does not depend on any of this: every block is still checked against the signed
//!   block list. These rules bound the time and the requests a hostile origin can cost.

use flotilla_protocol::origin::{OriginUrl, OriginUrlError};

/// Most redirects followed for one block request.
pub const MAX_REDIRECTS: usize = 3;

/// Whether `status` is a redirect this client follows.
pub fn is_redirect(status: u16) -> bool {
    matches!(status, 301 | 302 | 303 | 307 | 308)
}

/// Why a redirect was not followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RedirectError {
    #[error("the origin answered HTTP {status} without a Location")]
    NoLocation { status: u16 },
    #[error("more than {MAX_REDIRECTS} redirects (the last to {to})")]
    TooMany { to: String },
    #[error("a redirect loop: back to {to}")]
    Loop { to: String },
    #[error("a redirect from {from} to {to} is a downgrade from https to plain http: refused")]
    Downgrade { from: String, to: String },
    #[error("a redirect refused: {0}")]
    Refused(OriginUrlError),
}

/// The URLs one block request went through, the first one first.
#[derive(Debug, Clone)]
pub struct Redirects {
    chain: Vec<OriginUrl>,
}

impl Redirects {
    /// A request about to go to `start`.
    pub fn new(start: OriginUrl) -> Self {
        Redirects { chain: vec![start] }
    }

    /// Where the request goes now.
    pub fn current(&self) -> &OriginUrl {
        self.chain
            .last()
            .unwrap_or_else(|| unreachable!("never empty"))
    }

    /// Whether any redirect was followed.
    pub fn followed(&self) -> bool {
        self.chain.len() > 1
    }

    /// Follows a `status` answer carrying `location` (the header's value): the URL to ask next,
    /// or why not.
    pub fn follow(
        &mut self,
        status: u16,
        location: Option<&str>,
    ) -> Result<&OriginUrl, RedirectError> {
        let location = location.ok_or(RedirectError::NoLocation { status })?;
        let from = self.current();
        let next = resolve(from, location).map_err(RedirectError::Refused)?;
        if from.https && !next.https {
            return Err(RedirectError::Downgrade {
                from: url_text(from),
                to: url_text(&next),
            });
        }
        if self.chain.contains(&next) {
            return Err(RedirectError::Loop {
                to: url_text(&next),
            });
        }
        if self.chain.len() > MAX_REDIRECTS {
            return Err(RedirectError::TooMany {
                to: url_text(&next),
            });
        }
        self.chain.push(next);
        Ok(self.current())
    }
}

/// `url` written out again (its fragment is gone, its default port left out).
pub fn url_text(url: &OriginUrl) -> String {
    let scheme = if url.https { "https" } else { "http" };
    format!("{scheme}://{}{}", url.host_header(), url.path)
}

/// Resolves a `Location` value against the URL that answered: an absolute URL, one without a
/// scheme (`//host/path`), an absolute path, a query, or a path relative to the answering
/// URL's directory. The result is checked by [`OriginUrl::parse`], so another scheme, a
/// user name or a control character is refused naming the URL.
pub fn resolve(base: &OriginUrl, location: &str) -> Result<OriginUrl, OriginUrlError> {
    let scheme = if base.https { "https:" } else { "http:" };
    let origin = format!("{scheme}//{}", base.host_header());
    let base_path = base.path.split('?').next().unwrap_or("/");
    let text = if location.contains("://") {
        location.to_owned()
    } else if location.starts_with("//") {
        format!("{scheme}{location}")
    } else if location.starts_with('/') {
        format!("{origin}{location}")
    } else if location.starts_with('?') {
        format!("{origin}{base_path}{location}")
    } else {
        let dir = &base_path[..base_path.rfind('/').map_or(0, |i| i + 1)];
        let dir = if dir.is_empty() { "/" } else { dir };
        format!("{origin}{dir}{location}")
    };
    OriginUrl::parse(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> OriginUrl {
        OriginUrl::parse(text).expect("a valid URL")
    }

    #[test]
    fn locations_resolve_against_the_url_that_answered() {
        let base = url("https://cdn.example.com:8443/fw/app.bin?sig=1");
        for (location, expected) in [
            (
                "https://store.example.net/b/app.bin",
                "https://store.example.net/b/app.bin",
            ),
            (
                "//mirror.example.org/app.bin",
                "https://mirror.example.org/app.bin",
            ),
            (
                "/other/app.bin",
                "https://cdn.example.com:8443/other/app.bin",
            ),
            ("?sig=2", "https://cdn.example.com:8443/fw/app.bin?sig=2"),
            ("app-2.bin", "https://cdn.example.com:8443/fw/app-2.bin"),
        ] {
            assert_eq!(
                resolve(&base, location).map(|u| url_text(&u)),
                Ok(expected.to_owned()),
                "{location}"
            );
        }
    }

    #[test]
    fn up_to_three_redirects_are_followed_then_refused() {
        let mut hops = Redirects::new(url("http://a.example/x"));
        assert!(!hops.followed());
        for n in 1..=MAX_REDIRECTS {
            let next = hops
                .follow(302, Some(&format!("http://a.example/x{n}")))
                .expect("followed");
            assert_eq!(next.path, format!("/x{n}"));
        }
        assert!(hops.followed());
        let err = hops
            .follow(301, Some("http://a.example/x4"))
            .expect_err("a fourth redirect");
        assert_eq!(
            err.to_string(),
            "more than 3 redirects (the last to http://a.example/x4)"
        );
        assert_eq!(hops.current().path, "/x3", "the refused hop is not taken");
    }

    #[test]
    fn a_loop_is_refused_naming_where_it_leads_back() {
        let mut hops = Redirects::new(url("http://a.example/x"));
        hops.follow(307, Some("/y")).expect("to /y");
        let err = hops.follow(308, Some("/x")).expect_err("back to /x");
        assert_eq!(
            err,
            RedirectError::Loop {
                to: "http://a.example/x".to_owned()
            }
        );
        // A URL redirecting to itself is a loop at once.
        let mut hops = Redirects::new(url("http://a.example/x"));
        assert!(matches!(
            hops.follow(302, Some("http://a.example/x")),
            Err(RedirectError::Loop { .. })
        ));
    }

    #[test]
    fn a_downgrade_to_plain_http_and_other_schemes_are_refused_by_name() {
        let mut hops = Redirects::new(url("https://cdn.example.com/app.bin"));
        let err = hops
            .follow(302, Some("http://cdn.example.com/app.bin"))
            .expect_err("a downgrade");
        assert!(
            err.to_string()
                .contains("downgrade from https to plain http"),
            "{err}"
        );
        for location in [
            "file:///etc/passwd",
            "ftp://cdn.example.com/app.bin",
            "https://user:pw@cdn.example.com/app.bin",
            "/app.bin\r\nX-Injected: 1",
        ] {
            let err = hops.follow(302, Some(location)).expect_err(location);
            assert!(
                matches!(err, RedirectError::Refused(_)),
                "{location}: {err}"
            );
        }
        let err = hops.follow(303, None).expect_err("no Location");
        assert_eq!(
            err.to_string(),
            "the origin answered HTTP 303 without a Location"
        );
        // http -> https is an upgrade, and followed.
        let mut hops = Redirects::new(url("http://cdn.example.com/app.bin"));
        assert!(hops
            .follow(301, Some("https://cdn.example.com/app.bin"))
            .is_ok());
    }

    #[test]
    fn only_the_five_redirect_statuses_are_followed() {
        let followed: Vec<u16> = (100..600).filter(|s| is_redirect(*s)).collect();
        assert_eq!(followed, [301, 302, 303, 307, 308]);
    }
}
