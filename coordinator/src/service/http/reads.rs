//! Sessions and what a session may do: read, and follow live events (decision 0055).
//!
//! ```text
//! POST   /api/v1/session           a signed `login` request -> a session cookie
//! GET    /api/v1/session           who the session is for
//! DELETE /api/v1/session           ends it
//! GET    /api/v1/rollouts          rollouts, paged (`limit`, `after`, `phase`)
//! GET    /api/v1/rollouts/{name}   one rollout and a page of its devices
//! GET    /api/v1/devices           devices, paged (`select`, `phase`, `group`, `online`,
//!                                  `enrollment`)
//! GET    /api/v1/devices/{id}      one device, its actions (reads_devices.rs)
//! GET    /api/v1/enrollment        devices waiting for an operator, paged (reads_devices.rs)
//! GET    /api/v1/approvals         approval requests, paged
//! GET    /api/v1/releases          releases, paged
//! GET    /api/v1/events            live events (server-sent events): rollouts, approvals, trace
//! ```
//!
//! Reads are the viewer commands of the control API, run by the service loop in the session's
//! operator's name, always paged so an answer never grows with the fleet. A session never
//! changes anything: changes are signed requests to `POST /api/v1/control`.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use flotilla_protocol::control::{Command, PageQuery, DEFAULT_PAGE_LIMIT};
use tokio::sync::{broadcast, oneshot};

use crate::service::http::control::{HttpAnswer, HttpControl};
use crate::service::http::session::{self, Lookup, Session};
use crate::service::http::state::{is_json, read_body, refused, Api, LiveEvent};

/// Event streams open at once; one more is answered `503`.
pub const MAX_STREAMS: usize = 256;
/// How often an idle event stream checks that its session is still open.
const SESSION_CHECK: Duration = Duration::from_secs(2);

/// The session and read routes, added to `router`.
pub fn routes(router: Router<Api>) -> Router<Api> {
    router
        .route("/api/v1/session", get(whoami).post(login).delete(logout))
        .route("/api/v1/rollouts", get(rollouts))
        .route("/api/v1/rollouts/:name", get(rollout))
        .route("/api/v1/devices", get(devices))
        .route("/api/v1/approvals", get(approvals))
        .route("/api/v1/releases", get(releases))
        .route("/api/v1/events", get(events))
}

/// The session token in the request's cookies, if there is one.
fn cookie_token(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(session::token_in)
}

/// The session the request's cookie names, or the `401` that says why there is none.
// The error is the answer itself, returned to the client as it is, once a request: boxing it
// would only add an allocation.
#[allow(clippy::result_large_err)]
fn session(api: &Api, headers: &HeaderMap) -> Result<Session, Response> {
    match cookie_token(headers).map(|token| api.sessions.lookup(token)) {
        Some(Lookup::Open(session)) => Ok(session),
        Some(Lookup::Expired(at)) => Err(refused(
            StatusCode::UNAUTHORIZED,
            format!(
                "session expired: it ended at unix time {at} ({} h after login); log in again",
                session::TTL.as_secs() / 3600
            ),
        )),
        Some(Lookup::Unknown) => Err(refused(
            StatusCode::UNAUTHORIZED,
            "no such session: it was logged out, revoked, or opened before the coordinator's \
             store was reset; log in again (POST /api/v1/session)"
                .into(),
        )),
        None => Err(refused(
            StatusCode::UNAUTHORIZED,
            "no session: log in with a signed login request (POST /api/v1/session)".into(),
        )),
    }
}

async fn login(State(api): State<Api>, headers: HeaderMap, body: Body) -> Response {
    if !is_json(&headers) {
        return refused(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "a login is a signed request in JSON: send it with Content-Type: application/json"
                .into(),
        );
    }
    let payload = match read_body(body).await {
        Ok(bytes) => bytes,
        Err(answer) => return answer,
    };
    let (token, digest) = session::new_token();
    let (answer, answered) = oneshot::channel();
    let request = HttpControl::Login {
        payload: payload.to_vec(),
        digest: digest.clone(),
        answer,
    };
    match api.ask(request, answered).await {
        Ok(Ok(opened)) => {
            let body = serde_json::json!({
                "operator": opened.operator,
                "role": opened.role.as_str(),
                "expires_in": session::TTL.as_secs(),
            });
            api.sessions.insert(digest, opened);
            (
                [(header::SET_COOKIE, session::set_cookie(&token, api.secure))],
                Json(body),
            )
                .into_response()
        }
        Ok(Err(HttpAnswer { status, reply })) => (status, Json(reply)).into_response(),
        Err(answer) => answer,
    }
}

async fn whoami(State(api): State<Api>, headers: HeaderMap) -> Response {
    match session(&api, &headers) {
        Ok(s) => Json(serde_json::json!({
            "operator": s.operator,
            "role": s.role.as_str(),
            "expires": s.expires,
        }))
        .into_response(),
        Err(answer) => answer,
    }
}

/// Ends the session here and in the store, so no coordinator takes it back.
async fn logout(State(api): State<Api>, headers: HeaderMap) -> Response {
    let mut answer = Json(serde_json::json!({ "ok": true })).into_response();
    if let Some(digest) = cookie_token(&headers).and_then(|token| api.sessions.close(token)) {
        let (sent, answered) = oneshot::channel();
        match api
            .ask(
                HttpControl::Logout {
                    digest,
                    answer: sent,
                },
                answered,
            )
            .await
        {
            Ok(HttpAnswer { status, reply }) if status != StatusCode::OK => {
                answer = (status, Json(reply)).into_response();
            }
            Ok(_) => {}
            Err(refusal) => answer = refusal,
        }
    }
    answer.headers_mut().insert(
        header::SET_COOKIE,
        header::HeaderValue::from_str(&session::clear_cookie()).expect("a valid header"),
    );
    answer
}

/// Runs a viewer command for the session's operator: the reply as JSON, with its status.
pub(super) async fn read(api: &Api, headers: &HeaderMap, command: Command) -> Response {
    let session = match session(api, headers) {
        Ok(session) => session,
        Err(answer) => return answer,
    };
    let (answer, answered) = oneshot::channel();
    let request = HttpControl::Read {
        operator: session.operator,
        command,
        answer,
    };
    match api.ask(request, answered).await {
        Ok(HttpAnswer { status, reply }) => (status, Json(reply)).into_response(),
        Err(answer) => answer,
    }
}

/// Reads are always paged: an answer never grows with the fleet.
pub(super) fn paged(mut page: PageQuery) -> PageQuery {
    page.limit.get_or_insert(DEFAULT_PAGE_LIMIT);
    page
}

async fn rollouts(
    State(api): State<Api>,
    headers: HeaderMap,
    Query(page): Query<PageQuery>,
) -> Response {
    let command = Command::RolloutStatus {
        rollout: None,
        page: paged(page),
    };
    read(&api, &headers, command).await
}

async fn rollout(
    State(api): State<Api>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Query(page): Query<PageQuery>,
) -> Response {
    let command = Command::RolloutStatus {
        rollout: Some(name),
        page: paged(page),
    };
    read(&api, &headers, command).await
}

async fn devices(
    State(api): State<Api>,
    headers: HeaderMap,
    Query(page): Query<PageQuery>,
) -> Response {
    let command = Command::ListDevices { page: paged(page) };
    read(&api, &headers, command).await
}

async fn approvals(
    State(api): State<Api>,
    headers: HeaderMap,
    Query(page): Query<PageQuery>,
) -> Response {
    let command = Command::ListApprovals { page: paged(page) };
    read(&api, &headers, command).await
}

async fn releases(
    State(api): State<Api>,
    headers: HeaderMap,
    Query(page): Query<PageQuery>,
) -> Response {
    let command = Command::ListReleases { page: paged(page) };
    read(&api, &headers, command).await
}

/// Ends a stream's count when the stream is dropped (the client went away, or fell behind).
struct Open(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Live events as server-sent events: `rollout` (a rollout's summary, on every change),
/// `approval` (a request, approved or denied) and `trace` (each decision). A client that falls
/// more than a few hundred events behind is cut off (its browser reconnects and reads the
/// state afresh); nothing is buffered for it without bound. The stream ends when the session
/// does.
async fn events(State(api): State<Api>, headers: HeaderMap) -> Response {
    let session = match session(&api, &headers) {
        Ok(session) => session,
        Err(answer) => return answer,
    };
    let Some(events) = &api.events else {
        return refused(StatusCode::SERVICE_UNAVAILABLE, api.unavailable.clone());
    };
    if api.streams.fetch_add(1, Ordering::SeqCst) >= MAX_STREAMS {
        api.streams.fetch_sub(1, Ordering::SeqCst);
        return refused(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{MAX_STREAMS} event streams are open already; try again later"),
        );
    }
    let open = Open(api.streams.clone());
    let receiver = events.subscribe();
    let sessions = api.sessions.clone();
    let token = cookie_token(&headers).unwrap_or_default().to_owned();
    tracing::debug!(operator = %session.operator, "event stream opened");
    let stream = futures_util::stream::unfold(
        (receiver, open, sessions, token),
        |(mut receiver, open, sessions, token)| async move {
            let event = loop {
                sessions.get(&token)?;
                tokio::select! {
                    received = receiver.recv() => match received {
                        Ok(event) => break event,
                        // Fell behind, or the coordinator stopped leading: the client
                        // reconnects and reads the state afresh.
                        Err(broadcast::error::RecvError::Lagged(_)
                            | broadcast::error::RecvError::Closed) => return None,
                    },
                    // A session that ended (logged out, expired) ends its stream soon after.
                    _ = tokio::time::sleep(SESSION_CHECK) => {}
                }
            };
            let frame = to_frame(&event);
            Some((
                Ok::<Event, Infallible>(frame),
                (receiver, open, sessions, token),
            ))
        },
    );
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

fn to_frame(event: &LiveEvent) -> Event {
    let (kind, json) = &**event;
    Event::default().event(*kind).data(json.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::http::session::Sessions;
    use flotilla_protocol::operator::Role;
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio_util::sync::CancellationToken;

    /// A server of the read routes with one open session; its address, the cookie, the live
    /// event sender.
    async fn serving(
        capacity: usize,
    ) -> (
        std::net::SocketAddr,
        String,
        broadcast::Sender<LiveEvent>,
        CancellationToken,
    ) {
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
        let (events, _) = broadcast::channel(capacity);
        let state = Api {
            events: Some(events.clone()),
            sessions,
            ..Api::metrics_only(None)
        };
        let router = routes(Router::new()).with_state(state);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stop = CancellationToken::new();
        tokio::spawn(crate::service::http::server::serve(
            listener,
            None,
            router,
            MAX_STREAMS + 64,
            stop.clone(),
        ));
        (addr, format!("{}={token}", session::COOKIE), events, stop)
    }

    async fn subscribe(addr: std::net::SocketAddr, cookie: &str) -> TcpStream {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let request = format!("GET /api/v1/events HTTP/1.1\r\nHost: c\r\nCookie: {cookie}\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("send");
        stream
    }

    async fn head(stream: &mut TcpStream) -> String {
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("an answer")
            .expect("read");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[tokio::test]
    async fn a_stream_that_falls_behind_is_cut_off_and_never_buffered() {
        let (addr, cookie, events, stop) = serving(4).await;
        let mut slow = subscribe(addr, &cookie).await;
        assert!(head(&mut slow).await.contains("text/event-stream"));
        // The receiver exists once the stream was polled; send far more than it may lag by.
        tokio::time::sleep(Duration::from_millis(200)).await;
        for i in 0..64 {
            let _ = events.send(Arc::new(("trace", format!("{{\"n\":{i}}}"))));
        }
        let mut rest = Vec::new();
        let ended =
            tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut rest)).await;
        assert!(ended.is_ok(), "cut off");
        let text = String::from_utf8_lossy(&rest);
        assert!(
            !text.contains("\"n\":63"),
            "not everything was buffered for it: {text}"
        );
        stop.cancel();
    }

    #[tokio::test]
    async fn streams_beyond_the_bound_are_refused_and_a_stream_needs_a_session() {
        let (addr, cookie, _events, stop) = serving(16).await;
        let mut open = Vec::new();
        for _ in 0..MAX_STREAMS {
            let mut stream = subscribe(addr, &cookie).await;
            assert!(head(&mut stream).await.contains(" 200 "));
            open.push(stream);
        }
        let mut one_more = subscribe(addr, &cookie).await;
        let answer = head(&mut one_more).await;
        assert!(answer.contains(" 503 "), "{answer}");
        assert!(
            answer.contains("event streams are open already"),
            "{answer}"
        );
        // Dropped clients give their places back.
        open.truncate(MAX_STREAMS - 10);
        drop(one_more);
        let mut again = None;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut stream = subscribe(addr, &cookie).await;
            if head(&mut stream).await.contains(" 200 ") {
                again = Some(stream);
                break;
            }
        }
        assert!(again.is_some(), "a place was given back");
        let mut anonymous = subscribe(addr, "flotilla_session=nope").await;
        assert!(head(&mut anonymous).await.contains(" 401 "));
        stop.cancel();
    }
}
