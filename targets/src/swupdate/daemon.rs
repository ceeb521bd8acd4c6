//! Installing through a running SWUpdate daemon's sockets, for devices that keep SWUpdate running
//! (for suricatta or its web server), where `swupdate -i` would take the daemon's socket names.
//!
//! # The exchange (SWUpdate 2022.12)
//!
//! 1. Connect to the progress socket, if it listens, and log its messages (step, image,
//!    handler, percent) while the install runs.
//! 2. On a new connection to the install socket, send `REQ_INSTALL`; the daemon answers `ACK`,
//!    or `NACK` with "Installation in progress" while it installs something else. Then
//!    wait for it to go idle (logging what it reports) and ask again.
//! 3. Write the image's bytes on that connection, then shut down our side. The installer reads
//!    the archive and closes the connection when it is done with it (or as soon as it refused
//!    it), so reading until the end of the stream means the installer has started: from then
//!    on the daemon's "idle" is the end of *this* install. (Polling the status right after the
//!    bytes, as SWUpdate's own client does, can see "idle" before the installer woke up.)
//! 4. Ask `GET_STATUS` on new connections. Each answer carries the next queued message
//!    (SWUpdate's `ERROR` lines arrive as status `FAILURE`); those are logged as they come. When
//!    the queue is empty and the daemon is idle, `last_result` is the outcome.
//!
//! The layouts are in [`super::ipc`].

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::ipc::{self, MsgType, Recovery};

/// How often the daemon's status is asked while it has nothing new to say.
const POLL: Duration = Duration::from_millis(200);
/// How many times an install is requested again after the daemon finished another one.
const BUSY_RETRIES: u32 = 3;

/// Why an install through the daemon did not happen or did not succeed.
#[derive(Debug)]
pub(crate) enum DaemonError {
    /// Nothing listens on the socket (no file there, or a dead daemon's file): the caller may
    /// install with `swupdate -i` instead.
    NotListening(io::Error),
    /// Talking to the daemon failed (`what` says at which point).
    Io { what: String, source: io::Error },
    /// The daemon answered something that is not SWUpdate 2022.12's protocol.
    Protocol(String),
    /// The daemon refused the request (`NACK`).
    Refused(String),
    /// The install ran and failed; SWUpdate's error messages.
    Failed(Vec<String>),
    /// The install did not end within the install timeout.
    TimedOut,
}

/// One install through the daemon.
pub(crate) struct DaemonInstall<'a> {
    pub socket: &'a Path,
    pub progress_socket: Option<&'a Path>,
    pub image: &'a Path,
    pub timeout: Duration,
    pub action_id: &'a str,
}

impl DaemonInstall<'_> {
    /// Installs the image; `Ok` when SWUpdate reported `SUCCESS`.
    pub(crate) fn run(&self) -> Result<(), DaemonError> {
        let deadline = Instant::now() + self.timeout;
        let progress = self
            .progress_socket
            .and_then(|p| follow_progress(p, self.action_id));
        let result = self.install(deadline);
        if let Some((stream, reader)) = progress {
            // Wakes the reader from its blocking read; it ends on the closed stream.
            let _ = stream.shutdown(Shutdown::Both);
            let _ = reader.join();
        }
        result
    }

    fn install(&self, deadline: Instant) -> Result<(), DaemonError> {
        let mut image = File::open(self.image).map_err(|source| DaemonError::Io {
            what: format!("open {}", self.image.display()),
            source,
        })?;
        let len = image
            .metadata()
            .map_err(|source| DaemonError::Io {
                what: format!("read the size of {}", self.image.display()),
                source,
            })?
            .len();
        let mut conn = self.request_install(len, deadline)?;
        debug!(
            action_id = self.action_id,
            bytes = len,
            "SWUpdate's daemon takes the image"
        );
        // A daemon that refused the archive stops reading and closes: the rest of the bytes have
        // nowhere to go, and its messages say why.
        let sent = io::copy(&mut image, &mut conn);
        if let Err(e) = &sent {
            debug!(
                action_id = self.action_id,
                "SWUpdate stopped reading the image: {e}"
            );
        }
        let _ = conn.shutdown(Shutdown::Write);
        let mut rest = Vec::new();
        set_timeouts(&conn, deadline)?;
        match conn.read_to_end(&mut rest) {
            Ok(_) => {}
            Err(e) if is_timeout(&e) => return Err(DaemonError::TimedOut),
            // A reset is the installer closing with our bytes unread.
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
            Err(source) => {
                return Err(DaemonError::Io {
                    what: "wait for SWUpdate to read the image".to_owned(),
                    source,
                })
            }
        }
        let (last, errors) = self.wait_idle(deadline)?;
        match last {
            Recovery::Success => Ok(()),
            Recovery::Failure => Err(DaemonError::Failed(errors)),
            other => Err(DaemonError::Protocol(format!(
                "SWUpdate went idle with last result {other:?}"
            ))),
        }
    }

    /// Sends `REQ_INSTALL` until the daemon takes it; a busy daemon is waited for first.
    fn request_install(&self, len: u64, deadline: Instant) -> Result<UnixStream, DaemonError> {
        let mut attempt = 0;
        loop {
            let mut conn = connect(self.socket)?;
            set_timeouts(&conn, deadline)?;
            let reply = exchange(&mut conn, &ipc::install_request(len), "REQ_INSTALL")?;
            match reply.kind {
                MsgType::Ack => return Ok(conn),
                MsgType::Nack if reply.text.contains("in progress") && attempt < BUSY_RETRIES => {
                    attempt += 1;
                    info!(
                        action_id = self.action_id,
                        "SWUpdate is installing something else (an install this agent started \
                         before it restarted?); waiting for it to finish, then installing again"
                    );
                    drop(conn);
                    self.wait_idle(deadline)?;
                }
                MsgType::Nack => {
                    let why = if reply.text.is_empty() {
                        "no reason given (API version or software set not accepted)".to_owned()
                    } else {
                        reply.text
                    };
                    return Err(DaemonError::Refused(why));
                }
                other => {
                    return Err(DaemonError::Protocol(format!(
                        "SWUpdate answered REQ_INSTALL with message type {other:?}"
                    )))
                }
            }
        }
    }

    /// Asks `GET_STATUS` until the daemon is idle with nothing queued, logging its messages;
    /// returns the last result and the `ERROR` messages seen.
    ///
    /// Idle means its "Waiting for requests..." message was read, or it was idle with nothing
    /// queued twice in a row (another client may have taken that message). The installer goes
    /// back to waiting for a request only after that message: a request sent earlier would not
    /// wake it.
    fn wait_idle(&self, deadline: Instant) -> Result<(Recovery, Vec<String>), DaemonError> {
        let mut errors = Vec::new();
        let mut idle_before = false;
        loop {
            let mut conn = connect(self.socket)?;
            set_timeouts(&conn, deadline)?;
            let reply = exchange(&mut conn, &ipc::status_request(), "GET_STATUS")?;
            let status = reply.status;
            if !status.desc.is_empty() {
                match status.current {
                    Recovery::Failure => {
                        warn!(action_id = self.action_id, "swupdate: {}", status.desc);
                        let text = status.desc.trim();
                        let text = text.strip_prefix("ERROR :").unwrap_or(text).trim();
                        if !text.is_empty() && !errors.iter().any(|e| e == text) {
                            errors.push(text.to_owned());
                        }
                    }
                    Recovery::Idle => {
                        info!(action_id = self.action_id, "swupdate: {}", status.desc);
                        return Ok((status.last_result, errors));
                    }
                    _ => info!(action_id = self.action_id, "swupdate: {}", status.desc),
                }
                idle_before = false;
                continue;
            }
            if status.current == Recovery::Idle {
                if idle_before {
                    return Ok((status.last_result, errors));
                }
                idle_before = true;
            } else {
                idle_before = false;
            }
            if Instant::now() >= deadline {
                return Err(DaemonError::TimedOut);
            }
            thread::sleep(POLL);
        }
    }
}

/// Connects to the install socket; "nothing listens" is its own error.
fn connect(socket: &Path) -> Result<UnixStream, DaemonError> {
    UnixStream::connect(socket).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => DaemonError::NotListening(e),
        _ => DaemonError::Io {
            what: format!("connect to {}", socket.display()),
            source: e,
        },
    })
}

fn set_timeouts(conn: &UnixStream, deadline: Instant) -> Result<(), DaemonError> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    conn.set_read_timeout(Some(left))
        .and_then(|()| conn.set_write_timeout(Some(left)))
        .map_err(|source| DaemonError::Io {
            what: "set the socket's timeouts".to_owned(),
            source,
        })
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Writes one message and reads the one answer.
fn exchange(conn: &mut UnixStream, message: &[u8], what: &str) -> Result<ipc::Reply, DaemonError> {
    let io_err = |source: io::Error| {
        if is_timeout(&source) {
            DaemonError::TimedOut
        } else {
            DaemonError::Io {
                what: format!("send {what} and read the answer"),
                source,
            }
        }
    };
    conn.write_all(message).map_err(io_err)?;
    let mut answer = vec![0u8; ipc::MSG_SIZE];
    conn.read_exact(&mut answer).map_err(io_err)?;
    ipc::parse_reply(&answer).map_err(|e| {
        DaemonError::Protocol(format!(
            "SWUpdate's answer to {what} is not SWUpdate 2022.12's: {e}"
        ))
    })
}

/// Connects to the progress socket and logs what comes in a thread; `None` when it does not
/// listen (progress is for the log only).
fn follow_progress(socket: &Path, action_id: &str) -> Option<(UnixStream, thread::JoinHandle<()>)> {
    let stream = match UnixStream::connect(socket) {
        Ok(stream) => stream,
        Err(e) => {
            debug!(action_id, socket = %socket.display(), "no SWUpdate progress: {e}");
            return None;
        }
    };
    let mut reader = stream.try_clone().ok()?;
    let action_id = action_id.to_owned();
    let socket: PathBuf = socket.to_path_buf();
    let handle = thread::spawn(move || {
        let mut buf = vec![0u8; ipc::PROGRESS_SIZE];
        let mut shown = (u32::MAX, u32::MAX);
        while reader.read_exact(&mut buf).is_ok() {
            let Ok(p) = ipc::parse_progress(&buf) else {
                debug!(action_id, socket = %socket.display(), "not a progress message");
                return;
            };
            // One line per step and per quarter of a step. SWUpdate counts one more step after
            // the last (1/1, then 2/1) as it ends: that one is not shown.
            let now = (p.cur_step, p.cur_percent / 25);
            let in_range = p.cur_step > 0 && p.cur_step <= p.nsteps;
            match p.status {
                Recovery::Run | Recovery::Progress if now != shown && in_range => {
                    shown = now;
                    let what = if p.cur_image.is_empty() {
                        String::new()
                    } else {
                        format!(" {} ({})", p.cur_image, p.handler)
                    };
                    info!(
                        action_id,
                        "swupdate progress: step {}/{}{what} {}%",
                        p.cur_step,
                        p.nsteps,
                        p.cur_percent
                    );
                }
                Recovery::Success | Recovery::Failure => {
                    info!(action_id, "swupdate progress: {:?}", p.status);
                }
                _ => {}
            }
        }
    });
    Some((stream, handle))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// Plays SWUpdate's daemon on a socket for `connections` connections: answers each from
    /// `script`, which gets the request's type and image length and returns the reply (or
    /// `None`: ACK, read the image to its end, then close). Returns the image it read.
    fn fake_daemon(
        socket: &Path,
        connections: usize,
        mut script: impl FnMut(u32, u32) -> Option<Vec<u8>> + Send + 'static,
    ) -> thread::JoinHandle<Vec<u8>> {
        let listener = UnixListener::bind(socket).expect("bind");
        thread::spawn(move || {
            let mut image = Vec::new();
            for conn in listener.incoming().take(connections) {
                let mut conn = conn.expect("accept");
                let mut request = vec![0u8; ipc::MSG_SIZE];
                conn.read_exact(&mut request).expect("request");
                let (kind, len) = ipc::test_request(&request);
                match script(kind, len) {
                    Some(reply) => conn.write_all(&reply).expect("reply"),
                    None => {
                        conn.write_all(&ipc::test_reply(1, 0, 0, "")).expect("ACK");
                        conn.read_to_end(&mut image).expect("image");
                    }
                }
            }
            image
        })
    }

    #[test]
    fn a_busy_daemon_is_waited_for_then_the_image_is_sent_and_its_errors_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("sockinstctrl");
        let image_path = dir.path().join("image.swu");
        std::fs::write(&image_path, b"070701 a .swu, as far as this daemon cares").expect("image");
        // REQ_INSTALL -> busy; status: the other install ends; REQ_INSTALL -> taken; status:
        // SWUpdate's error, the generic one, idle with FAILURE.
        let mut step = 0;
        let daemon = fake_daemon(&socket, 7, move |kind, len| {
            step += 1;
            match (step, kind) {
                (1, 0) => Some(ipc::test_reply(2, 0, 0, "Installation in progress")),
                (2, 3) => Some(ipc::test_reply(1, 2, 3, "[install_images] : writing")),
                (3, 3) => Some(ipc::test_reply(1, 0, 3, "Waiting for requests...")),
                (4, 0) => {
                    assert_eq!(len, 42, "the image's length in the request");
                    None
                }
                (5, 3) => Some(ipc::test_reply(1, 4, 4, "ERROR : HASH mismatch : a <--> b")),
                (6, 3) => Some(ipc::test_reply(1, 4, 4, "Installation failed !")),
                (7, 3) => Some(ipc::test_reply(1, 0, 4, "Waiting for requests...")),
                other => panic!("unexpected request {other:?}"),
            }
        });
        let result = DaemonInstall {
            socket: &socket,
            progress_socket: None,
            image: &image_path,
            timeout: Duration::from_secs(60),
            action_id: "act-1",
        }
        .run();
        match result {
            Err(DaemonError::Failed(messages)) => assert_eq!(
                messages,
                vec![
                    "HASH mismatch : a <--> b".to_owned(),
                    "Installation failed !".to_owned()
                ]
            ),
            other => panic!("expected SWUpdate's errors, got {other:?}"),
        }
        assert_eq!(
            daemon.join().expect("daemon"),
            b"070701 a .swu, as far as this daemon cares"
        );
    }

    #[test]
    fn nothing_listening_is_told_apart_from_other_failures() {
        let dir = tempfile::tempdir().expect("tempdir");
        let image = dir.path().join("image.swu");
        std::fs::write(&image, b"x").expect("image");
        let install = |socket: &Path| {
            DaemonInstall {
                socket,
                progress_socket: None,
                image: &image,
                timeout: Duration::from_secs(5),
                action_id: "act-1",
            }
            .run()
        };
        let missing = dir.path().join("sockinstctrl");
        assert!(matches!(
            install(&missing),
            Err(DaemonError::NotListening(_))
        ));
        // A dead daemon's socket file: refused.
        drop(UnixListener::bind(&missing).expect("bind"));
        assert!(matches!(
            install(&missing),
            Err(DaemonError::NotListening(_))
        ));
    }
}
