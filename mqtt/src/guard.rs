//! The size guard: every flotilla link reaches its broker through it, so a message of any size
//! on a subscribed topic costs the link nothing but its bytes on the wire.
//!
//! rumqttc ends the connection when a packet is larger than its incoming limit, and a retained
//! message comes back on every reconnect: on a broker without a packet-size limit, one large
//! retained message keeps a client disconnected for good. rumqttc's socket cannot be replaced,
//! but it can be told to connect to a Unix socket ([`rumqttc::Transport::Unix`]). The guard
//! listens on one, in a private directory (mode 0700, under the system's temporary directory),
//! and for each connection rumqttc makes there it dials the broker itself (TCP, TLS with the
//! connection's rustls configuration and client certificate) and relays both ways. What comes
//! from the broker goes through [`crate::oversize::Filter`]: a PUBLISH larger than the link's
//! incoming limit is skipped as it streams and replaced by a small stand-in that rumqttc
//! acknowledges and the link counts and drops ([`crate::dropped`]). The connection stays up.
//! What the client sends is copied unchanged. Credentials and the last will travel inside
//! rumqttc's CONNECT as before; the guard holds no MQTT state.
//!
//! Decision 0039 weighs this against MQTT 5's Maximum Packet Size (which NATS's MQTT 3.1.1
//! listener cannot carry) and against a patched rumqttc, and measures the relay's cost.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rumqttc::tokio_rustls::TlsConnector;
use rumqttc::{AsyncClient, ConnectionError, EventLoop, MqttOptions, Transport};
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::oversize::Filter;

/// How long the guard tries to reach the broker for one connection of rumqttc's (which gives
/// up after its own connection timeout, 5 s by default).
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the guard tries one broker of a list before it tries the next.
pub const BROKER_DIAL_TIMEOUT: Duration = Duration::from_secs(3);

/// Bytes read at once from either side.
const BUFFER: usize = 64 * 1024;

/// Why a link could not get its guard; it then connects to the broker directly.
#[derive(Debug, thiserror::Error)]
#[error("cannot make the private socket of the MQTT size guard in {dir}: {source}")]
pub struct GuardError {
    pub dir: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Where the guard dials: one broker, or a list of brokers of one cluster.
#[derive(Clone)]
struct Target {
    brokers: Arc<Vec<(String, u16)>>,
    tls: Option<Arc<ClientConfig>>,
}

/// A link's rumqttc options, before its client is made: adjust `options` (keep alive, packet
/// sizes, last will), then [`LinkSetup::start`].
pub struct LinkSetup {
    /// Options that connect through the guard's socket (or, when the guard could not be set
    /// up, to the broker directly).
    pub options: MqttOptions,
    guard: Result<Pending, GuardError>,
}

impl fmt::Debug for LinkSetup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkSetup")
            .field("options", &self.options)
            .field("guarded", &self.guard.is_ok())
            .finish()
    }
}

/// A bound socket waiting for its relay task.
struct Pending {
    listener: std::os::unix::net::UnixListener,
    dir: PrivateDir,
    target: Target,
    /// The broker of the list tried first.
    first: usize,
}

impl LinkSetup {
    pub(crate) fn new(connection: &crate::Connection, client_id: String) -> LinkSetup {
        let brokers = connection.brokers();
        let first = match connection.order {
            crate::BrokerOrder::InOrder => 0,
            crate::BrokerOrder::SpreadById => spread(&client_id, brokers.len()),
        };
        let target = Target {
            brokers: Arc::new(brokers),
            tls: connection.tls.as_ref().map(|t| t.config.clone()),
        };
        match PrivateDir::create(&std::env::temp_dir()) {
            Ok((dir, listener)) => {
                let mut options = MqttOptions::new(client_id, dir.socket().to_string_lossy(), 0);
                options.set_transport(Transport::Unix);
                if let Some(c) = &connection.credentials {
                    options.set_credentials(c.username.clone(), c.password.expose());
                }
                LinkSetup {
                    options,
                    guard: Ok(Pending {
                        listener,
                        dir,
                        target,
                        first,
                    }),
                }
            }
            Err(e) => LinkSetup {
                options: connection.options(client_id),
                guard: Err(e),
            },
        }
    }

    /// Why the link has no guard, if it has none: worth a warning, since an oversized message on
    /// a broker without a packet-size limit then disconnects it.
    pub fn guard_error(&self) -> Option<&GuardError> {
        self.guard.as_ref().err()
    }

    /// Starts the guard on the current tokio runtime and makes the client, with
    /// [`crate::network_options`]. Publishes larger than the options' incoming packet size are
    /// replaced by stand-ins ([`crate::dropped`]).
    pub fn start(self, capacity: usize) -> Link {
        let limit = self.options.max_packet_size();
        let (client, eventloop) = crate::client(self.options, capacity);
        let running = self.guard.ok().and_then(|pending| {
            pending.listener.set_nonblocking(true).ok()?;
            let listener = UnixListener::from_std(pending.listener).ok()?;
            let shared = Arc::new(Shared::starting_at(pending.first));
            let (stop, stopped) = oneshot::channel();
            let task = tokio::spawn(serve(
                listener,
                pending.target,
                limit,
                shared.clone(),
                stopped,
            ));
            Some(Running {
                task,
                stop: Some(stop),
                shared,
                _dir: pending.dir,
            })
        });
        Link {
            client,
            eventloop,
            guard: Guard { running },
        }
    }
}

/// A link's client, event loop and guard. Keep the guard as long as the event loop.
pub struct Link {
    pub client: AsyncClient,
    pub eventloop: EventLoop,
    pub guard: Guard,
}

/// The running guard of one link. Dropping it stops the relay at once; [`Guard::finish`] first
/// lets what the client already sent reach the broker (a DISCONNECT, a last state).
#[derive(Default)]
pub struct Guard {
    running: Option<Running>,
}

struct Running {
    task: tokio::task::JoinHandle<()>,
    stop: Option<oneshot::Sender<Duration>>,
    shared: Arc<Shared>,
    _dir: PrivateDir,
}

impl fmt::Debug for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("running", &self.running.is_some())
            .finish()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(running) = &self.running {
            running.task.abort();
        }
    }
}

impl Guard {
    /// Whether the link goes through a guard (false when it could not be set up).
    pub fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// What made the last connection fail, in words: rumqttc sees only its side of the
    /// guard's socket, so a broker that cannot be reached, refuses TLS or sent something that
    /// is not MQTT shows up there as a closed connection. The guard's own reason, when it has
    /// one, replaces rumqttc's.
    pub fn explain(&self, error: &ConnectionError) -> String {
        let own = self.running.as_ref().and_then(|r| r.shared.take_error());
        match (own, error) {
            // The broker's answer came through the guard; it is the reason.
            (_, ConnectionError::ConnectionRefused(_)) => error.to_string(),
            (Some(own), _) => own,
            (None, _) => error.to_string(),
        }
    }

    /// Stops taking connections and waits at most `wait` for the open ones to pass on what the
    /// client sent before it closed them. Drop the event loop first: its connection ends when it
    /// does.
    pub async fn finish(mut self, wait: Duration) {
        if let Some(running) = self.running.as_mut() {
            if let Some(stop) = running.stop.take() {
                let _ = stop.send(wait);
            }
            let _ =
                tokio::time::timeout(wait + Duration::from_millis(100), &mut running.task).await;
        }
    }
}

#[derive(Default)]
struct Shared {
    /// Why the guard last failed to relay a connection; taken by [`Guard::explain`].
    error: Mutex<Option<String>>,
    /// The broker of the list the next connection tries first, and the one in use (`None`
    /// before the first connection).
    brokers: Mutex<(usize, Option<usize>)>,
}

impl Shared {
    fn starting_at(first: usize) -> Shared {
        Shared {
            error: Mutex::new(None),
            brokers: Mutex::new((first, None)),
        }
    }

    fn brokers(&self) -> std::sync::MutexGuard<'_, (usize, Option<usize>)> {
        self.brokers.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_error(&self, error: String) {
        *self.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
    }

    fn take_error(&self) -> Option<String> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Takes rumqttc's connections until told to stop; each is relayed in a task of its own.
async fn serve(
    listener: UnixListener,
    target: Target,
    limit: usize,
    shared: Arc<Shared>,
    mut stop: oneshot::Receiver<Duration>,
) {
    let mut relays = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => {
                    relays.spawn(relay(client, target.clone(), limit, shared.clone()));
                }
                Err(e) => {
                    // Out of file descriptors, most likely: rumqttc retries.
                    shared.set_error(format!("the MQTT size guard cannot take a connection: {e}"));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = relays.join_next() => {}
            wait = &mut stop => {
                let wait = wait.unwrap_or_default();
                let _ = tokio::time::timeout(wait, async {
                    while relays.join_next().await.is_some() {}
                })
                .await;
                return;
            }
        }
    }
}

trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

/// Dials one broker as rumqttc would have: TCP with TCP_NODELAY, then TLS checking the broker's
/// certificate against the connection's roots and host name.
async fn dial(
    host: &str,
    port: u16,
    tls: Option<&Arc<ClientConfig>>,
) -> Result<Box<dyn Stream>, String> {
    let addr = crate::host_port(host, port);
    let tcp = TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("cannot reach the broker at {addr}: {e}"))?;
    tcp.set_nodelay(true)
        .map_err(|e| format!("cannot set TCP_NODELAY towards {addr}: {e}"))?;
    let Some(config) = tls else {
        return Ok(Box::new(tcp));
    };
    let name = ServerName::try_from(host.to_owned())
        .map_err(|e| format!("TLS: {host:?} is not a host name: {e}"))?;
    let tls = TlsConnector::from(config.clone())
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS with the broker at {addr}: {e}"))?;
    Ok(Box::new(tls))
}

/// Dials the brokers of `target` in turn from the one `shared` says to try first, until one
/// answers; returns its stream and its place in the list. Logs when the broker in use changes.
async fn dial_any(target: &Target, shared: &Shared) -> Result<(Box<dyn Stream>, usize), String> {
    let count = target.brokers.len();
    let (first, using) = *shared.brokers();
    let timeout = if count == 1 {
        DIAL_TIMEOUT
    } else {
        BROKER_DIAL_TIMEOUT
    };
    let mut failures = Vec::new();
    for step in 0..count {
        let index = (first + step) % count;
        let (host, port) = &target.brokers[index];
        let result =
            match tokio::time::timeout(timeout, dial(host, *port, target.tls.as_ref())).await {
                Ok(result) => result,
                Err(_) => Err(format!(
                    "no connection to the broker at {} within {}s",
                    crate::host_port(host, *port),
                    timeout.as_secs()
                )),
            };
        match result {
            Ok(stream) => {
                *shared.brokers() = (index, Some(index));
                if count > 1 && using != Some(index) {
                    if failures.is_empty() {
                        tracing::info!(broker = %crate::host_port(host, *port), "using broker {} of {count}", index + 1);
                    } else {
                        tracing::warn!(broker = %crate::host_port(host, *port),
                            "using broker {} of {count}; before it: {}", index + 1, failures.join("; "));
                    }
                }
                return Ok((stream, index));
            }
            Err(e) => failures.push(e),
        }
    }
    if count == 1 {
        return Err(failures.pop().unwrap_or_default());
    }
    Err(format!(
        "none of the {count} brokers answered: {}",
        failures.join("; ")
    ))
}

/// One connection of rumqttc's: dial, then relay both ways until either side ends. A broker
/// that ends the connection makes the next connection try the next broker first.
async fn relay(client: UnixStream, target: Target, limit: usize, shared: Arc<Shared>) {
    let (broker, index) = match dial_any(&target, &shared).await {
        Ok(dialed) => dialed,
        Err(e) => return shared.set_error(e),
    };
    let (client_read, client_write) = client.into_split();
    let (broker_read, broker_write) = tokio::io::split(broker);
    tokio::select! {
        _ = upstream(client_read, broker_write) => {}
        result = downstream(broker_read, client_write, limit) => {
            if let Err(e) = result {
                shared.set_error(e);
            }
            // The broker's side ended: if it is going away, the next connection should not
            // spend a dial on it first.
            let count = target.brokers.len();
            let mut brokers = shared.brokers();
            if count > 1 && brokers.0 == index {
                brokers.0 = (index + 1) % count;
            }
        }
    }
}

/// Where client id `client_id` falls among `count` (0-based): its FNV-1a hash modulo `count`,
/// the same on every start. The broker of a list it starts with, so a fleet spreads evenly and
/// each device comes back to the same broker; the agent also spreads its state refreshes by it.
pub fn spread(client_id: &str, count: usize) -> usize {
    if count <= 1 {
        return 0;
    }
    let hash = client_id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    (hash % count as u64) as usize
}

/// Client to broker, unchanged; a clean end of the client's side closes the broker's (TLS
/// close_notify, then FIN).
async fn upstream(client: impl AsyncRead + Unpin, mut broker: impl AsyncWrite + Unpin) {
    let mut client = BufReader::with_capacity(BUFFER, client);
    if tokio::io::copy_buf(&mut client, &mut broker).await.is_ok() {
        let _ = broker.shutdown().await;
    }
}

/// Broker to client, through the filter.
async fn downstream(
    mut broker: impl AsyncRead + Unpin,
    mut client: impl AsyncWrite + Unpin,
    limit: usize,
) -> Result<(), String> {
    let mut filter = Filter::new(limit);
    // Neither buffer is zeroed: pages are touched as bytes arrive, so an idle link (an agent's)
    // costs little memory.
    let mut buf = Vec::with_capacity(BUFFER);
    let mut out = Vec::with_capacity(BUFFER);
    loop {
        buf.clear();
        match broker.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return Ok(()),
            Ok(_) => {}
        }
        out.clear();
        filter
            .feed(&buf, &mut out)
            .map_err(|e| format!("the broker sent what is not MQTT: {e}"))?;
        if !out.is_empty() && client.write_all(&out).await.is_err() {
            return Ok(());
        }
    }
}

/// A directory only this user can enter, holding the guard's socket; removed when dropped.
struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    const PREFIX: &'static str = "flotilla-mqtt-";

    /// Makes `{parent}/flotilla-mqtt-{pid}-{n}` (mode 0700) and binds its socket. Directories
    /// left by processes that no longer run (killed before they could remove theirs) are removed
    /// on the way.
    fn create(parent: &Path) -> Result<(PrivateDir, std::os::unix::net::UnixListener), GuardError> {
        use std::os::unix::fs::DirBuilderExt;
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let error = |source| GuardError {
            dir: parent.to_owned(),
            source,
        };
        let pid = std::process::id();
        let path = loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let path = parent.join(format!("{}{pid}-{n}", Self::PREFIX));
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => break path,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(error(e)),
            }
        };
        let dir = PrivateDir { path };
        sweep(parent, &dir.path);
        let listener = std::os::unix::net::UnixListener::bind(dir.socket()).map_err(error)?;
        Ok((dir, listener))
    }

    fn socket(&self) -> PathBuf {
        self.path.join("link")
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.socket());
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// Removes this process's own guard directories in the temporary directory, sockets and all:
/// for a process about to abort (a panic hook), whose guards' destructors will not run. A link
/// still in use loses its socket, which is what the caller wants; nothing else is touched.
pub fn remove_own_dirs() {
    let own = format!("{}{}-", PrivateDir::PREFIX, std::process::id());
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        if entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(&own))
        {
            let path = entry.path();
            let _ = std::fs::remove_file(path.join("link"));
            let _ = std::fs::remove_dir(&path);
        }
    }
}

/// Removes the guard directories in `parent` that belong to this user and to processes that are
/// gone. Best effort: anything unexpected is left alone.
fn sweep(parent: &Path, own: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(uid) = std::fs::metadata(own).map(|m| m.uid()) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(PrivateDir::PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let path = entry.path();
        let ours = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir() && m.uid() == uid);
        if ours && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(path.join("link"));
            let _ = std::fs::remove_dir(&path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_directory_is_private_and_removed_with_its_guard() {
        use std::os::unix::fs::PermissionsExt;
        let parent = tempfile::tempdir().expect("tempdir");
        // What a killed process left: a directory named after a pid that does not run.
        let stale = parent
            .path()
            .join(format!("{}{}-0", PrivateDir::PREFIX, u32::MAX));
        std::fs::create_dir(&stale).expect("stale dir");
        std::fs::write(stale.join("link"), b"").expect("stale socket");
        let other = parent.path().join("something-else");
        std::fs::create_dir(&other).expect("other dir");

        let (dir, _listener) = PrivateDir::create(parent.path()).expect("private dir");
        let mode = std::fs::metadata(&dir.path)
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        assert!(dir.socket().exists());
        assert!(!stale.exists(), "a dead process's directory is swept");
        assert!(other.exists(), "other directories are left alone");
        let path = dir.path.clone();
        drop(dir);
        assert!(!path.exists());
    }

    /// A stand-in broker: answers every CONNECT with a CONNACK and counts connections; the
    /// returned sender closes every connection it holds.
    async fn fake_broker(
        listener: tokio::net::TcpListener,
    ) -> (
        Arc<std::sync::atomic::AtomicUsize>,
        tokio::sync::watch::Sender<bool>,
    ) {
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (close, closed) = tokio::sync::watch::channel(false);
        let counted = count.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut closed = closed.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    if stream.read(&mut buf).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let _ = stream.write_all(&[0x20, 0x02, 0x00, 0x00]).await;
                    loop {
                        tokio::select! {
                            _ = closed.changed() => return,
                            n = stream.read(&mut buf) => if n.unwrap_or(0) == 0 { return },
                        }
                    }
                });
            }
        });
        (count, close)
    }

    async fn connack(eventloop: &mut EventLoop) -> Result<(), String> {
        loop {
            match tokio::time::timeout(Duration::from_secs(20), eventloop.poll()).await {
                Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_)))) => return Ok(()),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(e.to_string()),
                Err(_) => return Err("no answer".into()),
            }
        }
    }

    #[tokio::test]
    async fn a_link_goes_to_the_next_broker_when_one_is_down_and_moves_on_when_it_drops() {
        // Broker a is down (its port refuses), broker b answers.
        let a = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let a_port = a.local_addr().expect("addr").port();
        drop(a);
        let b = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let b_port = b.local_addr().expect("addr").port();
        let (b_count, b_close) = fake_broker(b).await;
        let mut connection = crate::Connection::plain("127.0.0.1", a_port);
        connection.alternates = vec![("127.0.0.1".to_owned(), b_port)];
        let mut link = connection.link("dev-1").start(10);
        connack(&mut link.eventloop)
            .await
            .expect("connected through b");
        assert_eq!(b_count.load(std::sync::atomic::Ordering::SeqCst), 1);

        // a comes up, b drops the connection: the next connection goes to a first.
        let a = tokio::net::TcpListener::bind(("127.0.0.1", a_port))
            .await
            .expect("rebind a");
        let (a_count, _a_close) = fake_broker(a).await;
        b_close.send(true).expect("close b's connections");
        let mut reconnected = false;
        for _ in 0..5 {
            if connack(&mut link.eventloop).await.is_ok() {
                reconnected = true;
                break;
            }
        }
        assert!(reconnected, "the link reconnected");
        assert_eq!(
            a_count.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "to broker a"
        );
        assert_eq!(
            b_count.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "not to b again"
        );
    }

    #[tokio::test]
    async fn every_broker_down_is_one_error_naming_each() {
        let ports: Vec<u16> = (0..2)
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
                l.local_addr().expect("addr").port()
            })
            .collect();
        let mut connection = crate::Connection::plain("127.0.0.1", ports[0]);
        connection.alternates = vec![("127.0.0.1".to_owned(), ports[1])];
        let mut link = connection.link("dev-1").start(10);
        let err = match tokio::time::timeout(Duration::from_secs(20), link.eventloop.poll()).await {
            Ok(Err(e)) => link.guard.explain(&e),
            other => panic!("expected a connection error, got {other:?}"),
        };
        assert!(err.starts_with("none of the 2 brokers answered"), "{err}");
        for port in ports {
            assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
        }
    }

    #[test]
    fn devices_spread_over_the_brokers_and_keep_theirs() {
        let mut seen = [0usize; 3];
        for i in 0..3000 {
            let id = format!("dev-{i:05}");
            let first = spread(&id, 3);
            assert_eq!(first, spread(&id, 3), "stable");
            seen[first] += 1;
        }
        for n in seen {
            assert!((800..=1200).contains(&n), "roughly even: {seen:?}");
        }
        assert_eq!(spread("dev-1", 1), 0);
    }
}
