//! # flotilla-coordinator
//!
//! The coordinator service and the `flotilla` command line. The rollout logic itself (specs in
//! four vocabularies, the planner, the sans-I/O engine) is the `flotilla-rollout` crate; this
//! crate puts it to work:
//!
//! - [`service`]: `flotilla serve`. One task owns the engine and applies its effects in order
//!   (persist to sled, then sign and publish over MQTT); around it the MQTT link, the embedded
//!   broker, the artifact block server, the release store, keys and the config.
//! - [`cli`]: the `flotilla` command line: arguments, commands, the control client that talks to
//!   a running coordinator over MQTT, views, `plan`, `simulate` and `demo`.
//!
//! ## Tasks and channels of `flotilla serve`
//!
//! ```text
//!             publishes, connection events          events.recv()
//! ┌─────────────────────┐  push, never waits   ┌────────────────┐   one at a time   ┌────────┐
//! │ link: poll task     │────────────────────>│ inbox          │──────────────────>│ service│
//! │ owns the EventLoop  │                      │ (128 MiB cap,  │                   │ loop   │
//! │                     │<── requests (10,000)─│  drops counted)│                   │ (owns  │
//! └─────────────────────┘   AsyncClient clones └────────────────┘                   │ engine,│
//!         ^                                                                         │ store) │
//!         └──────────────────── publish().await ───────────────────────────────────└────────┘
//! ```
//!
//! - The poll task (`service/mqtt.rs`) only polls rumqttc and pushes what arrives into the
//!   inbox; it never waits on the inbox (full means dropped and counted, connection events
//!   always go in) and never on the client, so it always drains the request queue.
//! - The service loop (`service/serve.rs`) takes one event, a control request or a one-second
//!   tick at a time, applies the engine's effects in order (store first, then publish), and may
//!   wait on `publish` while the request queue is full: the poll task empties it without waiting
//!   on anything the loop holds, so there is no cycle.
//! - With `[metrics] listen`, an accept task and one task per scrape connection
//!   (`service/metrics.rs`, at most 8) serve `GET /metrics`. A scrape raises a flag; the loop,
//!   between two inputs, hands over a snapshot of the engine and wakes it. The loop never waits
//!   on a scrape, and a scrape waits at most 2 s for the loop.
//! - Subscriptions go out from short-lived spawned tasks; the embedded broker (optional) runs on
//!   its own threads. On SIGTERM the loop stops taking events, applies the last tick, cancels
//!   the link and waits at most 2 s for it; a store that failed a write is abandoned rather
//!   than closed (closing can wait forever on a full disk).
//!
//! Layers point one way: `cli` -> `service` -> `flotilla_rollout` -> `flotilla_protocol`
//! (docs/architecture.md).

pub mod cli;
pub mod service;
