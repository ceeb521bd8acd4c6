//! The figures of a run ([`Summary`]): what `flotilla-fleetsim` prints at the end as
//! `name: value` lines, and writes as JSON with `--summary`.

/// The figures of a run; printed as `name: value` lines and written as JSON with `--summary`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Summary {
    pub devices: u64,
    pub online: u64,
    /// Install actions taken up (one per device and action id).
    pub desired: u64,
    /// Desired actions that arrived again, live, with an action id the device already had.
    pub desired_duplicates: u64,
    /// Desired actions refused: bad signature, another device's, expired, undecodable.
    pub refused: u64,
    pub ready: u64,
    pub failed: u64,
    pub canceled: u64,
    /// Online devices that finished at least one install.
    pub finished_devices: u64,
    pub reports: u64,
    pub states: u64,
    pub published: u64,
    pub acked: u64,
    pub connections_lost: u64,
    /// First desired action received to the last final report sent.
    pub rollout_s: Option<f64>,
    /// Desired actions received per second while a group's arrive: over each group's span,
    /// first to last, summed (the whole run is one group without `--groups`).
    pub desired_per_s: Option<f64>,
    pub transitions: usize,
    pub transition_p50_ms: Option<f64>,
    pub transition_p99_ms: Option<f64>,
    pub transition_max_ms: Option<f64>,
    /// Control round trips sent before the first desired action: while the fleet registers
    /// and the coordinator reads it (not idle; `--idle-probes` times an idle coordinator).
    pub probe_registering: usize,
    pub probe_registering_p50_ms: Option<f64>,
    pub probe_registering_p99_ms: Option<f64>,
    /// Control round trips sent while the rollout ran (first desired action to last final
    /// report).
    pub probe_rollout: usize,
    pub probe_rollout_p50_ms: Option<f64>,
    pub probe_rollout_p99_ms: Option<f64>,
    pub probe_unanswered: usize,
    /// Device messages signed with a nonce prepared before connecting (`--sign-ahead`), and
    /// how many were prepared.
    pub signed_ahead: u64,
    pub nonces_prepared: u64,
    /// The simulator's own CPU time, user + system, its whole life (from /proc/self/stat).
    pub cpu_s: Option<f64>,
    /// With `--download`: bytes the devices took over MQTT (block lists included) and HTTP,
    /// and downloads that failed.
    pub download_mqtt_bytes: u64,
    pub download_http_bytes: u64,
    pub download_failed: u64,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value = serde_json::to_value(self).map_err(|_| std::fmt::Error)?;
        if let serde_json::Value::Object(map) = value {
            for (k, v) in map {
                match v {
                    serde_json::Value::Null => writeln!(f, "{k}: -")?,
                    serde_json::Value::Number(n) if n.is_f64() => {
                        writeln!(f, "{k}: {:.3}", n.as_f64().unwrap_or_default())?
                    }
                    other => writeln!(f, "{k}: {other}")?,
                }
            }
        }
        Ok(())
    }
}
