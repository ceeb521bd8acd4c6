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
//! Layout, one file per concern:
//! - [`config`]: the TOML configuration, validated into [`Config`].
//! - [`store`]: sled: action records, installed release, report sequence, outbox.
//! - [`trust`]: signature, device, expiry, hardware and counter checks; the trust file.
//! - `trust_state` (private, re-exported by [`trust`]): the trust state and the trust file.
//! - [`record`]: the persisted records of an action: its state, action record, rollback point.
//! - [`machine`]: the persisted update state machine.
//! - [`fetch`]: the pipelined, resumable block fetcher.
//! - [`health`]: health checks over the soak time.
//! - [`fault`]: `FLOTILLA_FAULT`, crash points for crash-safety tests.
//! - [`link`]: the MQTT link (owns the rumqttc event loop).
//! - [`consent`]: local consent files for soft and time-forced actions.
//! - [`status`]: the local status view and the status file a running agent keeps.
//! - [`agent`]: ties them together: [`run`].
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let config = flotilla_agent::Config::load("/etc/flotilla/agent.toml".as_ref())?;
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! flotilla_agent::run(config, shutdown).await?;
//! # Ok(())
//! # }
//! ```

pub mod agent;
pub mod config;
pub mod consent;
pub mod error;
pub mod fault;
pub mod fetch;
pub mod health;
pub mod link;
pub mod machine;
pub mod record;
pub mod status;
pub mod store;
pub mod trust;
mod trust_state;

pub use agent::run;
pub use config::{Config, ConfigError, DEFAULT_CONFIG};
pub use consent::{consent, ConsentError};
pub use error::AgentError;
pub use status::{status, StatusError};
