//! The control client: sends one JSON control request to a running coordinator over MQTT and
//! waits for its reply. Used by `flotilla rollout …`, `flotilla devices` and tests.
//!
//! Every request is signed with the operator's key ([`SignedRequest`]): the request's JSON text
//! with the current time and a fresh nonce inside, so the coordinator can name who sent it and
//! refuse stale or replayed copies.
//!
//! Each client has a unique id (`flotilla-cli-…`, one per invocation). Its replies come on
//! `control/reply/{login}`, named after the broker login (the user name, or the client
//! certificate's common name), which the shipped Mosquitto ACL lets that login read and nobody
//! else (deploy/mosquitto/acl); without a login (the embedded broker) on
//! `control/reply/{client id}`. Replies to other commands under the same login are told apart
//! by the request id. It subscribes to that topic and waits for the SubAck before publishing
//! anything: with clean sessions and no retained replies, a reply that arrives before the
//! subscription is lost for good.
//!
//! The shipped broker keeps one connection per login (it replaces the client id with the user
//! name), so a client that logs in holds this machine's lock for that login while it is
//! connected ([`super::login_lock`]): a second command under the same login waits instead of
//! knocking the first off the broker.

use std::time::Duration;

use flotilla_mqtt::Connection;
use flotilla_protocol::control::{
    Command, ControlReply, ControlRequest, DeviceSummary, EnrollmentInfo, Page, PageQuery,
    RolloutPage, RolloutStatus,
};
use flotilla_protocol::operator::{new_nonce, SignedRequest};
use flotilla_protocol::{SigningKey, Topics};
use rumqttc::QoS;
use tokio_util::sync::CancellationToken;

use super::login_lock::{self, LoginLock};
use crate::service::mqtt::{self, LinkEvent, LinkOptions, MqttLink};

/// The default time to wait for a reply.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The least a change (any command above the viewer role) waits for its reply: right after a
/// (re)connect the coordinator holds changes until it has read every retained device state, up
/// to its default `[service] marker_timeout` of 30 s.
pub const CHANGE_TIMEOUT: Duration = Duration::from_secs(45);

/// How long a request refused as rate limited waits before it is sent again.
const RATE_LIMITED_RETRY: Duration = Duration::from_secs(1);

/// Why a control request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to the MQTT broker at {addr} within {secs}s (last error: {reason}) — is it running?")]
    Connect {
        addr: String,
        secs: u64,
        reason: String,
    },
    #[error("request could not be sent to the broker at {addr}: {reason}")]
    Send { addr: String, reason: String },
    #[error(
        "no reply from the coordinator at {addr} within {secs}s — is `flotilla serve` running?"
    )]
    NoReply { addr: String, secs: u64 },
    #[error("the coordinator refused the request: {message}")]
    Refused { message: String },
    #[error("lost the connection to the broker at {addr} while waiting for the reply: {reason}")]
    Lost { addr: String, reason: String },
    #[error(
        "the broker login {login:?} cannot name a reply topic (control/reply/<login>): it must \
         not be empty or contain '/', '+', '#' or U+0000"
    )]
    LoginName { login: String },
    #[error("the coordinator's reply to {what} is not what this client expects: {source}")]
    BadReply {
        what: &'static str,
        source: serde_json::Error,
    },
}

/// A connected control client.
#[derive(Debug)]
pub struct ControlClient {
    link: tokio::sync::Mutex<MqttLink>,
    topics: Topics,
    reply_topic: String,
    addr: String,
    shutdown: CancellationToken,
    /// The operator's key; signs every request.
    key: SigningKey,
    /// A reply said the coordinator was still loading, and the note was printed.
    loading_noted: std::sync::atomic::AtomicBool,
    /// The broker login, if any: named in the error when the connection is lost.
    login: Option<String>,
    /// This machine's lock on the login, held while connected.
    _login_lock: Option<LoginLock>,
}

impl Drop for ControlClient {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl ControlClient {
    /// Connects and subscribes to this client's reply topic, within [`DEFAULT_TIMEOUT`].
    /// Requests are signed with the operator key `key`.
    pub async fn connect(
        host: &str,
        port: u16,
        topic_root: &str,
        key: SigningKey,
    ) -> Result<ControlClient, ClientError> {
        Self::connect_within(host, port, topic_root, key, DEFAULT_TIMEOUT).await
    }

    /// [`ControlClient::connect`] with an explicit timeout.
    pub async fn connect_within(
        host: &str,
        port: u16,
        topic_root: &str,
        key: SigningKey,
        timeout: Duration,
    ) -> Result<ControlClient, ClientError> {
        Self::connect_with(Connection::plain(host, port), topic_root, key, timeout).await
    }

    /// Connects over `connection` (credentials, TLS) and subscribes to this client's reply
    /// topic, within `timeout`.
    pub async fn connect_with(
        connection: Connection,
        topic_root: &str,
        key: SigningKey,
        timeout: Duration,
    ) -> Result<ControlClient, ClientError> {
        let topics = Topics::new(topic_root);
        let addr = connection.addr();
        let client_id = mqtt::unique_client_id("flotilla-cli");
        let login = connection.login_name();
        let reply_topic = match &login {
            Some(name) if name.is_empty() || name.contains(['/', '+', '#', '\0']) => {
                return Err(ClientError::LoginName {
                    login: name.clone(),
                })
            }
            Some(name) => topics.control_reply(name),
            None => topics.control_reply(&client_id),
        };
        let login_lock = match &login {
            Some(name) => Some(login_lock::acquire(&addr, name, login_lock::WAIT).await),
            None => None,
        };
        let mut options =
            LinkOptions::with_connection(connection, client_id, vec![reply_topic.clone()]);
        options.keep_alive = Duration::from_secs(10);
        let shutdown = CancellationToken::new();
        let mut link = mqtt::start(options, shutdown.clone());
        let mut last = "no answer".to_owned();
        let subscribed = tokio::time::timeout(timeout, async {
            while let Some(event) = link.events.recv().await {
                match event {
                    LinkEvent::Subscribed => return true,
                    LinkEvent::Disconnected { reason } => last = reason,
                    _ => {}
                }
            }
            false
        })
        .await;
        if subscribed != Ok(true) {
            shutdown.cancel();
            return Err(ClientError::Connect {
                addr,
                secs: timeout.as_secs(),
                reason: last,
            });
        }
        Ok(ControlClient {
            link: tokio::sync::Mutex::new(link),
            topics,
            reply_topic,
            addr,
            shutdown,
            key,
            loading_noted: Default::default(),
            login,
            _login_lock: login_lock,
        })
    }

    /// The topic this client's replies come on.
    pub fn reply_topic(&self) -> &str {
        &self.reply_topic
    }

    /// Sends `command` and returns the reply's `result`. A reply with `ok: false` becomes
    /// [`ClientError::Refused`] carrying the coordinator's message. A reply given while the
    /// coordinator is still reading the retained device states (`loading`) prints a note on
    /// stderr, once per client: a list may miss devices. A request refused because its key is
    /// over its rate limit is sent again (a new request) a second later, within `timeout`.
    pub async fn request(
        &self,
        command: Command,
        timeout: Duration,
    ) -> Result<serde_json::Value, ClientError> {
        let timeout = if command.required_role() == flotilla_protocol::operator::Role::Viewer {
            timeout
        } else {
            timeout.max(CHANGE_TIMEOUT)
        };
        let deadline = tokio::time::Instant::now() + timeout;
        let reply = loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let reply = self.request_reply(command.clone(), left).await?;
            let limited = !reply.ok
                && reply
                    .error
                    .as_deref()
                    .is_some_and(|e| e.starts_with("rate limited"));
            if !limited || left <= RATE_LIMITED_RETRY {
                break reply;
            }
            tokio::time::sleep(RATE_LIMITED_RETRY).await;
        };
        if reply.loading
            && !self
                .loading_noted
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            eprintln!(
                "note: the coordinator is still reading the devices' retained states after a \
                 (re)connect; this answer may miss devices"
            );
        }
        if reply.ok {
            Ok(reply.result)
        } else {
            Err(ClientError::Refused {
                message: reply.error.unwrap_or_else(|| "no reason given".into()),
            })
        }
    }

    /// Sends `command` and returns the coordinator's whole reply, `ok` or not.
    pub async fn request_reply(
        &self,
        command: Command,
        timeout: Duration,
    ) -> Result<ControlReply, ClientError> {
        let id = mqtt::unique_client_id("req");
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let request = ControlRequest::new(
            id.clone(),
            self.reply_topic.clone(),
            at,
            new_nonce(),
            command,
        );
        let signed = SignedRequest::sign(&self.key, &request);
        // Serializing plain strings into JSON cannot fail.
        let payload = serde_json::to_vec(&signed).unwrap_or_default();
        let mut link = self.link.lock().await;
        link.client
            .publish(
                self.topics.control_request(),
                QoS::AtLeastOnce,
                false,
                payload,
            )
            .await
            .map_err(|e| ClientError::Send {
                addr: self.addr.clone(),
                reason: e.to_string(),
            })?;
        let reply = tokio::time::timeout(timeout, async {
            while let Some(event) = link.events.recv().await {
                match event {
                    LinkEvent::Publish { topic, payload } if topic == self.reply_topic => {
                        match serde_json::from_slice::<ControlReply>(&payload) {
                            // Replies to earlier, timed-out requests can still trickle in.
                            Ok(reply) if reply.id == id => return Ok(reply),
                            Ok(_) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, "ignoring malformed control reply")
                            }
                        }
                    }
                    LinkEvent::Disconnected { reason } => {
                        return Err(ClientError::Lost {
                            addr: self.addr.clone(),
                            reason: self.lost_reason(reason),
                        })
                    }
                    _ => {}
                }
            }
            Err(ClientError::Lost {
                addr: self.addr.clone(),
                reason: "link stopped".into(),
            })
        })
        .await
        .map_err(|_| ClientError::NoReply {
            addr: self.addr.clone(),
            secs: timeout.as_secs(),
        })??;
        Ok(reply)
    }
}

impl ControlClient {
    /// Why the connection was lost, with what a login adds: a broker that ties client ids to
    /// logins drops a connection when the same login connects again.
    fn lost_reason(&self, reason: String) -> String {
        match &self.login {
            Some(login) => format!(
                "{reason} (if another client logged in as {login} meanwhile, the broker let it \
                 take this connection's place: it keeps one connection per login; give each \
                 person and tool its own login)"
            ),
            None => reason,
        }
    }
}

/// The paged list commands: each fetches every page in turn and returns the whole list, so
/// callers see what an unpaged request returned while no single reply grows with the fleet.
impl ControlClient {
    /// Every item of a list command, fetched page by page (`command` builds the request for one
    /// page), for the lists whose items need no filter: approvals, strategies, device groups.
    pub async fn all_pages<T: serde::de::DeserializeOwned>(
        &self,
        what: &'static str,
        command: impl Fn(PageQuery) -> Command,
        timeout: Duration,
    ) -> Result<Vec<T>, ClientError> {
        self.pages(what, command, PageQuery::default(), None, timeout)
            .await
    }

    /// Fetches the pages of `command(query)` one after the other, each starting after the
    /// previous page's `next`, until there is none or `limit` items have come.
    async fn pages<T: serde::de::DeserializeOwned>(
        &self,
        what: &'static str,
        command: impl Fn(PageQuery) -> Command,
        mut query: PageQuery,
        limit: Option<usize>,
        timeout: Duration,
    ) -> Result<Vec<T>, ClientError> {
        let mut all = Vec::new();
        query.limit = Some(query.limit.unwrap_or(DEFAULT_PAGE_SIZE));
        loop {
            let result = self.request(command(query.clone()), timeout).await?;
            let page: Page<T> = serde_json::from_value(result)
                .map_err(|source| ClientError::BadReply { what, source })?;
            all.extend(page.items);
            if let Some(limit) = limit.filter(|l| all.len() >= *l) {
                all.truncate(limit);
                return Ok(all);
            }
            match page.next {
                // A cursor that does not move would ask for the same page forever.
                Some(next) if query.after.as_ref() != Some(&next) => query.after = Some(next),
                _ => return Ok(all),
            }
        }
    }

    /// Every device the coordinator knows that `query`'s filters let through (at most `limit`),
    /// in id order.
    pub async fn list_devices(
        &self,
        query: PageQuery,
        limit: Option<usize>,
        timeout: Duration,
    ) -> Result<Vec<DeviceSummary>, ClientError> {
        let command = |page| Command::ListDevices { page };
        self.pages("list_devices", command, query, limit, timeout)
            .await
    }

    /// Every device waiting for an operator, in id order.
    pub async fn pending_devices(
        &self,
        query: PageQuery,
        timeout: Duration,
    ) -> Result<Vec<EnrollmentInfo>, ClientError> {
        let command = |page| Command::PendingDevices { page };
        self.pages("pending_devices", command, query, None, timeout)
            .await
    }

    /// Every rollout's status without per-device detail, in name order.
    pub async fn rollout_summaries(
        &self,
        query: PageQuery,
        timeout: Duration,
    ) -> Result<Vec<RolloutStatus>, ClientError> {
        let command = |page| Command::RolloutStatus {
            rollout: None,
            page,
        };
        self.pages("rollout_status", command, query, None, timeout)
            .await
    }

    /// One rollout's status with the devices `query`'s filters let through, fetched page by
    /// page: the groups' counts and summaries come from the last page, the devices from all.
    pub async fn rollout_status(
        &self,
        rollout: &str,
        mut query: PageQuery,
        timeout: Duration,
    ) -> Result<RolloutStatus, ClientError> {
        query.limit = Some(query.limit.unwrap_or(DEFAULT_PAGE_SIZE));
        let mut devices = Vec::new();
        loop {
            let command = Command::RolloutStatus {
                rollout: Some(rollout.to_owned()),
                page: query.clone(),
            };
            let result = self.request(command, timeout).await?;
            let page: RolloutPage =
                serde_json::from_value(result).map_err(|source| ClientError::BadReply {
                    what: "rollout_status",
                    source,
                })?;
            devices.extend(page.items);
            match page.next {
                Some(next) if query.after.as_ref() != Some(&next) => query.after = Some(next),
                _ => {
                    let mut status = page.status;
                    status.add_devices(devices);
                    return Ok(status);
                }
            }
        }
    }
}

/// The page size the client asks for: large enough that 100,000 devices take 200 requests,
/// small enough that a page of them fits in one message with room to spare.
pub const DEFAULT_PAGE_SIZE: usize = flotilla_protocol::control::DEFAULT_PAGE_LIMIT;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::broker::EmbeddedBroker;

    #[tokio::test]
    async fn times_out_with_a_helpful_message_when_nobody_answers() {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr");
        let _broker = EmbeddedBroker::start(addr).expect("broker");
        let key = SigningKey::from_bytes(&[1; 32]);
        let client = ControlClient::connect("127.0.0.1", addr.port(), "flotilla", key)
            .await
            .expect("connects");
        // A short timeout keeps the test quick; the message format is what users see.
        let err = client
            .request(
                Command::ListDevices {
                    page: Default::default(),
                },
                Duration::from_secs(1),
            )
            .await
            .expect_err("no coordinator");
        let text = err.to_string();
        assert!(
            text.contains(&format!("127.0.0.1:{}", addr.port())),
            "{text}"
        );
        assert!(text.contains("is `flotilla serve` running?"), "{text}");
    }

    #[tokio::test]
    async fn connect_fails_clearly_without_a_broker() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let err = ControlClient::connect_within(
            "127.0.0.1",
            port,
            "flotilla",
            SigningKey::from_bytes(&[1; 32]),
            Duration::from_secs(1),
        )
        .await
        .expect_err("nothing listening");
        assert!(
            err.to_string().contains(&format!("127.0.0.1:{port}")),
            "{err}"
        );
    }
}
