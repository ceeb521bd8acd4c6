//! HTTP origins for the tests of artifacts fetched over HTTP (decision 0062): a small origin in
//! the harness that answers range requests well or badly on purpose, and Python's
//! `http.server`, a plain static server that ignores `Range` (it answers `200` with the whole
//! file), started as a process of the site.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::site::{Process, Site};
use crate::WAIT;

/// How the harness origin answers a range request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serves {
    /// `206` with the bytes asked for.
    Ranges,
    /// `206` with the range asked for, one byte flipped in every range that starts at or
    /// after this offset.
    CorruptFrom(u64),
    /// Reads the request and never answers.
    Silent,
    /// Serves this many requests, then answers `404 Not Found` to every one.
    NotFoundAfter(usize),
}

/// An origin serving the files of a directory on a free loopback port, until dropped.
pub struct Origin {
    pub port: u16,
    /// `(first byte, last byte)` of every range asked for, in order.
    pub ranges: Arc<Mutex<Vec<(u64, u64)>>>,
    stop: Arc<AtomicBool>,
}

impl Drop for Origin {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

impl Origin {
    /// Serves the files of `dir` as `http://127.0.0.1:{port}/{file}`.
    pub fn start(dir: PathBuf, serves: Serves) -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the origin");
        let port = listener.local_addr().expect("addr").port();
        let ranges = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicUsize::new(0));
        let (r, s) = (ranges.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let (dir, r, served) = (dir.clone(), r.clone(), served.clone());
                std::thread::spawn(move || {
                    let _ = connection(conn, &dir, serves, &r, &served);
                });
            }
        });
        Origin { port, ranges, stop }
    }

    /// The URL of `file` at this origin.
    pub fn url(&self, file: &str) -> String {
        format!("http://127.0.0.1:{}/{file}", self.port)
    }

    /// The ranges asked for so far.
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        self.ranges.lock().expect("ranges").clone()
    }
}

fn connection(
    conn: TcpStream,
    dir: &std::path::Path,
    serves: Serves,
    ranges: &Mutex<Vec<(u64, u64)>>,
    served: &AtomicUsize,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut out = conn;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line)? == 0 {
            return Ok(());
        }
        let path = request_line
            .split(' ')
            .nth(1)
            .unwrap_or("/")
            .trim_start_matches('/')
            .to_owned();
        let mut range = None;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 {
                return Ok(());
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some(r) = line
                .strip_prefix("Range: bytes=")
                .or(line.strip_prefix("range: bytes="))
            {
                if let Some((a, b)) = r.split_once('-') {
                    range = a.parse::<u64>().ok().zip(b.parse::<u64>().ok());
                }
            }
        }
        if serves == Serves::Silent {
            // Holds the connection open, answering nothing, until the client gives up.
            let mut sink = [0; 1024];
            while reader.read(&mut sink)? > 0 {}
            return Ok(());
        }
        let n = served.fetch_add(1, Ordering::SeqCst);
        let data = if path.contains('/') || path.contains("..") {
            None
        } else {
            std::fs::read(dir.join(&path)).ok()
        };
        let not_found = matches!(serves, Serves::NotFoundAfter(k) if n >= k);
        let (Some(data), Some((a, b)), false) = (data, range, not_found) else {
            out.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")?;
            continue;
        };
        ranges.lock().expect("ranges").push((a, b));
        let end = b.min(data.len() as u64 - 1);
        let mut body = data[a as usize..=end as usize].to_vec();
        if let Serves::CorruptFrom(from) = serves {
            if a >= from {
                body[0] ^= 0xff;
            }
        }
        let head = format!(
            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{end}/{}\r\n\
             Content-Length: {}\r\n\r\n",
            data.len(),
            body.len()
        );
        out.write_all(head.as_bytes())?;
        out.write_all(&body)?;
    }
}

impl Site {
    /// Starts `python3 -m http.server` serving `dir` on a free loopback port (process
    /// `python-http`, killed with the site) and waits until it accepts connections. Panics
    /// when python3 is missing: the test is about that server.
    pub fn start_python_http_server(&mut self, dir: &std::path::Path) -> u16 {
        let port = crate::free_port();
        let mut command = Command::new("python3");
        command
            .args([
                "-m",
                "http.server",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .arg("--directory")
            .arg(dir);
        let process = Process::spawn(command, self.path("python-http.log"));
        if let Some(mut old) = self.named.insert("python-http".to_owned(), process) {
            old.kill();
        }
        let started = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < WAIT,
                "python3 -m http.server did not listen on {port} (is python3 installed?)"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        port
    }
}
