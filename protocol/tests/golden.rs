//! Golden bytes: the exact wire encoding of every message type. If one of these fails, the wire
//! format changed and deployed agents would misread the new bytes. Append new variants and
//! fields at the end instead, and add a new fixture.

#[allow(dead_code)] // each test binary uses a different subset of the samples
mod samples;

use flotilla_protocol::{
    envelope, hex, keys, ActionBody, ActionKind, KeysDocument, MultiSignedBlob,
};

fn actual() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for m in samples::messages() {
        out.push((
            format!("envelope {}", m.name()),
            hex::encode(&envelope::encode(&m)),
        ));
    }
    out.push((
        "manifest".into(),
        hex::encode(&envelope::to_bytes(&samples::manifest())),
    ));
    let bodies = [
        ("nothing", ActionBody::Nothing),
        (
            "cancel",
            ActionBody::Cancel {
                action_id: "a1".into(),
            },
        ),
        (
            "rollback",
            ActionBody::Rollback {
                action_id: "a1".into(),
            },
        ),
    ];
    for (name, body) in bodies {
        out.push((
            format!("action {name}"),
            hex::encode(&envelope::to_bytes(&samples::action(body))),
        ));
    }
    for kind in [
        ActionKind::Forced,
        ActionKind::Soft,
        ActionKind::DownloadOnly,
        ActionKind::TimeForced { at: 300 },
    ] {
        out.push((
            format!("kind {kind:?}"),
            hex::encode(&envelope::to_bytes(&kind)),
        ));
    }
    for phase in samples::phases() {
        out.push((
            format!("phase {}", phase.name()),
            hex::encode(&envelope::to_bytes(&phase)),
        ));
    }
    for m in samples::device_messages() {
        out.push((
            format!("device message {}", m.name()),
            hex::encode(&envelope::to_bytes(&m)),
        ));
    }
    let doc = keys_document();
    out.push((
        "keys document".into(),
        hex::encode(&envelope::to_bytes(&doc)),
    ));
    let signed = MultiSignedBlob::sign(&[&samples::key()], envelope::to_bytes(&doc));
    out.push(("keys file".into(), hex::encode(&keys::encode_file(&signed))));
    out.push((
        "manifest with blocks".into(),
        hex::encode(&samples::manifest_with_blocks().encode()),
    ));
    out.push((
        "action install with peers".into(),
        hex::encode(&envelope::to_bytes(&samples::install_with_peers())),
    ));
    out
}

/// A keys document that rotates every kind of key, including the roots.
fn keys_document() -> KeysDocument {
    KeysDocument {
        version: 2,
        release_keys: vec![[0x11; 32]],
        coordinator_keys: vec![[0x22; 32], [0x23; 32]],
        root_keys: Some(vec![[0x33; 32]]),
        root_threshold: 1,
    }
}

const GOLDEN: &str = include_str!("golden.txt");

#[test]
fn wire_format_is_unchanged() {
    let actual: Vec<String> = actual()
        .into_iter()
        .map(|(n, h)| format!("{n}: {h}"))
        .collect();
    if std::env::var_os("FLOTILLA_BLESS").is_some() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden.txt");
        std::fs::write(path, actual.join("\n") + "\n").expect("write golden file");
        return;
    }
    let expected: Vec<&str> = GOLDEN.lines().collect();
    assert_eq!(
        expected.len(),
        actual.len(),
        "number of fixtures changed; see tests/golden.txt"
    );
    for (e, a) in expected.iter().zip(&actual) {
        assert_eq!(*e, a, "wire bytes changed");
    }
}

#[test]
fn every_fixture_decodes_back() {
    for m in samples::messages() {
        assert_eq!(envelope::decode(&envelope::encode(&m)), Ok(m));
    }
    for m in samples::device_messages() {
        let blob = flotilla_protocol::device::sign(&samples::key(), &m);
        assert_eq!(
            flotilla_protocol::device::open(&blob, &samples::key().verifying_key()),
            Ok(m)
        );
    }
}
