//! HTTP origins for the tests of artifacts fetched over HTTP (decisions 0062, 0064): a small
//! origin in the harness that answers range requests well or badly on purpose, over plain HTTP
//! or over TLS with a certificate of a private CA ([`OriginCerts`], made by the shipped
//! `deploy/mosquitto/make-certs.sh`), or redirects; and Python's `http.server`, a plain static
//! server that ignores `Range` (it answers `200` with the whole file), started as a process of
//! the site.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
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
    /// `206` with the range asked for, one byte flipped in every 64 KiB block of it that
    /// starts at or after this offset (the agent asks for runs of blocks in one range).
    CorruptFrom(u64),
    /// Reads the request and never answers.
    Silent,
    /// Serves this many requests, then answers `404 Not Found` to every one.
    NotFoundAfter(usize),
    /// Answers `302 Found` to every request, with the same path at `http://127.0.0.1:{port}`.
    RedirectTo(u16),
    /// Answers `302 Found` to every request, with its own URL: a redirect loop.
    RedirectLoop,
}

/// A private CA and a certificate it signed for `127.0.0.1` and `localhost`, for an HTTPS
/// origin.
pub struct OriginCerts {
    /// The CA's certificate: what a device names in `[origins] ca_file`.
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl OriginCerts {
    /// Makes them in `dir` with the shipped `make-certs.sh` (openssl must be installed).
    pub fn make(dir: &Path) -> OriginCerts {
        let script = crate::secure::deploy_dir().join("make-certs.sh");
        for args in [
            &["ca"][..],
            &["server", "origin", "IP:127.0.0.1", "DNS:localhost"],
        ] {
            let out = Command::new("sh")
                .arg(&script)
                .arg(dir)
                .args(args)
                .output()
                .expect("run make-certs.sh (is openssl installed?)");
            assert!(out.status.success(), "make-certs.sh {args:?}: {out:?}");
        }
        OriginCerts {
            ca: dir.join("ca.crt"),
            cert: dir.join("origin.crt"),
            key: dir.join("origin.key"),
        }
    }

    fn server_config(&self) -> Arc<rustls::ServerConfig> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = CertificateDer::pem_file_iter(&self.cert)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .expect("the origin's certificate");
        let key = PrivateKeyDer::from_pem_file(&self.key).expect("the origin's key");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("a TLS server configuration");
        Arc::new(config)
    }
}

/// An origin serving the files of a directory on a free loopback port, until dropped.
pub struct Origin {
    pub port: u16,
    /// Whether it speaks TLS ([`Origin::start_tls`]).
    pub https: bool,
    /// `(first byte, last byte)` of every range asked for, in order.
    pub ranges: Arc<Mutex<Vec<(u64, u64)>>>,
    /// Requests answered with a redirect.
    pub redirects: Arc<AtomicUsize>,
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
        Origin::start_with(dir, serves, None)
    }

    /// Serves the files of `dir` as `https://127.0.0.1:{port}/{file}`, with the certificate of
    /// `certs`.
    pub fn start_tls(dir: PathBuf, serves: Serves, certs: &OriginCerts) -> Origin {
        Origin::start_with(dir, serves, Some(certs.server_config()))
    }

    fn start_with(dir: PathBuf, serves: Serves, tls: Option<Arc<rustls::ServerConfig>>) -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the origin");
        let port = listener.local_addr().expect("addr").port();
        let ranges = Arc::new(Mutex::new(Vec::new()));
        let redirects = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let https = tls.is_some();
        let counters = Counters {
            port,
            ranges: ranges.clone(),
            redirects: redirects.clone(),
            served: AtomicUsize::new(0),
        };
        let s = stop.clone();
        std::thread::spawn(move || {
            let counters = Arc::new(counters);
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let (dir, counters, tls) = (dir.clone(), counters.clone(), tls.clone());
                std::thread::spawn(move || {
                    let _ = match tls {
                        None => connection(conn, &dir, serves, &counters),
                        Some(config) => match rustls::ServerConnection::new(config) {
                            Ok(tls) => connection(
                                rustls::StreamOwned::new(tls, conn),
                                &dir,
                                serves,
                                &counters,
                            ),
                            Err(e) => Err(std::io::Error::other(e)),
                        },
                    };
                });
            }
        });
        Origin {
            port,
            https,
            ranges,
            redirects,
            stop,
        }
    }

    /// The URL of `file` at this origin.
    pub fn url(&self, file: &str) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}/{file}", self.port)
    }

    /// Requests answered with a redirect so far.
    pub fn redirects(&self) -> usize {
        self.redirects.load(Ordering::SeqCst)
    }

    /// The ranges asked for so far.
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        self.ranges.lock().expect("ranges").clone()
    }

    /// The bytes the ranges asked for so far cover, all told.
    pub fn bytes_asked(&self) -> u64 {
        self.ranges().iter().map(|(a, b)| b + 1 - a).sum()
    }
}

/// What an origin's connections count.
struct Counters {
    port: u16,
    ranges: Arc<Mutex<Vec<(u64, u64)>>>,
    redirects: Arc<AtomicUsize>,
    served: AtomicUsize,
}

fn connection(
    conn: impl Read + Write,
    dir: &Path,
    serves: Serves,
    counters: &Counters,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn);
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
        let to_port = match serves {
            Serves::RedirectTo(port) => Some(port),
            Serves::RedirectLoop => Some(counters.port),
            _ => None,
        };
        if let Some(port) = to_port {
            counters.redirects.fetch_add(1, Ordering::SeqCst);
            let out = reader.get_mut();
            out.write_all(
                format!(
                    "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:{port}/{path}\r\n\
                     Content-Length: 0\r\n\r\n"
                )
                .as_bytes(),
            )?;
            out.flush()?;
            continue;
        }
        let n = counters.served.fetch_add(1, Ordering::SeqCst);
        let data = if path.contains('/') || path.contains("..") {
            None
        } else {
            std::fs::read(dir.join(&path)).ok()
        };
        let not_found = matches!(serves, Serves::NotFoundAfter(k) if n >= k);
        let out = reader.get_mut();
        let (Some(data), Some((a, b)), false) = (data, range, not_found) else {
            out.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")?;
            out.flush()?;
            continue;
        };
        counters.ranges.lock().expect("ranges").push((a, b));
        let end = b.min(data.len() as u64 - 1);
        let mut body = data[a as usize..=end as usize].to_vec();
        if let Serves::CorruptFrom(from) = serves {
            const BLOCK: u64 = 65536;
            let first = a.max(from).div_ceil(BLOCK) * BLOCK;
            for block in (first..=end).step_by(BLOCK as usize) {
                body[(block - a) as usize] ^= 0xff;
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
        out.flush()?;
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
