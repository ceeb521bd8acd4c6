//! Waiting for what the coordinator's device list says: devices online, one device's link,
//! an enrollment status. A wait that runs out names what it waited for and what the list said
//! last.

use std::time::{Duration, Instant};

use flotilla_protocol::control::{DeviceSummary, PageQuery};

use crate::{Site, WAIT};

impl Site {
    /// Waits until the coordinator knows `n` online devices.
    pub async fn wait_devices(&self, n: usize) -> Vec<DeviceSummary> {
        self.wait_for_devices(&format!("{n} online devices"), |devices| {
            (devices.iter().filter(|d| d.online).count() >= n).then(|| devices.to_vec())
        })
        .await
    }

    /// Waits until the coordinator reports `id` as online (or offline, after its last will).
    pub async fn wait_online(&self, id: &str, online: bool) -> DeviceSummary {
        self.wait_for_devices(&format!("{id} online={online}"), |devices| {
            devices
                .iter()
                .find(|d| d.id == id && d.online == online)
                .cloned()
        })
        .await
    }

    /// Waits until the coordinator lists device `id` with enrollment status `status`.
    pub async fn wait_for_enrollment(&self, id: &str, status: &str) {
        self.wait_for_devices(&format!("{id} {status}"), |devices| {
            devices
                .iter()
                .any(|d| d.id == id && d.enrollment.as_deref() == Some(status))
                .then_some(())
        })
        .await
    }

    /// Polls the coordinator's device list until `found` returns something; panics after
    /// [`WAIT`] (three times that on a NATS cluster, whose three nodes and their JetStream
    /// replicas share two cores with everything else) naming `what` and the last answer.
    async fn wait_for_devices<T>(
        &self,
        what: &str,
        found: impl Fn(&[DeviceSummary]) -> Option<T>,
    ) -> T {
        let client = self.client().await;
        let patience = if self.cluster.is_some() {
            WAIT * 3
        } else {
            WAIT
        };
        let deadline = Instant::now() + patience;
        loop {
            // Page by page, as `flotilla devices` does.
            let (last, listed) = match client
                .list_devices(PageQuery::default(), None, Duration::from_secs(5))
                .await
            {
                Ok(devices) => match found(&devices) {
                    Some(result) => return result,
                    None => (describe_devices(&devices), devices),
                },
                Err(e) => (format!("the last request failed: {e}"), Vec::new()),
            };
            assert!(
                Instant::now() < deadline,
                "coordinator did not see {what} within {patience:?}; {last}{}",
                self.describe_unlisted(&listed)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Site {
    /// For a failed wait: the end of the log of each agent this site started that the last
    /// list did not show online, so a CI log says whether it was connected, and to what.
    fn describe_unlisted(&self, listed: &[DeviceSummary]) -> String {
        let mut out = String::new();
        let coordinator = std::fs::read_to_string(self.path("coordinator.log")).unwrap_or_default();
        for id in self.agents.keys() {
            if listed.iter().any(|d| &d.id == id && d.online) {
                continue;
            }
            let log = std::fs::read_to_string(self.path(&format!("agents/{id}/agent.log")))
                .unwrap_or_else(|e| format!("(no log: {e})"));
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(25)..].join("\n");
            out.push_str(&format!(
                "\n--- {id}, not listed online; the end of its log:\n{tail}"
            ));
            let about: Vec<&str> = coordinator
                .lines()
                .filter(|l| l.contains(id.as_str()))
                .collect();
            let about = about[about.len().saturating_sub(10)..].join("\n");
            out.push_str(&format!(
                "\n--- what the coordinator's log says of {id}:\n{about}"
            ));
        }
        out
    }
}

/// What a device list says, for a failed wait: each device with its online flag, phase and
/// enrollment.
fn describe_devices(devices: &[DeviceSummary]) -> String {
    let each: Vec<String> = devices
        .iter()
        .map(|d| {
            format!(
                "{} {} {} {}",
                d.id,
                if d.online { "online" } else { "offline" },
                d.phase.as_deref().unwrap_or("-"),
                d.enrollment.as_deref().unwrap_or("-")
            )
        })
        .collect();
    format!(
        "the last list had {} devices: [{}]",
        devices.len(),
        each.join(", ")
    )
}
