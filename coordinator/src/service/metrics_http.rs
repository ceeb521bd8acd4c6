//! The small HTTP/1.1 responder behind `GET /metrics` (`[metrics] listen`): one request per
//! connection, answered and closed. What it serves comes from a [`Render`] (the metrics
//! module's `Endpoint`), so this module knows HTTP and connections, nothing of the metrics.
//!
//! Every connection is bounded: its request head is read within [`READ_TIMEOUT`] and
//! [`MAX_REQUEST_BYTES`], its answer written within [`WRITE_TIMEOUT`]. At most
//! [`MAX_CONNECTIONS`] are served at once. When they are all taken and another connection
//! arrives, a connection that is still waiting for its request head makes room: one of the peer
//! address that holds the most such connections, the oldest of them. It is answered `408` and
//! closed. So idle or slow connections can never keep a scrape out: a scrape sends its request
//! as soon as it connects, and the connections that pushed it out are the idle ones. Only when
//! every connection is busy answering a request (a few milliseconds each, or [`WRITE_TIMEOUT`]
//! for a client that does not read) is a new one answered `503` without being read.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// The largest request head read; a longer one is answered `431` and closed.
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// How long a client may take to send its request head.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client may take to read the answer.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once. A further one takes the place of a connection still waiting for
/// its request head, or is answered `503` when every connection is answering.
pub const MAX_CONNECTIONS: usize = 16;

/// The content type of the OpenMetrics text format, which Prometheus reads.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What the responder serves: the text of one answer, made when a request asks.
pub trait Render: Clone + Send + Sync + 'static {
    fn render(&self) -> impl Future<Output = String> + Send;
}

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen for metrics scrapes on {addr} (metrics.listen): {source}")]
pub struct ListenError {
    pub addr: SocketAddr,
    pub source: std::io::Error,
}

/// Binds the listener; the service refuses to start when it cannot.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, ListenError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ListenError { addr, source })
}

/// Where a connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for its request head: may make room for a new connection.
    Reading,
    /// Answering a whole request.
    Answering,
}

#[derive(Debug)]
struct Slot {
    peer: IpAddr,
    phase: Phase,
    evict: CancellationToken,
}

/// The connections being served, by the order they arrived in.
#[derive(Debug, Default)]
struct Slots {
    next: u64,
    live: BTreeMap<u64, Slot>,
}

impl Slots {
    /// Takes a slot for a connection from `peer`, making room when every slot is taken; `None`
    /// when every connection is answering.
    fn take(&mut self, peer: IpAddr) -> Option<(u64, CancellationToken)> {
        if self.live.len() >= MAX_CONNECTIONS {
            let victim = self.victim()?;
            if let Some(slot) = self.live.remove(&victim) {
                slot.evict.cancel();
            }
        }
        let id = self.next;
        self.next += 1;
        let evict = CancellationToken::new();
        self.live.insert(
            id,
            Slot {
                peer,
                phase: Phase::Reading,
                evict: evict.clone(),
            },
        );
        Some((id, evict))
    }

    /// The oldest connection still reading, of the peer that has the most of them.
    fn victim(&self) -> Option<u64> {
        let mut reading: BTreeMap<IpAddr, (usize, u64)> = BTreeMap::new();
        for (id, slot) in self.live.iter().filter(|(_, s)| s.phase == Phase::Reading) {
            // Ids grow with arrival, so the first one seen of a peer is its oldest.
            reading.entry(slot.peer).or_insert((0, *id)).0 += 1;
        }
        reading
            .into_values()
            .max_by(|(n1, oldest1), (n2, oldest2)| n1.cmp(n2).then(oldest2.cmp(oldest1)))
            .map(|(_, oldest)| oldest)
    }

    fn answering(&mut self, id: u64) {
        if let Some(slot) = self.live.get_mut(&id) {
            slot.phase = Phase::Answering;
        }
    }

    fn free(&mut self, id: u64) {
        self.live.remove(&id);
    }
}

fn lock(slots: &Mutex<Slots>) -> std::sync::MutexGuard<'_, Slots> {
    slots
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Serves `GET /metrics` on `listener` with what `render` makes, until `shutdown` is
/// cancelled.
pub async fn serve(listener: TcpListener, render: impl Render, shutdown: CancellationToken) {
    let slots = Arc::new(Mutex::new(Slots::default()));
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, most likely: wait rather than spin.
                tracing::warn!(error = %e, "metrics endpoint: cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let taken = lock(&slots).take(peer.ip());
        let Some((id, evict)) = taken else {
            // Every connection is answering: say so without reading the request or waiting.
            let _ = stream.try_write(&response(503, "too many connections\n", None).bytes);
            continue;
        };
        let render = render.clone();
        let shutdown = shutdown.clone();
        let slots = slots.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = answer(stream, &render, &evict, &slots, id) => {}
            }
            lock(&slots).free(id);
        });
    }
}

/// Reads one request head, answers it and closes the connection. While it waits for the
/// head, `evict` may take its slot for a newer connection.
async fn answer<R: Render>(
    mut stream: TcpStream,
    render: &R,
    evict: &CancellationToken,
    slots: &Mutex<Slots>,
    id: u64,
) {
    let head = tokio::select! {
        head = tokio::time::timeout(READ_TIMEOUT, read_head(&mut stream)) => head,
        _ = evict.cancelled() => {
            let reply = response(408, "the request took too long; another connection needed the slot\n", None);
            let _ = stream.try_write(&reply.bytes);
            return;
        }
    };
    lock(slots).answering(id);
    let reply = match head {
        Err(_) => response(408, "the request took too long\n", None),
        Ok(Err(Head::Closed)) => return,
        Ok(Err(Head::TooLarge)) => response(
            431,
            &format!("the request head is larger than {MAX_REQUEST_BYTES} bytes\n"),
            None,
        ),
        Ok(Ok(head)) => match route(&head) {
            Ok(Route::Metrics { head_only }) => {
                let text = render.render().await;
                let mut reply = response(200, &text, Some(CONTENT_TYPE));
                if head_only {
                    reply.bytes.truncate(reply.head_len);
                }
                reply
            }
            Err(refusal) => refusal,
        },
    };
    let _ = tokio::time::timeout(WRITE_TIMEOUT, async {
        stream.write_all(&reply.bytes).await?;
        stream.shutdown().await
    })
    .await;
}

/// Why no request head could be read.
#[derive(Debug, PartialEq, Eq)]
enum Head {
    /// The client closed before sending a whole head.
    Closed,
    TooLarge,
}

/// Reads up to the blank line that ends the request head, at most [`MAX_REQUEST_BYTES`].
async fn read_head(stream: &mut TcpStream) -> Result<Vec<u8>, Head> {
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await.map_err(|_| Head::Closed)?;
        if n == 0 {
            return Err(Head::Closed);
        }
        head.extend_from_slice(&chunk[..n]);
        if let Some(end) = head_end(&head) {
            head.truncate(end);
            return Ok(head);
        }
        if head.len() >= MAX_REQUEST_BYTES {
            return Err(Head::TooLarge);
        }
    }
}

/// Where the head ends (after `\r\n\r\n`, or a bare `\n\n`), if it does within the limit.
fn head_end(bytes: &[u8]) -> Option<usize> {
    let limit = bytes.len().min(MAX_REQUEST_BYTES);
    let bytes = &bytes[..limit];
    let crlf = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| p + 4);
    let lf = bytes.windows(2).position(|w| w == b"\n\n").map(|p| p + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What a well-formed request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Metrics { head_only: bool },
}

/// Checks the request line: `GET` or `HEAD`, the path `/metrics` (any query ignored),
/// HTTP/1.x. Anything else is the error answer to send.
fn route(head: &[u8]) -> Result<Route, Reply> {
    let bad = |why: &str| response(400, &format!("bad request: {why}\n"), None);
    let line_end = head.iter().position(|b| *b == b'\n').unwrap_or(head.len());
    let line = std::str::from_utf8(&head[..line_end])
        .map_err(|_| bad("the request line is not text"))?
        .trim_end_matches('\r');
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad("expected METHOD PATH HTTP/1.1"));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(bad("only HTTP/1.x is spoken here"));
    }
    let path = target.split('?').next().unwrap_or_default();
    if path != "/metrics" {
        return Err(response(404, "not found: only /metrics is served\n", None));
    }
    match method {
        "GET" => Ok(Route::Metrics { head_only: false }),
        "HEAD" => Ok(Route::Metrics { head_only: true }),
        _ => Err(response(
            405,
            "method not allowed: use GET\n",
            Some("text/plain; charset=utf-8\r\nAllow: GET, HEAD"),
        )),
    }
}

/// A whole HTTP answer, and where its head ends (for `HEAD`).
#[derive(Debug)]
struct Reply {
    bytes: Vec<u8>,
    head_len: usize,
}

/// An answer that closes the connection. `content_type` may carry further header lines.
fn response(status: u16, body: &str, content_type: Option<&str>) -> Reply {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        _ => "Service Unavailable",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        content_type.unwrap_or("text/plain; charset=utf-8"),
        body.len()
    );
    let head_len = head.len();
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body.as_bytes());
    Reply { bytes, head_len }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpSocket;
    use tokio::sync::Semaphore;

    /// Answers a fixed text; with a gate, only once the test lets each answer through.
    #[derive(Clone)]
    struct Fixed {
        gate: Option<Arc<Semaphore>>,
    }

    impl Render for Fixed {
        async fn render(&self) -> String {
            if let Some(gate) = &self.gate {
                if let Ok(permit) = gate.acquire().await {
                    permit.forget();
                }
            }
            "flotilla_test_total 1\n# EOF\n".to_owned()
        }
    }

    async fn serving(render: Fixed) -> (SocketAddr, CancellationToken) {
        let listener = bind("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let token = CancellationToken::new();
        tokio::spawn(serve(listener, render, token.clone()));
        (addr, token)
    }

    fn fixed() -> Fixed {
        Fixed { gate: None }
    }

    /// Connects to `addr` from the loopback address `from` (127.0.0.1, 127.0.0.2, …).
    async fn connect_from(from: &str, addr: SocketAddr) -> TcpStream {
        let socket = TcpSocket::new_v4().expect("socket");
        socket
            .bind(format!("{from}:0").parse().expect("addr"))
            .expect("bind the client side");
        socket.connect(addr).await.expect("connect")
    }

    /// Sends `request` and reads until the server closes.
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

    const GET: &[u8] = b"GET /metrics HTTP/1.1\r\n\r\n";

    #[tokio::test]
    async fn junk_wrong_paths_and_methods_get_an_error_answer() {
        let (addr, token) = serving(fixed()).await;
        let cases: [(&[u8], &str); 6] = [
            (b"\x00\xff\xfe junk\r\n\r\n", "HTTP/1.1 400 Bad Request"),
            (b"hello\r\n\r\n", "HTTP/1.1 400 Bad Request"),
            (b"GET /metrics SPDY/3\r\n\r\n", "HTTP/1.1 400 Bad Request"),
            (
                b"GET /../etc/passwd HTTP/1.1\r\n\r\n",
                "HTTP/1.1 404 Not Found",
            ),
            (
                b"POST /metrics HTTP/1.1\r\n\r\n",
                "HTTP/1.1 405 Method Not Allowed",
            ),
            (b"GET /metrics?x=1 HTTP/1.0\n\n", "HTTP/1.1 200 OK"),
        ];
        for (request, expected) in cases {
            let answer = exchange(addr, request).await;
            assert_eq!(status_line(&answer), expected, "{request:?}: {answer}");
        }
        token.cancel();
    }

    #[tokio::test]
    async fn an_oversized_request_is_refused_and_closed() {
        let (addr, token) = serving(fixed()).await;
        // A head that does not end within the limit: every byte is read, then refused.
        let mut request = b"GET /metrics HTTP/1.1\r\nX-Junk: ".to_vec();
        request.resize(MAX_REQUEST_BYTES, b'a');
        let answer = exchange(addr, &request).await;
        assert_eq!(
            status_line(&answer),
            "HTTP/1.1 431 Request Header Fields Too Large",
            "{answer}"
        );
        assert!(!answer.contains("flotilla_"), "no metrics: {answer}");
        // Far more than the limit: the connection is closed (with the refusal, or reset for
        // the unread rest) and nothing else is read or answered.
        request.extend(std::iter::repeat_n(b'a', MAX_REQUEST_BYTES * 64));
        let answer = exchange(addr, &request).await;
        assert!(!answer.contains("flotilla_"), "no metrics: {answer}");
        token.cancel();
    }

    /// A silent client is answered `408` once [`READ_TIMEOUT`] has passed.
    #[tokio::test]
    async fn a_silent_client_times_out() {
        let (addr, token) = serving(fixed()).await;
        let mut silent = TcpStream::connect(addr).await.expect("connect");
        let answer = read_all(&mut silent).await;
        assert_eq!(
            status_line(&answer),
            "HTTP/1.1 408 Request Timeout",
            "{answer}"
        );
        token.cancel();
    }

    /// Idle connections in every slot do not keep a scrape out: each new connection takes the
    /// place of the oldest idle one, again and again, and the scrape is answered.
    #[tokio::test]
    async fn idle_connections_cannot_keep_a_scrape_out() {
        let (addr, token) = serving(fixed()).await;
        let mut idle = Vec::new();
        for round in 0..3 {
            for _ in 0..MAX_CONNECTIONS {
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
        // The connections that made room were told why and closed.
        let answer = read_all(&mut idle[0]).await;
        assert_eq!(
            status_line(&answer),
            "HTTP/1.1 408 Request Timeout",
            "{answer}"
        );
        token.cancel();
    }

    /// The peer holding the most idle connections makes room, not an older, slower client of
    /// another address.
    #[tokio::test]
    async fn the_peer_with_the_most_idle_connections_makes_room() {
        let (addr, token) = serving(fixed()).await;
        let mut slow = connect_from("127.0.0.1", addr).await;
        let mut flood = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
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
    /// turned away with `503` at once, and served again once they are done.
    #[tokio::test]
    async fn busy_answers_are_not_interrupted_and_more_are_turned_away() {
        let gate = Arc::new(Semaphore::new(0));
        let (addr, token) = serving(Fixed {
            gate: Some(gate.clone()),
        })
        .await;
        let mut busy = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
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
        gate.add_permits(MAX_CONNECTIONS + 1);
        for stream in &mut busy {
            assert_eq!(status_line(&read_all(stream).await), "HTTP/1.1 200 OK");
        }
        token.cancel();
    }

    #[test]
    fn the_victim_is_the_oldest_reading_connection_of_the_busiest_peer() {
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        let mut slots = Slots::default();
        let (first, _) = slots.take(a).expect("slot");
        let (second, _) = slots.take(b).expect("slot");
        let (third, _) = slots.take(b).expect("slot");
        assert_eq!(slots.victim(), Some(second));
        slots.answering(second);
        slots.answering(third);
        assert_eq!(slots.victim(), Some(first), "answering connections stay");
        slots.answering(first);
        assert_eq!(slots.victim(), None);
    }
}
