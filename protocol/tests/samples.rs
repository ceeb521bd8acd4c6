//! Fixed sample values of every wire type, shared by the golden-bytes and fuzz tests.

use flotilla_protocol::*;

pub fn key() -> SigningKey {
    SigningKey::from_bytes(&[7u8; 32])
}

pub fn manifest() -> ReleaseManifest {
    ReleaseManifest {
        name: "fw-2.4.0".into(),
        version: "2.4.0".into(),
        counter: 24,
        hardware: vec!["pi4".into()],
        artifacts: vec![Artifact {
            name: "app.bin".into(),
            target: "app".into(),
            size: 5,
            sha256: [0xab; 32],
        }],
        created_at: 1_700_000_000,
        expires_at: 1_800_000_000,
    }
}

pub fn action(body: ActionBody) -> DesiredAction {
    DesiredAction {
        action_id: "fw-2-4.dev-1".into(),
        device_id: "dev-1".into(),
        rollout_id: "fw-2-4".into(),
        issued_at: 1_700_000_100,
        expires_at: 1_700_086_500,
        body,
    }
}

pub fn install() -> DesiredAction {
    let manifest = SignedBlob::sign(&key(), envelope::to_bytes(&manifest()));
    action(ActionBody::Install {
        manifest,
        kind: ActionKind::Forced,
        window: Some(TimeWindow {
            not_before: 1,
            not_after: 2,
        }),
    })
}

pub fn phases() -> Vec<Phase> {
    vec![
        Phase::Accepted,
        Phase::Waiting {
            reason: "consent".into(),
        },
        Phase::Downloading {
            done: 4096,
            total: 8192,
        },
        Phase::Verified,
        Phase::Staged,
        Phase::Activated,
        Phase::Confirming,
        Phase::Ready,
        Phase::Failed {
            reason: "health check failed".into(),
            rolled_back: true,
        },
        Phase::Canceled,
        Phase::Refused {
            reason: "unknown key".into(),
        },
        Phase::Downloaded,
        Phase::Applied,
    ]
}

pub fn report(phase: Phase) -> Report {
    Report {
        device_id: "dev-1".into(),
        seq: 3,
        action_id: "fw-2-4.dev-1".into(),
        rollout_id: "fw-2-4".into(),
        phase,
        at: 1_700_000_200,
    }
}

pub fn state() -> DeviceState {
    DeviceState {
        device_id: "dev-1".into(),
        hardware_id: "pi4".into(),
        labels: vec![("env".into(), "prod".into())],
        installed: Some(InstalledRelease {
            name: "fw-2.3.0".into(),
            version: "2.3.0".into(),
            counter: 23,
        }),
        current: Some(CurrentAction {
            action_id: "a".into(),
            rollout_id: "r".into(),
            phase: Phase::Ready,
        }),
        online: true,
        agent_version: "0.1.0".into(),
        at: 1_700_000_300,
    }
}

/// One of every envelope message.
pub fn messages() -> Vec<Message> {
    vec![
        Message::Desired(SignedBlob::sign(&key(), envelope::to_bytes(&install()))),
        Message::Report(report(Phase::Ready)),
        Message::State(state()),
        Message::Fetch(BlockRequest {
            sha256: [1; 32],
            offset: 65536,
            length: 16384,
        }),
        Message::Block(BlockReply::Data {
            sha256: [2; 32],
            offset: 0,
            data: vec![1, 2, 3],
        }),
        Message::Block(BlockReply::Unavailable {
            sha256: [3; 32],
            offset: 9,
            reason: "no such artifact".into(),
        }),
        Message::Device(device::sign(&key(), &device_state())),
        Message::PeerFetch(PeerFetch {
            grant: SignedBlob::sign(&key(), envelope::to_bytes(&grant())),
            request: BlockRequest {
                sha256: [4; 32],
                offset: 131072,
                length: 65536,
            },
        }),
    ]
}

/// A peer grant naming two sources.
pub fn grant() -> PeerGrant {
    PeerGrant {
        device_id: "dev-1".into(),
        action_id: "fw-2-4.dev-1".into(),
        rollout_id: "fw-2-4".into(),
        sources: vec!["dev-2".into(), "dev-3".into()],
        digests: vec![[0xab; 32], [0xcd; 32]],
        expires_at: 1_700_086_500,
    }
}

/// The sample manifest with its block-index extension.
pub fn manifest_with_blocks() -> manifest::Manifest {
    manifest::Manifest {
        release: manifest(),
        blocks: Some(manifest::ManifestBlocks {
            artifacts: vec![blocks::BlockIndexRef {
                block_size: 65536,
                sha256: [0xcd; 32],
            }],
        }),
        types: None,
    }
}

/// An install from peers.
pub fn install_with_peers() -> DesiredAction {
    let manifest = SignedBlob::sign(&key(), manifest_with_blocks().encode());
    action(ActionBody::InstallWithPeers {
        manifest,
        kind: ActionKind::Forced,
        window: None,
        grant: SignedBlob::sign(&key(), envelope::to_bytes(&grant())),
    })
}

/// One of every signed device message.
pub fn device_messages() -> Vec<DeviceMessage> {
    vec![
        device_state(),
        DeviceMessage::State {
            state: state(),
            enrollment: None,
        },
        DeviceMessage::Report(report(Phase::Ready)),
        DeviceMessage::Fetch {
            device_id: "dev-1".into(),
            request: BlockRequest {
                sha256: [1; 32],
                offset: 65536,
                length: 16384,
            },
        },
        DeviceMessage::ReportWithBytes {
            report: report(Phase::Ready),
            bytes: ByteCounts {
                coordinator: 65536,
                local: 4096,
                peers: vec![("dev-2".into(), 131072)],
            },
            bypassed: vec![BypassedPeer {
                peer: "dev-3".into(),
                reason: "block 2 failed its hash".into(),
            }],
        },
    ]
}

/// A signed state with an enrollment proof.
pub fn device_state() -> DeviceMessage {
    DeviceMessage::State {
        state: state(),
        enrollment: Some(device::enrollment_proof(
            "token",
            "dev-1",
            &key().verifying_key(),
        )),
    }
}
