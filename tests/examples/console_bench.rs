//! The client side of bench/console.sh: the console's figures against a running coordinator.
//! Not a test and not shipped; the script builds and runs it.
//!
//! ```text
//! console_bench mqtt --broker-port P --key FILE --rollout NAME [--rounds 20]
//!     The same first pages as the HTTP API serves, asked on the MQTT control API over one
//!     connection (signed, as the CLI asks): devices (500), rollouts (200), a rollout and 200 of
//!     its devices. Prints `NAME_p50_ms: X` and `NAME_p99_ms: Y` lines.
//! console_bench browser --url http://127.0.0.1:PORT --key FILE --rollout NAME [--loads 10]
//!                       [--live PROBE --cookie TOKEN --out DIR --stop FILE]
//!     Logs in on the console in Debian's headless Chromium (the operator's key file, as a
//!     person does), then loads the rollouts page and the rollout page --loads times each, from
//!     a blank page: the time from navigation to the page's rows being drawn. With --live, opens
//!     the rollout page of PROBE with a MutationObserver on its device rows and a plain
//!     server-sent events client of its own, writes DIR/ready, and when FILE exists writes
//!     DIR/sse.times (when each `rollout` event of PROBE arrived) and DIR/dom.times (when the
//!     page redrew its device rows, and what they said), Unix seconds, one a line.
//! ```

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use flotilla_coordinator::cli::client::ControlClient;
use flotilla_protocol::control::{Command, PageQuery};
use flotilla_tests::webdriver::{require_browser, Browser};

const WAIT: Duration = Duration::from_secs(60);

/// The page's Navigation and Resource Timing, in ms from navigation start: when the HTML was
/// answered, when the document was parsed and its script ran, and each API read's start-end.
const TIMING: &str = r#"
    const nav = performance.getEntriesByType("navigation")[0];
    const reads = performance.getEntriesByType("resource")
      .filter((r) => r.name.includes("/api/v1/") && !r.name.includes("/events"))
      .map((r) => new URL(r.name).pathname.replace("/api/v1/", "") + " " + Math.round(r.startTime) + "-" + Math.round(r.responseEnd));
    return "html " + Math.round(nav.responseEnd) + ", parsed " + Math.round(nav.domContentLoadedEventEnd) +
      ", loaded " + Math.round(nav.loadEventEnd) + ", reads " + reads.join(", ") + ", seen " + Math.round(performance.now());
"#;

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_default();
    let mut opts = HashMap::new();
    while let Some(flag) = args.next() {
        let Some(name) = flag.strip_prefix("--") else {
            fail(&format!("unexpected argument {flag:?}"));
        };
        let value = args
            .next()
            .unwrap_or_else(|| fail(&format!("--{name} needs a value")));
        opts.insert(name.to_owned(), value);
    }
    let opts = Opts(opts);
    match mode.as_str() {
        "mqtt" => mqtt(&opts),
        "browser" => browser(&opts),
        _ => fail("usage: console_bench mqtt|browser [--flag value]... (see the source's docs)"),
    }
}

fn fail(why: &str) -> ! {
    eprintln!("console_bench: {why}");
    std::process::exit(2)
}

struct Opts(HashMap<String, String>);

impl Opts {
    fn get(&self, name: &str) -> &str {
        self.0
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| fail(&format!("--{name} is required")))
    }
    fn opt(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }
    fn number(&self, name: &str, default: usize) -> usize {
        self.opt(name).map_or(default, |v| {
            v.parse()
                .unwrap_or_else(|_| fail(&format!("--{name} {v:?}: not a number")))
        })
    }
}

/// The p-th percentile (nearest rank) of `samples` in milliseconds.
fn percentile(samples: &[f64], p: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn print_figures(name: &str, samples: &[f64]) {
    println!("{name}_p50_ms: {:.1}", percentile(samples, 50.0));
    println!("{name}_p99_ms: {:.1}", percentile(samples, 99.0));
    println!("{name}_n: {}", samples.len());
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

// ---- the MQTT control API ------------------------------------------------------------------

fn mqtt(opts: &Opts) {
    let port: u16 = opts
        .get("broker-port")
        .parse()
        .unwrap_or_else(|_| fail("--broker-port: not a port"));
    let text = std::fs::read_to_string(opts.get("key")).unwrap_or_else(|e| fail(&e.to_string()));
    let key = flotilla_protocol::signing::secret_key_from_text(&text)
        .unwrap_or_else(|e| fail(&format!("--key: {e}")));
    let rollout = opts.get("rollout").to_owned();
    let rounds = opts.number("rounds", 20);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async move {
        let client = ControlClient::connect("127.0.0.1", port, "flotilla", key)
            .await
            .unwrap_or_else(|e| fail(&format!("connect: {e}")));
        let page = |limit| PageQuery {
            limit: Some(limit),
            ..PageQuery::default()
        };
        let asks = [
            ("mqtt_devices", Command::ListDevices { page: page(500) }),
            (
                "mqtt_rollouts",
                Command::RolloutStatus {
                    rollout: None,
                    page: page(200),
                },
            ),
            (
                "mqtt_rollout",
                Command::RolloutStatus {
                    rollout: Some(rollout),
                    page: page(200),
                },
            ),
        ];
        for (name, command) in asks {
            let mut samples = Vec::new();
            for _ in 0..rounds {
                let started = Instant::now();
                let reply = client.request_reply(command.clone(), WAIT).await;
                let ms = started.elapsed().as_secs_f64() * 1000.0;
                match reply {
                    Ok(reply) if reply.ok => samples.push(ms),
                    Ok(reply) => eprintln!("console_bench: {name} refused: {:?}", reply.error),
                    Err(e) => eprintln!("console_bench: {name}: {e}"),
                }
                // Well inside the admin key's rate limit: what is timed is the answer, not a
                // refusal.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            print_figures(name, &samples);
        }
    });
}

// ---- the browser ---------------------------------------------------------------------------

fn browser(opts: &Opts) {
    if !require_browser("console_bench") {
        fail("chromium and chromedriver are needed (apt-get install chromium chromium-driver)");
    }
    let base = opts.get("url").trim_end_matches('/').to_owned();
    let console = format!("{base}/console");
    let key = opts.get("key").to_owned();
    let rollout = opts.get("rollout").to_owned();
    let loads = opts.number("loads", 10);
    let browser = Browser::start();

    // Log in as a person does: the key file chosen in the form, signed in the page.
    browser.log_in(&console, std::path::Path::new(&key), "", WAIT);

    let pages = [
        (
            "render_rollouts",
            format!("{console}#/"),
            format!("[data-rollout=\"{rollout}\"]"),
        ),
        (
            "render_rollout",
            format!("{console}#/rollouts/{rollout}"),
            "#device-rows tr".to_owned(),
        ),
    ];
    for (name, url, drawn) in &pages {
        let mut samples = Vec::new();
        let mut breakdowns = Vec::new();
        for _ in 0..loads {
            // A page left for another stays in Chromium's back-forward cache with its event
            // stream open, and Chromium opens at most 6 HTTP/1.1 connections to one host: the
            // sixth load would wait for a cached page's stream to be dropped (about 25 s). A page
            // with an unload handler is not cached, so every load starts as a new visit does.
            browser.execute("window.addEventListener('unload', () => {}); return 0;");
            browser.goto("about:blank");
            let started = Instant::now();
            browser.goto(url);
            loop {
                if browser.find(drawn).is_some() {
                    break;
                }
                if started.elapsed() > WAIT {
                    fail(&format!("{name}: {drawn} not drawn within {WAIT:?}"));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            samples.push(started.elapsed().as_secs_f64() * 1000.0);
            // Where the time went, by the page's own clock (ms from navigation start): the
            // HTML's answer, the script run, the API reads (start-end, server time included).
            let timing = browser.execute(TIMING);
            breakdowns.push(timing.as_str().unwrap_or_default().to_owned());
        }
        // What the page shows, as a check that it is the page meant.
        let text = browser
            .find(drawn)
            .map(|e| browser.text(&e))
            .unwrap_or_default();
        println!("{name}_row: {}", text.replace('\n', " "));
        print_figures(name, &samples);
        let all: Vec<String> = samples.iter().map(|ms| format!("{ms:.0}")).collect();
        println!("{name}_samples: {}", all.join(" "));
        // The breakdown of the load nearest the median.
        let median = percentile(&samples, 50.0);
        if let Some(i) = samples.iter().position(|ms| *ms == median) {
            println!("{name}_breakdown: {}", breakdowns[i]);
        }
    }

    if let Some(probe) = opts.opt("live") {
        live(opts, &browser, &console, probe);
    }
}

/// Follows PROBE's page and a plain event stream until the stop file appears.
fn live(opts: &Opts, browser: &Browser, console: &str, probe: &str) {
    let out = PathBuf::from(opts.get("out"));
    let stop = PathBuf::from(opts.get("stop"));
    let cookie = opts.get("cookie").to_owned();
    let base = opts.get("url").trim_end_matches('/').to_owned();
    browser.goto(&format!("{console}#/rollouts/{probe}"));
    browser.wait_text("#rollout-name", WAIT, |t| t == probe);
    browser
        .wait_for("#device-rows tr", WAIT)
        .expect("the probe's device rows");
    // Every redraw of the device rows, with what they say (a redraw replaces them all).
    let observer = r#"
        window.__redraws = [];
        const rows = document.getElementById("device-rows");
        new MutationObserver(() => {
          const text = Array.from(rows.querySelectorAll("tr"),
            (tr) => tr.getAttribute("data-device") + "=" + (tr.children[2] ? tr.children[2].textContent : "")).join(" ");
          window.__redraws.push([Date.now(), text]);
        }).observe(rows, { childList: true, subtree: true, characterData: true });
        return rows.children.length;
    "#;
    browser.execute(observer);

    // A plain client of the event stream, as curl -N would be, timestamping each event.
    let sse_out = out.join("sse.times");
    let addr = base
        .strip_prefix("http://")
        .unwrap_or_else(|| fail("--url must be http://HOST:PORT"))
        .to_owned();
    let probe_name = format!("\"name\":\"{probe}\"");
    let (opened, is_open) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut stream = TcpStream::connect(&addr).expect("connect for events");
        let request = format!(
            "GET /api/v1/events HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\nCookie: flotilla_session={cookie}\r\n\r\n"
        );
        stream
            .write_all(request.as_bytes())
            .expect("ask for events");
        let mut file = std::fs::File::create(&sse_out).expect("sse.times");
        let mut lines = BufReader::new(stream).lines();
        let mut kind = String::new();
        let mut told = false;
        while let Some(Ok(line)) = lines.next() {
            let at = now_s();
            if !told && line.is_empty() {
                // The end of the answer's head: the stream is open.
                let _ = opened.send(());
                told = true;
            }
            if let Some(k) = line.strip_prefix("event:") {
                kind = k.trim().to_owned();
            } else if line.starts_with("data:") && kind == "rollout" && line.contains(&probe_name) {
                let _ = writeln!(file, "{at:.6}");
                let _ = file.flush();
            }
        }
    });
    is_open
        .recv_timeout(WAIT)
        .unwrap_or_else(|_| fail("the event stream did not open"));
    std::fs::write(out.join("ready"), b"ready\n").expect("write ready");

    let deadline = Instant::now() + Duration::from_secs(1800);
    while !stop.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let redraws = browser.execute("return window.__redraws || [];");
    let mut dom = std::fs::File::create(out.join("dom.times")).expect("dom.times");
    for entry in redraws.as_array().into_iter().flatten() {
        let ms = entry[0].as_f64().unwrap_or_default();
        let text = entry[1].as_str().unwrap_or_default();
        writeln!(dom, "{:.3}\t{text}", ms / 1000.0).expect("write dom.times");
    }
    println!("live_redraws: {}", redraws.as_array().map_or(0, Vec::len));
}
