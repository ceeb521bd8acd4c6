//! The coordinator service, `flotilla serve`, and what it owns.
//!
//! ## Tasks and channels of `flotilla serve`
//!
//! ```text
//! ┌──────────────────────┐ LinkEvent  ┌──────────────────┐ Arrival ┌─────────────────────────────┐
//! │ mqtt link task       │ (inbox,    │ verify workers   │ (round  │ service loop (serve): the   │
//! │ owns the rumqttc     │ bytes-     │ (threads): decode│ robin,  │ one owner of the engine,    │
//! │ EventLoop, polls it  │ bounded)──>│ and check device │ arrival │ the store, the enrollment   │
//! │                      │            │ signatures       │ order)─>│ registry and the operator   │
//! │                      │<──────────────── AsyncClient publishes ──│ gate; a 1 s tick            │
//! └──────────────────────┘            └──────────────────┘         └─────────────────────────────┘
//! ```
//!
//! The service loop handles one input at a time (a publish, a control request, a tick) and
//! applies the engine's effects in order; publishing only queues on the client, which the link
//! task drains while it polls. A message that cannot be published is dropped and counted, never
//! a reason to stop. SIGINT or SIGTERM cancels the loop between inputs; the link gets its own
//! token, cancelled after the last effects were queued, and two seconds to send them.
//!
//! ## Modules
//!
//! - [`serve`](mod@serve): starts the service: on sled it leads from start to stop; on a
//!   shared PostgreSQL store ([`shared`]) it stands by and leads while it holds the lease
//!   ([`leadership`], [`store`]).
//! - [`lead`]: the service while it leads, and its loop. One task owns the rollout
//!   engine ([`flotilla_rollout::engine`]) and applies its effects in order: persist, then sign
//!   and publish. The loop's `Service` is split by concern: `state` (its fields and
//!   bookkeeping), `inbound` (what arrives from the link), `dispatch` (control commands),
//!   `lists` (paged lists), `effects` (persist, sign, publish), `error` (`ServiceError`).
//! - [`config`]: the coordinator's TOML configuration, validated.
//! - [`coverage`]: whether the broker delivered every accepted device's state after a
//!   (re)connect; a shortfall, or drops the broker reports in `$SYS`, is a warning.
//! - [`enrollment`]: device keys and enrollment; which signed device messages pass.
//! - [`store`]: sled persistence of rollouts, strategies, device groups and enrollments.
//! - [`mqtt`]: the MQTT link; owns the rumqttc event loop and nothing else.
//! - [`verify`]: worker threads that decode device messages and check their signatures ahead
//!   of the service loop, which gets every event in the order it arrived; [`verify_batch`]:
//!   those signatures checked in batches.
//! - [`metrics`]: the Prometheus endpoint (`[metrics] listen`): counters, timings, and a
//!   snapshot of the engine that the loop hands over when a scrape asks.
//! - [`http`]: the HTTP server (hyper): the HTTP API (`POST /api/v1/control`, the same signed
//!   requests and gate as the MQTT control topic), its OpenAPI document, and `/metrics`.
//! - [`metrics_limits`]: what the rate limits refused, read at scrape time.
//! - [`broker`]: the embedded rumqttd broker for a single box and the demo.
//! - [`artifacts`]: the artifact block server.
//! - [`releases`]: signed release manifests, artifacts and their block lists on disk.
//! - [`grants`]: an install's action body, with the signed peer grant when it names peers.
//! - [`keys`]: the coordinator's and the release key files.
//! - [`sequence`]: the per-device order of desired actions (`issued_at` only grows).
//! - [`operators`]: who sent a control request and whether they may (signature, clock window,
//!   replay, rate limits, role).
//! - [`tokens`]: enrollment tokens: how strong, how made, how many attempts are checked.
//! - [`rate`]: token buckets over whole seconds, for the gate's and enrollment's rate limits.

pub mod artifacts;
pub mod backup;
pub mod broker;
pub mod config;
pub mod config_http;
pub mod config_store;
pub mod control_link;
pub mod coverage;
mod dispatch;
mod effects;
pub mod enrollment;
mod error;
pub mod grants;
pub mod http;
mod inbound;
pub mod keys;
pub mod lead;
pub mod leadership;
mod lists;
mod live;
mod live_changes;
pub mod loading;
pub mod metrics;
pub mod metrics_leader;
pub mod metrics_limits;
pub mod mqtt;
pub mod operators;
pub mod origins;
pub mod page;
pub mod rate;
pub mod release_types;
pub mod releases;
pub mod seal;
pub mod sequence;
pub mod serve;
pub mod shared;
mod standby;
mod state;
pub mod store;
pub mod store_health;
mod takeover;
pub mod tokens;
pub mod verify;
pub mod verify_batch;
pub mod warm;

pub use error::ServiceError;
pub use serve::serve;
