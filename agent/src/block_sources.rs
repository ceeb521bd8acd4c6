//! Where the blocks of a block-indexed download may come from (`crate::fetch_blocks`): the
//! action's peers, its HTTP(S) origin and the coordinator, and the limits past which a peer or
//! the origin is bypassed.

use std::path::PathBuf;
use std::time::Duration;

use flotilla_mqtt::https::OriginTls;
use flotilla_protocol::origin::OriginUrl;
use flotilla_protocol::SignedBlob;

/// `Unavailable` answers in a row (no good block between them) from one peer before it is
/// bypassed for the action.
pub const PEER_UNAVAILABLE_LIMIT: u32 = 8;

/// The wait before asking the peers again for a block every peer in use answered `Unavailable`.
pub const PEER_RETRY: Duration = Duration::from_secs(1);

/// How many of a peer's latest blocks are timed against `Sources::slow_block`: a peer whose
/// last this many blocks cost more than this many times `slow_block` is bypassed as slow.
pub const PEER_SLOW_BLOCKS: usize = 8;

/// Bytes that may be outstanding once the HTTP origin is the source asked (when it is larger
/// than `in_flight` blocks): enough for a run of blocks ([`crate::http_origin::RUN_BYTES`]) on
/// each of the origin's connections. The origin is timed by its progress, not per block
/// (`Download::origin_heard`), so a slow link is not mistaken for a silent origin.
pub const ORIGIN_WINDOW_BYTES: u64 = 4 * crate::http_origin::RUN_BYTES;

/// Where block requests may go, and for how long peers are tried.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// Peers in the order the grant names them (this device left out).
    pub peers: Vec<String>,
    /// The signed grant shown to every peer; without one, no peer is asked.
    pub grant: Option<SignedBlob>,
    /// A peer that leaves a block unanswered this long is bypassed.
    pub peer_timeout: Duration,
    /// The average time a peer's block may cost, its `Unavailable` answers included, over its
    /// last [`PEER_SLOW_BLOCKS`] blocks; a peer over it is bypassed as slow.
    pub slow_block: Duration,
    /// Once the peers have delivered no block for this long (from the start, or since their
    /// last block), every block not yet asked goes to the coordinator.
    pub fallback_after: Duration,
    /// Files the device holds that may share blocks (target contents, A/B slots); read up to
    /// the artifact's size. Verified artifacts in the download directory are added.
    pub local: Vec<PathBuf>,
    /// The artifact's HTTP(S) origin, asked after the peers and before the coordinator.
    pub origin: Option<OriginUrl>,
    /// The certificates an HTTPS origin's must chain to (`[origins] ca_file`).
    pub origin_tls: OriginTls,
}
