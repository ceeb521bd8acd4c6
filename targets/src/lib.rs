//! flotilla update targets: the things an agent can update on a device, behind one trait.
//!
//! The agent downloads and verifies an artifact, then hands it to an [`UpdateTarget`], which
//! takes it through `check`, `stage`, `activate`, and after the health checks either `confirm` or
//! `rollback`. Every step can be interrupted by a kill -9 or a power cut and called again for the
//! same action by the restarted agent; targets keep what they need on disk to make that safe.
//!
//! # Layout
//!
//! - [`target`]: the [`UpdateTarget`] trait, [`ActionContext`] and [`Activation`], with the
//!   contract every target follows.
//! - [`error`]: [`TargetError`], one variant per failed operation, worded for device operators.
//! - [`file`](mod@file): [`FileTarget`], which replaces one file atomically and keeps the previous one.
//! - [`ab`]: [`AbTarget`], which writes an image into the inactive slot of an A/B pair and
//!   switches the boot slot through a [`bootctl`] backend (U-Boot, GRUB or a plain file).
//! - [`script`]: [`ScriptTarget`], which hands each step to a user's executable with a fixed
//!   contract (subcommands, environment, JSON on stdout, exit codes); see `docs/targets.md`.
//! - [`mender`]: [`MenderModuleTarget`], which runs an unchanged Mender update module (protocol
//!   v3) through its states; see `docs/targets.md` for the mapping.
//! - [`swupdate`]: [`SwupdateTarget`], which installs a `.swu` image with SWUpdate
//!   (`swupdate -i`, or through a running SWUpdate daemon's IPC socket) and maps confirm,
//!   rollback and reboot to configured commands.
//! - [`rauc`]: [`RaucTarget`], which installs a RAUC bundle through RAUC's service (its `rauc`
//!   client) and maps confirm and rollback onto RAUC's slot marks.
//! - [`fs`]: the atomic, fsync-ing file helpers that every file write on a device goes through
//!   ([`atomic_write`](fs::atomic_write), [`atomic_copy`](fs::atomic_copy),
//!   [`atomic_rename`](fs::atomic_rename), [`fsync_dir`](fs::fsync_dir)).
//!
//! The conformance suite in `tests/conformance.rs` runs every target through the same scenarios,
//! including a crash between `stage` and `activate`.
//!
//! # Example
//!
//! ```
//! use flotilla_targets::{ActionContext, Activation, FileTarget, UpdateTarget};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let dest = dir.path().join("app.conf");
//! # let artifact = dir.path().join("app.conf.download");
//! # std::fs::write(&dest, "workers = 4\n")?;
//! # std::fs::write(&artifact, "workers = 8\n")?;
//! let target = FileTarget::new(dest.clone());
//! let ctx = ActionContext::new("act-0042", "app-2.4.0", "app.conf");
//!
//! target.check(&ctx)?;
//! target.stage(&ctx, &artifact)?; // the running file is untouched
//! assert_eq!(target.activate(&ctx)?, Activation::Done);
//! assert_eq!(std::fs::read_to_string(&dest)?, "workers = 8\n");
//!
//! // Health checks failed during the soak time: go back to exactly what was there.
//! target.rollback(&ctx)?;
//! assert_eq!(std::fs::read_to_string(&dest)?, "workers = 4\n");
//! # Ok(())
//! # }
//! ```

pub mod ab;
pub mod bootctl;
pub mod error;
pub mod file;
pub mod fs;
pub mod mender;
mod process;
pub mod rauc;
pub mod script;
pub mod swupdate;
pub mod target;

pub use ab::{AbConfig, AbTarget};
pub use bootctl::{BootControl, BootControlKind, Slot};
pub use error::TargetError;
pub use file::FileTarget;
pub use mender::{MenderModuleConfig, MenderModuleTarget};
pub use rauc::{RaucConfig, RaucTarget};
pub use script::{ScriptConfig, ScriptTarget, ScriptTimeouts};
pub use swupdate::{SwupdateConfig, SwupdateTarget};
pub use target::{ActionContext, Activation, UpdateTarget};
