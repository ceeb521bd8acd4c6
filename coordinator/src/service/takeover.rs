//! Taking over from a warm standby: what it kept of the fleet (`warm.rs`) goes into the engine
//! as if it had just been read back from the broker, without reading it again.

use std::collections::HashMap;

use flotilla_protocol::DeviceId;

use crate::service::error::ServiceError;
use crate::service::state::{now, Service};
use crate::service::warm::Kept;

impl Service {
    /// Reads what the standby kept, in the order a coordinator reads the broker's retained
    /// messages: the desired actions first (so every action published from now on is issued
    /// above what devices were told), then the reports and block requests of the last few
    /// seconds (those sent while no coordinator led), then the states, each checked once more against the
    /// enrollments just loaded (a device revoked or given a new key since is not let in on the
    /// standby's word). States the standby could not check go through the same path as any
    /// state that arrives. Then the marker: when it comes back, the owed actions not found
    /// retained go out ([`Service::reissue_unconfirmed`]).
    pub(super) async fn take_over(&mut self, kept: Kept) -> Result<(), ServiceError> {
        let started = std::time::Instant::now();
        let Kept {
            states,
            unchecked,
            desired,
            recent,
        } = kept;
        self.confirmed = Some(HashMap::new());
        let desired_count = desired.len();
        for (device, action) in &desired {
            self.note_desired(device, action);
        }
        // Reports before states: a state is the device's latest word.
        let recent_count = recent.len();
        for (topic, payload) in recent {
            self.on_publish(&topic, &payload, None).await?;
        }
        let (mut fed, mut refused) = (0usize, 0usize);
        let now = now();
        for (device, kept) in states {
            if !Kept::still_accepted(&self.registry, &device, &kept) {
                refused += 1;
                continue;
            }
            fed += 1;
            let effects = self.engine.observe_state(kept.state, now);
            self.apply(effects).await?;
        }
        let unchecked_count = unchecked.len();
        for (device, payload) in unchecked {
            let Ok(id) = DeviceId::new(&device) else {
                continue;
            };
            let topic = self.topics.state(&id);
            self.on_publish(&topic, &payload, None).await?;
        }
        tracing::info!(
            states = fed,
            states_no_longer_accepted = refused,
            states_checked_now = unchecked_count,
            desired_actions = desired_count,
            recent_reports_and_block_requests = recent_count,
            took_ms = started.elapsed().as_millis(),
            "took over the standby's view of the fleet: nothing read again from the broker"
        );
        // The broker queues this marker behind whatever it still holds for this link: when it
        // comes back, everything is read, and what is owed and not found goes out.
        let nonce = self.loading.subscribed(tokio::time::Instant::now());
        let marker = self.topics.marker();
        self.publish(marker, false, nonce.into_bytes()).await
    }
}
