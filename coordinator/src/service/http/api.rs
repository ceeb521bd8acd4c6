//! The routes: `GET /metrics`, `GET /api/openapi.json`, and `POST /api/v1/control`, which takes
//! the same signed operator envelope as the MQTT control topic (`{"request", "key",
//! "signature"}`, made by `flotilla operator sign`) and answers the same `ControlReply`
//! (docs/operations.md, "The HTTP API"; decision 0055).
//!
//! Every body is bounded ([`state::MAX_BODY`](crate::service::http::state::MAX_BODY), read within
//! [`state::BODY_TIMEOUT`](crate::service::http::state::BODY_TIMEOUT)); a control request must say
//! `Content-Type: application/json`, which a cross-site form cannot send without the browser
//! asking first, so no other site can make a browser post one.

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::service::http::state::{is_json, read_body, refused, Api};
use crate::service::http::{artifacts, commands, console, reads, reads_devices};
use crate::service::metrics::CONTENT_TYPE;

/// The OpenAPI document, served as it is.
pub const OPENAPI: &str = include_str!("openapi.json");

/// Where the metrics are.
pub const METRICS: &str = "/metrics";
/// Where the OpenAPI document is.
pub const OPENAPI_PATH: &str = "/api/openapi.json";
/// Where control requests go.
pub const CONTROL: &str = "/api/v1/control";

/// Every route, as the OpenAPI document must list it: method and path (the OpenAPI form of a
/// path parameter).
pub const ROUTES: [(&str, &str); 21] = [
    ("get", METRICS),
    ("get", OPENAPI_PATH),
    ("post", CONTROL),
    ("post", "/api/v1/session"),
    ("get", "/api/v1/session"),
    ("delete", "/api/v1/session"),
    ("get", "/api/v1/rollouts"),
    ("get", "/api/v1/rollouts/{name}"),
    ("get", "/api/v1/devices"),
    ("get", "/api/v1/devices/{id}"),
    ("get", "/api/v1/enrollment"),
    ("get", "/api/v1/approvals"),
    ("get", "/api/v1/releases"),
    ("get", "/api/v1/events"),
    ("get", "/console"),
    ("get", "/console/app.js"),
    ("get", "/console/devices.js"),
    ("get", "/console/queues.js"),
    ("get", "/console/releases.js"),
    ("get", "/console/style.css"),
    ("get", "/artifacts/{sha256}"),
];

/// The routes of one listener: `/metrics` always; with `api`, the HTTP API and its document.
/// Without the service loop's inbox (`state.control`, a standby's) the API answers `503` with
/// `state.unavailable`.
pub fn router(state: Api, api: bool) -> Router {
    let mut router = Router::new().route(METRICS, get(scrape));
    if api {
        router = router
            .route(OPENAPI_PATH, get(openapi))
            .route(CONTROL, post(run_control));
        router = reads::routes(router);
        router = reads_devices::routes(router);
        router = commands::routes(router);
        router = console::routes(router);
        router = artifacts::routes(router);
    }
    router.fallback(not_found).with_state(state)
}

async fn scrape(State(api): State<Api>, method: Method) -> Response {
    let Some(metrics) = &api.metrics else {
        return text(StatusCode::NOT_FOUND, "not found: no metrics here\n");
    };
    let body = if method == Method::HEAD {
        String::new()
    } else {
        metrics.render().await
    };
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response()
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn not_found() -> Response {
    text(
        StatusCode::NOT_FOUND,
        "not found: see /api/openapi.json for what is served\n",
    )
}

fn text(status: StatusCode, body: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body.to_owned(),
    )
        .into_response()
}

async fn run_control(State(api): State<Api>, headers: HeaderMap, body: Body) -> Response {
    if !is_json(&headers) {
        return refused(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "a control request is JSON: send it with Content-Type: application/json".into(),
        );
    }
    let payload = match read_body(body).await {
        Ok(bytes) => bytes,
        Err(answer) => return answer,
    };
    api.run_signed(&payload).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::metrics::{Malformed, Metrics};
    use flotilla_protocol::Topics;
    use std::net::SocketAddr;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio_util::sync::CancellationToken;

    /// A listener on a free loopback port, serving `metrics` until the token is cancelled.
    async fn serving(metrics: &Metrics) -> (SocketAddr, CancellationToken) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let token = CancellationToken::new();
        let router = router(Api::metrics_only(Some(metrics.endpoint())), false);
        tokio::spawn(crate::service::http::server::serve(
            listener,
            None,
            router,
            16,
            token.clone(),
        ));
        (addr, token)
    }

    /// Sends `request` and reads until the server closes.
    async fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        // The server may close before reading everything of an oversized request.
        let _ = stream.write_all(request).await;
        read_all(&mut stream).await
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
    async fn get_metrics_answers_the_registry_as_openmetrics() {
        let mut metrics = Metrics::new();
        let topics = Topics::default();
        drop(metrics.received(&topics, "flotilla/v1/devices/dev-1/report"));
        metrics.malformed(Malformed::Undecodable);
        let (addr, token) = serving(&metrics).await;
        let answer = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert_eq!(status_line(&answer), "HTTP/1.1 200 OK", "{answer}");
        assert!(
            answer
                .to_ascii_lowercase()
                .contains("content-type: application/openmetrics-text"),
            "{answer}"
        );
        assert!(
            answer.contains("flotilla_messages_received_total{topic=\"report\"} 1"),
            "{answer}"
        );
        assert!(
            answer.contains("flotilla_messages_malformed_total{reason=\"undecodable\"} 1"),
            "{answer}"
        );
        assert!(answer.trim_end().ends_with("# EOF"), "{answer}");
        let (head, body) = answer.split_once("\r\n\r\n").expect("head and body");
        let length: usize = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length: ")
                    .map(str::to_owned)
            })
            .and_then(|n| n.parse().ok())
            .expect("content length");
        assert_eq!(length, body.len());
        // HEAD: the same head, no body.
        let answer = exchange(addr, b"HEAD /metrics HTTP/1.1\r\n\r\n").await;
        let (head, body) = answer.split_once("\r\n\r\n").expect("a head");
        assert!(head.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(body.is_empty(), "{answer}");
        token.cancel();
    }

    /// Every command of the control API, read from the one place that names them all.
    fn command_names() -> Vec<String> {
        let source = include_str!("../../../../protocol/src/operator.rs");
        let start = source.find("pub fn name(&self)").expect("Command::name");
        let body = &source[start..];
        let body = &body[..body.find("\n    }\n").expect("end of name")];
        body.split("=> \"")
            .skip(1)
            .filter_map(|rest| rest.split('"').next())
            .map(str::to_owned)
            .collect()
    }

    /// Every route the document lists is served: none answers 404 or 405 (without a session or
    /// a body they answer 401, 415 or 503, which is the point: they are there).
    #[tokio::test]
    async fn every_documented_route_is_served() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let token = CancellationToken::new();
        let state = Api::metrics_only(Some(Metrics::new().endpoint()));
        tokio::spawn(crate::service::http::server::serve(
            listener,
            None,
            router(state, true),
            16,
            token.clone(),
        ));
        let per_command: Vec<(&str, String)> = command_names()
            .into_iter()
            .map(|c| ("post", format!("{}{c}", commands::PREFIX)))
            .collect();
        let routes = ROUTES
            .iter()
            .map(|(m, p)| (*m, p.to_string()))
            .chain(per_command);
        for (method, path) in routes {
            let path = path.replace("{name}", "fw-2").replace("{id}", "dev-1");
            let request = format!(
                "{} {path} HTTP/1.1\r\nHost: c\r\nContent-Length: 0\r\n\r\n",
                method.to_uppercase()
            );
            let answer = exchange(addr, request.as_bytes()).await;
            let status = status_line(&answer);
            assert!(
                !status.contains(" 404 ") && !status.contains(" 405 "),
                "{method} {path}: {answer}"
            );
        }
        token.cancel();
    }

    #[test]
    fn the_openapi_document_lists_every_route_and_every_command() {
        let doc: serde_json::Value = serde_json::from_str(OPENAPI).expect("OpenAPI is JSON");
        assert_eq!(doc["openapi"], "3.0.3");
        let paths = doc["paths"].as_object().expect("paths");
        for (method, path) in ROUTES {
            assert!(
                paths[path][method].is_object(),
                "{method} {path} is not documented"
            );
        }
        let served: std::collections::BTreeSet<&str> = ROUTES.iter().map(|(_, p)| *p).collect();
        // Every command has its own path, whose signed request names exactly that command.
        for command in command_names() {
            let path = format!("{}{command}", commands::PREFIX);
            let post = &doc["paths"][path.as_str()]["post"];
            assert!(post.is_object(), "post {path} is not documented");
            assert_eq!(
                post["requestBody"]["content"]["application/json"]["schema"]["$ref"],
                "#/components/schemas/SignedRequest",
                "{path} takes the signed envelope"
            );
            let schema = post["x-signed-request"]["$ref"]
                .as_str()
                .and_then(|r| r.strip_prefix("#/components/schemas/"))
                .unwrap_or_else(|| panic!("{path} names the schema of its signed request"));
            let inner = &doc["components"]["schemas"][schema]["allOf"][1];
            assert_eq!(
                inner["properties"]["command"]["enum"],
                serde_json::json!([command]),
                "{schema} is the request of {command}"
            );
            for code in ["200", "400", "401", "403", "413", "415"] {
                assert!(
                    post["responses"][code].is_object(),
                    "{path}: status {code} is not documented"
                );
            }
        }
        assert_eq!(
            paths.len(),
            served.len() + command_names().len(),
            "documented paths that are not served"
        );
        assert!(
            paths.keys().all(|p| served.contains(p.as_str())
                || p.strip_prefix(commands::PREFIX)
                    .is_some_and(|c| command_names().iter().any(|n| n == c))),
            "a documented path that is neither a route nor a command"
        );
        let documented: Vec<String> = doc["components"]["schemas"]["ControlRequest"]["properties"]
            ["command"]["enum"]
            .as_array()
            .expect("the command enum")
            .iter()
            .filter_map(|c| c.as_str().map(str::to_owned))
            .collect();
        let commands = command_names();
        assert!(commands.len() >= 25, "{commands:?}");
        assert_eq!(
            documented, commands,
            "the document's commands are the protocol's"
        );
        for code in [
            "200", "400", "401", "403", "404", "409", "413", "415", "429", "503",
        ] {
            assert!(
                paths[CONTROL]["post"]["responses"][code].is_object(),
                "status {code} is not documented"
            );
        }
    }
}
