//! The HTTP server under load and slow clients, in one process (a server of the real routes
//! and a stand-in for the service loop that answers control requests):
//!
//! - 10,000 clients open event streams at once, twice: at most [`MAX_STREAMS`] get one, every
//!   other gets `503` with a reason or is cut off (the connection cap), none hangs; a control
//!   request is answered while they come and after; dropped streams give their places back;
//!   the second wave leaves the process no bigger than the first did, give or take.
//! - A request head sent a byte a second (slowloris) is cut off by the head timeout.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use flotilla_protocol::control::ControlReply;
use flotilla_protocol::operator::Role;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::service::http::control::{HttpAnswer, HttpControl};
use crate::service::http::reads::MAX_STREAMS;
use crate::service::http::server::{self, HEAD_TIMEOUT, MAX_CONNECTIONS};
use crate::service::http::session::{self, Session, Sessions};
use crate::service::http::state::Api;

const CLIENTS: usize = 10_000;

/// Raises this process's open-file limit to its hard limit; the limit now (`None`: unlimited).
fn raise_open_files() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        },
    );
    getrlimit(Resource::Nofile).current
}

/// This process's resident memory, in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// The API's routes on a free port, with one viewer session and a stand-in service loop that
/// answers every signed control request `200`; the address, the session cookie, the state.
async fn serving() -> (SocketAddr, String, Api, CancellationToken) {
    let (token, digest) = session::new_token();
    let sessions = Arc::new(Sessions::with([(
        digest,
        Session {
            operator: "vic".into(),
            role: Role::Viewer,
            key: String::new(),
            expires: session::unix_now() + 3600,
        },
    )]));
    let (events, _) = broadcast::channel(16);
    let (inbox, mut requests) = crate::service::http::control::channel();
    tokio::spawn(async move {
        while let Some(request) = requests.recv().await {
            if let HttpControl::Signed { answer, .. } = request {
                let reply = ControlReply {
                    id: "1".into(),
                    ok: true,
                    error: None,
                    result: serde_json::json!("done"),
                    loading: false,
                };
                let _ = answer.send(HttpAnswer {
                    status: axum::http::StatusCode::OK,
                    reply,
                });
            }
        }
    });
    let state = Api {
        control: Some(inbox),
        events: Some(events),
        sessions,
        ..Api::metrics_only(None)
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stop = CancellationToken::new();
    tokio::spawn(server::serve(
        listener,
        None,
        crate::service::http::api::router(state.clone(), true),
        MAX_CONNECTIONS,
        stop.clone(),
    ));
    (addr, format!("{}={token}", session::COOKIE), state, stop)
}

/// What one client got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Outcome {
    /// `200` and an event stream.
    Stream,
    /// `503`, saying the streams are all taken.
    StreamsFull,
    /// `503`, saying the connections are all taken.
    ConnectionsFull,
    /// Closed without an answer (the connection cap made room for another).
    CutOff,
}

/// Opens an event stream; what came of it, and the connection while it is a stream.
async fn open_stream(
    addr: SocketAddr,
    cookie: String,
) -> (
    Result<Outcome, String>,
    Option<(TcpStream, std::time::Instant)>,
) {
    let mut stream = match TcpStream::connect(addr).await {
        Ok(s) => s,
        Err(e) => return (Err(format!("connect: {e}")), None),
    };
    let request = format!("GET /api/v1/events HTTP/1.1\r\nHost: c\r\nCookie: {cookie}\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return (Ok(Outcome::CutOff), None);
    }
    let mut buf = vec![0u8; 2048];
    let mut got = Vec::new();
    // Long enough for any answer under this load; a client still waiting then is a hang. Past
    // the listen backlog (10,000 clients at once overflow it) the kernel drops the client's
    // handshake ACK and keeps the connection half-open while it retries its SYN-ACK, for about
    // 63 s, then forgets it; the client, which took itself for connected, learns so by a reset
    // when it next resends its request (about 100 s after the first send): a cut off. The bound
    // waits that out, so the kernel of a busy machine is not taken for the server hanging.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(150);
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => {
                return (
                    Err(format!(
                        "no answer and not closed: {:?}",
                        String::from_utf8_lossy(&got)
                    )),
                    None,
                )
            }
            Ok(Err(_)) | Ok(Ok(0)) => break,
            Ok(Ok(n)) => {
                got.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&got);
                if text.starts_with("HTTP/1.1 200") && text.contains("\r\n\r\n") {
                    if text.contains("text/event-stream") {
                        return (
                            Ok(Outcome::Stream),
                            Some((stream, std::time::Instant::now())),
                        );
                    }
                    return (Err(format!("200 without a stream: {text}")), None);
                }
            }
        }
    }
    let text = String::from_utf8_lossy(&got);
    let outcome = if text.is_empty() {
        Ok(Outcome::CutOff)
    } else if text.starts_with("HTTP/1.1 503") && text.contains("event streams are open already") {
        Ok(Outcome::StreamsFull)
    } else if text.starts_with("HTTP/1.1 503") && text.contains("too many connections") {
        Ok(Outcome::ConnectionsFull)
    } else {
        Err(format!("an unexpected answer: {text}"))
    };
    (outcome, None)
}

/// Posts a control request; the status, or 0 when the connection was cut.
async fn control(addr: SocketAddr) -> u16 {
    let Ok(mut stream) = TcpStream::connect(addr).await else {
        return 0;
    };
    let body = r#"{"request":"{}","key":"00","signature":"00"}"#;
    let request = format!(
        "POST /api/v1/control HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(request.as_bytes()).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out);
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// One wave: `CLIENTS` event streams opened at once while control requests keep coming; the
/// count of each outcome, and how many control requests were answered `200` during it.
async fn wave(
    addr: SocketAddr,
    cookie: &str,
    api: &Api,
) -> (std::collections::HashMap<Outcome, usize>, usize) {
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..CLIENTS {
        clients.spawn(open_stream(addr, cookie.to_owned()));
    }
    let storm = CancellationToken::new();
    let controls = {
        let storm = storm.clone();
        tokio::spawn(async move {
            let mut done = 0;
            while !storm.is_cancelled() {
                let status = control(addr).await;
                assert!(
                    [200, 503, 0].contains(&status),
                    "a control request during the storm: {status}"
                );
                done += usize::from(status == 200);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            done
        })
    };
    let mut counts = std::collections::HashMap::new();
    let mut held = Vec::new();
    while let Some(joined) = clients.join_next().await {
        let (outcome, stream) = joined.expect("a client task");
        let outcome = outcome.unwrap_or_else(|e| panic!("a client: {e}"));
        *counts.entry(outcome).or_insert(0) += 1;
        held.extend(stream);
    }
    // With the streams still open, a control request is answered.
    assert_eq!(
        control(addr).await,
        200,
        "a control request beside {} streams",
        held.len()
    );
    storm.cancel();
    // Every stream answered is still open, none cut off after its answer began, unless its
    // connection has reached the server's lifetime (HEAD_TIMEOUT + WRITE_TIMEOUT, after which
    // the browser reconnects): on a loaded machine a wave can outlast it. Streams answered
    // within the last 20 s are well inside it.
    let open = api.streams.load(Ordering::SeqCst);
    let recent = held
        .iter()
        .filter(|(_, answered)| answered.elapsed() < Duration::from_secs(20))
        .count();
    assert!(
        (recent..=held.len()).contains(&open),
        "{open} streams open on the server: the {recent} answered in the last 20 s must be, and \
         no more than the {} answered 200",
        held.len()
    );
    let answered = controls.await.expect("the control task");
    drop(held);
    (counts, answered)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_event_streams_come_and_go_and_the_api_keeps_answering() {
    let limit = raise_open_files();
    assert!(
        limit.is_none_or(|n| n >= (CLIENTS + MAX_CONNECTIONS + 512) as u64),
        "this test needs {} open files and may have {limit:?}: raise the hard limit (ulimit -Hn)",
        CLIENTS + MAX_CONNECTIONS + 512
    );
    let (addr, cookie, api, stop) = serving().await;
    let mut rss = Vec::new();
    for round in 1..=2 {
        let (counts, answered) = wave(addr, &cookie, &api).await;
        let streams = counts.get(&Outcome::Stream).copied().unwrap_or(0);
        eprintln!("wave {round}: {counts:?}; control requests answered during it: {answered}");
        assert_eq!(counts.values().sum::<usize>(), CLIENTS);
        assert!(
            (1..=MAX_STREAMS).contains(&streams),
            "at most {MAX_STREAMS} streams at once: {counts:?}"
        );
        assert!(
            counts.get(&Outcome::StreamsFull).copied().unwrap_or(0) > 0,
            "the stream cap answered with its reason: {counts:?}"
        );
        // Every dropped stream gives its place back.
        for _ in 0..600 {
            if api.streams.load(Ordering::SeqCst) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(api.streams.load(Ordering::SeqCst), 0, "streams left open");
        let (outcome, stream) = open_stream(addr, cookie.clone()).await;
        assert_eq!(outcome, Ok(Outcome::Stream), "a new stream after the wave");
        drop(stream);
        assert_eq!(control(addr).await, 200, "a control request after the wave");
        rss.push(rss_kib());
    }
    eprintln!("resident memory after each wave: {rss:?} KiB");
    assert!(
        rss[1] < rss[0] + 64 * 1024,
        "memory grew by more than 64 MiB from one wave to the next: {rss:?} KiB"
    );
    stop.cancel();
}

/// A head sent a byte a second is cut off by the head timeout, long before it is complete,
/// and unanswered.
#[tokio::test]
async fn a_head_sent_a_byte_a_second_is_cut_off() {
    let (addr, _cookie, _api, stop) = serving().await;
    let head = b"GET /metrics HTTP/1.1\r\nHost: slow.example\r\nUser-Agent: slowloris\r\nAccept: */*\r\n\r\n";
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let mut sent = 0;
    let mut answer = Vec::new();
    for byte in head {
        if stream.write_all(&[*byte]).await.is_err() {
            break;
        }
        sent += 1;
        // Closed by the server: a read returns at once.
        let mut buf = [0u8; 512];
        match tokio::time::timeout(Duration::from_secs(1), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => answer.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    let expected = HEAD_TIMEOUT.as_secs() as usize + 2;
    assert!(
        sent <= expected,
        "cut off after about {} s: {sent} of {} bytes were taken",
        HEAD_TIMEOUT.as_secs(),
        head.len()
    );
    let answer = String::from_utf8_lossy(&answer);
    assert!(!answer.contains(" 200 "), "never answered: {answer}");
    stop.cancel();
}

/// Sends `request` and reads the answer until the server closes.
async fn exchange(addr: SocketAddr, request: &str) -> String {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let _ = stream.write_all(request.as_bytes()).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// A 10 MB body is refused with `413` and the limit, before it is sent (`Expect:
/// 100-continue`, as curl sends for large bodies); the server goes on answering.
#[tokio::test]
async fn a_ten_megabyte_body_gets_413_with_the_limit() {
    let (addr, _cookie, _api, stop) = serving().await;
    for path in [
        "/api/v1/control",
        "/api/v1/commands/pause_rollout",
        "/api/v1/session",
    ] {
        let answer = exchange(
            addr,
            &format!(
                "POST {path} HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nExpect: 100-continue\r\n\r\n",
                10 << 20
            ),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 413"), "{path}: {answer}");
        assert!(
            answer.contains("is 10485760 bytes, larger than 262144 bytes"),
            "{path}: {answer}"
        );
        assert!(
            !answer.contains("100 Continue"),
            "{path}: not asked for: {answer}"
        );
    }
    assert_eq!(control(addr).await, 200, "still answering");
    stop.cancel();
}

/// A session that expired is answered `401` saying so, and so are a logged-out one and none.
#[tokio::test]
async fn an_expired_session_gets_401_saying_it_expired() {
    let (addr, cookie, api, stop) = serving().await;
    let (old, digest) = session::new_token();
    api.sessions.insert(
        digest,
        Session {
            operator: "vic".into(),
            role: Role::Viewer,
            key: String::new(),
            expires: session::unix_now() - 1,
        },
    );
    let get = |cookie: String| {
        format!("GET /api/v1/session HTTP/1.1\r\nHost: c\r\nCookie: {cookie}\r\n\r\n")
    };
    let answer = exchange(addr, &get(format!("{}={old}", session::COOKIE))).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("session expired"), "{answer}");
    assert!(answer.contains("log in again"), "{answer}");
    let answer = exchange(addr, &get(cookie.clone())).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"operator\":\"vic\""), "{answer}");
    let answer = exchange(addr, &get(format!("{}=forged", session::COOKIE))).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("no such session"), "{answer}");
    let answer = exchange(addr, "GET /api/v1/rollouts HTTP/1.1\r\nHost: c\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("no session: log in"), "{answer}");
    stop.cancel();
}
