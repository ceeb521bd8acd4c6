//! The accept loop: one request per connection, HTTP/1.1 through hyper, over TLS when
//! configured, every connection bounded.
//!
//! - At most `max_connections` at once. When they are all taken, a connection still waiting for
//!   its request head (or its TLS handshake) makes room ([`super::slots`]); when every one is
//!   answering, a new connection is answered `503` without being read.
//! - The TLS handshake and the request head must arrive within [`HEAD_TIMEOUT`]; a head over
//!   [`MAX_HEAD_BYTES`] is answered `431`. Bodies are the handlers' to bound ([`super::api`]).
//! - A connection serves one request and closes (no keep-alive): nothing idles in a slot.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use hyper::service::Service as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::service::http::slots::{lock, Slots};

/// How long a client may take for its TLS handshake and then its request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest request head read; a larger one is answered `431`.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// How long an answer may take to be written to a client that does not read.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections served at once by default (event streams, at most
/// [`super::reads::MAX_STREAMS`], hold theirs while they last).
pub const MAX_CONNECTIONS: usize = 512;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen for HTTP on {addr} ({setting}): {source}")]
pub struct ListenError {
    pub addr: SocketAddr,
    pub setting: &'static str,
    pub source: std::io::Error,
}

/// Binds `addr`, trying again for up to three seconds: a coordinator that changes role (leading,
/// standing by) closes one server and opens the next on the same address, and the closing one
/// may not have let go of it yet. `setting` names the config field in the error.
pub async fn bind_retrying(
    addr: SocketAddr,
    setting: &'static str,
) -> Result<TcpListener, ListenError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    loop {
        match TcpListener::bind(addr).await {
            Ok(listener) => return Ok(listener),
            Err(source) if tokio::time::Instant::now() >= deadline => {
                return Err(ListenError {
                    addr,
                    setting,
                    source,
                })
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Serves `router` on `listener` until `shutdown` is cancelled, with at most `max_connections`
/// connections at once.
pub async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    router: Router,
    max_connections: usize,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Mutex::new(Slots::new(max_connections)));
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, most likely: wait rather than spin.
                tracing::warn!(error = %e, "http: cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let taken = lock(&slots).take(peer.ip());
        let Some((id, evict)) = taken else {
            // Every connection is answering: say so without reading the request or waiting.
            let _ = stream.try_write(BUSY);
            continue;
        };
        let (router, tls, shutdown, slots) =
            (router.clone(), tls.clone(), shutdown.clone(), slots.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                // Only a connection still waiting for its head is ever evicted.
                _ = evict.cancelled() => {}
                _ = connection(stream, tls, router, &slots, id) => {}
            }
            lock(&slots).free(id);
        });
    }
}

const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n";

async fn connection(
    stream: TcpStream,
    tls: Option<TlsAcceptor>,
    router: Router,
    slots: &Arc<Mutex<Slots>>,
    id: u64,
) {
    let _ = stream.set_nodelay(true);
    match tls {
        None => http1(stream, router, slots, id).await,
        Some(acceptor) => match tokio::time::timeout(HEAD_TIMEOUT, acceptor.accept(stream)).await {
            Ok(Ok(stream)) => http1(stream, router, slots, id).await,
            Ok(Err(e)) => tracing::debug!(error = %e, "http: TLS handshake failed"),
            Err(_) => tracing::debug!("http: TLS handshake timed out"),
        },
    }
}

/// One HTTP/1.1 exchange on an established stream.
async fn http1<S>(stream: S, router: Router, slots: &Arc<Mutex<Slots>>, id: u64)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let tower = TowerToHyperService::new(router);
    let slots_for_call = slots.clone();
    let service = hyper::service::service_fn(move |request| {
        // The head is in: from now on this connection is not evicted. One evicted while its
        // head came in is not answered (an answer would start and then be cut off).
        let kept = lock(&slots_for_call).answering(id);
        let call = tower.call(request);
        async move {
            if !kept {
                return Err(std::io::Error::other("evicted to make room"));
            }
            call.await.map_err(|never| match never {})
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    match tokio::time::timeout(HEAD_TIMEOUT + WRITE_TIMEOUT, conn).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "http: connection ended with an error"),
        Err(_) => tracing::debug!("http: connection took too long; closed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpSocket;
    use tokio::sync::Semaphore;

    const MAX: usize = 16;
    const GET: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";

    /// A server of `/metrics` answering a fixed text; with a gate, only once the test lets each
    /// answer through.
    async fn serving(gate: Option<Arc<Semaphore>>) -> (SocketAddr, CancellationToken) {
        let router = Router::new().route(
            "/metrics",
            get(move || {
                let gate = gate.clone();
                async move {
                    if let Some(gate) = gate {
                        if let Ok(permit) = gate.acquire().await {
                            permit.forget();
                        }
                    }
                    "flotilla_test_total 1\n# EOF\n"
                }
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let token = CancellationToken::new();
        tokio::spawn(serve(listener, None, router, MAX, token.clone()));
        (addr, token)
    }

    async fn connect_from(from: &str, addr: SocketAddr) -> TcpStream {
        let socket = TcpSocket::new_v4().expect("socket");
        socket
            .bind(format!("{from}:0").parse().expect("addr"))
            .expect("bind the client side");
        socket.connect(addr).await.expect("connect")
    }

    async fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        send(&mut stream, request).await
    }

    async fn send(stream: &mut TcpStream, request: &[u8]) -> String {
        // The server may close before reading everything of an oversized request.
        let _ = stream.write_all(request).await;
        read_all(stream).await
    }

    async fn read_all(stream: &mut TcpStream) -> String {
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    fn status_line(answer: &str) -> &str {
        answer.lines().next().unwrap_or_default()
    }

    #[tokio::test]
    async fn junk_wrong_paths_and_methods_get_an_error_answer() {
        let (addr, token) = serving(None).await;
        let cases: [(&[u8], &str); 5] = [
            (b"\x00\xff\xfe junk\r\n\r\n", "HTTP/1.1 400 Bad Request"),
            (b"hello\r\n\r\n", "HTTP/1.1 400 Bad Request"),
            (
                b"GET /../etc/passwd HTTP/1.1\r\n\r\n",
                "HTTP/1.1 404 Not Found",
            ),
            (
                b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
                "HTTP/1.1 405 Method Not Allowed",
            ),
            (b"GET /metrics?x=1 HTTP/1.0\r\n\r\n", "HTTP/1.0 200 OK"),
        ];
        for (request, expected) in cases {
            let answer = exchange(addr, request).await;
            assert_eq!(status_line(&answer), expected, "{request:?}: {answer}");
        }
        token.cancel();
    }

    #[tokio::test]
    async fn an_oversized_head_is_refused_and_closed() {
        let (addr, token) = serving(None).await;
        let mut request = b"GET /metrics HTTP/1.1\r\nX-Junk: ".to_vec();
        request.resize(MAX_HEAD_BYTES * 4, b'a');
        let answer = exchange(addr, &request).await;
        assert!(!answer.contains("flotilla_"), "no metrics: {answer}");
        assert!(
            answer.is_empty() || status_line(&answer).contains("431"),
            "{answer}"
        );
        token.cancel();
    }

    /// A silent client is cut off once [`HEAD_TIMEOUT`] has passed.
    #[tokio::test]
    async fn a_silent_client_is_cut_off() {
        let (addr, token) = serving(None).await;
        let mut silent = TcpStream::connect(addr).await.expect("connect");
        let mut out = Vec::new();
        let read = tokio::time::timeout(HEAD_TIMEOUT * 3, silent.read_to_end(&mut out)).await;
        assert!(read.is_ok(), "the connection was closed");
        assert!(!String::from_utf8_lossy(&out).contains("flotilla_"));
        token.cancel();
    }

    /// Idle connections in every slot do not keep a scrape out: each new connection takes the
    /// place of the oldest idle one, again and again, and the scrape is answered.
    #[tokio::test]
    async fn idle_connections_cannot_keep_a_scrape_out() {
        let (addr, token) = serving(None).await;
        let mut idle = Vec::new();
        for round in 0..3 {
            for _ in 0..MAX {
                idle.push(TcpStream::connect(addr).await.expect("connect"));
            }
            let answer = exchange(addr, GET).await;
            assert_eq!(
                status_line(&answer),
                "HTTP/1.1 200 OK",
                "round {round}: {answer}"
            );
            assert!(answer.contains("flotilla_test_total 1"), "{answer}");
        }
        // The connections that made room were closed.
        let mut out = Vec::new();
        let read =
            tokio::time::timeout(Duration::from_secs(1), idle[0].read_to_end(&mut out)).await;
        assert!(matches!(read, Ok(Ok(0))), "evicted and closed: {read:?}");
        token.cancel();
    }

    /// The peer holding the most idle connections makes room, not an older, slower client of
    /// another address.
    #[tokio::test]
    async fn the_peer_with_the_most_idle_connections_makes_room() {
        let (addr, token) = serving(None).await;
        let mut slow = connect_from("127.0.0.1", addr).await;
        let mut flood = Vec::new();
        for _ in 0..MAX {
            flood.push(connect_from("127.0.0.2", addr).await);
        }
        let mut scrape = connect_from("127.0.0.3", addr).await;
        assert_eq!(
            status_line(&send(&mut scrape, GET).await),
            "HTTP/1.1 200 OK"
        );
        // The slow client, connected before all of them, still has its slot.
        assert_eq!(status_line(&send(&mut slow, GET).await), "HTTP/1.1 200 OK");
        token.cancel();
    }

    /// When every connection is answering a request, nothing is taken from them: a new one is
    /// turned away with `503` at once, and all are served once they are done.
    #[tokio::test]
    async fn busy_answers_are_not_interrupted_and_more_are_turned_away() {
        let gate = Arc::new(Semaphore::new(0));
        let (addr, token) = serving(Some(gate.clone())).await;
        let mut busy = Vec::new();
        for _ in 0..MAX {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            stream.write_all(GET).await.expect("send");
            busy.push(stream);
        }
        // Give the server a moment to read each request (no timing is asserted).
        let mut turned_away = String::new();
        for _ in 0..100 {
            turned_away = exchange(addr, GET).await;
            if status_line(&turned_away).contains("503") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            status_line(&turned_away),
            "HTTP/1.1 503 Service Unavailable",
            "{turned_away}"
        );
        gate.add_permits(MAX + 1);
        for stream in &mut busy {
            assert_eq!(status_line(&read_all(stream).await), "HTTP/1.1 200 OK");
        }
        token.cancel();
    }
}
