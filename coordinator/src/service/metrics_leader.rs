//! Leadership on `/metrics`: whether this coordinator leads, the lease's epoch and how often
//! leadership changed hands to it. On sled the coordinator always leads, at epoch 0.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::service::leadership::Leadership;

/// Reads the leadership at each scrape.
#[derive(Debug)]
pub struct LeaderCollector {
    leadership: Arc<dyn Leadership>,
}

impl LeaderCollector {
    pub fn boxed(leadership: Arc<dyn Leadership>) -> Box<dyn Collector> {
        Box::new(LeaderCollector { leadership })
    }
}

impl Collector for LeaderCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let leader = ConstGauge::new(i64::from(self.leadership.leads()));
        let metric = encoder.encode_descriptor(
            "flotilla_leader",
            "1 while this coordinator leads (holds the store's lease), 0 while it stands by",
            None,
            leader.metric_type(),
        )?;
        leader.encode(metric)?;
        let epoch = ConstGauge::new(i64::try_from(self.leadership.epoch()).unwrap_or(i64::MAX));
        let metric = encoder.encode_descriptor(
            "flotilla_lease_epoch",
            "The epoch of the lease this coordinator holds or last held (0 on sled)",
            None,
            epoch.metric_type(),
        )?;
        epoch.encode(metric)?;
        let takeovers = ConstCounter::new(self.leadership.status().takeovers);
        let metric = encoder.encode_descriptor(
            "flotilla_failovers",
            "Times this coordinator took the lease after another coordinator's expired",
            None,
            takeovers.metric_type(),
        )?;
        takeovers.encode(metric)?;
        Ok(())
    }
}
