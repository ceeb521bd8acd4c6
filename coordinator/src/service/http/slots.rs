//! Which connections the HTTP server serves when they are more than it takes: a connection still
//! waiting for its request head makes room for a new one (the oldest of the peer address that
//! holds the most such connections); one that is answering is never interrupted.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;

use tokio_util::sync::CancellationToken;

/// Where a connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for its request head: may make room for a new connection.
    Reading,
    /// Answering a whole request.
    Answering,
}

#[derive(Debug)]
struct Slot {
    peer: IpAddr,
    phase: Phase,
    evict: CancellationToken,
}

/// The connections being served, by the order they arrived in.
#[derive(Debug)]
pub(super) struct Slots {
    max: usize,
    next: u64,
    live: BTreeMap<u64, Slot>,
}

impl Slots {
    /// At most `max` connections at once.
    pub(super) fn new(max: usize) -> Slots {
        Slots {
            max,
            next: 0,
            live: BTreeMap::new(),
        }
    }

    /// Takes a slot for a connection from `peer`, making room when every slot is taken; `None`
    /// when every connection is answering.
    pub(super) fn take(&mut self, peer: IpAddr) -> Option<(u64, CancellationToken)> {
        if self.live.len() >= self.max {
            let victim = self.victim()?;
            if let Some(slot) = self.live.remove(&victim) {
                slot.evict.cancel();
            }
        }
        let id = self.next;
        self.next += 1;
        let evict = CancellationToken::new();
        self.live.insert(
            id,
            Slot {
                peer,
                phase: Phase::Reading,
                evict: evict.clone(),
            },
        );
        Some((id, evict))
    }

    /// The oldest connection still reading, of the peer that has the most of them.
    fn victim(&self) -> Option<u64> {
        let mut reading: BTreeMap<IpAddr, (usize, u64)> = BTreeMap::new();
        for (id, slot) in self.live.iter().filter(|(_, s)| s.phase == Phase::Reading) {
            // Ids grow with arrival, so the first one seen of a peer is its oldest.
            reading.entry(slot.peer).or_insert((0, *id)).0 += 1;
        }
        reading
            .into_values()
            .max_by(|(n1, oldest1), (n2, oldest2)| n1.cmp(n2).then(oldest2.cmp(oldest1)))
            .map(|(_, oldest)| oldest)
    }

    /// The connection `id` has its head and answers from now on; `false` when it was evicted
    /// meanwhile (and must not answer).
    pub(super) fn answering(&mut self, id: u64) -> bool {
        match self.live.get_mut(&id) {
            Some(slot) => {
                slot.phase = Phase::Answering;
                true
            }
            None => false,
        }
    }

    pub(super) fn free(&mut self, id: u64) {
        self.live.remove(&id);
    }
}

pub(super) fn lock(slots: &Mutex<Slots>) -> std::sync::MutexGuard<'_, Slots> {
    slots
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_victim_is_the_oldest_reading_connection_of_the_busiest_peer() {
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        let mut slots = Slots::new(16);
        let (first, _) = slots.take(a).expect("slot");
        let (second, _) = slots.take(b).expect("slot");
        let (third, _) = slots.take(b).expect("slot");
        assert_eq!(slots.victim(), Some(second));
        slots.answering(second);
        slots.answering(third);
        assert_eq!(slots.victim(), Some(first), "answering connections stay");
        slots.answering(first);
        assert_eq!(slots.victim(), None);
    }
}
