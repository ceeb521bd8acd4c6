//! The body of an install action, and the peer grant that goes with it when the engine names
//! peers (decision 0024).
//!
//! An install whose effect names no peers is a plain `ActionBody::Install`, which every agent
//! reads. One that names peers becomes `ActionBody::InstallWithPeers` with a [`PeerGrant`] signed
//! by the coordinator key on its own: the device, the action and its rollout, the peers in the
//! order the engine gave, every digest of the release a peer may be asked for (each artifact and
//! each block list) and the action's expiry. The device shows the grant to those peers; a peer
//! serves only what the grant covers and answers on the topic of the device the grant names.

use flotilla_protocol::origin::Origin;
use flotilla_protocol::{
    envelope, ActionBody, ActionKind, Digest, PeerGrant, SignedBlob, SigningKey, TimeWindow,
    UnixTime,
};

/// What an install effect asks for, before the action is stamped and signed.
#[derive(Debug, Clone)]
pub struct Install<'a> {
    pub device: &'a str,
    pub action_id: &'a str,
    pub rollout: &'a str,
    pub manifest: SignedBlob,
    pub kind: ActionKind,
    pub window: Option<TimeWindow>,
    /// Peers to fetch from, in order; empty for a plain install.
    pub peers: &'a [String],
    /// Every digest of the release: artifacts and block lists.
    pub digests: &'a [Digest],
    /// HTTP(S) locations of the release's artifacts (decision 0062); empty for none.
    pub origins: Vec<Origin>,
}

/// The action body for `install`, given the action's expiry (the grant's too).
/// With HTTP locations it is an `InstallFromOrigins`, which carries the grant too (when there
/// are peers); without, the older variants, which older agents read.
pub fn install_body(key: &SigningKey, install: Install<'_>, expires_at: UnixTime) -> ActionBody {
    let grant = (!install.peers.is_empty()).then(|| {
        let grant = PeerGrant {
            device_id: install.device.to_owned(),
            action_id: install.action_id.to_owned(),
            rollout_id: install.rollout.to_owned(),
            sources: install.peers.to_vec(),
            digests: install.digests.to_vec(),
            expires_at,
        };
        SignedBlob::sign(key, envelope::to_bytes(&grant))
    });
    if !install.origins.is_empty() {
        return ActionBody::InstallFromOrigins {
            manifest: install.manifest,
            kind: install.kind,
            window: install.window,
            grant,
            origins: install.origins,
        };
    }
    match grant {
        None => ActionBody::Install {
            manifest: install.manifest,
            kind: install.kind,
            window: install.window,
        },
        Some(grant) => ActionBody::InstallWithPeers {
            manifest: install.manifest,
            kind: install.kind,
            window: install.window,
            grant,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_rollout::engine::Effect;
    use flotilla_rollout::plan::ActionType;

    fn body_for(effect: &Effect, key: &SigningKey) -> ActionBody {
        let Effect::Desired {
            device,
            action_id,
            rollout,
            peers,
            ..
        } = effect
        else {
            panic!("not a desired effect: {effect:?}");
        };
        let manifest = SignedBlob::sign(&SigningKey::from_bytes(&[3; 32]), b"manifest".to_vec());
        install_body(
            key,
            Install {
                device,
                action_id,
                rollout,
                manifest,
                kind: ActionKind::Forced,
                window: None,
                peers,
                digests: &[[1; 32], [2; 32]],
                origins: Vec::new(),
            },
            5_000,
        )
    }

    fn effect(peers: Vec<String>) -> Effect {
        Effect::Desired {
            device: "pi-7".into(),
            action_id: "harbour-3-pi-7".into(),
            rollout: "harbour".into(),
            release: "fw-2".into(),
            action: ActionType::Forced,
            peers,
        }
    }

    #[test]
    fn an_effect_with_peers_gets_a_grant_the_coordinator_key_signed() {
        let key = SigningKey::from_bytes(&[9; 32]);
        let body = body_for(&effect(vec!["pi-1".into(), "pi-2".into()]), &key);
        let install = body.install().expect("an install");
        let grant = install.grant.expect("a grant");
        let bytes = grant
            .verify("peer grant", &[key.verifying_key()])
            .expect("signed by the coordinator key");
        let grant: PeerGrant = envelope::from_bytes("peer grant", bytes).expect("decodes");
        assert_eq!(
            grant,
            PeerGrant {
                device_id: "pi-7".into(),
                action_id: "harbour-3-pi-7".into(),
                rollout_id: "harbour".into(),
                sources: vec!["pi-1".into(), "pi-2".into()],
                digests: vec![[1; 32], [2; 32]],
                expires_at: 5_000,
            }
        );
        let other = SigningKey::from_bytes(&[8; 32]).verifying_key();
        assert!(
            install
                .grant
                .expect("grant")
                .verify("peer grant", &[other])
                .is_err(),
            "a grant verifies against a key that did not sign it"
        );
    }

    #[test]
    fn an_effect_without_peers_stays_a_plain_install() {
        let key = SigningKey::from_bytes(&[9; 32]);
        let body = body_for(&effect(Vec::new()), &key);
        assert!(
            matches!(body, ActionBody::Install { .. }),
            "an install without peers became {body:?}"
        );
    }
}
