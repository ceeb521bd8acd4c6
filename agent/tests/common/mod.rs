//! What the agent's broker tests share: a real mosquitto on a free port, the fixed test keys and
//! the clock. Each test file uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use flotilla_protocol::SigningKey;

pub const TIMEOUT: Duration = Duration::from_secs(30);

/// The test key with every byte `seed`.
pub fn key(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32])
}

pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Starts mosquitto on a free port, or `None` (with a notice) when it is not installed.
pub fn find_mosquitto() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join("mosquitto"))
        .find(|p| p.is_file())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

pub struct Broker {
    _child: tokio::process::Child,
    pub port: u16,
}

pub async fn start_broker(dir: &Path) -> Option<Broker> {
    let Some(bin) = find_mosquitto() else {
        eprintln!("NOTICE: mosquitto not found on PATH or in /usr/sbin; skipping this test");
        return None;
    };
    // Another test may take the probed port before mosquitto binds it; then try another.
    for _ in 0..5 {
        let port = free_port();
        let conf = dir.join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!("listener {port} 127.0.0.1\nallow_anonymous true\n"),
        )
        .expect("write conf");
        let mut child = tokio::process::Command::new(&bin)
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start mosquitto");
        let listening = tokio::time::timeout(TIMEOUT, async {
            loop {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    return false;
                }
                if tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    return matches!(child.try_wait(), Ok(None));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("mosquitto did not start listening within 30s");
        if listening {
            return Some(Broker {
                _child: child,
                port,
            });
        }
    }
    panic!("mosquitto could not bind a free port in five tries");
}
