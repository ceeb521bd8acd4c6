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

/// Where the guard dials.
#[derive(Clone)]
struct Target {
    host: String,
    port: u16,
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
}

impl LinkSetup {
    pub(crate) fn new(connection: &crate::Connection, client_id: String) -> LinkSetup {
        let target = Target {
            host: connection.host.clone(),
            port: connection.port,
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
            let shared = Arc::new(Shared::default());
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
}

impl Shared {
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

/// Dials the broker as rumqttc would have: TCP with TCP_NODELAY, then TLS checking the broker's
/// certificate against the connection's roots and host name.
async fn dial(target: &Target) -> Result<Box<dyn Stream>, String> {
    let addr = if target.host.contains(':') {
        format!("[{}]:{}", target.host, target.port)
    } else {
        format!("{}:{}", target.host, target.port)
    };
    let tcp = TcpStream::connect((target.host.as_str(), target.port))
        .await
        .map_err(|e| format!("cannot reach the broker at {addr}: {e}"))?;
    tcp.set_nodelay(true)
        .map_err(|e| format!("cannot set TCP_NODELAY towards {addr}: {e}"))?;
    let Some(config) = &target.tls else {
        return Ok(Box::new(tcp));
    };
    let name = ServerName::try_from(target.host.clone())
        .map_err(|e| format!("TLS: {:?} is not a host name: {e}", target.host))?;
    let tls = TlsConnector::from(config.clone())
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS with the broker at {addr}: {e}"))?;
    Ok(Box::new(tls))
}

/// One connection of rumqttc's: dial, then relay both ways until either side ends.
async fn relay(client: UnixStream, target: Target, limit: usize, shared: Arc<Shared>) {
    let broker = match tokio::time::timeout(DIAL_TIMEOUT, dial(&target)).await {
        Ok(Ok(broker)) => broker,
        Ok(Err(e)) => return shared.set_error(e),
        Err(_) => {
            return shared.set_error(format!(
                "no connection to the broker at {}:{} within {}s",
                target.host,
                target.port,
                DIAL_TIMEOUT.as_secs()
            ))
        }
    };
    let (client_read, client_write) = client.into_split();
    let (broker_read, broker_write) = tokio::io::split(broker);
    tokio::select! {
        _ = upstream(client_read, broker_write) => {}
        result = downstream(broker_read, client_write, limit) => {
            if let Err(e) = result {
                shared.set_error(e);
            }
        }
    }
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
}
