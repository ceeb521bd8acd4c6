//! A minimal HTTP/1.1 client for range requests over one keep-alive `TcpStream`: what a
//! simulated device needs to fetch an artifact's blocks from a plain `http://` origin (the
//! coordinator's own `GET /artifacts/{sha256}` in `bench/fleet.sh`). The agent's client
//! (`agent/src/http_origin.rs`) does more (https, redirects, origins that ignore `Range`);
//! here only `206 Partial Content` with the exact range asked for is taken, and anything else
//! is an error naming the status or what was wrong. The body is not trusted: the caller checks
//! every block ([`crate::artifact_check`]).

use flotilla_protocol::origin::OriginUrl;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Most bytes a response head may take.
pub const MAX_HEAD: usize = 16 * 1024;

/// Why a range request failed; every variant names the URL.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("origin {url}: {reason}")]
    Refused { url: String, reason: String },
    #[error("origin {url}: cannot connect: {source}")]
    Connect { url: String, source: std::io::Error },
    #[error("origin {url}: the connection failed: {source}")]
    Io { url: String, source: std::io::Error },
    #[error("origin {url}: answered {status} to the range bytes={first}-{last}")]
    Status {
        url: String,
        status: u16,
        first: u64,
        last: u64,
    },
    #[error("origin {url}: {reason}")]
    BadResponse { url: String, reason: String },
}

/// What a response head says that matters here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub status: u16,
    pub content_length: Option<u64>,
    /// `Content-Range: bytes first-last/total`: (first, last), inclusive.
    pub content_range: Option<(u64, u64)>,
    /// The server said `Connection: close`.
    pub close: bool,
}

/// Parses a response head (status line and headers, without the blank line).
pub fn parse_head(text: &str) -> Result<Head, String> {
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(format!("not an HTTP/1 status line: {status_line:.80?}"));
    }
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("no status code in {status_line:.80?}"))?;
    let mut head = Head {
        status,
        content_length: None,
        content_range: None,
        close: false,
    };
    for line in lines.filter(|l| !l.is_empty()) {
        let Some((name, value)) = line.split_once(':') else {
            return Err(format!("a header line without a colon: {line:.80?}"));
        };
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => {
                let n = value
                    .parse()
                    .map_err(|_| format!("Content-Length {value:.40?} is not a number"))?;
                head.content_length = Some(n);
            }
            "content-range" => {
                let range = value
                    .strip_prefix("bytes ")
                    .and_then(|r| r.split_once('/'))
                    .and_then(|(range, _total)| range.split_once('-'))
                    .and_then(|(a, b)| Some((a.trim().parse().ok()?, b.trim().parse().ok()?)))
                    .filter(|(a, b)| a <= b)
                    .ok_or_else(|| {
                        format!("Content-Range {value:.80?} is not bytes first-last/total")
                    })?;
                head.content_range = Some(range);
            }
            "connection" => head.close = value.eq_ignore_ascii_case("close"),
            "transfer-encoding" => {
                return Err(format!("Transfer-Encoding {value:.40?} is not spoken here"))
            }
            _ => {}
        }
    }
    Ok(head)
}

/// Checks a head answers the range `first..=last` exactly; returns the body's length.
pub fn check_range(head: &Head, first: u64, last: u64) -> Result<u64, RangeError> {
    if head.status != 206 {
        return Err(RangeError::Status(head.status));
    }
    let want = last - first + 1;
    match (head.content_range, head.content_length) {
        (Some((a, b)), Some(len)) if (a, b) == (first, last) && len == want => Ok(want),
        (range, len) => Err(RangeError::Mismatch(format!(
            "asked bytes={first}-{last}, answered Content-Range {range:?} Content-Length {len:?}"
        ))),
    }
}

/// Why a head does not answer the range asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RangeError {
    Status(u16),
    Mismatch(String),
}

/// One keep-alive connection to one origin URL.
pub struct RangeClient {
    url: String,
    origin: OriginUrl,
    stream: Option<BufReader<TcpStream>>,
}

impl RangeClient {
    /// Checks the URL (plain `http` only); connects on the first request.
    pub fn new(url: &str) -> Result<RangeClient, HttpError> {
        let origin = OriginUrl::parse(url).map_err(|e| HttpError::Refused {
            url: url.to_owned(),
            reason: e.to_string(),
        })?;
        if origin.https {
            return Err(HttpError::Refused {
                url: url.to_owned(),
                reason: "https is not spoken by the simulator; give an http:// origin".into(),
            });
        }
        Ok(RangeClient {
            url: url.to_owned(),
            origin,
            stream: None,
        })
    }

    /// The bytes `offset..offset + length` (`length` > 0), exactly, or an error.
    pub async fn get(&mut self, offset: u64, length: u64) -> Result<Vec<u8>, HttpError> {
        let (first, last) = (offset, offset + length.max(1) - 1);
        let url = self.url.clone();
        let io = |source| HttpError::Io {
            url: url.clone(),
            source,
        };
        if self.stream.is_none() {
            let addr = (self.origin.host.as_str(), self.origin.port);
            let tcp = TcpStream::connect(addr)
                .await
                .map_err(|source| HttpError::Connect {
                    url: self.url.clone(),
                    source,
                })?;
            let _ = tcp.set_nodelay(true);
            self.stream = Some(BufReader::new(tcp));
        }
        let Some(stream) = self.stream.as_mut() else {
            return Err(self.bad("no connection"));
        };
        let request = format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\nRange: bytes={first}-{last}\r\nUser-Agent: flotilla-fleetsim\r\n\r\n",
            self.origin.path, self.origin.host
        );
        let result = async {
            stream.get_mut().write_all(request.as_bytes()).await?;
            let mut head = String::new();
            loop {
                let before = head.len();
                let n = stream.read_line(&mut head).await?;
                if n == 0 {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "closed before the end of the response head",
                    ));
                }
                if head.len() > MAX_HEAD {
                    return Err(std::io::Error::other("response head over 16 KiB"));
                }
                if head[before..].trim_end().is_empty() {
                    break;
                }
            }
            Ok(head)
        }
        .await;
        let head = match result {
            Ok(h) => h,
            Err(e) => {
                self.stream = None;
                return Err(io(e));
            }
        };
        let head = match parse_head(head.trim_end()) {
            Ok(head) => head,
            Err(reason) => {
                self.stream = None;
                return Err(self.bad(&reason));
            }
        };
        let len = match check_range(&head, first, last) {
            Ok(len) => len,
            Err(e) => {
                // The body of a refusal is not read: start afresh next time.
                self.stream = None;
                return Err(match e {
                    RangeError::Status(status) => HttpError::Status {
                        url: self.url.clone(),
                        status,
                        first,
                        last,
                    },
                    RangeError::Mismatch(reason) => self.bad(&reason),
                });
            }
        };
        let mut body = vec![0u8; len as usize];
        if let Some(stream) = self.stream.as_mut() {
            if let Err(e) = stream.read_exact(&mut body).await {
                self.stream = None;
                return Err(io(e));
            }
        }
        if head.close {
            self.stream = None;
        }
        Ok(body)
    }

    fn bad(&self, reason: &str) -> HttpError {
        HttpError::BadResponse {
            url: self.url.clone(),
            reason: reason.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_reply_is_parsed_and_checked_against_the_range_asked() {
        let head = parse_head(
            "HTTP/1.1 206 Partial Content\r\ncontent-type: application/octet-stream\r\n\
             Content-Range: bytes 65536-131071/262144\r\ncontent-length: 65536",
        )
        .expect("parses");
        assert_eq!(
            head,
            Head {
                status: 206,
                content_length: Some(65536),
                content_range: Some((65536, 131_071)),
                close: false,
            }
        );
        assert_eq!(check_range(&head, 65536, 131_071), Ok(65536));
        // Another range than the one asked, a 200 (Range ignored), a 404: refused.
        assert!(matches!(
            check_range(&head, 0, 65535),
            Err(RangeError::Mismatch(_))
        ));
        let whole = parse_head("HTTP/1.1 200 OK\r\nContent-Length: 262144").expect("parses");
        assert_eq!(check_range(&whole, 0, 65535), Err(RangeError::Status(200)));
        let closing = parse_head("HTTP/1.0 404 Not Found\r\nConnection: close").expect("parses");
        assert!(closing.close);
        assert_eq!(check_range(&closing, 0, 9), Err(RangeError::Status(404)));
    }

    #[test]
    fn malformed_heads_are_refused_saying_why() {
        for (head, says) in [
            ("SSH-2.0-OpenSSH", "not an HTTP/1 status line"),
            ("HTTP/1.1 abc OK", "no status code"),
            ("HTTP/1.1 206 OK\r\nContent-Length: many", "Content-Length"),
            (
                "HTTP/1.1 206 OK\r\nContent-Range: bytes 9-2/10",
                "Content-Range",
            ),
            ("HTTP/1.1 206 OK\r\nno colon here", "without a colon"),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked",
                "Transfer-Encoding",
            ),
        ] {
            let err = parse_head(head).expect_err(head);
            assert!(err.contains(says), "{head}: {err}");
        }
    }

    #[tokio::test]
    async fn fetches_a_range_from_a_server_over_one_connection() {
        use tokio::io::AsyncWriteExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binds");
        let port = listener.local_addr().expect("addr").port();
        let server = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.expect("accepts");
            let mut socket = BufReader::new(socket);
            let mut ranges = Vec::new();
            for _ in 0..2 {
                let mut range = String::new();
                loop {
                    let mut line = String::new();
                    socket.read_line(&mut line).await.expect("reads");
                    if let Some(r) = line.strip_prefix("Range: bytes=") {
                        range = r.trim().to_owned();
                    }
                    if line == "\r\n" {
                        break;
                    }
                }
                let (a, b) = range.split_once('-').expect("a range");
                let (a, b): (u64, u64) = (a.parse().expect("a"), b.parse().expect("b"));
                let body: Vec<u8> = (a..=b).map(|i| i as u8).collect();
                let head = format!(
                    "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/1000\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                );
                socket
                    .get_mut()
                    .write_all(head.as_bytes())
                    .await
                    .expect("writes");
                socket.get_mut().write_all(&body).await.expect("writes");
                ranges.push(range);
            }
            ranges
        });
        let mut client =
            RangeClient::new(&format!("http://127.0.0.1:{port}/artifacts/x")).expect("a URL");
        let first = client.get(0, 10).await.expect("first range");
        assert_eq!(first, (0..10u8).collect::<Vec<_>>());
        let second = client
            .get(300, 4)
            .await
            .expect("second range, same connection");
        assert_eq!(second, vec![44, 45, 46, 47]);
        assert_eq!(server.await.expect("server"), ["0-9", "300-303"]);
        assert!(RangeClient::new("https://example.com/a").is_err());
        assert!(RangeClient::new("ftp://example.com/a").is_err());
    }
}
