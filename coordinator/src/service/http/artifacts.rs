//! `GET /artifacts/{sha256}`: the coordinator's artifact store over HTTP, with single byte
//! ranges, so one box needs no other server to be a release's HTTP origin (decision 0062):
//! `release locate fw-2 app http://coordinator:8443/artifacts/<sha256>`.
//!
//! No session is asked for: an artifact is named by its digest, which only someone who already
//! knows the release can name, and devices check every block against the signed block list
//! anyway. Only files named by 64 lower-case hex digits are served, from the artifacts
//! directory and nowhere else (no path is built from anything else the request says); block
//! lists are served the same way, being content-addressed too.

use std::io::SeekFrom;
use std::path::PathBuf;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use crate::service::http::state::Api;

/// The route, in axum's form.
pub const ROUTE: &str = "/artifacts/:sha256";

/// Bytes read from the file per chunk of the body: each read is a hop to tokio's blocking
/// pool, so a device asking for runs of a megabyte (decision 0068) costs 4 hops, not 16.
const CHUNK: usize = 256 * 1024;

/// The artifact route, added to `router`.
pub fn routes(router: Router<Api>) -> Router<Api> {
    router.route(ROUTE, get(artifact))
}

fn text(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

/// A `Range` that starts past the end of the file: answered `416 Range Not Satisfiable`.
#[derive(Debug, PartialEq, Eq)]
pub struct Unsatisfiable;

/// The byte range a `Range` header asks for within `size` bytes: `Ok(None)` for the whole
/// file (no header, or one this server does not take, such as several ranges, which it may
/// ignore), `Err(Unsatisfiable)` when the range starts past the end (416).
pub fn parse_range(value: Option<&str>, size: u64) -> Result<Option<(u64, u64)>, Unsatisfiable> {
    let Some(spec) = value.and_then(|v| v.trim().strip_prefix("bytes=")) else {
        return Ok(None);
    };
    if spec.contains(',') {
        return Ok(None);
    }
    let Some((a, b)) = spec.split_once('-') else {
        return Ok(None);
    };
    let (a, b) = (a.trim(), b.trim());
    let range = if a.is_empty() {
        // The last `b` bytes.
        let Ok(n) = b.parse::<u64>() else {
            return Ok(None);
        };
        if n == 0 || size == 0 {
            return Err(Unsatisfiable);
        }
        (size.saturating_sub(n), size - 1)
    } else {
        let Ok(start) = a.parse::<u64>() else {
            return Ok(None);
        };
        let end = if b.is_empty() {
            size.saturating_sub(1)
        } else {
            match b.parse::<u64>() {
                Ok(end) if end >= start => end.min(size.saturating_sub(1)),
                _ => return Ok(None),
            }
        };
        if start >= size {
            return Err(Unsatisfiable);
        }
        (start, end)
    };
    Ok(Some(range))
}

async fn artifact(
    State(api): State<Api>,
    Path(name): Path<String>,
    method: Method,
    headers: HeaderMap,
) -> Response {
    if name.len() != 64
        || !name
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return text(
            StatusCode::BAD_REQUEST,
            format!("{name:.80}: an artifact is named by its sha256, 64 lower-case hex digits\n"),
        );
    }
    let Some(dir) = &api.artifacts else {
        return text(
            StatusCode::NOT_FOUND,
            "this listener does not serve artifacts\n".to_owned(),
        );
    };
    let path: PathBuf = dir.join(&name);
    let mut file = match tokio::fs::File::open(&path).await {
        Ok(f) => f,
        Err(_) => {
            return text(
                StatusCode::NOT_FOUND,
                format!("no artifact {name} in this coordinator's store\n"),
            )
        }
    };
    let size = match file.metadata().await {
        Ok(m) if m.is_file() => m.len(),
        _ => {
            return text(
                StatusCode::NOT_FOUND,
                format!("no artifact {name} in this coordinator's store\n"),
            )
        }
    };
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let (status, start, end) = match parse_range(range.as_deref(), size) {
        Ok(Some((a, b))) => (StatusCode::PARTIAL_CONTENT, a, b),
        Ok(None) => (StatusCode::OK, 0, size.saturating_sub(1)),
        Err(Unsatisfiable) => {
            return (
                StatusCode::RANGE_NOT_SATISFIABLE,
                [(header::CONTENT_RANGE, format!("bytes */{size}"))],
                format!("the artifact is {size} bytes\n"),
            )
                .into_response()
        }
    };
    let length = if size == 0 { 0 } else { end - start + 1 };
    let mut response = Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::CONTENT_LENGTH, length)
        // Content-addressed: the bytes under a name never change.
        .header(header::CACHE_CONTROL, "public, max-age=31536000, immutable");
    if status == StatusCode::PARTIAL_CONTENT {
        response = response.header(header::CONTENT_RANGE, format!("bytes {start}-{end}/{size}"));
    }
    if method == Method::HEAD || length == 0 {
        return response.body(Body::empty()).unwrap_or_default();
    }
    if file.seek(SeekFrom::Start(start)).await.is_err() {
        return text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot read artifact {name}\n"),
        );
    }
    // Counted as each chunk is handed to the server (`flotilla_artifact_http_bytes_served`).
    let counter = api.metrics.clone();
    let stream = futures_util::stream::unfold((file, length), move |(mut file, left)| {
        let counter = counter.clone();
        async move {
            if left == 0 {
                return None;
            }
            let mut buf = vec![0; (left as usize).min(CHUNK)];
            match file.read(&mut buf).await {
                Ok(0) => Some((
                    Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)),
                    (file, 0),
                )),
                Ok(n) => {
                    buf.truncate(n);
                    if let Some(metrics) = &counter {
                        metrics.http_artifact_bytes(n as u64);
                    }
                    Some((Ok(Bytes::from(buf)), (file, left - n as u64)))
                }
                Err(e) => Some((Err(e), (file, 0))),
            }
        }
    });
    response.body(Body::from_stream(stream)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_read_as_a_static_server_reads_them() {
        assert_eq!(parse_range(None, 100), Ok(None));
        assert_eq!(parse_range(Some("bytes=0-9"), 100), Ok(Some((0, 9))));
        assert_eq!(parse_range(Some("bytes=90-"), 100), Ok(Some((90, 99))));
        assert_eq!(parse_range(Some("bytes=90-200"), 100), Ok(Some((90, 99))));
        assert_eq!(parse_range(Some("bytes=-10"), 100), Ok(Some((90, 99))));
        assert_eq!(parse_range(Some("bytes=100-"), 100), Err(Unsatisfiable));
        // Several ranges, or nonsense: the whole file, which a server may answer instead.
        assert_eq!(parse_range(Some("bytes=0-1,5-6"), 100), Ok(None));
        assert_eq!(parse_range(Some("bytes=x-y"), 100), Ok(None));
        assert_eq!(parse_range(Some("items=0-1"), 100), Ok(None));
        assert_eq!(parse_range(Some("bytes=5-1"), 100), Ok(None));
    }

    async fn get(addr: std::net::SocketAddr, path: &str, range: Option<&str>) -> Vec<u8> {
        use tokio::io::AsyncWriteExt as _;
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let range = range.map(|r| format!("Range: {r}\r\n")).unwrap_or_default();
        let request = format!("GET {path} HTTP/1.1\r\nHost: c\r\n{range}\r\n");
        stream.write_all(request.as_bytes()).await.expect("send");
        let mut out = Vec::new();
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            stream.read_to_end(&mut out),
        )
        .await;
        out
    }

    fn split(answer: &[u8]) -> (String, Vec<u8>) {
        let at = answer
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a head");
        (
            String::from_utf8_lossy(&answer[..at]).into_owned(),
            answer[at + 4..].to_vec(),
        )
    }

    #[tokio::test]
    async fn the_store_is_served_by_digest_with_ranges_and_nothing_else_is() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = dir.path().join("artifacts");
        std::fs::create_dir_all(&store).expect("mkdir");
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let name = "ab".repeat(32);
        std::fs::write(store.join(&name), &data).expect("write");
        std::fs::write(dir.path().join("secret.key"), b"secret").expect("write");
        let metrics = crate::service::metrics::Metrics::new().endpoint();
        let state = Api {
            artifacts: Some(store),
            ..Api::metrics_only(Some(metrics.clone()))
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let token = tokio_util::sync::CancellationToken::new();
        tokio::spawn(crate::service::http::server::serve(
            listener,
            None,
            routes(Router::new()).with_state(state),
            16,
            token.clone(),
        ));

        let (head, body) = split(
            &get(
                addr,
                &format!("/artifacts/{name}"),
                Some("bytes=65536-131071"),
            )
            .await,
        );
        assert!(head.starts_with("HTTP/1.1 206"), "{head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("content-range: bytes 65536-131071/200000"),
            "{head}"
        );
        assert_eq!(body, &data[65536..131072]);

        let (head, body) = split(&get(addr, &format!("/artifacts/{name}"), None).await);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert_eq!(body, data, "the whole file without a range");

        let scraped = metrics.render().await;
        assert!(
            scraped.contains("flotilla_artifact_http_bytes_served_total 265536"),
            "the range and the whole file are counted: {scraped}"
        );

        let (head, _) =
            split(&get(addr, &format!("/artifacts/{name}"), Some("bytes=200000-")).await);
        assert!(head.starts_with("HTTP/1.1 416"), "{head}");

        for bad in [
            "/artifacts/..%2Fsecret.key",
            "/artifacts/secret.key",
            &format!("/artifacts/{}", "AB".repeat(32)),
        ] {
            let (head, body) = split(&get(addr, bad, None).await);
            assert!(head.starts_with("HTTP/1.1 400"), "{bad}: {head}");
            assert!(
                String::from_utf8_lossy(&body).contains("64 lower-case hex digits"),
                "{bad}"
            );
        }
        let (head, _) = split(&get(addr, &format!("/artifacts/{}", "cd".repeat(32)), None).await);
        assert!(head.starts_with("HTTP/1.1 404"), "{head}");
        token.cancel();
    }
}
