//! `flotilla-verify-speed FILE`: prints `<sha256 hex>  FILE`, as `sha256sum` does, computed the
//! way the agent verifies a finished download (`agent/src/fetch.rs`, `hash_file`): sha2's
//! `Sha256` over 64 KiB reads. bench/footprint.sh times it against `sha256sum` on the same file.

use std::fs::File;
use std::io::Read;
use std::process::ExitCode;

use sha2::Digest as _;

fn hash_file(path: &str) -> std::io::Result<[u8; 32]> {
    let mut file = File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().into())
}

fn main() -> ExitCode {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: flotilla-verify-speed FILE");
        return ExitCode::from(2);
    };
    match hash_file(&path) {
        Ok(digest) => {
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            println!("{hex}  {path}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("flotilla-verify-speed: cannot read {path}: {e}");
            ExitCode::FAILURE
        }
    }
}
