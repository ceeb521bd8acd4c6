//! What the rate limits refused, as metrics: the operator gate's requests by operator, role and
//! limit (`flotilla_control_requests_rate_limited_total`), and enrollment attempts by result
//! (`flotilla_enrollment_attempts_total`). The gate and the registry count in atomics they
//! share ([`GateCounts`], [`AttemptCounts`]); a scrape reads them, the service loop never waits.

use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;

use crate::service::operators::{GateCounts, Limit};
use crate::service::tokens::AttemptCounts;

#[derive(Debug, Default)]
struct Watched {
    gate: Option<Arc<GateCounts>>,
    attempts: Option<Arc<AttemptCounts>>,
}

/// The counts a scrape reads, once the service has handed them over.
#[derive(Debug, Clone, Default)]
pub struct LimitCounts {
    watched: Arc<Mutex<Watched>>,
}

impl LimitCounts {
    /// From now on scrapes show these counts.
    pub fn watch(&self, gate: Arc<GateCounts>, attempts: Arc<AttemptCounts>) {
        let mut watched = self
            .watched
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        watched.gate = Some(gate);
        watched.attempts = Some(attempts);
    }

    /// The collector to register, reading these counts.
    pub fn collector(&self) -> Box<dyn Collector> {
        Box::new(LimitsCollector {
            counts: self.clone(),
        })
    }
}

#[derive(Debug)]
struct LimitsCollector {
    counts: LimitCounts,
}

impl Collector for LimitsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (gate, attempts) = {
            let watched = self
                .counts
                .watched
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            (watched.gate.clone(), watched.attempts.clone())
        };
        let counter = ConstCounter::new(0u64).metric_type();
        if let Some(gate) = gate {
            let mut metric = encoder.encode_descriptor(
                "flotilla_control_requests_rate_limited",
                "Control requests refused because their operator's key, or all keys of its role, \
                 sent more than the rate limit (docs/security.md, \"Operator commands\")",
                None,
                counter,
            )?;
            for operator in &gate.operators {
                for limit in [Limit::Key, Limit::Role] {
                    let labels = [
                        ("operator", operator.name.as_str()),
                        ("role", operator.role.as_str()),
                        ("limit", limit.name()),
                    ];
                    ConstCounter::new(operator.limited(limit))
                        .encode(metric.encode_family(&labels)?)?;
                }
            }
        }
        if let Some(attempts) = attempts {
            let mut metric = encoder.encode_descriptor(
                "flotilla_enrollment_attempts",
                "States carrying an enrollment token's proof, by result: accepted (an unused \
                 token matched), failed (none did), limited (not checked: over the attempt limits)",
                None,
                counter,
            )?;
            for (result, n) in attempts.get() {
                ConstCounter::new(n).encode(metric.encode_family(&[("result", result)])?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::config::OperatorConfig;
    use crate::service::operators::Gate;
    use flotilla_protocol::operator::Role;
    use prometheus_client::registry::Registry;
    use std::sync::atomic::Ordering;

    #[test]
    fn every_operator_and_result_is_shown_once_watched() {
        let counts = LimitCounts::default();
        let mut registry = Registry::default();
        registry.register_collector(counts.collector());
        let text = |registry: &Registry| {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, registry).expect("encode");
            text
        };
        assert!(
            !text(&registry).contains("flotilla_control"),
            "nothing before"
        );
        let operators = vec![OperatorConfig {
            name: "vic".into(),
            role: Role::Viewer,
            key: flotilla_protocol::SigningKey::from_bytes(&[2; 32]).verifying_key(),
        }];
        let gate = Gate::new(operators, 60, flotilla_protocol::Topics::default(), 0);
        let attempts = Arc::new(AttemptCounts::default());
        attempts.limited.fetch_add(7, Ordering::Relaxed);
        counts.watch(gate.counts(), attempts);
        let text = text(&registry);
        assert!(
            text.contains(
                "flotilla_control_requests_rate_limited_total{operator=\"vic\",role=\"viewer\",limit=\"key\"} 0"
            ) && text.contains("flotilla_enrollment_attempts_total{result=\"limited\"} 7")
                && text.contains("flotilla_enrollment_attempts_total{result=\"failed\"} 0"),
            "{text}"
        );
    }
}
