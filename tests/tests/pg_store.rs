//! The PostgreSQL store and lease against a real, private PostgreSQL per test
//! (`flotilla_tests::postgres`): migrations, the round trip of records, fencing of a deposed
//! leader, takeover after expiry, two coordinators racing for the lease, a leader partitioned
//! from the database (`flotilla_tests::tcp_proxy`), and a database crash.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use flotilla_coordinator::service::leadership::{Leadership, LeaseSettings, Role};
use flotilla_coordinator::service::store::backend::{Backend, BackendError, Op};
use flotilla_coordinator::service::store::postgres::{Fence, Lease, PgBackend, PgSettings};
use flotilla_tests::postgres::Postgres;
use flotilla_tests::tcp_proxy::Proxy;

/// Small timings, so takeovers happen within seconds.
const FAST: LeaseSettings = LeaseSettings {
    ttl: Duration::from_secs(3),
    renew_every: Duration::from_secs(1),
    margin: Duration::from_secs(1),
};

/// A generous bound for anything these tests wait for.
const BOUND: Duration = Duration::from_secs(30);

fn settings(url: String) -> PgSettings {
    PgSettings {
        url,
        connect_timeout: Duration::from_secs(2),
        statement_timeout: Duration::from_secs(2),
        ..PgSettings::default()
    }
}

fn lease(pg_url: String, me: &str, timing: LeaseSettings) -> Arc<Lease> {
    Lease::start(
        &settings(pg_url),
        me.to_owned(),
        format!("client-{me}"),
        timing,
    )
    .expect("start the lease")
}

fn wait_until(what: &str, bound: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + bound;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {bound:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn migrations_apply_once_and_a_newer_database_is_refused_naming_both_versions() {
    let Some(pg) = Postgres::start() else { return };
    let first = PgBackend::connect(&settings(pg.url()), Fence::NoLiveLease).expect("connect");
    assert_eq!(pg.sql("SELECT version, name FROM migrations"), "1|initial");
    assert_eq!(pg.sql("SELECT holder, epoch FROM lease"), "|0");
    assert!(first.is_empty().expect("is_empty"));
    drop(first);

    // Connecting again (and a lease connecting too) applies nothing more.
    let again = PgBackend::connect(&settings(pg.url()), Fence::NoLiveLease).expect("reconnect");
    let lease = lease(pg.url(), "a", FAST);
    assert_eq!(pg.sql("SELECT count(*) FROM migrations"), "1");
    assert_eq!(pg.sql("SELECT count(*) FROM lease"), "1");
    drop((again, lease));

    pg.sql("INSERT INTO migrations (version, name) VALUES (9999, 'from the future')");
    let err = PgBackend::connect(&settings(pg.url()), Fence::NoLiveLease)
        .expect_err("a newer schema is refused")
        .to_string();
    assert!(err.contains("9999"), "{err}");
    assert!(
        err.contains("version 1"),
        "names what this binary knows: {err}"
    );
    assert!(
        err.contains(&format!(
            "postgresql://flotilla@127.0.0.1:{}/postgres",
            pg.port()
        )),
        "names the database: {err}"
    );
    let err = Lease::start(&settings(pg.url()), "b".into(), "cb".into(), FAST)
        .expect_err("the lease refuses it too")
        .to_string();
    assert!(err.contains("9999"), "{err}");
}

#[test]
fn records_round_trip_and_survive_a_reconnect() {
    let Some(pg) = Postgres::start() else { return };
    let lease = lease(pg.url(), "a", FAST);
    assert!(lease.leads(), "alone, it takes the lease at once");
    let store =
        PgBackend::connect(&settings(pg.url()), Fence::Lease(lease.clone())).expect("connect");
    assert_eq!(
        store.describe(),
        format!("postgresql://flotilla@127.0.0.1:{}/postgres", pg.port())
    );
    assert!(store.is_empty().expect("is_empty"));

    store
        .write(vec![
            Op::put("rollouts", b"r2".to_vec(), b"{\"two\":2}".to_vec()),
            Op::put("rollouts", b"r1".to_vec(), b"{\"one\":1}".to_vec()),
            Op::put("rollouts", vec![0xff, 0x00], b"binary key".to_vec()),
            Op::put("published", b"dev-1".to_vec(), vec![7; 32]),
            Op::put("published", b"dev-2".to_vec(), vec![8; 32]),
            // The last operation on a key decides.
            Op::put("meta", b"gone".to_vec(), b"x".to_vec()),
            Op::remove("meta", b"gone".to_vec()),
            Op::put("meta", b"generation".to_vec(), 1u64.to_be_bytes().to_vec()),
            Op::put("meta", b"generation".to_vec(), 2u64.to_be_bytes().to_vec()),
        ])
        .expect("write");
    assert!(!store.is_empty().expect("is_empty"));
    assert_eq!(
        store.get("rollouts", b"r1").expect("get"),
        Some(b"{\"one\":1}".to_vec())
    );
    assert_eq!(store.get("rollouts", b"r3").expect("get"), None);
    assert_eq!(
        store.get("meta", b"generation").expect("get"),
        Some(2u64.to_be_bytes().to_vec())
    );
    assert_eq!(store.get("meta", b"gone").expect("get"), None);
    let keys: Vec<Vec<u8>> = store
        .scan("rollouts")
        .expect("scan")
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        keys,
        vec![b"r1".to_vec(), b"r2".to_vec(), vec![0xff, 0x00]],
        "in byte order"
    );
    assert_eq!(
        store.get("published", b"dev-1").expect("get"),
        Some(vec![7; 32])
    );

    store
        .write(vec![
            Op::remove("rollouts", b"r2".to_vec()),
            Op::remove("published", b"dev-2".to_vec()),
        ])
        .expect("remove");
    assert_eq!(store.get("rollouts", b"r2").expect("get"), None);
    assert_eq!(store.get("published", b"dev-2").expect("get"), None);
    store.write(Vec::new()).expect("an empty write commits");

    // A lazy put is seen at once here, and committed by the next write.
    store
        .put_lazily("issued", b"dev-1", &5u64.to_be_bytes())
        .expect("put lazily");
    assert_eq!(
        store.get("issued", b"dev-1").expect("get"),
        Some(5u64.to_be_bytes().to_vec())
    );
    assert_eq!(store.scan("issued").expect("scan").len(), 1);
    assert_eq!(
        pg.sql("SELECT count(*) FROM records WHERE tree = 'issued'"),
        "0"
    );
    store.write(Vec::new()).expect("commit");
    assert_eq!(
        pg.sql("SELECT count(*) FROM records WHERE tree = 'issued'"),
        "1"
    );
    drop(store);

    // Another connection (as after a restart) finds everything, `published` included.
    let mut store =
        PgBackend::connect(&settings(pg.url()), Fence::Lease(lease.clone())).expect("reconnect");
    assert_eq!(store.scan("rollouts").expect("scan").len(), 2);
    assert_eq!(
        store.get("published", b"dev-1").expect("get"),
        Some(vec![7; 32])
    );
    assert_eq!(store.get("published", b"dev-2").expect("get"), None);
    store.reopen().expect("reopen");
    assert_eq!(
        store.scan("published").expect("scan"),
        vec![(b"dev-1".to_vec(), vec![7; 32])]
    );
    assert_eq!(pg.sql("SELECT count(*) FROM records"), "5");
}

#[test]
fn a_deposed_leaders_write_is_fenced_and_not_visible() {
    let Some(pg) = Postgres::start() else { return };
    // Slow renewals, so the lease still believes it leads when the database says otherwise.
    let slow = LeaseSettings {
        ttl: Duration::from_secs(60),
        renew_every: Duration::from_secs(20),
        margin: Duration::from_secs(5),
    };
    let lease = lease(pg.url(), "a", slow);
    assert_eq!(lease.leading_epoch(), Some(1));
    let store =
        PgBackend::connect(&settings(pg.url()), Fence::Lease(lease.clone())).expect("connect");
    store
        .write(vec![Op::put("rollouts", b"before".to_vec(), b"1".to_vec())])
        .expect("the leader writes");

    // Another coordinator took the lease (as after a takeover this one did not notice yet).
    pg.sql(
        "UPDATE lease SET holder = 'b', epoch = epoch + 1, acquired_at = now(), \
         renewed_at = now(), expires_at = now() + interval '1 minute'",
    );
    assert!(lease.leads(), "locally it has not noticed yet");
    let err = store
        .write(vec![Op::put("rollouts", b"after".to_vec(), b"2".to_vec())])
        .expect_err("fenced");
    assert!(err.is_fenced(), "{err}");
    assert!(
        err.to_string().contains("`b` holds the lease at epoch 2"),
        "{err}"
    );
    assert_eq!(store.get("rollouts", b"after").expect("get"), None);
    assert_eq!(
        pg.sql("SELECT count(*) FROM records WHERE key = 'after'::bytea"),
        "0"
    );
    assert_eq!(
        store
            .get("rollouts", b"before")
            .expect("reads do not need the lease"),
        Some(b"1".to_vec())
    );

    // An offline tool (`flotilla restore`) is refused too, naming the leader.
    let offline = PgBackend::connect(&settings(pg.url()), Fence::NoLiveLease).expect("connect");
    let err = offline
        .write(vec![Op::put(
            "rollouts",
            b"restored".to_vec(),
            b"3".to_vec(),
        )])
        .expect_err("refused while a lease is live")
        .to_string();
    assert!(err.contains("coordinator `b` leads"), "{err}");
    // Once the lease ran out, the offline tool writes.
    pg.sql("UPDATE lease SET expires_at = now()");
    offline
        .write(vec![Op::put(
            "rollouts",
            b"restored".to_vec(),
            b"3".to_vec(),
        )])
        .expect("no live lease: written");
    let err = store
        .write(vec![Op::put("rollouts", b"late".to_vec(), b"4".to_vec())])
        .expect_err("an expired lease is not ours either");
    assert!(err.is_fenced(), "{err}");
}

#[test]
fn a_standby_takes_over_only_after_the_lease_expired_with_a_higher_epoch() {
    let Some(pg) = Postgres::start() else { return };
    let a = lease(pg.url(), "a", FAST);
    let b = lease(pg.url(), "b", FAST);
    assert!(a.leads());
    assert!(!b.leads(), "the lease is taken");
    let first = a.epoch();
    let mut b_role = b.watch();
    assert!(matches!(*b_role.borrow(), Role::Standby { .. }));

    // Both renew for a while: b never leads while a's lease is renewed.
    std::thread::sleep(FAST.ttl + FAST.renew_every);
    assert!(a.leads(), "renewals keep it leading");
    assert!(!b.leads(), "no takeover while the lease is renewed");
    let status = b.status();
    assert_eq!(status.lease.as_ref().map(|l| l.holder.as_str()), Some("a"));
    let ids: Vec<&str> = status.members.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, vec!["a", "b"], "both registered");
    assert_eq!(status.members[1].client_id, "client-b");

    // a stops without stepping down (a crash): b waits for the lease to run out.
    let expires_at = a.status().lease.expect("read").expires_at;
    drop(a);
    wait_until("b leads", BOUND, || b.leads());
    assert!(
        b.epoch() > first,
        "a new epoch: {} after {first}",
        b.epoch()
    );
    // The status is read right after each attempt.
    wait_until("b's status shows its lease", BOUND, || {
        b.status().lease.is_some_and(|l| l.holder == "b")
    });
    let view = b.status().lease.expect("read");
    assert!(
        view.acquired_at >= expires_at,
        "taken at {} before a's lease ran out at {expires_at}",
        view.acquired_at
    );
    assert_eq!(b.status().takeovers, 1);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        tokio::time::timeout(BOUND, b_role.wait_for(|r| matches!(r, Role::Leader { .. })))
            .await
            .expect("the watch says so")
            .expect("watch open");
    });

    // A clean step-down hands over at once, long before a (slow) ttl.
    let slow = LeaseSettings {
        ttl: Duration::from_secs(120),
        ..FAST
    };
    drop(b);
    let c = lease(pg.url(), "c", slow);
    wait_until("c leads after b's lease ran out", BOUND, || c.leads());
    let d = lease(pg.url(), "d", slow);
    assert!(!d.leads());
    let started = Instant::now();
    c.step_down();
    assert!(!c.leads(), "stops acting at once");
    wait_until("d leads after c stepped down", BOUND, || d.leads());
    assert!(
        started.elapsed() < slow.ttl / 2,
        "without waiting for the ttl"
    );
    assert_eq!(d.epoch(), c.epoch() + 1);
}

#[test]
fn of_two_coordinators_starting_at_the_same_instant_exactly_one_leads() {
    let Some(pg) = Postgres::start() else { return };
    let mut last_epoch = 0;
    for round in 0..20 {
        let barrier = Arc::new(Barrier::new(2));
        let starts: Vec<_> = ["a", "b"]
            .into_iter()
            .map(|me| {
                let barrier = barrier.clone();
                let url = pg.url();
                std::thread::spawn(move || {
                    barrier.wait();
                    lease(url, me, FAST)
                })
            })
            .collect();
        let leases: Vec<Arc<Lease>> = starts
            .into_iter()
            .map(|t| t.join().expect("start"))
            .collect();
        let leaders: Vec<&Arc<Lease>> = leases.iter().filter(|l| l.leads()).collect();
        assert_eq!(leaders.len(), 1, "round {round}: {leases:?}");
        assert_eq!(
            leaders[0].epoch(),
            last_epoch + 1,
            "round {round}: one takeover per round"
        );
        last_epoch = leaders[0].epoch();
        for lease in &leases {
            lease.step_down();
        }
    }
    assert_eq!(pg.sql("SELECT epoch FROM lease"), "20");
}

#[test]
fn a_leader_cut_off_from_the_database_stops_leading_and_the_standby_takes_over() {
    let Some(pg) = Postgres::start() else { return };
    let proxy = Proxy::start(pg.port());
    let behind = format!("postgres://flotilla@127.0.0.1:{}/postgres", proxy.port());
    let a = lease(behind.clone(), "a", FAST);
    // A patient store: its own timeouts would keep a write waiting well past the lease.
    let patient = PgSettings {
        statement_timeout: Duration::from_secs(20),
        ..settings(behind)
    };
    let store_a = PgBackend::connect(&patient, Fence::Lease(a.clone())).expect("a");
    let b = lease(pg.url(), "b", FAST);
    assert!(a.leads() && !b.leads());
    store_a
        .write(vec![Op::put("rollouts", b"r".to_vec(), b"by a".to_vec())])
        .expect("a writes");
    let mut a_role = a.watch();

    proxy.cut();
    let cut_at = Instant::now();
    // A write sent into the partition waits no longer than a may act, then says it is fenced.
    let err = store_a
        .write(vec![Op::put(
            "rollouts",
            b"r".to_vec(),
            b"into the void".to_vec(),
        )])
        .expect_err("no answer from the database");
    assert!(err.is_fenced(), "{err}");
    // Bounds well above the lease's (a loaded machine observes late) and well below the
    // store's 20 s: what is checked is which of the two ended the wait.
    assert!(
        cut_at.elapsed() < Duration::from_secs(12),
        "the write gave up with the lease, not after the store's 20 s: {:?}",
        cut_at.elapsed()
    );
    wait_until("a stops leading", BOUND, || !a.leads());
    assert!(
        cut_at.elapsed() < Duration::from_secs(12),
        "a stops with its lease, not with the store's timeout: {:?}",
        cut_at.elapsed()
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        tokio::time::timeout(
            BOUND,
            a_role.wait_for(|r| matches!(r, Role::Standby { .. })),
        )
        .await
        .expect("a's watch says standby")
        .expect("watch open");
    });
    wait_until("b takes over", BOUND, || b.leads());
    assert!(b.epoch() > a.epoch());
    let err = store_a
        .write(vec![Op::put(
            "rollouts",
            b"r".to_vec(),
            b"by a, late".to_vec(),
        )])
        .expect_err("a no longer writes");
    assert!(err.is_fenced(), "{err}");

    // The path heals: a stays a standby, b keeps leading.
    proxy.restore();
    std::thread::sleep(FAST.ttl);
    assert!(!a.leads() && b.leads());
    assert_eq!(
        pg.sql("SELECT value FROM records WHERE tree = 'rollouts'"),
        "\\x62792061"
    );
}

#[test]
fn writes_fail_while_the_database_is_down_and_work_again_after_reopen() {
    let Some(pg) = Postgres::start() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    // The service calls the backend from its tasks on a multi-thread runtime.
    let pg = Arc::new(pg);
    let task = rt.spawn(async move {
        let lease = lease(pg.url(), "a", FAST);
        let mut store =
            PgBackend::connect(&settings(pg.url()), Fence::Lease(lease.clone())).expect("connect");
        store
            .write(vec![Op::put("published", b"dev-1".to_vec(), vec![1; 32])])
            .expect("write");

        pg.crash();
        let err = store
            .write(vec![Op::put("rollouts", b"r".to_vec(), b"x".to_vec())])
            .expect_err("the database is down");
        let text = err.to_string();
        assert!(matches!(err, BackendError::Failed { .. }), "{text}");
        assert!(
            text.contains(&format!(
                "postgresql://flotilla@127.0.0.1:{}/postgres",
                pg.port()
            )),
            "names the database: {text}"
        );
        assert_eq!(
            store.get("published", b"dev-1").expect("from memory"),
            Some(vec![1; 32])
        );
        assert!(store.get("rollouts", b"r").is_err(), "other reads fail");

        pg.start_again();
        store.reopen().expect("reopen");
        let deadline = Instant::now() + BOUND;
        while !lease.leads() {
            assert!(Instant::now() < deadline, "the lease is renewed again");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        store
            .write(vec![Op::put("rollouts", b"r".to_vec(), b"x".to_vec())])
            .expect("writes again");
        assert_eq!(
            store.get("rollouts", b"r").expect("get"),
            Some(b"x".to_vec())
        );
        let renewed = lease.status().lease.expect("read").renewed_at;
        tokio::time::sleep(FAST.renew_every * 3).await;
        let later = lease.status().lease.expect("read");
        assert!(later.renewed_at > renewed, "renewals continue");
        assert_eq!(later.holder, "a");
        lease.step_down();
    });
    rt.block_on(task).expect("the test's task");
}

#[test]
fn tls_with_the_servers_ca_connects_and_a_wrong_ca_is_refused() {
    let Some(pg) = Postgres::start_tls() else {
        return;
    };
    let tls = PgSettings {
        tls: true,
        ca_file: pg.ca_file(),
        ..settings(pg.url())
    };
    let store = PgBackend::connect(&tls, Fence::NoLiveLease).expect("connect over TLS");
    store
        .write(vec![Op::put("meta", b"k".to_vec(), b"v".to_vec())])
        .expect("write over TLS");
    let lease = Lease::start(&tls, "a".into(), "ca".into(), FAST).expect("lease over TLS");
    assert!(lease.leads());
    assert_eq!(
        pg.sql(
            "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE s.ssl AND a.application_name = 'flotilla'"
        ),
        "2",
        "the store's and the lease's connections are encrypted"
    );

    // A CA that did not sign the server's certificate: refused, naming the database.
    let other = tempfile::tempdir().expect("temp dir");
    let script = flotilla_tests::secure::deploy_dir().join("make-certs.sh");
    let made = std::process::Command::new("sh")
        .arg(&script)
        .arg(other.path())
        .arg("ca")
        .output()
        .expect("make another CA");
    assert!(made.status.success());
    let wrong = PgSettings {
        ca_file: Some(other.path().join("ca.crt")),
        ..tls.clone()
    };
    let err = PgBackend::connect(&wrong, Fence::NoLiveLease)
        .expect_err("the server's certificate does not chain to this CA")
        .to_string();
    assert!(err.contains("cannot connect"), "{err}");
    assert!(err.contains(&format!("127.0.0.1:{}", pg.port())), "{err}");
}
