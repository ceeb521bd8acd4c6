//! A TCP forwarder on a free loopback port, for partitions: [`Proxy::cut`] stops forwarding
//! bytes both ways while every socket stays open (what a client sees when a network path goes
//! silent, not a reset), and [`Proxy::restore`] lets them flow again, the held bytes first.
//!
//! ```no_run
//! let proxy = flotilla_tests::tcp_proxy::Proxy::start(5432);
//! // connect to 127.0.0.1:{proxy.port()} instead of 5432
//! proxy.cut();
//! proxy.restore();
//! ```

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
            .finish()
    }
}

struct Shared {
    cut: AtomicBool,
    stop: AtomicBool,
    /// Every socket, to close them all on drop.
    sockets: Mutex<Vec<TcpStream>>,
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
        let up = shared.clone();
        std::thread::spawn(move || pump(client_read, server, up));
        let down = shared.clone();
        std::thread::spawn(move || pump(server_read, client, down));
    }
}

/// Copies `from` to `to` while not cut; while cut, reads nothing (the bytes wait in the
/// kernel's buffers) and holds what it already read.
fn pump(mut from: TcpStream, mut to: TcpStream, shared: Arc<Shared>) {
    let _ = from.set_read_timeout(Some(POLL));
    let mut buf = vec![0u8; 64 * 1024];
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
}
