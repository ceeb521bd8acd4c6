//! Whether the registry holds every retained device state yet, and the control commands
//! waiting for it.
//!
//! After a (re)connect the broker delivers every retained state, desired action and report on
//! subscribe, in one burst that takes seconds at 100k devices. The coordinator cannot tell the
//! last of them from the others, so once its subscriptions are acknowledged it publishes a
//! marker (not retained) on its own marker topic ([`flotilla_protocol::Topics::marker`]): the
//! broker queues it behind the retained messages it already queued for this client, so when the
//! marker comes back through the same ordered queue every one of them has been read.
//!
//! The marker's payload is a random nonce, new for every connection: a marker another client
//! manages to publish (a broker without the shipped ACL) cannot end the loading state early,
//! nor can one left over from an earlier connection. A marker that does not come back within
//! [`MARKER_TIMEOUT`] (an ACL that refuses it, a broker that drops it) ends the loading state
//! anyway; the service logs a warning saying the registry may be incomplete.
//!
//! While loading, commands whose result depends on the whole registry wait here, in arrival
//! order, at most [`MAX_HELD`] of them; the service runs them when loading ends. Pure: the
//! service owns the clock and the I/O.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// How long the marker may take to come back before the registry is taken as complete.
pub const MARKER_TIMEOUT: Duration = Duration::from_secs(30);

/// Commands held at most while loading; more get an error reply.
pub const MAX_HELD: usize = 64;

/// What a marker did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkerSeen {
    /// This connection's marker: every retained message delivered on subscribe was read.
    Complete,
    /// Not this connection's marker (a wrong nonce, or none is awaited): ignored.
    Foreign,
}

/// The loading state and the commands it holds (`T`).
#[derive(Debug)]
pub struct Loading<T> {
    loading: bool,
    /// The nonce of the marker awaited, and until when.
    awaited: Option<(String, Instant)>,
    held: VecDeque<T>,
    limit: usize,
    timeout: Duration,
}

impl<T> Loading<T> {
    /// Loading (nothing read yet), holding at most `limit` commands, waiting `timeout` for a
    /// marker.
    pub fn new(limit: usize, timeout: Duration) -> Self {
        Self {
            loading: true,
            awaited: None,
            held: VecDeque::new(),
            limit,
            timeout,
        }
    }

    /// Whether retained states may still be on their way.
    pub fn is_loading(&self) -> bool {
        self.loading
    }

    /// A new connection: its retained messages are still to come.
    pub fn connected(&mut self) {
        self.loading = true;
        self.awaited = None;
    }

    /// The subscriptions were acknowledged: returns the nonce to publish as the marker now.
    pub fn subscribed(&mut self, now: Instant) -> String {
        let nonce = flotilla_protocol::operator::new_nonce();
        self.loading = true;
        self.awaited = Some((nonce.clone(), now + self.timeout));
        nonce
    }

    /// A marker arrived with `payload`.
    pub fn marker(&mut self, payload: &[u8]) -> MarkerSeen {
        match &self.awaited {
            Some((nonce, _)) if nonce.as_bytes() == payload => {
                self.loading = false;
                self.awaited = None;
                MarkerSeen::Complete
            }
            _ => MarkerSeen::Foreign,
        }
    }

    /// When the awaited marker times out, if one is awaited.
    pub fn deadline(&self) -> Option<Instant> {
        self.awaited.as_ref().map(|(_, at)| *at)
    }

    /// Ends the loading state if the awaited marker is overdue at `now`; true if it did.
    pub fn expire(&mut self, now: Instant) -> bool {
        match self.deadline() {
            Some(at) if now >= at => {
                self.loading = false;
                self.awaited = None;
                true
            }
            _ => false,
        }
    }

    /// Holds `item` until loading ends; gives it back when [`MAX_HELD`] are held already.
    pub fn hold(&mut self, item: T) -> Result<(), T> {
        if self.held.len() >= self.limit {
            return Err(item);
        }
        self.held.push_back(item);
        Ok(())
    }

    /// How long a marker may take.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Commands held now.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The next held command, oldest first, once loading has ended.
    pub fn release(&mut self) -> Option<T> {
        if self.loading {
            return None;
        }
        self.held.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_connections_marker_ends_loading_and_held_commands_come_out_in_order() {
        let mut loading = Loading::new(3, MARKER_TIMEOUT);
        let start = Instant::now();
        assert!(
            loading.is_loading(),
            "nothing read before the first connection"
        );
        loading.connected();
        let nonce = loading.subscribed(start);
        assert_eq!(nonce.len(), 32, "16 random bytes in hex");
        for n in 1..=3 {
            loading.hold(n).expect("room");
        }
        assert_eq!(loading.hold(4), Err(4), "bounded: the fourth is refused");
        assert_eq!(loading.release(), None, "nothing released while loading");
        assert_eq!(
            loading.marker(b"0123456789abcdef0123456789abcdef"),
            MarkerSeen::Foreign
        );
        assert_eq!(loading.marker(b""), MarkerSeen::Foreign);
        assert!(loading.is_loading(), "a forged marker does not end loading");
        assert_eq!(loading.marker(nonce.as_bytes()), MarkerSeen::Complete);
        assert!(!loading.is_loading());
        assert_eq!(
            std::iter::from_fn(|| loading.release()).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert_eq!(
            loading.marker(nonce.as_bytes()),
            MarkerSeen::Foreign,
            "a marker seen twice is not awaited any more"
        );
    }

    #[test]
    fn a_reconnect_needs_a_new_marker_and_the_old_one_does_not_count() {
        let mut loading: Loading<()> = Loading::new(1, MARKER_TIMEOUT);
        let now = Instant::now();
        let first = loading.subscribed(now);
        loading.connected();
        let second = loading.subscribed(now);
        assert_ne!(first, second, "a fresh nonce per connection");
        assert_eq!(loading.marker(first.as_bytes()), MarkerSeen::Foreign);
        assert!(loading.is_loading());
        assert_eq!(loading.marker(second.as_bytes()), MarkerSeen::Complete);
    }

    #[test]
    fn an_overdue_marker_ends_loading_and_releases_what_was_held() {
        let mut loading = Loading::new(4, Duration::from_secs(30));
        let now = Instant::now();
        assert!(
            !loading.expire(now),
            "no deadline before the subscription is acknowledged"
        );
        loading.subscribed(now);
        loading.hold("create").expect("room");
        assert_eq!(loading.deadline(), Some(now + Duration::from_secs(30)));
        assert!(!loading.expire(now + Duration::from_secs(29)));
        assert!(loading.is_loading());
        assert!(loading.expire(now + Duration::from_secs(30)));
        assert!(!loading.is_loading());
        assert_eq!(loading.deadline(), None);
        assert_eq!(loading.release(), Some("create"));
    }
}
