//! Two coordinators on one PostgreSQL store, against real processes: the leader is killed,
//! stopped, cut off from the database, or the database itself crashes, and the rollout still
//! ends with every device installed exactly once, no group started twice and no report lost.
//!
//! Each test starts its own PostgreSQL (`flotilla_tests::postgres`), its own Mosquitto and its
//! own processes. Lease timings are short (ttl 3 s, renewed every second, a leader stops 1 s
//! early) so a failover takes seconds; each test prints its failover time: from the moment
//! the leader was lost to the first desired action the new leader published. The larger case
//! plays a few hundred devices with `flotilla-fleetsim` instead of agent processes.

use std::collections::BTreeMap;
use std::fs;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flotilla_protocol::control::RolloutStatus;
use flotilla_protocol::Topics;
use flotilla_tests::postgres::Postgres;
use flotilla_tests::tcp_proxy::Proxy;
use flotilla_tests::{AgentOptions, BrokerKind, Site, Watcher, WAIT};

const FIRMWARE: &[u8] = b"firmware 2.0\n";
const LEADS: &str = "this coordinator leads now";
const STANDING_BY: &str = "standing by until this one holds the lease";
const STEPPED_DOWN: &str = "stopped leading";

/// The `[store]` section of coordinator `id` on the database at `url`.
fn store(url: &str, id: &str) -> String {
    format!(
        "[store]\nurl = {url:?}\ncoordinator_id = {id:?}\nlease_ttl = 3\nlease_renew = 1\nlease_margin = 1\n"
    )
}

/// Three stages of two devices each; `approval` puts an approval after the first.
fn spec(name: &str, approval: bool) -> String {
    let after = if approval {
        "after = { approval = true }\n"
    } else {
        ""
    };
    format!(
        r#"
name = "{name}"
release = "fw-2"
[[staged.stage]]
name = "a"
select = "stage=a"
{after}[[staged.stage]]
name = "b"
select = "stage=b"
[[staged.stage]]
name = "c"
select = "stage=c"
"#
    )
}

const DEVICES: [(&str, &str); 6] = [
    ("dev-1", "a"),
    ("dev-2", "a"),
    ("dev-3", "b"),
    ("dev-4", "b"),
    ("dev-5", "c"),
    ("dev-6", "c"),
];

/// A site with coordinator `a` leading and `b` standing by on `pg`, six agents enrolled.
async fn pair(pg: &Postgres, a_url: &str) -> Site {
    pair_on(Site::new(BrokerKind::Mosquitto), pg, a_url, "").await
}

/// [`pair`] on `site`, with `a_extra` added to a's config.
async fn pair_on(mut site: Site, pg: &Postgres, a_url: &str, a_extra: &str) -> Site {
    site.release("fw-2", 2, FIRMWARE);
    site.start_named_coordinator("a", &(store(a_url, "a") + a_extra));
    site.wait_named_log("a", LEADS, 1, WAIT);
    site.start_named_coordinator("b", &store(&pg.url(), "b"));
    site.wait_named_log("b", STANDING_BY, 1, WAIT);
    for (id, stage) in DEVICES {
        let options = AgentOptions {
            soak: "2s",
            ..AgentOptions::default()
        };
        site.add_agent(id, &[("stage", stage)], options);
    }
    site.wait_devices(DEVICES.len()).await;
    site
}

async fn desired_watcher(site: &Site) -> Watcher {
    site.watcher(&[Topics::default().desired_filter()]).await
}

/// Waits for the first desired action published after `since` (the watcher was cleared
/// then), and prints the failover time.
async fn failover_time(watcher: &Watcher, since: Instant, case: &str) -> Duration {
    watcher
        .wait_until("the new leader's first desired action", WAIT, |w| {
            (!w.messages().is_empty()).then_some(())
        })
        .await;
    let took = since.elapsed();
    println!(
        "failover ({case}): {:.1} s from losing the leader to the new leader's first desired action",
        took.as_secs_f64()
    );
    took
}

/// What every case must end with: finished, each stage started once, every device ready and
/// installed once, its report counted.
fn assert_clean_finish(site: &Site, status: &RolloutStatus) {
    assert_groups_finished_once(status);
    for (id, _) in DEVICES {
        assert_eq!(
            fs::read(site.target_file(id)).expect("target file"),
            FIRMWARE,
            "{id} runs the new firmware"
        );
        let log =
            fs::read_to_string(site.path(&format!("agents/{id}/agent.log"))).unwrap_or_default();
        let finished = log
            .lines()
            .filter(|l| l.contains("action finished"))
            .count();
        assert_eq!(finished, 1, "{id} installed exactly once; its log:\n{log}");
    }
}

/// Finished, every group's devices ready (no report lost), and no group started twice (by
/// the status's decision trace).
fn assert_groups_finished_once(status: &RolloutStatus) {
    assert_eq!(status.state, "finished", "{status:#?}");
    for group in &status.groups {
        assert_eq!(group.ready, group.total, "no report lost: {status:#?}");
        let starts = status
            .trace
            .iter()
            .filter(|t| {
                t.group.as_deref() == Some(group.name.as_str())
                    && t.message
                        .starts_with(&format!("group {} started", group.name))
            })
            .count();
        assert!(
            starts <= 1,
            "group {} started {starts} times: {status:#?}",
            group.name
        );
    }
}

/// Creates and starts rollout `name` and waits until its first stage is under way.
async fn start_rollout(site: &Site, name: &str) {
    site.create_and_start(&spec(name, false)).await;
    site.wait_status(name, "stage a to be under way", WAIT, |s| {
        s.groups[0].state == "running"
    })
    .await;
}

/// Waits for rollout `name` to finish and checks it finished cleanly ([`assert_clean_finish`]).
async fn finishes_cleanly(site: &Site, name: &str) -> RolloutStatus {
    let status = site
        .wait_status(name, "the rollout to finish", WAIT * 2, |s| {
            s.state == "finished"
        })
        .await;
    assert_clean_finish(site, &status);
    status
}

/// The rollout's trace names the coordinator behind every decision: `a` before it was killed,
/// `b` after it took over.
fn decided_by_a_then_b(status: &RolloutStatus) {
    let by: Vec<&str> = status
        .trace
        .iter()
        .map(|t| t.coordinator.as_deref().unwrap_or("nobody"))
        .collect();
    assert!(
        by.iter()
            .all(|c| *c == "a at lease epoch 1" || *c == "b at lease epoch 2"),
        "every decision names its coordinator: {by:?}"
    );
    let first_b = by
        .iter()
        .position(|c| c.starts_with("b "))
        .expect("b decided");
    assert!(
        first_b > 0 && by[first_b..].iter().all(|c| c.starts_with("b ")),
        "a decided first, b everything after it took over: {by:?}"
    );
}

/// The URL of `pg` through `proxy`.
fn through(pg: &Postgres, proxy: &Proxy) -> String {
    pg.url()
        .replace(&format!(":{}/", pg.port()), &format!(":{}/", proxy.port()))
}

/// When the leader is killed.
#[derive(Debug, Clone, Copy)]
enum Moment {
    /// The second stage has started and is not done.
    MidGroup,
    /// The first stage has just finished.
    GroupBoundary,
    /// The rollout waits for an approval after the first stage.
    ApprovalWait,
    /// Right after a desired action went out (the first one of the rollout).
    AfterDesired,
}

async fn kill_leader_at(moment: Moment) {
    let Some(pg) = Postgres::start() else { return };
    let mut site = pair(&pg, &pg.url()).await;
    let desired = desired_watcher(&site).await;
    let name = "fo";
    site.create_and_start(&spec(name, matches!(moment, Moment::ApprovalWait)))
        .await;
    match moment {
        Moment::MidGroup => {
            site.wait_status(name, "stage b to be under way", WAIT, |s| {
                s.groups[1].state == "running" && s.groups[1].ready < s.groups[1].total
            })
            .await;
        }
        Moment::GroupBoundary => {
            site.wait_status(name, "stage a to finish", WAIT, |s| {
                s.groups[0].state == "finished"
            })
            .await;
        }
        Moment::ApprovalWait => {
            site.wait_status(name, "the approval after stage a", WAIT, |s| {
                s.groups[0].state == "waiting"
            })
            .await;
        }
        Moment::AfterDesired => {
            desired
                .wait_until("the first desired action", WAIT, |w| {
                    (!w.messages().is_empty()).then_some(())
                })
                .await;
        }
    }
    desired.clear();
    let lost = Instant::now();
    site.kill_named_coordinator("a");
    site.wait_named_log("b", LEADS, 1, WAIT);
    if matches!(moment, Moment::ApprovalWait) {
        site.wait_status(name, "the new leader to show the approval", WAIT, |s| {
            s.groups[0].state == "waiting"
        })
        .await;
        site.flotilla(&["approve", &format!("{name}-a")]);
    }
    let took = failover_time(&desired, lost, &format!("kill -9 {moment:?}")).await;
    assert!(took < WAIT);
    let status = finishes_cleanly(&site, name).await;
    decided_by_a_then_b(&status);
    took_over_warm(&site, "b");
    no_action_sent_twice(&desired);
}

/// Coordinator `name` led on the link it stood by on, with the view of the fleet it kept: it
/// connected to the broker once, and never read the retained messages again.
fn took_over_warm(site: &Site, name: &str) {
    let log = site.named_log(name);
    let connects = log
        .lines()
        .filter(|l| l.contains("connecting to the MQTT broker"))
        .count();
    assert_eq!(connects, 1, "{name} connected once:\n{log}");
    assert!(
        log.contains("took over the standby's view of the fleet"),
        "{name} took over warm:\n{log}"
    );
}

/// No device was sent the same action twice since `watcher` was cleared (the new leader
/// re-sends nothing the broker still holds).
fn no_action_sent_twice(watcher: &Watcher) {
    let mut seen = BTreeMap::new();
    for (device, action) in watcher.desired_actions() {
        *seen.entry((device, action)).or_insert(0) += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, &n)| n > 1).collect();
    assert!(twice.is_empty(), "sent more than once: {twice:?}");
    assert!(!seen.is_empty(), "the watcher saw the new leader's actions");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_finishes_the_rollout_when_the_leader_is_killed_mid_group() {
    kill_leader_at(Moment::MidGroup).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_finishes_the_rollout_when_the_leader_is_killed_at_a_group_boundary() {
    kill_leader_at(Moment::GroupBoundary).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_keeps_the_approval_wait_when_the_leader_is_killed_during_it() {
    kill_leader_at(Moment::ApprovalWait).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_finishes_the_rollout_when_the_leader_is_killed_right_after_publishing() {
    kill_leader_at(Moment::AfterDesired).await;
}

/// What the broker received from coordinator `a` (Mosquitto logs every PUBLISH with the
/// client id that sent it, under `log_type all`), in the broker's log from byte `from` on.
fn publishes_from_a(site: &Site, from: usize) -> Vec<String> {
    let log = fs::read_to_string(site.path("mosquitto.log")).unwrap_or_default();
    log.get(from..)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("Received PUBLISH from flotilla-coordinator-a "))
        .map(str::to_owned)
        .collect()
}

/// `GET /metrics` on `port`, or `None` while nothing answers there.
async fn try_scrape(port: u16) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: coordinator\r\n\r\n")
            .await
            .ok()?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.ok()?;
        String::from_utf8(answer).ok()
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .ok()?
}

/// Scrapes `/metrics` on `port` until it holds `line` (an endpoint may be changing hands).
async fn scrape_when(port: u16, line: &str) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let metrics = try_scrape(port).await.unwrap_or_default();
        if metrics.lines().any(|l| l == line) {
            return metrics;
        }
        assert!(
            Instant::now() < deadline,
            "no {line:?} on /metrics: {metrics}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A leader stopped for twice the lease's time-to-live publishes nothing after it wakes, and
/// comes back as a standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stopped_past_its_lease_wakes_as_a_standby_and_publishes_nothing() {
    let Some(pg) = Postgres::start() else { return };
    let a_metrics = flotilla_tests::free_port();
    let a_http = flotilla_tests::free_port();
    let mut site = pair_on(
        Site::mosquitto_with("log_type all\n"),
        &pg,
        &pg.url(),
        &format!(
            "[metrics]\nlisten = \"127.0.0.1:{a_metrics}\"\n[http]\nlisten = \"127.0.0.1:{a_http}\"\n"
        ),
    )
    .await;
    let name = "stopped";
    start_rollout(&site, name).await;
    let desired = desired_watcher(&site).await;
    let lost = Instant::now();
    site.signal_named_coordinator("a", "STOP");
    site.wait_named_log("b", LEADS, 1, WAIT);
    failover_time(&desired, lost, "SIGSTOP").await;
    // Twice the time-to-live in all, then the old leader wakes up.
    let ttl = Duration::from_secs(3);
    if let Some(rest) = (ttl * 2).checked_sub(lost.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    let broker_log_at_wake =
        fs::metadata(site.path("mosquitto.log")).map_or(0, |m| m.len() as usize);
    site.signal_named_coordinator("a", "CONT");
    site.wait_named_log("a", STEPPED_DOWN, 1, WAIT);
    // Standing by, its metrics say so (the endpoint moves from the leader's to the standby's).
    let metrics = scrape_when(a_metrics, "flotilla_leader 0").await;
    assert!(metrics.contains("flotilla_lease_epoch 1"), "{metrics}");
    // Its HTTP API says it stands by, naming itself, and runs nothing.
    let (status, body) = post_control(&site, a_http, r#"{"command":"list_approvals"}"#).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("is a standby"), "{body}");
    finishes_cleanly(&site, name).await;
    // Counted at the broker, by client id: the woken coordinator published nothing, while
    // the broker log does show what b published (the count is not blind).
    let from_a = publishes_from_a(&site, broker_log_at_wake);
    assert!(from_a.is_empty(), "a published after it woke: {from_a:#?}");
    let log = fs::read_to_string(site.path("mosquitto.log")).unwrap_or_default();
    assert!(
        log[broker_log_at_wake..].contains("Received PUBLISH from flotilla-coordinator-b "),
        "the broker log names b's publishes"
    );
    assert_eq!(site.named_log_count("a", LEADS), 1, "a did not lead again");

    // a stands by for real: when b dies, a leads again, at a new epoch, and its metrics
    // endpoint (closed when it stepped down) opens again and says so.
    site.kill_named_coordinator("b");
    site.wait_named_log("a", LEADS, 2, WAIT);
    let metrics = scrape_when(a_metrics, "flotilla_leader 1").await;
    assert!(metrics.contains("flotilla_lease_epoch 3"), "{metrics}");
    let (status, body) = post_control(&site, a_http, r#"{"command":"list_approvals"}"#).await;
    assert_eq!(status, 200, "leading again, a answers: {body}");
}

/// Signs `command` as the site's admin and posts it to the HTTP API on `port`: the status code
/// and the body.
async fn post_control(site: &Site, port: u16, command: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let envelope = site.flotilla(&["operator", "sign", command]);
    let body = envelope.trim();
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the HTTP API");
    let request = format!(
        "POST /api/v1/control HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(WAIT, stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, answer)
}

/// The database crashes mid-rollout: the leader cannot renew, steps down, and once the
/// database is back a coordinator leads again and the rollout finishes; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_mid_rollout_pauses_publishing_and_loses_nothing() {
    let Some(pg) = Postgres::start() else {
        return;
    };
    let site = pair(&pg, &pg.url()).await;
    let name = "dbcrash";
    start_rollout(&site, name).await;
    // Subscribed before the crash; what it gets on subscribing (the retained actions) is
    // forgotten once the leader stepped down.
    let desired = desired_watcher(&site).await;
    pg.crash();
    site.wait_named_log("a", STEPPED_DOWN, 1, WAIT);
    desired.clear();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        desired.messages().is_empty(),
        "nothing is published while no coordinator can write the store"
    );
    let back = Instant::now();
    pg.start_again();
    let leader = site.first_to_log(&["a", "b"], LEADS, 1, WAIT);
    println!("after the database came back, {leader} leads");
    failover_time(&desired, back, "database restart").await;
    finishes_cleanly(&site, name).await;
}

/// The leader loses the database but not the broker: it steps down, and the standby leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_database_steps_down_and_the_standby_leads() {
    let Some(pg) = Postgres::start() else { return };
    let proxy = Proxy::start(pg.port());
    let proxied = through(&pg, &proxy);
    let site = pair(&pg, &proxied).await;
    let name = "cut";
    start_rollout(&site, name).await;
    let desired = desired_watcher(&site).await;
    let lost = Instant::now();
    proxy.cut();
    site.wait_named_log("a", STEPPED_DOWN, 1, WAIT);
    let stepped_down = lost.elapsed();
    println!(
        "the cut-off leader stepped down after {:.1} s",
        stepped_down.as_secs_f64()
    );
    // When it stops acting is the lease's deadline (checked before every publish and bounding
    // every write); this line is when it noticed, printed above, not asserted: a loaded
    // machine delays it.
    site.wait_named_log("b", LEADS, 1, WAIT);
    failover_time(&desired, lost, "leader cut off from the database").await;
    let status = finishes_cleanly(&site, name).await;
    decided_by_a_then_b(&status);
}

/// Two coordinators started at the same instant, again and again: exactly one leads each
/// time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_coordinators_started_at_once_agree_on_one_leader_every_time() {
    let Some(pg) = Postgres::start() else { return };
    let mut site = Site::new(BrokerKind::Mosquitto);
    let mut leaders = BTreeMap::new();
    for round in 0..20 {
        let (a, b) = (format!("a{round}"), format!("b{round}"));
        site.start_named_coordinator(&a, &store(&pg.url(), &a));
        site.start_named_coordinator(&b, &store(&pg.url(), &b));
        let leader = site.first_to_log(&[&a, &b], LEADS, 1, WAIT);
        // Long enough for the other to take the lease too, were the lease to let it.
        std::thread::sleep(Duration::from_secs(2));
        let both = [&a, &b]
            .iter()
            .filter(|n| site.named_log_count(n, LEADS) > 0)
            .count();
        assert_eq!(both, 1, "round {round}: exactly one of {a} and {b} leads");
        if round == 0 {
            // What an operator sees: the leader, its epoch, and both coordinators.
            let shown = site.flotilla(&["status"]);
            assert!(
                shown.contains(&format!("leader    {leader}, lease epoch 1,")),
                "{shown}"
            );
            let standby = if leader == a { &b } else { &a };
            assert!(
                shown
                    .lines()
                    .any(|l| l.starts_with(&leader) && l.contains(" leader "))
                    && shown
                        .lines()
                        .any(|l| l.starts_with(standby.as_str()) && l.contains(" standby ")),
                "{shown}"
            );
        }
        *leaders
            .entry(leader.chars().next().unwrap_or('?'))
            .or_insert(0) += 1;
        // A clean stop hands the lease over at once, so the next round starts free.
        assert!(site.terminate_named_coordinator(&a, Duration::from_secs(10)));
        assert!(site.terminate_named_coordinator(&b, Duration::from_secs(10)));
    }
    println!("leaders over 20 rounds: {leaders:?}");
}

/// The leader is killed while its database connection hangs (whatever it had in flight, a
/// write or a renewal, never completes, and the database still sees the connection open): the
/// database ends what it left open, and the standby takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_takes_over_from_a_leader_killed_while_its_database_connection_hangs() {
    let Some(pg) = Postgres::start() else { return };
    let proxy = Proxy::start(pg.port());
    let proxied = through(&pg, &proxy);
    let mut site = pair(&pg, &proxied).await;
    let name = "hung";
    start_rollout(&site, name).await;
    let desired = desired_watcher(&site).await;
    proxy.cut();
    let lost = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    site.kill_named_coordinator("a");
    desired.clear();
    site.wait_named_log("b", LEADS, 1, WAIT);
    failover_time(&desired, lost, "kill -9 with its database connection hung").await;
    let status = finishes_cleanly(&site, name).await;
    decided_by_a_then_b(&status);
}

/// The leader is killed while one of its store writes is open at the database: the write's
/// statements ran, and its COMMIT is held in the proxy, so it never arrives. The database
/// rolls the write back when the killed leader's connection ends, and the standby takes over
/// and finishes the rollout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_finishes_the_rollout_when_the_leader_is_killed_before_its_write_commits() {
    let Some(pg) = Postgres::start() else { return };
    let proxy = Proxy::start(pg.port());
    let mut site = pair(&pg, &through(&pg, &proxy)).await;
    let name = "midwrite";
    start_rollout(&site, name).await;
    let desired = desired_watcher(&site).await;
    // Only a store write takes the lease row `FOR SHARE` (the lease itself runs on its own
    // connection, renewing with single UPDATEs): the first COMMIT after that and a statement on
    // the records, on the same connection, ends a write that wrote something. The lease goes
    // on renewing while it is held.
    proxy.hold_when(&[b"FOR SHARE", b"records", b"COMMIT"]);
    let held = proxy.wait_held(WAIT);
    assert!(
        held.windows(6).any(|w| w == b"COMMIT"),
        "the held bytes are the COMMIT: {:?}",
        String::from_utf8_lossy(&held)
    );
    // At the database the write is open, its records written, its commit not yet asked for.
    let open = pg.sql(
        "SELECT query FROM pg_stat_activity \
         WHERE state = 'idle in transaction' AND query LIKE '%records%'",
    );
    assert!(
        !open.is_empty(),
        "no store write open at the database while its COMMIT is held: {}",
        pg.sql("SELECT state, query FROM pg_stat_activity")
    );
    println!(
        "killing the leader with its write open at the database, its last statement: {}",
        open.lines().next().unwrap_or_default().trim()
    );
    desired.clear();
    let lost = Instant::now();
    site.kill_named_coordinator("a");
    // The kill ended the connection with the COMMIT still held: it never reached the database.
    let discarded = proxy.wait_discarded(WAIT);
    assert!(discarded.windows(6).any(|w| w == b"COMMIT"));
    // b's takeover updates the lease row, which the open write holds FOR SHARE: b leads only
    // once the database has ended that write.
    site.wait_named_log("b", LEADS, 1, WAIT);
    failover_time(&desired, lost, "kill -9 with a store write open").await;
    let status = finishes_cleanly(&site, name).await;
    decided_by_a_then_b(&status);
    took_over_warm(&site, "b");
    no_action_sent_twice(&desired);
}

/// Simulated devices of the fleet failover test.
const SIM_DEVICES: u64 = 300;
/// Groups of its rollout; the leader is killed while the middle one runs.
const SIM_GROUPS: usize = 5;

/// A fleet of [`SIM_DEVICES`] simulated devices (`flotilla-fleetsim`) and two coordinators on
/// one database: the leader is killed mid-rollout, in the middle group, and the standby
/// finishes it: every device ready, no group started twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_finishes_a_rollout_over_hundreds_of_simulated_devices_when_the_leader_is_killed(
) {
    let Some(pg) = Postgres::start() else { return };
    let mut site = Site::new(BrokerKind::Mosquitto);
    let n = SIM_DEVICES;
    let sim = flotilla_tests::bin("flotilla-fleetsim");
    let status = Command::new(&sim)
        .args(["--count", &n.to_string(), "--write-authorized-keys"])
        .arg(site.authorized_keys_file())
        .stdout(Stdio::null())
        .status()
        .expect("run flotilla-fleetsim");
    assert!(status.success(), "writing the authorized keys failed");
    site.flotilla(&[
        "release",
        "create",
        "--data-dir",
        &site.path("coordinator").to_string_lossy(),
        "--key",
        &site.path("keys/release.key").to_string_lossy(),
        "--name",
        "fw-2",
        "--version",
        "2.0.0",
        "--counter",
        "2",
        "--hardware",
        "sim-board",
        "--artifact",
        &format!("app={}", site.path("keys/release.pub").display()),
    ]);
    site.start_named_coordinator("a", &store(&pg.url(), "a"));
    site.wait_named_log("a", LEADS, 1, WAIT);
    site.start_named_coordinator("b", &store(&pg.url(), "b"));
    site.wait_named_log("b", STANDING_BY, 1, WAIT);

    let summary = site.path("fleetsim.json");
    let log = fs::File::create(site.path("fleetsim.log")).expect("fleetsim log");
    let child = Command::new(&sim)
        .args(["--broker", &format!("127.0.0.1:{}", site.port)])
        .args(["--count", &n.to_string()])
        .arg("--coordinator-key")
        .arg(site.path("keys/coordinator.pub"))
        // Long enough that a group is still running when the leader is killed.
        .args(["--install-time", "3s", "--timeout", "5m"])
        .arg("--summary")
        .arg(&summary)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start flotilla-fleetsim");
    let mut simulator = Simulator(child);
    site.wait_devices(n as usize).await;

    let name = "fleet";
    let desired = desired_watcher(&site).await;
    site.create_and_start(&format!(
        "name = {name:?}\nrelease = \"fw-2\"\n[groups]\ncount = {SIM_GROUPS}\n\
         success = {{ threshold = \"100%\", action = \"next\" }}\n"
    ))
    .await;
    let middle = SIM_GROUPS / 2;
    site.wait_status(name, "the middle group to be under way", WAIT, |s| {
        s.groups[middle].state == "running" && s.groups[middle].ready < s.groups[middle].total
    })
    .await;
    desired.clear();
    let lost = Instant::now();
    site.kill_named_coordinator("a");
    site.wait_named_log("b", LEADS, 1, WAIT);
    failover_time(&desired, lost, "kill -9 mid-rollout, simulated fleet").await;
    let status = site
        .wait_status(name, "the rollout to finish", WAIT * 2, |s| {
            s.state == "finished"
        })
        .await;
    assert_groups_finished_once(&status);
    assert_eq!(status.groups.len(), SIM_GROUPS);
    let devices: usize = status.groups.iter().map(|g| g.total).sum();
    assert_eq!(devices as u64, n, "the rollout covered the whole fleet");

    let figures = simulator.stop(&summary);
    assert_eq!(figures["ready"], n, "every device ready: {figures:#}");
    assert_eq!(figures["desired"], n, "one install per device: {figures:#}");
    assert_eq!(figures["failed"], 0, "{figures:#}");
    assert_eq!(
        figures["refused"], 0,
        "a desired action failed its checks: {figures:#}"
    );
    println!(
        "simulated fleet: {} desired actions taken up, {} sent again after the takeover",
        figures["desired"], figures["desired_duplicates"]
    );
    assert_eq!(
        figures["desired_duplicates"], 0,
        "the new leader sent no device an action it holds already: {figures:#}"
    );
    took_over_warm(&site, "b");
}

/// A running `flotilla-fleetsim`, killed on drop.
struct Simulator(std::process::Child);

impl Simulator {
    /// Stops it with SIGTERM and returns its figures (`--summary`'s JSON).
    fn stop(&mut self, summary: &std::path::Path) -> serde_json::Value {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let exit = self.0.wait().expect("wait for flotilla-fleetsim");
        assert!(exit.success(), "flotilla-fleetsim exited with {exit}");
        serde_json::from_slice(&fs::read(summary).expect("fleetsim summary")).expect("summary JSON")
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
