//! An embedded MQTT broker (rumqttd) for a single box, the demo and tests.
//!
//! Real fleets point the coordinator and agents at an external broker; this one exists so that
//! `flotilla serve --embedded-broker 127.0.0.1:1883` is a complete system. The configuration is
//! built in code rather than read from rumqttd's TOML so the limits flotilla depends on cannot
//! be misconfigured: payloads up to [`BROKER_PACKET_LIMIT`] (artifact blocks of up to
//! `MAX_PACKET_SIZE`; rumqttd's default is 20 KiB; larger publishes are refused, so nobody can
//! leave a message the clients would not read), ten thousand connections, and segments large enough to hold a retained desired
//! action and state for every device. There is no console, metrics or prometheus endpoint.
//!
//! rumqttd has no shutdown: the broker runs on its own threads until the process exits.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use flotilla_protocol::BROKER_PACKET_LIMIT;
use rumqttd::{Config, ConnectionSettings, RouterConfig, ServerSettings};

/// How long [`EmbeddedBroker::start`] waits for the listener to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the embedded broker did not start.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("embedded broker cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("embedded broker thread could not be spawned: {source}")]
    Spawn { source: std::io::Error },
    #[error("embedded broker on {addr} did not accept connections within {}s", START_TIMEOUT.as_secs())]
    NotListening { addr: SocketAddr },
}

/// A running embedded broker.
#[derive(Debug)]
pub struct EmbeddedBroker {
    addr: SocketAddr,
}

impl EmbeddedBroker {
    /// Starts rumqttd with an MQTT 3.1.1 listener on `addr` and returns once the port accepts
    /// TCP connections.
    pub fn start(addr: SocketAddr) -> Result<EmbeddedBroker, BrokerError> {
        // rumqttd only logs a failed bind from its server thread; binding here first turns
        // "port already taken" into an error the operator sees, instead of silently talking to
        // whatever else owns the port.
        drop(TcpListener::bind(addr).map_err(|source| BrokerError::Bind { addr, source })?);
        let config = broker_config(addr);
        std::thread::Builder::new()
            .name("flotilla-broker".into())
            .spawn(move || {
                let mut broker = rumqttd::Broker::new(config);
                if let Err(e) = broker.start() {
                    tracing::error!(%addr, error = %e, "embedded broker stopped");
                }
            })
            .map_err(|source| BrokerError::Spawn { source })?;
        let deadline = Instant::now() + START_TIMEOUT;
        let probe = if addr.ip().is_unspecified() {
            SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), addr.port())
        } else {
            addr
        };
        while TcpStream::connect_timeout(&probe, Duration::from_millis(200)).is_err() {
            if Instant::now() > deadline {
                return Err(BrokerError::NotListening { addr });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if addr.ip().to_canonical().is_loopback() {
            tracing::info!(%addr, "embedded MQTT broker listening");
        } else {
            // The config refuses this address unless the operator insisted (broker.insecure_embedded).
            tracing::warn!(%addr, "embedded MQTT broker listening beyond loopback, with no login, \
                TLS or ACL: anyone who reaches {addr} can read every device's state, clear retained \
                messages and take over the coordinator's client id");
        }
        Ok(EmbeddedBroker { addr })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

fn broker_config(addr: SocketAddr) -> Config {
    let connections = ConnectionSettings {
        connection_timeout_ms: 60_000,
        // The envelope and MQTT framing add a little to the largest flotilla payload.
        max_payload_size: BROKER_PACKET_LIMIT,
        max_inflight_count: 500,
        auth: None,
        external_auth: None,
        dynamic_filters: true,
    };
    let server = ServerSettings {
        name: "flotilla-v4".into(),
        listen: addr,
        tls: None,
        next_connection_delay_ms: 0,
        connections,
    };
    Config {
        id: 0,
        router: RouterConfig {
            max_connections: 20_000,
            max_outgoing_packet_count: 1_000,
            max_segment_size: 100 * 1024 * 1024,
            max_segment_count: 10,
            ..RouterConfig::default()
        },
        v4: Some(HashMap::from([("1".to_owned(), server)])),
        ..Config::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rumqttc::{AsyncClient, Event, EventLoop, LastWill, MqttOptions, Packet, QoS};

    fn free_addr() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    }

    fn client(addr: SocketAddr, id: &str, will: Option<LastWill>) -> (AsyncClient, EventLoop) {
        let mut o = MqttOptions::new(id, addr.ip().to_string(), addr.port());
        o.set_keep_alive(Duration::from_secs(5));
        o.set_max_packet_size(
            flotilla_protocol::CLIENT_PACKET_LIMIT,
            flotilla_protocol::MAX_PACKET_SIZE,
        );
        if let Some(w) = will {
            o.set_last_will(w);
        }
        AsyncClient::new(o, 100)
    }

    /// Polls until a publish on `topic` arrives.
    async fn next_publish(el: &mut EventLoop, topic: &str) -> rumqttc::Publish {
        loop {
            match el.poll().await.expect("connection") {
                Event::Incoming(Packet::Publish(p)) if p.topic == topic => return p,
                _ => {}
            }
        }
    }

    #[tokio::test]
    async fn retained_messages_reach_late_subscribers_and_wills_fire() {
        let addr = free_addr();
        let broker = EmbeddedBroker::start(addr).expect("broker starts");
        assert_eq!(broker.addr(), addr);
        let timeout = Duration::from_secs(20);

        // A retained QoS 1 message, bigger than rumqttd's 20 KiB default, then disconnect.
        let big = vec![7u8; 100 * 1024];
        let (pub_client, mut pub_el) = client(addr, "publisher", None);
        pub_client
            .publish("t/retained", QoS::AtLeastOnce, true, big.clone())
            .await
            .expect("queue");
        tokio::time::timeout(timeout, async {
            loop {
                if let Event::Incoming(Packet::PubAck(_)) = pub_el.poll().await.expect("connection")
                {
                    return;
                }
            }
        })
        .await
        .expect("puback");
        pub_client.disconnect().await.expect("disconnect");
        let _ = tokio::time::timeout(Duration::from_secs(2), pub_el.poll()).await;

        let (sub_client, mut sub_el) = client(addr, "late-subscriber", None);
        sub_client
            .subscribe("t/#", QoS::AtLeastOnce)
            .await
            .expect("subscribe");
        let got = tokio::time::timeout(timeout, next_publish(&mut sub_el, "t/retained"))
            .await
            .expect("retained message delivered to a late subscriber");
        assert_eq!(got.payload.as_ref(), &big[..]);

        // A client whose TCP connection drops: its will reaches the subscriber.
        let will = LastWill::new("t/will", "gone", QoS::AtLeastOnce, false);
        let (_doomed_client, mut doomed_el) = client(addr, "doomed", Some(will));
        tokio::time::timeout(timeout, async {
            loop {
                if let Event::Incoming(Packet::ConnAck(_)) =
                    doomed_el.poll().await.expect("connection")
                {
                    return;
                }
            }
        })
        .await
        .expect("connack");
        // Dropping the event loop closes the socket without a DISCONNECT packet.
        drop(doomed_el);
        let will = tokio::time::timeout(timeout, next_publish(&mut sub_el, "t/will"))
            .await
            .expect("last will delivered");
        assert_eq!(will.payload.as_ref(), b"gone");
    }

    #[test]
    fn refuses_a_taken_port() {
        let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = taken.local_addr().expect("addr");
        let err = EmbeddedBroker::start(addr).expect_err("port in use");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    }
}
