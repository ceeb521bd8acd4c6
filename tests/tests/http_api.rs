//! The coordinator's HTTP API from a real `flotilla serve` with real agents, as a release
//! pipeline uses it: `flotilla operator sign` makes each request, a plain HTTP POST sends it.
//! One authority: the same operator gate and roles as on MQTT, the same trace.

use std::time::Duration;

use flotilla_protocol::operator::Role;
use flotilla_tests::{bin, AgentOptions, BrokerKind, Site, ADMIN, WAIT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const FIRMWARE: &[u8] = b"firmware 2.0, started over HTTP\n";

/// One HTTP/1.1 exchange: the status code and the body. The body is written as far as the
/// server reads it (it may close early on an oversized one).
async fn exchange(port: u16, head: &str, body: &[u8]) -> (u16, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the HTTP port");
    let mut request = head.as_bytes().to_vec();
    request.extend_from_slice(body);
    let _ = stream.write_all(&request).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(WAIT, stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

async fn post(port: u16, content_type: &str, body: &[u8]) -> (u16, String) {
    let head = format!(
        "POST /api/v1/control HTTP/1.1\r\nHost: coordinator\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    exchange(port, &head, body).await
}

/// `flotilla operator sign COMMAND` with the key of `operator`.
fn sign(site: &Site, operator: &str, command: &str) -> String {
    let key = site.operator_key_file(operator);
    let out = site.flotilla(&[
        "--operator-key",
        &key.to_string_lossy(),
        "operator",
        "sign",
        command,
    ]);
    out.trim().to_owned()
}

/// Signs and posts `command` as `operator`; the status and the reply as JSON.
async fn call(site: &Site, port: u16, operator: &str, command: &str) -> (u16, serde_json::Value) {
    let envelope = sign(site, operator, command);
    let (status, body) = post(port, "application/json", envelope.as_bytes()).await;
    let reply = serde_json::from_str(&body)
        .unwrap_or_else(|e| panic!("the answer is a JSON reply ({e}): {status} {body}"));
    (status, reply)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_creates_and_starts_a_rollout_over_http_and_the_gate_refuses_what_mqtt_would() {
    let mut site = Site::new(BrokerKind::Embedded);
    let port = site.enable_http();
    site.add_operator("vic", Role::Viewer);
    site.release("fw-2", 2, FIRMWARE);
    site.release(
        "fw-3",
        3,
        b"firmware 3.0, started by the pipeline example\n",
    );
    site.start_coordinator();
    for id in ["dev-01", "dev-02"] {
        site.add_agent(id, &[("env", "http")], AgentOptions::default());
    }
    site.wait_devices(2).await;

    // Create and start, as a pipeline would.
    let spec =
        "name = \"over-http\"\nrelease = \"fw-2\"\nselect = \"env=http\"\n[groups]\ncount = 2\n";
    let create = serde_json::json!({ "command": "create_rollout", "spec": spec }).to_string();
    let (status, reply) = call(&site, port, ADMIN, &create).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(reply["result"]["name"], "over-http", "{reply}");
    let start = r#"{"command":"start_rollout","rollout":"over-http"}"#;
    let (status, reply) = call(&site, port, ADMIN, start).await;
    assert_eq!(status, 200, "{reply}");
    let ended = site.wait_ended("over-http").await;
    assert_eq!(ended.state, "finished", "{ended:#?}");

    // The same status over HTTP, to a viewer; the trace names who started it.
    let (status, reply) = call(
        &site,
        port,
        "vic",
        r#"{"command":"rollout_status","rollout":"over-http"}"#,
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["result"]["state"], "finished", "{reply}");
    let json = site.flotilla(&["rollout", "status", "over-http", "--json"]);
    let status: serde_json::Value = serde_json::from_str(&json).expect("status JSON");
    let by_admin = status["trace"]
        .as_array()
        .expect("a trace")
        .iter()
        .any(|entry| entry["by"] == ADMIN);
    assert!(
        by_admin,
        "the trace names the operator who started it over HTTP: {json}"
    );

    // The pipeline example of docs/operations.md, as shipped: starts a rollout and waits for it.
    let spec =
        "name = \"by-script\"\nrelease = \"fw-3\"\nselect = \"env=http\"\n[groups]\ncount = 1\n";
    let create = serde_json::json!({ "command": "create_rollout", "spec": spec }).to_string();
    assert_eq!(call(&site, port, ADMIN, &create).await.0, 200);
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/pipeline.sh");
    let bin_dir = bin("flotilla").parent().expect("bin dir").to_owned();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = tokio::process::Command::new("sh")
        .arg(&script)
        .arg("by-script")
        .env("PATH", path)
        .env("FLOTILLA_API", format!("http://127.0.0.1:{port}"))
        .env("FLOTILLA_POLL_SECONDS", "1")
        .env("FLOTILLA_OPERATOR_KEY", site.operator_key_file(ADMIN))
        .output();
    let out = tokio::time::timeout(WAIT, run)
        .await
        .expect("the pipeline ends")
        .expect("sh runs");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("by-script: finished"),
        "the pipeline example: {said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Refused as on MQTT, each with the status a client expects and the gate's reason.
    let (status, reply) = call(
        &site,
        port,
        "vic",
        r#"{"command":"stop_rollout","rollout":"over-http"}"#,
    )
    .await;
    assert_eq!(status, 403, "{reply}");
    assert!(
        reply["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("not allowed: operator vic has role viewer")),
        "{reply}"
    );
    let (status, reply) = call(
        &site,
        port,
        ADMIN,
        r#"{"command":"pause_rollout","rollout":"no-such"}"#,
    )
    .await;
    assert_eq!(status, 404, "{reply}");
    let envelope = sign(&site, ADMIN, r#"{"command":"list_approvals"}"#);
    let (first, _) = post(port, "application/json", envelope.as_bytes()).await;
    assert_eq!(first, 200);
    let (again, body) = post(port, "application/json", envelope.as_bytes()).await;
    assert_eq!(again, 401, "a replayed request: {body}");
    assert!(body.contains("replayed request"), "{body}");
    let forged = envelope.replacen("list_approvals", "list_strategies", 1);
    let (status, body) = post(port, "application/json", forged.as_bytes()).await;
    assert_eq!(status, 401, "a changed request: {body}");

    // Bad input: each answered with a reason, and the coordinator keeps answering.
    let (status, body) = post(port, "application/json", b"{not json").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("malformed request"), "{body}");
    let (status, body) = post(port, "text/plain", envelope.as_bytes()).await;
    assert_eq!(status, 415, "a form post cannot carry a request: {body}");
    let huge = vec![b'a'; 10 << 20];
    let (status, body) = post(port, "application/json", &huge).await;
    assert!(
        status == 413 || status == 0,
        "10 MB refused (or the connection cut): {status} {body}"
    );
    let (status, _) = exchange(port, "GET /nowhere HTTP/1.1\r\nHost: c\r\n\r\n", b"").await;
    assert_eq!(status, 404);
    // A client that sends half a body and stalls is cut off; the server goes on.
    let mut stalled = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    stalled
        .write_all(b"POST /api/v1/control HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"req")
        .await
        .expect("send half");

    // The OpenAPI document and the metrics are served on the same port.
    let (status, body) = exchange(
        port,
        "GET /api/openapi.json HTTP/1.1\r\nHost: c\r\n\r\n",
        b"",
    )
    .await;
    assert_eq!(status, 200);
    let doc: serde_json::Value = serde_json::from_str(&body).expect("OpenAPI is JSON");
    assert!(doc["paths"]["/api/v1/control"]["post"].is_object(), "{doc}");
    let (status, body) = exchange(port, "GET /metrics HTTP/1.1\r\nHost: c\r\n\r\n", b"").await;
    assert_eq!(status, 200);
    assert!(body.contains("flotilla_"), "{body}");
    let (status, reply) = call(&site, port, "vic", r#"{"command":"list_releases"}"#).await;
    assert_eq!(status, 200, "still answering: {reply}");
    let mut rest = Vec::new();
    let cut = tokio::time::timeout(Duration::from_secs(30), stalled.read_to_end(&mut rest)).await;
    assert!(cut.is_ok(), "the stalled client was cut off");
    assert!(
        String::from_utf8_lossy(&rest).contains(" 408 "),
        "told why: {}",
        String::from_utf8_lossy(&rest)
    );
}

/// Reads from `stream` until `text` has arrived, or `WAIT` has passed; what arrived.
async fn read_until(stream: &mut TcpStream, seen: &mut String, text: &str) -> bool {
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut buf = [0u8; 8192];
    while !seen.contains(text) {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
            _ => return false,
        }
    }
    true
}

/// A GET with `cookie` (if any): the status and the body.
async fn get_with(port: u16, path: &str, cookie: Option<&str>) -> (u16, String) {
    let cookie = cookie
        .map(|c| format!("Cookie: {c}\r\n"))
        .unwrap_or_default();
    exchange(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: c\r\n{cookie}\r\n"),
        b"",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_reads_and_follows_a_rollout_live_but_changes_nothing() {
    let mut site = Site::new(BrokerKind::Embedded);
    let port = site.enable_http();
    site.add_operator("vic", Role::Viewer);
    site.release("fw-2", 2, FIRMWARE);
    site.start_coordinator();
    for id in ["dev-01", "dev-02"] {
        site.add_agent(id, &[("env", "live")], AgentOptions::default());
    }
    site.wait_devices(2).await;

    // No session, no reads.
    let (status, body) = get_with(port, "/api/v1/rollouts", None).await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("no session"), "{body}");

    // A viewer logs in with a signed login request and gets a cookie scripts cannot read.
    let login = sign(&site, "vic", r#"{"command":"login"}"#);
    let head = format!(
        "POST /api/v1/session HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        login.len()
    );
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    stream
        .write_all(format!("{head}{login}").as_bytes())
        .await
        .expect("send");
    let mut answer = String::new();
    let _ = tokio::time::timeout(WAIT, async {
        let mut bytes = Vec::new();
        let _ = stream.read_to_end(&mut bytes).await;
        answer = String::from_utf8_lossy(&bytes).into_owned();
    })
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let set_cookie = answer
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .starts_with("set-cookie:")
                .then(|| l["set-cookie:".len()..].trim().to_owned())
        })
        .expect("a cookie");
    assert!(
        set_cookie.contains("HttpOnly") && set_cookie.contains("SameSite=Strict"),
        "{set_cookie}"
    );
    let cookie = set_cookie.split(';').next().expect("name=value").to_owned();
    // The same signed login again is a replay.
    let (status, body) = post(port, "application/json", login.as_bytes()).await;
    assert_eq!(status, 401, "control refuses the replay too: {body}");
    let (status, body) = get_with(port, "/api/v1/session", Some(&cookie)).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("\"operator\":\"vic\"") && body.contains("\"role\":\"viewer\""),
        "{body}"
    );

    // Live events: the viewer follows a rollout an operator starts, without asking again.
    let mut events = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    events
        .write_all(
            format!("GET /api/v1/events HTTP/1.1\r\nHost: c\r\nCookie: {cookie}\r\n\r\n")
                .as_bytes(),
        )
        .await
        .expect("subscribe");
    let mut seen = String::new();
    assert!(
        read_until(&mut events, &mut seen, "text/event-stream").await,
        "{seen}"
    );
    let spec = "name = \"live\"\nrelease = \"fw-2\"\nselect = \"env=live\"\n[groups]\ncount = 2\n";
    let create = serde_json::json!({ "command": "create_rollout", "spec": spec }).to_string();
    assert_eq!(call(&site, port, ADMIN, &create).await.0, 200);
    let start = r#"{"command":"start_rollout","rollout":"live"}"#;
    assert_eq!(call(&site, port, ADMIN, start).await.0, 200);
    assert!(
        read_until(&mut events, &mut seen, "rollout started by admin").await,
        "the trace came live: {seen}"
    );
    assert!(
        read_until(&mut events, &mut seen, "rollout live finished").await,
        "the rollout came live to its end: {seen}"
    );
    let ended = site.wait_ended("live").await;
    assert_eq!(ended.state, "finished", "{ended:#?}");
    assert!(
        seen.contains("event: rollout") && seen.contains("event: trace"),
        "{seen}"
    );

    // Paged reads in the session's name.
    let (status, body) = get_with(port, "/api/v1/rollouts/live?limit=1", Some(&cookie)).await;
    assert_eq!(status, 200, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(reply["result"]["status"]["state"], "finished", "{reply}");
    assert_eq!(
        reply["result"]["items"].as_array().map(Vec::len),
        Some(1),
        "{reply}"
    );
    assert!(reply["result"]["next"].is_string(), "a next page: {reply}");
    let (status, body) = get_with(port, "/api/v1/devices?select=env%3Dlive", Some(&cookie)).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("dev-01") && body.contains("dev-02"), "{body}");
    let (status, _) = get_with(port, "/api/v1/rollouts/nope", Some(&cookie)).await;
    assert_eq!(status, 404);

    // A session changes nothing: a change is a signed request, whatever cookie comes with it.
    let stop = r#"{"command":"stop_rollout","rollout":"live"}"#;
    let head = format!(
        "POST /api/v1/control HTTP/1.1\r\nHost: c\r\nCookie: {cookie}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        stop.len()
    );
    let (status, body) = exchange(port, &head, stop.as_bytes()).await;
    assert_eq!(
        status, 401,
        "an unsigned change with a session cookie: {body}"
    );
    assert!(body.contains("unsigned request"), "{body}");
    // Logged out: the cookie opens nothing any more, and the event stream ends.
    let head = format!("DELETE /api/v1/session HTTP/1.1\r\nHost: c\r\nCookie: {cookie}\r\n\r\n");
    let (status, _) = exchange(port, &head, b"").await;
    assert_eq!(status, 200);
    let (status, _) = get_with(port, "/api/v1/session", Some(&cookie)).await;
    assert_eq!(status, 401);
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(WAIT, events.read_to_end(&mut rest)).await;
    assert!(ended.is_ok(), "the event stream ended with the session");
    // A login must be a login.
    let other = sign(&site, "vic", r#"{"command":"list_releases"}"#);
    let head = format!(
        "POST /api/v1/session HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        other.len()
    );
    let (status, body) = exchange(port, &head, other.as_bytes()).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("signed login request"), "{body}");
}
