//! `#[serde(with = "crate::raw_bytes")]` for a `Vec<u8>` that carries bulk data (a block of an
//! artifact): serialized as one byte string instead of a sequence of `u8`s.
//!
//! In postcard both are a varint length followed by the bytes, so the wire form is unchanged
//! (the envelope tests pin it); the difference is speed: a sequence goes through serde one
//! element at a time, which cost the artifact server and the agent about a fifth of their time
//! per 64 KiB block (docs/performance.md, "One agent's download"). Deserializing also takes a
//! sequence, so a format without byte strings (JSON: an array of numbers) reads what it wrote.

use serde::de::{Deserializer, Error, SeqAccess, Visitor};
use serde::Serializer;

/// Serializes `bytes` as one byte string.
pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_bytes(bytes)
}

/// Reads a byte string, or a sequence of `u8`s.
pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
    deserializer.deserialize_byte_buf(BytesVisitor)
}

struct BytesVisitor;

impl<'de> Visitor<'de> for BytesVisitor {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a byte string")
    }

    fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
        Ok(v.to_vec())
    }

    fn visit_byte_buf<E: Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
        Ok(v)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
        // The hint comes from the input: never trust it for more than a block's worth.
        let mut bytes = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64 * 1024));
        while let Some(b) = seq.next_element::<u8>()? {
            bytes.push(b);
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use crate::envelope::Message;
    use crate::envelope::{self, DecodeError};
    use crate::messages::{BlockReply, Digest};

    /// `BlockReply` as it was declared before its data became a byte string.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum SequenceBlockReply {
        Data {
            sha256: Digest,
            offset: u64,
            data: Vec<u8>,
        },
        Unavailable {
            sha256: Digest,
            offset: u64,
            reason: String,
        },
    }

    #[test]
    fn a_block_reply_has_the_same_bytes_as_a_sequence_and_reads_either_way() {
        // Lengths around postcard's varint steps, up to a full block.
        for len in [0usize, 1, 127, 128, 16_383, 16_384, 65_536] {
            let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let new = envelope::to_bytes(&BlockReply::Data {
                sha256: [3; 32],
                offset: 1 << 40,
                data: data.clone(),
            });
            let old = envelope::to_bytes(&SequenceBlockReply::Data {
                sha256: [3; 32],
                offset: 1 << 40,
                data: data.clone(),
            });
            assert_eq!(new, old, "{len} bytes");
            let read: BlockReply = envelope::from_bytes("block reply", &old).expect("decodes");
            assert!(matches!(read, BlockReply::Data { data: d, .. } if d == data));
        }
    }

    #[test]
    fn json_reads_what_it_wrote() {
        let reply = BlockReply::Data {
            sha256: [0; 32],
            offset: 7,
            data: vec![1, 2, 255],
        };
        let text = serde_json::to_string(&reply).expect("json");
        assert!(text.contains("[1,2,255]"), "{text}");
        assert_eq!(serde_json::from_str::<BlockReply>(&text).ok(), Some(reply));
    }

    #[test]
    fn a_length_past_the_end_is_an_error() {
        let mut bytes = envelope::encode(&Message::Block(BlockReply::Data {
            sha256: [0; 32],
            offset: 0,
            data: vec![9; 300],
        }));
        bytes.truncate(bytes.len() - 1);
        assert!(matches!(
            envelope::decode(&bytes),
            Err(DecodeError::Malformed { .. })
        ));
        // A declared length of u32::MAX with nothing after it.
        let mut huge = envelope::encode(&Message::Block(BlockReply::Data {
            sha256: [0; 32],
            offset: 0,
            data: Vec::new(),
        }));
        huge.pop();
        huge.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(envelope::decode(&huge).is_err());
    }
}
