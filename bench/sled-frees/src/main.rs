//! Rewrites a store record the way the coordinator does during a rollout and prints how much the
//! process's resident memory grew, for four cases: the whole rollout as one record (RECORD_BYTES,
//! default 4,500,000: a 100k-device rollout) or one small record per device that changed
//! (DEVICES, default 30,000, a fifth of them per save), each with and without
//! `crossbeam_epoch::pin().flush()` after the flush. The writes come from a task on a two-worker
//! tokio runtime that sleeps between saves, so it moves between threads as the service does.
//!
//! Usage: flotilla-sled-frees [SAVES]   (default 45, a 100k rollout's ticks at 1 s: about 200)

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).map(str::to_owned))
        })
        .and_then(|kb| kb.parse().ok())
        .unwrap_or(0)
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn run(whole: bool, flush: bool, saves: usize) -> u64 {
    let dir = std::env::temp_dir().join(format!(
        "flotilla-sled-frees-{}-{whole}-{flush}",
        std::process::id()
    ));
    let db = sled::Config::new()
        .path(&dir)
        .cache_capacity(8 << 20)
        .open()
        .expect("open sled");
    let tree = db.open_tree("rollouts").expect("tree");
    let (record, devices) = (env("RECORD_BYTES", 4_500_000), env("DEVICES", 30_000));
    let before = rss_kib();
    for save in 0..saves {
        if whole {
            tree.insert("rollout", vec![b'a' + (save % 2) as u8; record])
                .expect("insert");
        } else {
            let mut batch = sled::Batch::default();
            for i in 0..devices / 5 {
                let device = (save * 997 + i * 5) % devices;
                batch.insert(
                    format!("rollout\0s\0dev-{device:06}").as_bytes(),
                    vec![b'a' + (save % 20) as u8; 200],
                );
            }
            tree.apply_batch(batch).expect("batch");
        }
        db.flush().expect("flush");
        if flush {
            crossbeam_epoch::pin().flush();
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let grew = rss_kib().saturating_sub(before);
    drop(tree);
    drop(db);
    let _ = std::fs::remove_dir_all(&dir);
    grew
}

/// Each case runs in a process of its own, so memory one case freed does not hide another's.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let [_, case, saves] = args.as_slice() {
        let saves: usize = saves.parse().unwrap_or(45);
        let (whole, flush) = match case.as_str() {
            "whole" => (true, false),
            "whole-flushed" => (true, true),
            "devices" => (false, false),
            _ => (false, true),
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .expect("runtime");
        let grew = runtime.block_on(run(whole, flush, saves));
        let what = if whole { "whole record" } else { "per-device records" };
        let frees = if flush { "flushed" } else { "left" };
        println!("{what:<20} {saves} saves, deferred frees {frees:<7}: RSS grew {} MiB", grew / 1024);
        return;
    }
    let saves = args.get(1).cloned().unwrap_or_else(|| "45".into());
    for case in ["whole", "whole-flushed", "devices", "devices-flushed"] {
        let status = std::process::Command::new(&args[0])
            .args([case, saves.as_str()])
            .status()
            .expect("run a case");
        assert!(status.success(), "case {case} failed");
    }
}
