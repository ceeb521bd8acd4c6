//! # flotilla-agent
//!
//! The device agent of flotilla: it receives signed desired actions over MQTT, checks them
//! against its trusted keys, downloads the release's artifacts block by block, applies them
//! through update targets, runs health checks over a soak time, and reports every step back.
//!
//! ```text
//!          (desired action, verified)
//! Idle ──> Accepted ──> [Waiting] ──> Downloading{done} ──> Verified ──> Staged ──> Activated
//!   │         │                            │                   │  └──> Downloaded (download-only)
//!   │         └──> Refused{reason}         │                   │
//!   │                                      └──> Failed{reason} │        Confirming (health checks
//!   │   Canceled <── (signed cancel, any state before activation)        over the soak time)
//!   │                                                                      ├──> Ready
//!   └── every state is persisted (sled) before its side effect runs        └──> Failed{rolled_back}
//!
//! A device without health checks goes from Activated straight to Applied: installed, but its
//! readiness cannot be tracked.
//! ```
//!
//! ## Layout
//!
//! One file per concern, in layers: a module imports only modules on lower lines, so no two
//! modules import each other, directly or around a circle (`tests/tests/layers.rs` in the
//! workspace checks the second half for every crate).
//!
//! ```text
//! agent                              the daemon: the agent loop, one action task at a time
//! peer_serve                         answering peers' block requests
//! machine                            one action, state by state
//! download  env                      the download step; what a step works with (Env, ActionIo, Next)
//! fetch_blocks  health  link  consent   what a step uses: blocks, health checks, MQTT, consent
//! fetch   adaptive   whole_hash      the streaming fetcher and channel types; local blocks;
//!                                    the block fetcher's whole-file hash, on its own thread
//! held                               verified downloads served to peers, and how many are kept
//! resume                             whether a stored action may go on, verified again
//! trust   status   error             trust checks, keys install; status view; AgentError
//! store                              sled, and opening the agent's state
//! record  trust_state  identity      persisted data: action records; the trust state; device key
//! config  fault                      used from every layer
//! log_filter  notify                 `RUST_LOG` (for the binary); systemd notifications (import nothing)
//! ```
//!
//! - [`agent`]: ties them together: [`run`].
//! - [`machine`]: the persisted update state machine ([`machine::drive`], [`machine::step`]).
//! - [`download`](mod@download): the download step of an action, artifact by artifact.
//! - [`env`]: what the machine works with: [`env::Env`] (config, store, trust state, link,
//!   targets), the channels of one running action ([`env::ActionIo`]), a step's outcome.
//! - [`fetch_blocks`]: the block-verified, multi-source fetcher (local copies, peers, the
//!   HTTP origin, the coordinator) for artifacts whose manifest signs a block list;
//!   [`block_list_fetch`]: that block list, fetched, checked and kept.
//! - [`fetch`]: the pipelined, resumable streaming fetcher, for artifacts without one.
//! - [`adaptive`]: finding blocks the device already holds.
//! - [`whole_hash`]: the whole file's sha256 of a block download, in file order on a thread of
//!   its own, whatever order the blocks arrive in.
//! - [`peer_serve`]: answers peers' block requests (grant checks, bounded work).
//! - [`held`]: the verified downloads a device serves from, re-checked per block; [`held::prune`]
//!   bounds what is kept.
//! - [`health`]: health checks over the soak time.
//! - [`link`]: the MQTT link (owns the rumqttc event loop).
//! - [`consent`](mod@consent): local consent files for soft and time-forced actions.
//! - [`resume`]: a stored action found unfinished is verified again (signatures, counter against
//!   the trust file, expiry) before it goes on.
//! - [`trust`]: signature, device, expiry, hardware, replay and counter checks; keys install.
//! - [`status`](mod@status): the local status view and the status file a running agent keeps.
//! - [`error`]: [`AgentError`], what stops the daemon. Other errors live where they arise:
//!   [`ConfigError`], [`store::StoreError`], [`trust::InstallKeysError`], [`StatusError`],
//!   [`ConsentError`].
//! - [`store`]: sled, every value with its sha256: action records, installed release, rollback
//!   point, report sequence, outbox, trust mirror; [`store::open_data_dir`] opens it with the
//!   trust state and notices a database behind the trust file.
//! - [`record`]: the persisted records of an action: its state, action record, rollback point.
//! - `trust_state` (private, re-exported by [`trust`]): the trust state and the trust file.
//! - [`identity`]: the device's own key (`<data_dir>/device.key`), which signs what it sends.
//! - [`config`]: the TOML configuration, validated into [`Config`].
//! - [`fault`]: `FLOTILLA_FAULT`, crash points for crash-safety tests.
//! - [`log_filter`]: `RUST_LOG`, read without a regular-expression engine.
//! - [`notify`]: systemd's `READY=1`, `WATCHDOG=1` and `STOPPING=1` (`Type=notify`,
//!   `WatchdogSec`), over the `NOTIFY_SOCKET` datagram socket; the agent loop pings the watchdog.
//!
//! ## At run time
//!
//! ```text
//! ┌──────────────────┐ LinkEvent (256) ┌──────────────────┐ FetchInput (256) ┌────────────────┐
//! │ link: poll task  │────────────────>│ agent loop (run) │─────────────────>│ action task    │
//! │ owns the rumqttc │                 │ verify, start or │── cancel token ─>│ machine::drive │
//! │ EventLoop        │                 │ cancel, route    │<─────────────────│ persist, step, │
//! └──────────────────┘                 │ blocks, outbox   │ final record (4) │ report         │
//!          ^ rumqttc requests (64)     └────────┬─────────┘                  └─┬────────┬─────┘
//! ┌──────────────────┐                          │                              │        │
//! │ link: writer task│<── Outgoing (64) ────────┴──────────────────────────────┘        │
//! │ owns AsyncClient │<── Outgoing::Fetch ── forwarder task <── BlockRequest (64) ──────┘
//! └──────────────────┘
//! ```
//!
//! - The link's poll task owns the rumqttc `EventLoop` and does nothing but poll it: publishes
//!   and acknowledgements become [`link::LinkEvent`]s. It never waits on the agent loop: an event
//!   that finds the queue full waits in a bounded backlog (one reconnect, acknowledgements up to
//!   1,024, only the newest desired action; a block reply is dropped and asked for again) that a
//!   backlog task hands on. So the poll task always drains rumqttc's request queue, and no cycle
//!   of bounded waits (poll -> agent loop -> writer -> request queue -> poll) can close, however
//!   many messages arrive. The writer task holds an `AsyncClient` and sends the
//!   [`link::Outgoing`] messages queued through [`link::LinkHandle`] clones.
//! - The agent loop ([`run`], in the caller's task) decides: it verifies desired actions, runs at
//!   most one action task, passes it block replies and reconnects (`FetchInput`), cancels it on
//!   a signed cancel or for a newer action, and removes acknowledged reports from the outbox.
//! - The action task runs [`machine::drive`]: it persists each state before the step that acts
//!   on it and reports through the link itself. Its block requests go through a forwarder task
//!   that ends with the action. Target steps (stage, activate, rollback, reboot) run on the
//!   blocking pool; health checks are child processes.
//! - Peer requests (`peer-fetch`) bypass the agent loop: the poll task offers each to the peer
//!   server's bounded inbox ([`link::PeerInbox`], dropped when full) and the server
//!   ([`peer_serve::start`]) answers at most `[peers] max_concurrent` at once, reading blocks
//!   on the blocking pool, and replies through the writer task ([`link::Outgoing::PeerBlock`]).
//! - The caller's shutdown token (the binary cancels it on SIGINT or SIGTERM) stops the agent
//!   loop and the action task at a safe point. The link has its own token, cancelled last, once
//!   the offline state and the last report acknowledgements had a second to go through.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let config = flotilla_agent::Config::load("/etc/flotilla/agent.toml".as_ref())?;
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! flotilla_agent::run(config, shutdown).await?;
//! # Ok(())
//! # }
//! ```

pub mod adaptive;
pub mod agent;
pub mod block_list_fetch;
pub mod block_sources;
pub mod config;
pub mod consent;
pub mod download;
pub mod env;
pub mod error;
pub mod fault;
pub mod fetch;
pub mod fetch_blocks;
pub mod health;
pub mod held;
pub mod http_origin;
pub mod http_redirect;
pub mod identity;
pub mod link;
pub mod log_filter;
pub mod machine;
pub mod notify;
pub mod peer_serve;
pub mod record;
pub mod refresh;
pub mod resume;
pub mod status;
pub mod store;
pub mod trust;
mod trust_state;
pub mod whole_hash;

pub use agent::run;
pub use config::{Config, ConfigError, DEFAULT_CONFIG};
pub use consent::{consent, ConsentError};
pub use error::AgentError;
pub use status::{status, StatusError};
