//! Signatures of 300-byte messages (about a device report's size) under distinct keys, checked
//! one by one with `verify_strict` and in batches of 8, 16, 32 and 64 with `verify_batch`.
//!
//! Usage: flotilla-sig-batch [COUNT] [MODE], MODE `single`, `batch:N` or `setup` (keys and
//! signatures made, nothing checked): one mode only, for instruction counts under callgrind; or
//! every mode timed when none is given.

use std::time::Instant;

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};

fn main() {
    let mut args = std::env::args().skip(1);
    let count: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(4096);
    let mode = args.next();
    let keys: Vec<SigningKey> = (0..count)
        .map(|n| {
            let mut seed = [7u8; 32];
            seed[..8].copy_from_slice(&(n as u64).to_le_bytes());
            SigningKey::from_bytes(&seed)
        })
        .collect();
    let messages: Vec<Vec<u8>> = (0..count).map(|n| vec![(n % 251) as u8; 300]).collect();
    let signatures: Vec<Signature> = keys.iter().zip(&messages).map(|(k, m)| k.sign(m)).collect();
    let public: Vec<VerifyingKey> = keys.iter().map(|k| k.verifying_key()).collect();
    let run = |mode: &str| -> bool {
        match mode {
            "setup" => true,
            "single" => (0..count).all(|n| public[n].verify_strict(&messages[n], &signatures[n]).is_ok()),
            _ => {
                let size: usize = mode.trim_start_matches("batch:").parse().expect("batch:N");
                (0..count).step_by(size).all(|start| {
                    let end = (start + size).min(count);
                    let m: Vec<&[u8]> = messages[start..end].iter().map(|m| m.as_slice()).collect();
                    ed25519_dalek::verify_batch(&m, &signatures[start..end], &public[start..end]).is_ok()
                })
            }
        }
    };
    match mode {
        Some(mode) => assert!(run(&mode), "every signature verifies"),
        None => {
            for mode in ["single", "batch:8", "batch:16", "batch:32", "batch:64"] {
                let start = Instant::now();
                assert!(run(mode), "every signature verifies");
                let per = start.elapsed().as_secs_f64() * 1e6 / count as f64;
                println!("{mode:>9}: {per:.1} us per signature ({count} signatures)");
            }
        }
    }
}
