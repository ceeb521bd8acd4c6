//! The control connection: control requests on an MQTT connection of their own (decision 0066).
//!
//! The coordinator's main connection carries every device's state, report and block request,
//! and after a (re)connect the whole fleet's retained messages, in one ordered TCP stream; a
//! control request sent then sits behind all of it in the broker's queue and the socket before
//! any reader can see it. A second connection that subscribes to the control request topic alone
//! has nothing in front of a request, and the service loop reads it first (`lead.rs`): while the
//! retained states load and while a rollout's device traffic streams in. Its replies go out on
//! it too, so they do not queue behind the desired actions the main connection publishes.
//!
//! Its login is derived from the main one, so there is nothing new to configure in flotilla:
//! the same brokers (the `[broker] hosts` failover list), the same TLS and the same size guard
//! (both connections go through [`mqtt::start`]); the user name with [`CONTROL_SUFFIX`] and the
//! same password; the client id with the same suffix. A broker that makes the user name the
//! client id (the shipped Mosquitto config) therefore sees two logins, and neither connection
//! takes the other's over. The shipped ACL gives that login the control request topic to read
//! and the reply topics to write, nothing else (deploy/mosquitto/acl, deploy/nats/users.sh).
//!
//! The main connection stays subscribed to control requests as before (its lane while the
//! retained states load, `mqtt.rs`, decision 0033; arrival order afterwards), so a broker that
//! refuses the control login (one set up before it existed) costs the head start, never an
//! answer: with both connections up each request arrives twice and is taken once, from
//! whichever brought it first ([`Twins`]), and its reply goes out on the control connection
//! while that is up, on the main one otherwise. A coordinator that logs in by client
//! certificate alone (mutual TLS, no user name) has no second login to derive and opens no
//! control connection; it says so at start. A standby opens none either: it answers from the
//! main connection as before (`standby.rs`), and opens it when it takes over.

use flotilla_mqtt::{Connection, Credentials};
use flotilla_protocol::Topics;

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use sha2::{Digest, Sha256};

use rumqttc::AsyncClient;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::service::config::Config;
use crate::service::mqtt::{self, Events, LinkEvent, LinkOptions};

/// What the control connection's user name and client id add to the main connection's.
pub const CONTROL_SUFFIX: &str = "-control";

/// A running control connection.
#[derive(Debug)]
pub struct ControlLink {
    pub events: Events,
    /// Publishes control replies while the connection is up.
    pub client: AsyncClient,
    pub task: JoinHandle<()>,
    /// Whether it was subscribed when [`open`] returned.
    pub up: bool,
}

/// Opens the control connection of a leader configured as `config`, stopped by `token`, and
/// waits for it ([`subscribed`]); `None` where it can have none (logged).
pub async fn open(
    config: &Config,
    topics: &Topics,
    token: CancellationToken,
) -> Option<ControlLink> {
    match options(config, topics) {
        Ok(options) => {
            tracing::info!(client = %options.client_id,
                user = options.connection.login_name().unwrap_or_default(),
                "control requests on a connection of their own");
            let link = mqtt::start(options, token);
            let mut events = link.events;
            let up = subscribed(&mut events).await;
            Some(ControlLink {
                events,
                client: link.client,
                task: link.task,
                up,
            })
        }
        Err(why) => {
            tracing::info!(
                "control requests share the main connection, ahead of device traffic only \
                 while the retained states load: {why}"
            );
            None
        }
    }
}

/// The control connection's options for a coordinator configured as `config`, or why it has
/// none (then control requests stay on the main connection).
pub fn options(config: &Config, topics: &Topics) -> Result<LinkOptions, &'static str> {
    let connection = connection(config.connection())?;
    Ok(LinkOptions::with_connection(
        connection,
        client_id(&config.broker.client_id),
        vec![topics.control_request()],
    ))
}

/// The control connection's login, from the main connection's: the same brokers and TLS, the
/// user name with [`CONTROL_SUFFIX`] and the same password.
pub fn connection(main: Connection) -> Result<Connection, &'static str> {
    let certificate_login = main
        .tls
        .as_ref()
        .is_some_and(|tls| tls.client_cert.is_some());
    if main.credentials.is_none() && certificate_login {
        return Err(
            "the coordinator logs in by client certificate alone, and a second \
                    connection with the same certificate would be the same login",
        );
    }
    let credentials = main.credentials.map(|c| Credentials {
        username: format!("{}{CONTROL_SUFFIX}", c.username),
        password: c.password,
    });
    Ok(Connection {
        credentials,
        ..main
    })
}

/// How long a coordinator waits at start for its control connection before it connects the
/// main one anyway. A refused login or a broker that cannot be reached ends the wait at once:
/// the link logs why and keeps trying.
pub const FIRST_WAIT: Duration = Duration::from_secs(5);

/// Waits until the control connection's subscription is acknowledged, at most [`FIRST_WAIT`]
/// and not past its first failure; what it reads before (its connection events) is of no use
/// to the service loop.
pub async fn subscribed(events: &mut Events) -> bool {
    let wait = async {
        loop {
            match events.recv().await {
                Some(LinkEvent::Subscribed) | None => return true,
                Some(LinkEvent::Disconnected { .. }) => return false,
                Some(_) => {}
            }
        }
    };
    let up = tokio::time::timeout(FIRST_WAIT, wait)
        .await
        .unwrap_or(false);
    if !up {
        tracing::warn!(
            "the control connection is not up; control requests are read on the main \
             connection until it is, behind device traffic. Check that the broker knows its \
             login: the coordinator's user name with \"{CONTROL_SUFFIX}\", the same password \
             (docs/operations.md, \"The control connection\")"
        );
    }
    up
}

/// The control connection's client id.
pub fn client_id(main: &str) -> String {
    format!("{main}{CONTROL_SUFFIX}")
}

/// Which connection a control request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The main connection (in its lane while loading, in arrival order afterwards).
    Main,
    /// The control connection.
    Control,
}

/// The control requests taken from one connection whose copy on the other has not come yet.
///
/// The main connection stays subscribed to the control request topic, so a broker that refuses
/// the control login (one set up before it existed) costs the speed-up, never the answers. Where
/// both connections are up every request arrives twice; the first copy is taken, whichever
/// connection it came on, and the copy on the other connection is dropped here. A payload
/// published again on purpose (a replay) arrives twice more and is taken once more, so the gate
/// refuses it exactly as often as it was published. Bounded: a copy that never comes (the
/// control connection down) is forgotten after [`TWINS_KEPT`] others.
#[derive(Debug, Default)]
pub struct Twins {
    /// Digest of a payload -> the side it was taken from and how many copies await a twin.
    waiting: HashMap<[u8; 32], (Side, u32)>,
    order: VecDeque<[u8; 32]>,
}

/// Payloads remembered at most while their copy on the other connection is awaited.
pub const TWINS_KEPT: usize = 4096;

impl Twins {
    /// Whether `payload`, arriving on `side`, is the copy of one already taken from the other
    /// connection (then it is to be dropped).
    pub fn is_twin(&mut self, side: Side, payload: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(payload).into();
        match self.waiting.get_mut(&digest) {
            Some((taken, count)) if *taken != side => {
                *count -= 1;
                if *count == 0 {
                    self.waiting.remove(&digest);
                }
                true
            }
            Some((_, count)) => {
                *count += 1;
                false
            }
            None => {
                while self.waiting.len() >= TWINS_KEPT {
                    let Some(oldest) = self.order.pop_front() else {
                        break;
                    };
                    self.waiting.remove(&oldest);
                }
                self.waiting.insert(digest, (side, 1));
                self.order.push_back(digest);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_mqtt::Password;

    #[test]
    fn the_control_login_is_the_main_one_with_a_suffix_on_the_same_brokers() {
        let mut main = Connection::plain("broker-a", 8883);
        main.alternates = vec![("broker-b".to_owned(), 8883)];
        main.credentials = Some(Credentials {
            username: "flotilla-coordinator".to_owned(),
            password: Password::new("secret"),
        });
        let control = connection(main.clone()).expect("derived");
        let login = control.credentials.as_ref().expect("a login");
        assert_eq!(login.username, "flotilla-coordinator-control");
        assert_eq!(login.password.expose(), "secret");
        assert_eq!(control.brokers(), main.brokers(), "the same failover list");
        assert_eq!(control.tls, main.tls);
        assert_eq!(
            client_id("flotilla-coordinator"),
            "flotilla-coordinator-control"
        );
    }

    #[test]
    fn a_request_is_taken_once_from_whichever_connection_brings_it_first() {
        let mut twins = Twins::default();
        assert!(
            !twins.is_twin(Side::Control, b"a"),
            "the first copy is taken"
        );
        assert!(
            twins.is_twin(Side::Main, b"a"),
            "its copy on the main connection is not"
        );
        assert!(!twins.is_twin(Side::Main, b"b"), "main first: taken");
        assert!(twins.is_twin(Side::Control, b"b"));
        // Published twice (a replay): each publish is taken once.
        assert!(!twins.is_twin(Side::Control, b"c"));
        assert!(!twins.is_twin(Side::Control, b"c"));
        assert!(twins.is_twin(Side::Main, b"c"));
        assert!(twins.is_twin(Side::Main, b"c"));
        assert!(
            !twins.is_twin(Side::Main, b"c"),
            "a third publish is taken again"
        );
        // A control connection that is down: the main copies are taken, and forgotten in time.
        for n in 0..TWINS_KEPT * 2 {
            assert!(!twins.is_twin(Side::Main, n.to_string().as_bytes()));
        }
        assert!(twins.waiting.len() <= TWINS_KEPT);
    }

    #[test]
    fn without_a_login_the_control_connection_is_anonymous_too() {
        let control = connection(Connection::plain("127.0.0.1", 1883)).expect("derived");
        assert_eq!(control.credentials, None);
    }
}
