//! One side of the size guard benchmark (bench/guard.sh). Each role runs in a process of its
//! own, so the CPU time a role prints is that of one link only.
//!
//! ```text
//! flotilla-guard-bench receive PORT COUNT direct|guarded   a link like the coordinator's: subscribes to
//!                                                           bench/in, takes COUNT messages; prints its CPU time
//! flotilla-guard-bench publish PORT COUNT SIZE              a bare client: COUNT messages of SIZE bytes on bench/in
//! flotilla-guard-bench send PORT COUNT SIZE direct|guarded  a link: COUNT messages of SIZE bytes on bench/out;
//!                                                           prints its CPU time
//! flotilla-guard-bench drain PORT COUNT                     a bare client: takes COUNT messages from bench/out
//! ```
//!
//! Every message is QoS 1, as flotilla's are. "direct" is rumqttc connected to the broker itself
//! (`flotilla_mqtt::client`), "guarded" goes through the guard (`Connection::link`).

use std::time::{Duration, Instant};

use flotilla_mqtt::{Connection, Link};
use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Packet, QoS};

/// What the links read and send at most, as flotilla's (CLIENT_PACKET_LIMIT, BROKER_PACKET_LIMIT).
const READ_LIMIT: usize = 266_240 + 64 * 1024 + 64;
const SEND_LIMIT: usize = 266_240;

fn usage() -> ! {
    eprintln!("usage: see the module documentation of bench/guard/src/main.rs");
    std::process::exit(2)
}

/// User plus system CPU time of this process so far (from /proc/self/stat, clock ticks of 10 ms).
fn cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or_default();
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // After the command name: state is field 0, utime 11, stime 12.
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

fn link(
    port: u16,
    id: &str,
    guarded: bool,
) -> (AsyncClient, EventLoop, Option<flotilla_mqtt::Guard>) {
    let connection = Connection::plain("127.0.0.1", port);
    if guarded {
        let mut setup = connection.link(id);
        setup
            .options
            .set_max_packet_size(READ_LIMIT, SEND_LIMIT)
            .set_keep_alive(Duration::from_secs(30))
            .set_inflight(1000)
            .set_request_channel_capacity(10_000);
        assert!(setup.guard_error().is_none(), "{:?}", setup.guard_error());
        let Link {
            client,
            eventloop,
            guard,
        } = setup.start(10_000);
        (client, eventloop, Some(guard))
    } else {
        let mut options = connection.options(id);
        options
            .set_max_packet_size(READ_LIMIT, SEND_LIMIT)
            .set_keep_alive(Duration::from_secs(30))
            .set_inflight(1000)
            .set_request_channel_capacity(10_000);
        let (client, eventloop) = flotilla_mqtt::client(options, 10_000);
        (client, eventloop, None)
    }
}

fn bare(port: u16, id: &str) -> (AsyncClient, EventLoop) {
    let mut options = MqttOptions::new(id, "127.0.0.1", port);
    options
        .set_max_packet_size(READ_LIMIT, READ_LIMIT)
        .set_keep_alive(Duration::from_secs(30))
        .set_inflight(1000);
    flotilla_mqtt::client(options, 10_000)
}

async fn subscribed(client: &AsyncClient, eventloop: &mut EventLoop, filter: &str) {
    client
        .subscribe(filter, QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    loop {
        if let Ok(Event::Incoming(Packet::SubAck(_))) = eventloop.poll().await {
            return;
        }
    }
}

/// A connection loss spoils the figures (and, with clean sessions, loses messages): stop.
fn fail(role: &str, done: u64, error: &str) -> ! {
    eprintln!("{role}: connection lost after {done} messages: {error}");
    std::process::exit(1)
}

fn report(role: &str, mode: &str, count: u64, bytes: u64, cpu: Duration, wall: Duration) {
    println!(
        "{role} {mode}: {count} messages, {:.1} MiB in {:.2} s wall, {:.2} s CPU: {:.2} us CPU a message, {:.1} MiB/s",
        bytes as f64 / 1048576.0,
        wall.as_secs_f64(),
        cpu.as_secs_f64(),
        cpu.as_secs_f64() * 1e6 / count.max(1) as f64,
        bytes as f64 / 1048576.0 / wall.as_secs_f64().max(1e-9),
    );
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_else(|| usage());
    let num = |i: usize| arg(i).parse::<u64>().unwrap_or_else(|_| usage());
    let port = num(1) as u16;
    let count = num(2);
    match arg(0).as_str() {
        "receive" => {
            let mode = arg(3);
            let (client, mut eventloop, _guard) = link(port, "bench-receiver", mode == "guarded");
            subscribed(&client, &mut eventloop, "bench/in").await;
            println!("ready");
            let (mut n, mut bytes) = (0u64, 0u64);
            let mut started = None;
            while n < count {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        started.get_or_insert((Instant::now(), cpu()));
                        n += 1;
                        bytes += p.payload.len() as u64;
                    }
                    Ok(_) => {}
                    Err(e) => fail("receive", n, &e.to_string()),
                }
            }
            let (at, cpu_at) = started.unwrap_or((Instant::now(), cpu()));
            report("receive", &mode, n, bytes, cpu() - cpu_at, at.elapsed());
        }
        "publish" => {
            let size = num(3) as usize;
            let (client, mut eventloop) = bare(port, "bench-publisher");
            let payload = vec![7u8; size];
            tokio::spawn(async move {
                for _ in 0..count {
                    client
                        .publish("bench/in", QoS::AtLeastOnce, false, payload.clone())
                        .await
                        .expect("queue");
                }
            });
            let mut acked = 0;
            while acked < count {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::PubAck(_))) => acked += 1,
                    Ok(_) => {}
                    Err(e) => fail("publish", acked, &e.to_string()),
                }
            }
        }
        "send" => {
            let size = num(3) as usize;
            let mode = arg(4);
            let (client, mut eventloop, _guard) = link(port, "bench-sender", mode == "guarded");
            let payload = vec![7u8; size];
            let started = (Instant::now(), cpu());
            tokio::spawn(async move {
                for _ in 0..count {
                    client
                        .publish("bench/out", QoS::AtLeastOnce, false, payload.clone())
                        .await
                        .expect("queue");
                }
            });
            let mut acked = 0;
            while acked < count {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::PubAck(_))) => acked += 1,
                    Ok(_) => {}
                    Err(e) => fail("send", acked, &e.to_string()),
                }
            }
            report(
                "send",
                &mode,
                count,
                count * size as u64,
                cpu() - started.1,
                started.0.elapsed(),
            );
        }
        "drain" => {
            let (client, mut eventloop) = bare(port, "bench-drain");
            subscribed(&client, &mut eventloop, "bench/out").await;
            println!("ready");
            let mut n = 0;
            while n < count {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::Publish(_))) => n += 1,
                    Ok(_) => {}
                    Err(e) => fail("drain", n, &e.to_string()),
                }
            }
        }
        _ => usage(),
    }
}
