//! A TCP forwarder on a free loopback port, for partitions: [`Proxy::cut`] stops forwarding
//! bytes both ways while every socket stays open (what a client sees when a network path goes
//! silent, not a reset), and [`Proxy::restore`] lets them flow again, the held bytes first.
//!
//! [`Proxy::hold_when`] is narrower: it holds one connection's client-to-server bytes once the
//! client has sent given patterns in order (a transaction's `COMMIT` after its first
//! statement, say), while every other connection flows. [`Proxy::release`] delivers them; a
//! client that closes while held takes them with it ([`Proxy::wait_discarded`]): the server
//! never sees them, and sees the connection end, as it would when a client process is killed.
//!
//! ```no_run
//! # use std::time::Duration;
//! let proxy = flotilla_tests::tcp_proxy::Proxy::start(5432);
//! // connect to 127.0.0.1:{proxy.port()} instead of 5432
//! proxy.cut();
//! proxy.restore();
//! proxy.hold_when(&[b"FOR SHARE", b"COMMIT"]);
//! let held = proxy.wait_held(Duration::from_secs(60)); // the chunk with COMMIT, and what followed
//! proxy.release();
//! ```

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::free_port;

/// How often a held pump or the accept loop looks at the flags again.
const POLL: Duration = Duration::from_millis(20);

/// Forwards connections on `port()` to a target port on 127.0.0.1; stops (closing every
/// socket) on drop.
pub struct Proxy {
    port: u16,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("port", &self.port)
            .field("cut", &self.shared.cut.load(Ordering::SeqCst))
            .field("hold", &*self.shared.hold())
            .finish()
    }
}

struct Shared {
    cut: AtomicBool,
    stop: AtomicBool,
    /// Every socket, to close them all on drop.
    sockets: Mutex<Vec<TcpStream>>,
    hold: Mutex<Hold>,
    /// Numbers the connections, for [`Hold::Holding`].
    connections: AtomicU64,
}

/// [`Proxy::hold_when`]'s rule and what came of it. Each rule holds at most once.
#[derive(Debug, Clone, Default)]
enum Hold {
    #[default]
    Off,
    /// Waiting for a connection's client to send `patterns` in order; `generation` tells a
    /// pump that its progress on an earlier rule no longer counts.
    Armed {
        patterns: Vec<Vec<u8>>,
        generation: u64,
    },
    /// Connection `connection`'s bytes from the chunk with the last pattern on: not forwarded.
    Holding { connection: u64, bytes: Vec<u8> },
    /// [`Proxy::release`]d: delivered, and that connection flows again.
    Released,
    /// The client closed while held: these bytes were never delivered.
    Discarded(Vec<u8>),
}

/// A pump's progress through an armed rule.
#[derive(Debug, Default)]
struct Progress {
    generation: u64,
    /// How many of the patterns were seen.
    matched: usize,
    /// The last bytes of the previous chunk, so a pattern split between two reads is found.
    tail: Vec<u8>,
}

impl Proxy {
    /// Listens on a free port and forwards each connection to `127.0.0.1:target`.
    pub fn start(target: u16) -> Proxy {
        let port = free_port();
        let listener = TcpListener::bind(("127.0.0.1", port)).expect("bind the proxy's port");
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let shared = Arc::new(Shared {
            cut: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sockets: Mutex::new(Vec::new()),
            hold: Mutex::new(Hold::Off),
            connections: AtomicU64::new(0),
        });
        let accept_shared = shared.clone();
        std::thread::spawn(move || accept(listener, target, accept_shared));
        Proxy { port, shared }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops forwarding, both ways, on every connection and on new ones; sockets stay open.
    pub fn cut(&self) {
        self.shared.cut.store(true, Ordering::SeqCst);
    }

    /// Forwards again, starting with what was held.
    pub fn restore(&self) {
        self.shared.cut.store(false, Ordering::SeqCst);
    }

    /// Holds the client-to-server bytes of the first connection whose client sends each of
    /// `patterns` in this order (from now on; a pattern may span two reads): the chunk that
    /// holds the last pattern and everything after it wait here, while the server-to-client
    /// direction and every other connection flow on. Replaces an earlier rule. Holds once.
    pub fn hold_when(&self, patterns: &[&[u8]]) {
        assert!(
            !patterns.is_empty() && patterns.iter().all(|p| !p.is_empty()),
            "hold_when needs non-empty patterns"
        );
        let generation = next_generation();
        *self.shared.hold() = Hold::Armed {
            patterns: patterns.iter().map(|p| p.to_vec()).collect(),
            generation,
        };
    }

    /// Waits until [`Proxy::hold_when`]'s rule holds a connection's bytes, and returns what it
    /// holds so far; panics after `within`.
    pub fn wait_held(&self, within: Duration) -> Vec<u8> {
        self.wait_hold("bytes held", within, |hold| match hold {
            Hold::Holding { bytes, .. } => Some(bytes.clone()),
            _ => None,
        })
    }

    /// Delivers what is held and lets that connection flow again.
    pub fn release(&self) {
        let mut hold = self.shared.hold();
        if matches!(*hold, Hold::Holding { .. }) {
            *hold = Hold::Released;
        }
    }

    /// Waits until the held connection's client has closed, its held bytes undelivered, and
    /// returns them; panics after `within`.
    pub fn wait_discarded(&self, within: Duration) -> Vec<u8> {
        self.wait_hold("held bytes discarded", within, |hold| match hold {
            Hold::Discarded(bytes) => Some(bytes.clone()),
            _ => None,
        })
    }

    fn wait_hold<T>(&self, what: &str, within: Duration, done: impl Fn(&Hold) -> Option<T>) -> T {
        let deadline = Instant::now() + within;
        loop {
            let hold = self.shared.hold().clone();
            if let Some(found) = done(&hold) {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "no {what} within {within:?}; the rule is now {hold:?}"
            );
            std::thread::sleep(POLL);
        }
    }
}

/// Numbers the rules (from 1: a pump's fresh [`Progress`] follows none), so a pump never
/// counts its progress on an earlier rule toward a new one.
fn next_generation() -> u64 {
    static GENERATION: AtomicU64 = AtomicU64::new(1);
    GENERATION.fetch_add(1, Ordering::SeqCst)
}

impl Shared {
    fn hold(&self) -> MutexGuard<'_, Hold> {
        self.hold.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `chunk`, just read from connection `connection`'s client, completes the armed
    /// rule; if so, the rule now holds it.
    fn holds(&self, connection: u64, progress: &mut Progress, chunk: &[u8]) -> bool {
        let mut hold = self.hold();
        let Hold::Armed {
            patterns,
            generation,
        } = &*hold
        else {
            return false;
        };
        if progress.generation != *generation {
            *progress = Progress {
                generation: *generation,
                ..Progress::default()
            };
        }
        let old = progress.tail.len();
        let mut window = std::mem::take(&mut progress.tail);
        window.extend_from_slice(chunk);
        // A match must end in this chunk's bytes (one wholly in the tail was counted before).
        let mut from = 0;
        while let Some(pattern) = patterns.get(progress.matched) {
            let last_start = (window.len() + 1).saturating_sub(pattern.len());
            let found = (from..last_start)
                .find(|&at| at + pattern.len() > old && window[at..].starts_with(pattern));
            let Some(at) = found else { break };
            progress.matched += 1;
            from = at + pattern.len();
        }
        if progress.matched == patterns.len() {
            *hold = Hold::Holding {
                connection,
                bytes: chunk.to_vec(),
            };
            return true;
        }
        let longest = patterns.iter().map(Vec::len).max().unwrap_or(1);
        let keep = window.len().min(longest - 1);
        progress.tail = window.split_off(window.len() - keep);
        false
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let sockets = std::mem::take(
            &mut *self
                .shared
                .sockets
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        for socket in sockets {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

fn accept(listener: TcpListener, target: u16, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(POLL);
                continue;
            }
            Err(_) => {
                std::thread::sleep(POLL);
                continue;
            }
        };
        let _ = client.set_nonblocking(false);
        let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        };
        let (Ok(client_read), Ok(server_read)) = (client.try_clone(), server.try_clone()) else {
            continue;
        };
        {
            let mut sockets = shared.sockets.lock().unwrap_or_else(|e| e.into_inner());
            for socket in [&client, &server] {
                if let Ok(clone) = socket.try_clone() {
                    sockets.push(clone);
                }
            }
        }
        let connection = shared.connections.fetch_add(1, Ordering::SeqCst);
        let up = shared.clone();
        std::thread::spawn(move || pump(client_read, server, up, Some(connection)));
        let down = shared.clone();
        std::thread::spawn(move || pump(server_read, client, down, None));
    }
}

/// Copies `from` to `to` while not cut; while cut, reads nothing (the bytes wait in the
/// kernel's buffers) and holds what it already read. The client-to-server pump of connection
/// `rules` also follows [`Proxy::hold_when`]'s rule.
fn pump(mut from: TcpStream, mut to: TcpStream, shared: Arc<Shared>, rules: Option<u64>) {
    let _ = from.set_read_timeout(Some(POLL));
    let mut buf = vec![0u8; 64 * 1024];
    let mut progress = Progress::default();
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        if shared.cut.load(Ordering::SeqCst) {
            std::thread::sleep(POLL);
            continue;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if let Some(connection) = rules {
            if shared.holds(connection, &mut progress, &buf[..n]) {
                match held(&mut from, &shared, connection, &buf[..n]) {
                    Some(bytes) if to.write_all(&bytes).is_ok() => continue,
                    _ => break,
                }
            }
        }
        // Cut between the read and the write: hold these bytes until restored.
        while shared.cut.load(Ordering::SeqCst) && !shared.stop.load(Ordering::SeqCst) {
            std::thread::sleep(POLL);
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// While connection `connection` is held (`first`, the chunk that completed the rule, and
/// what its client sends after): keeps reading the client until [`Proxy::release`] (then
/// returns everything held, to deliver) or until the client closes or the proxy stops (then
/// `None`: the held bytes are discarded, never delivered).
fn held(from: &mut TcpStream, shared: &Shared, connection: u64, first: &[u8]) -> Option<Vec<u8>> {
    let mut pending = first.to_vec();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let (more, closed) = if shared.stop.load(Ordering::SeqCst) {
            (0, true)
        } else {
            match from.read(&mut buf) {
                Ok(0) => (0, true),
                Ok(n) => (n, false),
                Err(e) => (
                    0,
                    !matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                    ),
                ),
            }
        };
        pending.extend_from_slice(&buf[..more]);
        let mut hold = shared.hold();
        match &mut *hold {
            Hold::Holding {
                connection: c,
                bytes,
            } if *c == connection => {
                if closed {
                    *hold = Hold::Discarded(pending);
                    return None;
                }
                bytes.extend_from_slice(&buf[..more]);
            }
            // Released, or the rule replaced by a new one: deliver what was held (a close
            // that came with it is seen by the next read).
            _ => return Some(pending),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwards_holds_while_cut_and_delivers_after_restore() {
        let echo = TcpListener::bind("127.0.0.1:0").expect("bind echo");
        let echo_port = echo.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            for stream in echo.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut read = stream.try_clone().expect("clone");
                    let mut write = stream;
                    let _ = std::io::copy(&mut read, &mut write);
                });
            }
        });
        let proxy = Proxy::start(echo_port);
        let mut client = TcpStream::connect(("127.0.0.1", proxy.port())).expect("connect");
        client
            .set_read_timeout(Some(Duration::from_millis(500)))
            .expect("timeout");
        let mut answer = [0u8; 5];
        client.write_all(b"hello").expect("write");
        client
            .read_exact(&mut answer)
            .expect("echo through the proxy");
        assert_eq!(&answer, b"hello");

        proxy.cut();
        std::thread::sleep(POLL * 3);
        client
            .write_all(b"again")
            .expect("the socket stays open while cut");
        let err = client
            .read(&mut answer)
            .expect_err("nothing comes back while cut");
        assert!(
            matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{err}"
        );

        proxy.restore();
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        client
            .read_exact(&mut answer)
            .expect("held bytes arrive after restore");
        assert_eq!(&answer, b"again");
    }

    /// A server that records what each connection sent until it closed, and echoes it.
    fn recording_echo() -> (u16, std::sync::mpsc::Receiver<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    let mut read = stream.try_clone().expect("clone");
                    let mut write = stream;
                    let mut got = Vec::new();
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = read.read(&mut buf) {
                        if n == 0 || write.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        got.extend_from_slice(&buf[..n]);
                    }
                    let _ = tx.send(got);
                });
            }
        });
        (port, rx)
    }

    fn client(proxy: &Proxy) -> TcpStream {
        let client = TcpStream::connect(("127.0.0.1", proxy.port())).expect("connect");
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        client
    }

    /// Sends `text` and reads its echo.
    fn round_trip(client: &mut TcpStream, text: &[u8]) {
        client.write_all(text).expect("write");
        let mut answer = vec![0u8; text.len()];
        client.read_exact(&mut answer).expect("echo");
        assert_eq!(answer, text);
    }

    #[test]
    fn holds_only_the_connection_that_sent_the_patterns_in_order_until_released() {
        let (port, _) = recording_echo();
        let proxy = Proxy::start(port);
        let mut writer = client(&proxy);
        let mut other = client(&proxy);
        proxy.hold_when(&[b"BEGIN", b"COMMIT"]);
        // The patterns out of order: nothing is held.
        round_trip(&mut other, b"COMMIT then BEGIN");
        round_trip(&mut writer, b"BEGIN; UPDATE");
        // The second pattern split across two writes still counts, in the chunk ending it.
        round_trip(&mut writer, b"; COM");
        writer.write_all(b"MIT;").expect("write");
        let held = proxy.wait_held(Duration::from_secs(10));
        assert_eq!(held, b"MIT;");
        writer.set_read_timeout(Some(POLL * 10)).expect("timeout");
        let mut answer = [0u8; 4];
        let err = writer
            .read(&mut answer)
            .expect_err("held bytes do not reach the server");
        assert!(
            matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{err}"
        );
        // What the client sends after is held too; other connections flow.
        writer.write_all(b" more").expect("write while held");
        round_trip(&mut other, b"BEGIN; COMMIT");
        round_trip(&mut other, b"still flowing");

        proxy.release();
        writer
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut answer = [0u8; 9];
        writer.read_exact(&mut answer).expect("held bytes arrive");
        assert_eq!(&answer, b"MIT; more");
        // The rule held once; it does not hold again.
        round_trip(&mut writer, b"BEGIN; COMMIT");
    }

    #[test]
    fn a_client_that_closes_while_held_takes_its_held_bytes_with_it() {
        let (port, received) = recording_echo();
        let proxy = Proxy::start(port);
        let mut writer = client(&proxy);
        proxy.hold_when(&[b"COMMIT"]);
        round_trip(&mut writer, b"BEGIN; INSERT;");
        writer.write_all(b"COMMIT;").expect("write");
        assert_eq!(proxy.wait_held(Duration::from_secs(10)), b"COMMIT;");
        drop(writer);
        assert_eq!(proxy.wait_discarded(Duration::from_secs(10)), b"COMMIT;");
        // The server saw the connection end without the held bytes.
        let got = received
            .recv_timeout(Duration::from_secs(10))
            .expect("the server sees the connection close");
        assert_eq!(got, b"BEGIN; INSERT;");
    }
}
