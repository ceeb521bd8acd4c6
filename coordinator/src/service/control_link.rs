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
//! A coordinator that logs in by client certificate alone (mutual TLS, no user name) has no
//! second login to derive; it keeps control requests on its one connection, in the lane the link
//! opens while the retained states load (`mqtt.rs`, decision 0033), and says so at start.

use flotilla_mqtt::{Connection, Credentials};
use flotilla_protocol::Topics;

use std::time::Duration;

use crate::service::config::Config;
use crate::service::mqtt::{Events, LinkEvent, LinkOptions};

/// What the control connection's user name and client id add to the main connection's.
pub const CONTROL_SUFFIX: &str = "-control";

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
        return Err("the coordinator logs in by client certificate alone, and a second \
                    connection with the same certificate would be the same login");
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
/// main one anyway (a login the broker refuses: the link logs why and keeps trying).
pub const FIRST_WAIT: Duration = Duration::from_secs(5);

/// Waits until the control connection's subscription is acknowledged, at most [`FIRST_WAIT`];
/// what it reads before (its connection events) is of no use to the service loop.
pub async fn subscribed(events: &mut Events) {
    let wait = async {
        loop {
            match events.recv().await {
                Some(LinkEvent::Subscribed) | None => return,
                Some(_) => {}
            }
        }
    };
    if tokio::time::timeout(FIRST_WAIT, wait).await.is_err() {
        tracing::warn!(
            "the control connection is not subscribed after {FIRST_WAIT:?}; connecting the main \
             one anyway. Control requests are not answered until it is: check that the broker \
             knows its login (the coordinator's user name with \"{CONTROL_SUFFIX}\", the same \
             password; docs/operations.md)"
        );
    }
}

/// The control connection's client id.
pub fn client_id(main: &str) -> String {
    format!("{main}{CONTROL_SUFFIX}")
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
        assert_eq!(client_id("flotilla-coordinator"), "flotilla-coordinator-control");
    }

    #[test]
    fn without_a_login_the_control_connection_is_anonymous_too() {
        let control = connection(Connection::plain("127.0.0.1", 1883)).expect("derived");
        assert_eq!(control.credentials, None);
    }
}
