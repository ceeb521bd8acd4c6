//! A real browser for the console tests: Debian's headless Chromium driven by its ChromeDriver
//! over the W3C WebDriver protocol (JSON over HTTP on a free port). A small client of our own:
//! the handful of commands the tests use, with no crate that could fetch a browser of its own.
//!
//! With `FLOTILLA_REQUIRE_TOOLS=1` (CI, whose `.ci/run` installs `chromium` and
//! `chromium-driver`) a missing browser fails the test; elsewhere the skip is loud.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::free_port;

/// The key WebDriver names an element by.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// Whether Chromium and ChromeDriver are installed; see the module docs for what happens when
/// they are not.
pub fn require_browser(test: &str) -> bool {
    let missing: Vec<&str> = ["/usr/bin/chromium", "/usr/bin/chromedriver"]
        .into_iter()
        .filter(|p| !Path::new(p).is_file())
        .collect();
    if missing.is_empty() {
        return true;
    }
    if std::env::var_os("FLOTILLA_REQUIRE_TOOLS").is_some() || std::env::var_os("CI").is_some() {
        panic!(
            "{test}: {missing:?} not installed; .ci/run must install chromium and chromium-driver"
        );
    }
    eprintln!("\n!!!! SKIPPED {test}: {missing:?} not installed (apt-get install chromium chromium-driver)");
    false
}

/// A headless Chromium session; the driver and the browser stop when it is dropped.
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
    _profile: tempfile::TempDir,
}

/// A page element, by WebDriver's reference.
#[derive(Debug, Clone)]
pub struct Element(String);

impl Browser {
    /// Starts ChromeDriver on a free port and a headless Chromium with an empty profile.
    pub fn start() -> Browser {
        let port = free_port();
        let driver = Command::new("/usr/bin/chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "chromedriver did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let profile = tempfile::tempdir().expect("profile dir");
        // The flags Chromium needs here: no sandbox as root, and no background connections,
        // which this machine's closed network refuses.
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1280,1000",
            &format!("--user-data-dir={}", profile.path().display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": "/usr/bin/chromium", "args": args}
        }}});
        let mut browser = Browser {
            driver,
            port,
            session: String::new(),
            _profile: profile,
        };
        let answer = browser.call("POST", "/session", &caps);
        browser.session = answer["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("a WebDriver session: {answer}"))
            .to_owned();
        browser
    }

    /// One WebDriver command: the `value` of its answer; panics with the driver's error.
    fn call(&self, method: &str, path: &str, body: &Value) -> Value {
        self.try_call(method, path, body)
            .unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"))
    }

    /// One WebDriver command: the `value` of its answer, or the driver's error.
    fn try_call(&self, method: &str, path: &str, body: &Value) -> Result<Value, String> {
        let body = body.to_string();
        let mut stream =
            TcpStream::connect(("127.0.0.1", self.port)).expect("connect to chromedriver");
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream
            .write_all(request.as_bytes())
            .expect("send to chromedriver");
        let answer = read_answer(&mut stream);
        let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)
        } else {
            body.to_owned()
        };
        let value: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("chromedriver answered no JSON ({e}): {answer}"));
        if value["value"]["error"].is_string() {
            return Err(value["value"].to_string());
        }
        Ok(value["value"].clone())
    }

    fn session_path(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    pub fn goto(&self, url: &str) {
        self.call("POST", &self.session_path("/url"), &json!({ "url": url }));
    }

    /// Logs in to the console at `url` as a person does: `key_file` chosen in the form, the
    /// login signed in the page; returns once the header names an operator starting with
    /// `operator`.
    pub fn log_in(&self, url: &str, key_file: &Path, operator: &str, within: Duration) {
        self.goto(url);
        let file = self.wait_for("#keyfile", within).expect("the login form");
        self.send_keys(&file, &key_file.to_string_lossy());
        self.click_text("#login-button", "Log in", within);
        self.wait_text("#who", within, |t| t.starts_with(operator));
    }

    /// The first element matching `css`, if there is one now.
    pub fn find(&self, css: &str) -> Option<Element> {
        let found = self.call(
            "POST",
            &self.session_path("/elements"),
            &json!({"using": "css selector", "value": css}),
        );
        found
            .as_array()
            .and_then(|all| all.first())
            .and_then(|e| e[ELEMENT].as_str())
            .map(|id| Element(id.to_owned()))
    }

    /// Waits up to `within` for an element matching `css`.
    pub fn wait_for(&self, css: &str, within: Duration) -> Option<Element> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(element) = self.find(css) {
                return Some(element);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits up to `within` for an element matching `css` whose text satisfies `wanted`; its
    /// text. Panics naming what it waited for and the page's text.
    pub fn wait_text(&self, css: &str, within: Duration, wanted: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + within;
        loop {
            // The page redraws as events come: an element found may be gone when its text is
            // read, and is looked for again.
            if let Some(element) = self.find(css) {
                let path = self.session_path(&format!("/element/{}/text", element.0));
                if let Ok(text) = self.try_call("GET", &path, &json!({})) {
                    let text = text.as_str().unwrap_or_default().to_owned();
                    if wanted(&text) {
                        return text;
                    }
                }
            }
            if Instant::now() > deadline {
                let body = self.find("body").map(|b| self.text(&b)).unwrap_or_default();
                panic!("no {css:?} with the wanted text within {within:?}; the page says:\n{body}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Clicks the element matching `css` whose text is `label`, waiting up to `within` for it.
    /// The page redraws as events come, so an element found may be gone by the time it is
    /// clicked; it is looked for again.
    pub fn click_text(&self, css: &str, label: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if let Some(element) = self.find(css) {
                let text_path = self.session_path(&format!("/element/{}/text", element.0));
                let click_path = self.session_path(&format!("/element/{}/click", element.0));
                let text = self.try_call("GET", &text_path, &json!({}));
                if text.is_ok_and(|t| t.as_str() == Some(label))
                    && self.try_call("POST", &click_path, &json!({})).is_ok()
                {
                    return;
                }
            }
            if Instant::now() > deadline {
                let body = self.find("body").map(|b| self.text(&b)).unwrap_or_default();
                panic!("no {css:?} reading {label:?} to click within {within:?}; the page says:\n{body}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn text(&self, element: &Element) -> String {
        self.call(
            "GET",
            &self.session_path(&format!("/element/{}/text", element.0)),
            &json!({}),
        )
        .as_str()
        .unwrap_or_default()
        .to_owned()
    }

    pub fn click(&self, element: &Element) {
        self.call(
            "POST",
            &self.session_path(&format!("/element/{}/click", element.0)),
            &json!({}),
        );
    }

    /// Types `text` into an element; for a file input, `text` is the path of the file to choose.
    pub fn send_keys(&self, element: &Element, text: &str) {
        self.call(
            "POST",
            &self.session_path(&format!("/element/{}/value", element.0)),
            &json!({ "text": text }),
        );
    }

    /// Runs `script` in the page and returns what it returns.
    pub fn execute(&self, script: &str) -> Value {
        self.call(
            "POST",
            &self.session_path("/execute/sync"),
            &json!({"script": script, "args": []}),
        )
    }

    /// Resizes the window to `width` x `height` CSS pixels (a phone's, a laptop's).
    pub fn set_window_size(&self, width: u32, height: u32) {
        self.call(
            "POST",
            &self.session_path("/window/rect"),
            &json!({"width": width, "height": height}),
        );
    }

    /// Saves a PNG of the page to `path`.
    pub fn screenshot(&self, path: &Path) {
        let data = self.call("GET", &self.session_path("/screenshot"), &json!({}));
        let png = base64_decode(data.as_str().unwrap_or_default());
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("screenshot dir");
        }
        std::fs::write(path, png).expect("write screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let path = self.session_path("");
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.call("DELETE", &path, &json!({}))
            }));
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// Where the console tests save their screenshots: `$CARGO_TARGET_DIR/screenshots`.
pub fn screenshot_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("screenshots")
}

/// Reads one HTTP answer: its head, then as many body bytes as `Content-Length` says (the driver
/// keeps the connection open), or to the end without one.
fn read_answer(stream: &mut TcpStream) -> String {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = stream.read(&mut buf).expect("read chromedriver's answer");
        if n == 0 {
            break;
        }
        bytes.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&bytes);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse::<usize>().ok())
                    .flatten()
            });
            if length.is_some_and(|len| body.len() >= len) {
                break;
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || after.len() < size {
            break;
        }
        out.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    out
}

fn base64_decode(text: &str) -> Vec<u8> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut bits, mut count) = (0u32, 0);
    for b in text.bytes() {
        let Some(v) = ALPHABET.iter().position(|a| *a == b) else {
            continue;
        };
        bits = (bits << 6) | v as u32;
        count += 6;
        if count >= 8 {
            count -= 8;
            out.push((bits >> count) as u8);
        }
    }
    out
}
