//! Which devices of a group start now: the group's pace, the rate limit, maintenance windows,
//! sites' budgets and other rollouts on the same devices; starting, retrying and deferring them.

use flotilla_protocol::control::TraceKind;

use super::model::{DevicePhase, GroupState, Rollout, Stall, ISSUED};
use super::queues::SiteQueues;
use super::trace::Decision;
use crate::plan::OfflinePolicy;
use crate::text::count;
use crate::window::{utc_text, Window, LOOKAHEAD};

use super::advance::*;

impl Rollout {
    /// Starts the group's next devices as far as every limit allows; returns why it stopped
    /// short, if it did.
    pub(super) fn fill(&mut self, gi: usize, now: u64, ctx: &Ctx, out: &mut Out) -> Option<Wait> {
        if self.groups[gi].cursor >= self.groups[gi].devices.len() {
            return None;
        }
        if !ctx.windows.is_empty() && !ctx.windows.iter().any(|w| w.is_open(now)) {
            let next = ctx.windows.iter().filter_map(|w| w.next_open(now)).min();
            return Some(Wait {
                kind: "window",
                text: match next {
                    Some(at) => format!(
                        "outside the maintenance windows; the next opens at {}",
                        utc_text(at)
                    ),
                    None => "outside the maintenance windows".to_owned(),
                },
            });
        }
        let site_policy = self.spec.policies.sites.is_some();
        let generation = self.site_generation();
        if site_policy {
            if let Some(stall) = &self.groups[gi].cache.stalled {
                if stall.generation == generation && now < stall.until {
                    return Some(Wait {
                        kind: "site",
                        text: stall.text.clone(),
                    });
                }
            }
            self.groups[gi].cache.stalled = None;
        }
        let (offline_policy, my_weight) = (self.spec.policies.offline, self.spec.policies.weight);
        let successes = self.successes();
        let mut queues = self.site_queues(gi, now);
        // When the fill began: the group's sites with devices left to start, and whether devices
        // without a site are left too.
        let open_sites = self.groups[gi].cache.open_sites;
        let open_without_site =
            self.groups[gi].counts.scheduled > self.groups[gi].cache.scheduled_in_sites;
        let mut started = 0usize;
        let mut result = None;
        // Devices start in list order; one whose site is full is passed over (the cursor stays
        // on it) and the next is looked at, so other sites keep going. The queues give that
        // order; `pos` is where a scan of the list would be (devices before it were looked at).
        let mut pos = self.groups[gi].cursor;
        // The last look ended at a device it could not start or at the end of the list (not at
        // the end of a batch): the cursor moves up to the first device not started.
        let mut stopped = false;
        'batches: loop {
            let group = &self.groups[gi];
            if group.cursor >= group.devices.len() {
                break;
            }
            let total = group.counts.effective_total();
            if let Some(gate) = group.pace.gate {
                let allowed = gate.of(total);
                if group.counts.not_ready() > allowed {
                    result = Some(Wait {
                        kind: "budget",
                        text: format!(
                            "group {}: {} of {total} not ready > {allowed} allowed ({gate}); the next batch waits",
                            group.name,
                            group.counts.not_ready()
                        ),
                    });
                    break;
                }
            }
            let batch = group.pace.batch.unwrap_or(usize::MAX);
            let mut in_batch = 0usize;
            let mut last_started = pos;
            stopped = true;
            while in_batch < batch {
                let next = queues.next(|pos| scheduled_at(&self.groups[gi], pos));
                let group = &self.groups[gi];
                if let Some(limit) = group.pace.concurrency {
                    // The limit holds at the next device not started whose site was not yet
                    // found full in this fill, blocked sites' first devices included.
                    if group.counts.not_ready() >= limit
                        && (next.is_some() || queues.blocked_from(pos))
                    {
                        result = Some(Wait {
                            kind: "concurrency",
                            text: format!(
                                "group {}: {} of {limit} allowed at once are not ready",
                                group.name,
                                group.counts.not_ready()
                            ),
                        });
                        break 'batches;
                    }
                }
                let Some((at, site_id)) = next else {
                    break 'batches;
                };
                pos = at + 1;
                let device = group.devices[at].clone();
                let site = queues.name(site_id).map(str::to_owned);
                let peers = match site.as_ref() {
                    Some(site) => match self.site_gate(site, &device, now) {
                        Ok(peers) => peers,
                        Err(why) => {
                            queues.block(at, site_id, why);
                            continue;
                        }
                    },
                    None => Vec::new(),
                };
                if let Some(ramp) = self.ramp.as_mut() {
                    if ramp.available(now, successes) == 0 {
                        result = Some(Wait {
                            kind: "rate",
                            text: format!(
                                "rate limit of {:.1} devices per minute",
                                ramp.rate(successes)
                            ),
                        });
                        break 'batches;
                    }
                }
                let offline_since = ctx.offline.get(&device).copied();
                if offline_since.is_some() && offline_policy == OfflinePolicy::Skip {
                    let group = &mut self.groups[gi];
                    group.set_phase(
                        &device,
                        DevicePhase::Skipped("offline when its turn came".into()),
                    );
                    if let Some(slot) = group.slots.get_mut(&device) {
                        slot.ended_at = Some(now);
                    }
                    queues.pop(at, site_id);
                    let gname = group.name.clone();
                    let message = format!(
                        "device {device} skipped in group {gname}: offline when its turn came"
                    );
                    let decision = Decision::new(TraceKind::DeviceSkipped, message);
                    self.record(now, decision.group(&gname).device(&device), out);
                    continue;
                }
                if let Some((owner, weight)) = ctx.owners.get(&device) {
                    if owner != &self.name {
                        if *weight > my_weight {
                            result = Some(Wait {
                                kind: "overlap",
                                text: format!(
                                    "device {device} is busy with rollout {owner} (weight {weight} > {my_weight})"
                                ),
                            });
                            break 'batches;
                        }
                        out.preempt
                            .push((owner.clone(), device.clone(), self.name.clone()));
                    }
                }
                if let Some(site) = &site {
                    self.seed_if_first(site, &device, &peers, now);
                }
                self.start_device(gi, &device, peers, now, out);
                queues.pop(at, site_id);
                if let Some(ramp) = self.ramp.as_mut() {
                    ramp.take(1);
                }
                last_started = at + 1;
                in_batch += 1;
                started += 1;
            }
            // The batch is full: a scan would be just past its last device.
            stopped = false;
            self.advance_cursor(gi, last_started);
            if self.groups[gi].pace.gate.is_none() && self.groups[gi].pace.batch.is_some() {
                // A batch without a gate is only a chunk: go on with the next one.
                continue;
            }
            if self.groups[gi].pace.gate.is_none() {
                break;
            }
        }
        if stopped {
            self.advance_cursor(gi, usize::MAX);
        }
        self.groups[gi].cache.queues = Some(queues);
        if started > 0 {
            let group = &self.groups[gi];
            if group.pace.batch.is_some() || group.pace.gate.is_some() {
                let (name, begun, total, not_ready) = (
                    group.name.clone(),
                    group.cursor,
                    group.devices.len(),
                    group.counts.not_ready(),
                );
                let message = format!(
                    "group {name}: started {} ({begun} of {total} started, {not_ready} not ready)",
                    count(started, "device")
                );
                let decision = Decision::new(TraceKind::DevicesStarted, message);
                self.record(now, decision.group(&name), out);
            }
        }
        if result.is_some() {
            return result;
        }
        // The sites found full: when the fill got here, every site with devices left to start
        // was looked at.
        let queues = self.groups[gi].cache.queues.as_deref()?;
        let (site, why) = queues
            .blocked
            .first_key_value()
            .map(|(s, w)| (s.clone(), w.clone()))?;
        let all_blocked = !open_without_site && queues.blocked.len() >= open_sites;
        let until = queues.first_seed_wait().unwrap_or(u64::MAX);
        let wait = Wait {
            kind: "site",
            text: self.site_wait(&site, why),
        };
        if all_blocked {
            // Until a site changes, a fill would pass over the same devices again.
            self.groups[gi].cache.stalled = Some(Stall {
                generation: self.site_generation(),
                until,
                text: wait.text.clone(),
            });
        }
        Some(wait)
    }

    /// Moves a group's cursor past the devices that have started, up to `bound`.
    pub(super) fn advance_cursor(&mut self, gi: usize, bound: usize) {
        let group = &mut self.groups[gi];
        let end = bound.min(group.devices.len());
        while group.cursor < end
            && group
                .slots
                .get(&group.devices[group.cursor])
                .map(|s| &s.phase)
                != Some(&DevicePhase::Scheduled)
        {
            group.cursor += 1;
        }
    }

    /// The group's waiting queues for a fill, up to date: the sites touched since the last
    /// fill are open again in every group's queues, and those whose seed wait ended.
    pub(super) fn site_queues(&mut self, gi: usize, now: u64) -> Box<SiteQueues> {
        let touched: Vec<String> = self
            .groups
            .iter_mut()
            .flat_map(|g| {
                g.cache.touched_folded = 0;
                std::mem::take(&mut g.cache.touched)
            })
            .collect();
        for (i, g) in self.groups.iter_mut().enumerate() {
            if i != gi && g.state != GroupState::Running {
                // Built again if the group runs again.
                g.cache.queues = None;
            }
            if let Some(queues) = g.cache.queues.as_mut() {
                for site in &touched {
                    queues.reopen(site);
                }
            }
        }
        let mut queues = self.groups[gi]
            .cache
            .queues
            .take()
            .unwrap_or_else(|| Box::new(build_queues(&self.groups[gi])));
        queues.end_seed_waits(now);
        queues
    }

    /// Sends a device its desired action (first attempt), naming the peers it may fetch from.
    pub(crate) fn start_device(
        &mut self,
        gi: usize,
        device: &str,
        peers: Vec<String>,
        now: u64,
        out: &mut Out,
    ) {
        let group = &mut self.groups[gi];
        group.set_phase(device, DevicePhase::InProgress(ISSUED.to_owned()));
        if let Some(slot) = group.slots.get_mut(device) {
            slot.attempt = 1;
            slot.started_at = Some(now);
            slot.attempt_at = Some(now);
            slot.peers = peers;
        }
        if group.devices.get(group.cursor).map(String::as_str) == Some(device) {
            group.cursor += 1;
        }
        out.commands.push(self.desired(gi, device, 1));
        out.claims.push((
            device.to_owned(),
            self.name.clone(),
            self.spec.policies.weight,
        ));
    }

    /// Sends the next attempt of a device waiting for its retry.
    pub(crate) fn retry_device(&mut self, gi: usize, device: &str, now: u64, out: &mut Out) {
        let group = &mut self.groups[gi];
        let Some(slot) = group.slots.get_mut(device) else {
            return;
        };
        slot.attempt += 1;
        slot.attempt_at = Some(now);
        slot.retry_at = None;
        let attempt = slot.attempt;
        let site = slot.site.clone();
        group.set_phase(device, DevicePhase::InProgress(ISSUED.to_owned()));
        let gname = group.name.clone();
        // A retry fetches from the site's holders as they are now (none: from the coordinator).
        let peers = site
            .filter(|_| self.spec.policies.sites.as_ref().is_some_and(|p| p.peers))
            .map(|site| self.holders_for(&site, device))
            .unwrap_or_default();
        if let Some(slot) = self.groups[gi].slots.get_mut(device) {
            slot.peers = peers;
        }
        out.commands.push(self.desired(gi, device, attempt));
        out.claims.push((
            device.to_owned(),
            self.name.clone(),
            self.spec.policies.weight,
        ));
        let message = format!("device {device} in group {gname}: attempt {attempt} sent");
        let decision = Decision::new(TraceKind::DeviceStarted, message);
        self.record(now, decision.group(&gname).device(device), out);
    }

    /// Moves a retry that is due while the maintenance windows are closed to the next opening
    /// (or a lookahead later when none opens within it, to look again then).
    pub(super) fn defer_retry(
        &mut self,
        gi: usize,
        device: &str,
        now: u64,
        windows: &[Window],
        out: &mut Out,
    ) {
        let opens = windows.iter().filter_map(|w| w.next_open(now)).min();
        let group = &mut self.groups[gi];
        let gname = group.name.clone();
        let Some(slot) = group.slots.get_mut(device) else {
            return;
        };
        slot.retry_at = Some(opens.unwrap_or(now + LOOKAHEAD));
        let when = match opens {
            Some(at) => format!("which opens at {}", utc_text(at)),
            None => "none of which opens within 366 days".to_owned(),
        };
        self.record(
            now,
            format!(
                "device {device} in group {gname}: retry waits for the maintenance window, {when}"
            ),
            out,
        );
    }
}
