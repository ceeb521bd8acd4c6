//! The stream filter of the size guard ([`crate::guard`]): MQTT packets from the broker pass
//! through unchanged, except a PUBLISH larger than the client's limit, which is skipped as it
//! streams and replaced by a small PUBLISH on [`DROPPED_TOPIC`] with the same QoS, retain flag
//! and packet id. The client acknowledges that one as it would have the original (so the broker
//! is done with it), and the link that polls the client recognises it ([`dropped`]), counts it
//! and drops it.
//!
//! No I/O: bytes in, bytes out, in any chunking. Of an oversized PUBLISH only the fixed header,
//! the topic (up to 64 KiB, by the protocol) and the packet id are held; the payload is counted
//! down, never stored. Anything but a PUBLISH is passed on whatever its size, so the client's own
//! limit still refuses it.

use std::fmt;

/// The topic of the stand-in for a PUBLISH that was too large. A broker never delivers it: topics
/// that start with `$` match no subscription filter that does not (MQTT 3.1.1, 4.7.2), and no
/// flotilla link subscribes to one under `$flotilla`.
pub const DROPPED_TOPIC: &str = "$flotilla/dropped";

/// How much of a dropped message's topic its stand-in names.
pub const TOPIC_KEPT: usize = 256;

const PUBLISH: u8 = 3;

/// A message the size guard dropped, as the link sees its stand-in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// The message's topic, cut to [`TOPIC_KEPT`] bytes.
    pub topic: String,
    /// The size of its PUBLISH packet, in bytes.
    pub bytes: u64,
}

/// The dropped message a publish stands for, if it is the guard's stand-in.
pub fn dropped(publish: &rumqttc::Publish) -> Option<Dropped> {
    if publish.topic != DROPPED_TOPIC {
        return None;
    }
    let (size, topic) = publish.payload.split_first_chunk::<8>()?;
    Some(Dropped {
        topic: String::from_utf8_lossy(topic).into_owned(),
        bytes: u64::from_be_bytes(*size),
    })
}

/// The broker sent something that is not MQTT; the connection must end.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    #[error("a packet's remaining length takes more than 4 bytes")]
    RemainingLength,
    #[error("a PUBLISH of {remaining} bytes has QoS 3")]
    Qos3 { remaining: usize },
    #[error("a PUBLISH of {remaining} bytes has a topic or packet id longer than itself")]
    HeaderBeyondPacket { remaining: usize },
}

/// Where the filter is in the byte stream.
enum State {
    /// Reading a fixed header: the first byte and up to four bytes of remaining length.
    Header { bytes: [u8; 5], len: usize },
    /// Passing on the rest of a packet.
    Pass { left: usize },
    /// Reading the variable header of an oversized PUBLISH: topic length, topic, packet id.
    Head(Head),
    /// Skipping the rest of an oversized PUBLISH; its stand-in goes out at the end.
    Skip { left: usize, stand_in: Vec<u8> },
}

struct Head {
    first: u8,
    remaining: usize,
    /// Bytes of the variable header read so far.
    read: usize,
    topic_len: usize,
    topic: Vec<u8>,
    pkid: [u8; 2],
}

impl Head {
    fn qos(&self) -> u8 {
        (self.first >> 1) & 0b11
    }

    /// How long the variable header is, once the topic length is known (2 bytes of it first).
    fn needed(&self) -> usize {
        let pkid = if self.qos() > 0 { 2 } else { 0 };
        if self.read < 2 {
            2
        } else {
            2 + self.topic_len + pkid
        }
    }
}

/// The broker-to-client filter of one connection.
pub struct Filter {
    limit: usize,
    state: State,
    dropped: u64,
}

impl fmt::Debug for Filter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Filter")
            .field("limit", &self.limit)
            .field("dropped", &self.dropped)
            .finish_non_exhaustive()
    }
}

impl Filter {
    /// A filter that replaces every PUBLISH whose remaining length exceeds `limit` (what
    /// rumqttc compares with its incoming packet size).
    pub fn new(limit: usize) -> Filter {
        Filter {
            limit,
            state: State::Header {
                bytes: [0; 5],
                len: 0,
            },
            dropped: 0,
        }
    }

    /// Oversized publishes replaced so far.
    #[cfg(test)]
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Takes the next bytes from the broker and appends what the client gets to `out`.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) -> Result<(), FilterError> {
        while !input.is_empty() {
            match &mut self.state {
                State::Pass { left } => {
                    let n = (*left).min(input.len());
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    *left -= n;
                    if *left == 0 {
                        self.state = header();
                    }
                }
                State::Skip { left, stand_in } => {
                    let n = (*left).min(input.len());
                    input = &input[n..];
                    *left -= n;
                    if *left == 0 {
                        out.extend_from_slice(stand_in);
                        self.dropped += 1;
                        self.state = header();
                    }
                }
                State::Header { bytes, len } => {
                    bytes[*len] = input[0];
                    *len += 1;
                    input = &input[1..];
                    if *len == 1 {
                        continue;
                    }
                    if bytes[*len - 1] & 0x80 != 0 {
                        if *len == 5 {
                            return Err(FilterError::RemainingLength);
                        }
                        continue;
                    }
                    let remaining = bytes[1..*len]
                        .iter()
                        .rev()
                        .fold(0usize, |n, b| (n << 7) | usize::from(b & 0x7f));
                    let first = bytes[0];
                    if first >> 4 == PUBLISH && remaining > self.limit {
                        if (first >> 1) & 0b11 == 3 {
                            return Err(FilterError::Qos3 { remaining });
                        }
                        self.state = State::Head(Head {
                            first,
                            remaining,
                            read: 0,
                            topic_len: 0,
                            topic: Vec::new(),
                            pkid: [0; 2],
                        });
                        continue;
                    }
                    out.extend_from_slice(&bytes[..*len]);
                    self.state = if remaining == 0 {
                        header()
                    } else {
                        State::Pass { left: remaining }
                    };
                }
                State::Head(head) => {
                    let byte = input[0];
                    input = &input[1..];
                    let at = head.read;
                    head.read += 1;
                    match at {
                        0 => head.topic_len = usize::from(byte) << 8,
                        1 => head.topic_len |= usize::from(byte),
                        _ if at < 2 + head.topic_len => {
                            if head.topic.len() < TOPIC_KEPT {
                                head.topic.push(byte);
                            }
                        }
                        _ => head.pkid[at - 2 - head.topic_len] = byte,
                    }
                    if head.needed() > head.remaining {
                        return Err(FilterError::HeaderBeyondPacket {
                            remaining: head.remaining,
                        });
                    }
                    if head.read < head.needed() {
                        continue;
                    }
                    let left = head.remaining - head.read;
                    let stand_in = stand_in(head);
                    if left == 0 {
                        out.extend_from_slice(&stand_in);
                        self.dropped += 1;
                        self.state = header();
                    } else {
                        self.state = State::Skip { left, stand_in };
                    }
                }
            }
        }
        Ok(())
    }
}

fn header() -> State {
    State::Header {
        bytes: [0; 5],
        len: 0,
    }
}

/// The PUBLISH packet that stands in for the one `head` began: same flags and packet id, topic
/// [`DROPPED_TOPIC`], payload the original packet's size (8 bytes, big endian) and the start of
/// its topic.
fn stand_in(head: &Head) -> Vec<u8> {
    let header_len = 1 + length_bytes(head.remaining);
    let size = (header_len + head.remaining) as u64;
    let pkid = if head.qos() > 0 { 2 } else { 0 };
    let remaining = 2 + DROPPED_TOPIC.len() + pkid + 8 + head.topic.len();
    let mut packet = Vec::with_capacity(2 + remaining);
    packet.push(head.first);
    let mut n = remaining;
    loop {
        let mut byte = (n & 0x7f) as u8;
        n >>= 7;
        if n > 0 {
            byte |= 0x80;
        }
        packet.push(byte);
        if n == 0 {
            break;
        }
    }
    packet.extend_from_slice(&(DROPPED_TOPIC.len() as u16).to_be_bytes());
    packet.extend_from_slice(DROPPED_TOPIC.as_bytes());
    if pkid > 0 {
        packet.extend_from_slice(&head.pkid);
    }
    packet.extend_from_slice(&size.to_be_bytes());
    packet.extend_from_slice(&head.topic);
    packet
}

/// How many bytes MQTT's variable-length encoding takes for `n`.
fn length_bytes(n: usize) -> usize {
    match n {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use rumqttc::{Packet, QoS};

    fn encode(packet: Packet) -> Vec<u8> {
        let mut buf = BytesMut::new();
        packet.write(&mut buf, usize::MAX).expect("encode");
        buf.to_vec()
    }

    fn publish(topic: &str, qos: QoS, retain: bool, pkid: u16, size: usize) -> Packet {
        let mut p = rumqttc::Publish::new(topic, qos, vec![7u8; size]);
        p.retain = retain;
        p.pkid = pkid;
        Packet::Publish(p)
    }

    fn decode_all(bytes: &[u8]) -> Vec<Packet> {
        let mut buf = BytesMut::from(bytes);
        let mut packets = Vec::new();
        while !buf.is_empty() {
            packets.push(Packet::read(&mut buf, 1 << 20).expect("decodes"));
        }
        packets
    }

    /// A stream of packets, some oversized, cut into chunks of every size from 1 byte up: the
    /// client gets every small packet unchanged and in order, and for each oversized publish a
    /// stand-in with its flags, packet id, size and topic.
    #[test]
    fn oversized_publishes_are_replaced_in_any_chunking() {
        let stream = [
            encode(Packet::ConnAck(rumqttc::ConnAck::new(
                rumqttc::ConnectReturnCode::Success,
                false,
            ))),
            encode(publish("a/small", QoS::AtLeastOnce, false, 1, 100)),
            encode(publish("a/huge", QoS::AtLeastOnce, true, 2, 300_000)),
            encode(Packet::PingResp),
            encode(publish("b/huge", QoS::AtMostOnce, false, 0, 2_000)),
            encode(publish("a/edge", QoS::AtLeastOnce, false, 3, 990)),
            encode(Packet::PubAck(rumqttc::PubAck::new(9))),
        ]
        .concat();
        let limit = 1000;
        for chunk in [1, 2, 3, 7, 100, 4096, stream.len()] {
            let mut filter = Filter::new(limit);
            let mut out = Vec::new();
            for piece in stream.chunks(chunk) {
                filter.feed(piece, &mut out).expect("valid stream");
            }
            let packets = decode_all(&out);
            assert_eq!(packets.len(), 7, "chunks of {chunk}");
            assert_eq!(filter.dropped(), 2);
            assert!(matches!(&packets[0], Packet::ConnAck(_)));
            assert!(
                matches!(&packets[1], Packet::Publish(p) if p.topic == "a/small" && p.payload.len() == 100)
            );
            let Packet::Publish(huge) = &packets[2] else {
                panic!("{:?}", packets[2])
            };
            assert_eq!(
                (huge.qos, huge.retain, huge.pkid),
                (QoS::AtLeastOnce, true, 2)
            );
            assert_eq!(
                dropped(huge),
                Some(Dropped {
                    topic: "a/huge".into(),
                    bytes: encode(publish("a/huge", QoS::AtLeastOnce, true, 2, 300_000)).len()
                        as u64
                })
            );
            assert!(matches!(&packets[3], Packet::PingResp));
            let Packet::Publish(qos0) = &packets[4] else {
                panic!("{:?}", packets[4])
            };
            assert_eq!((qos0.qos, qos0.pkid), (QoS::AtMostOnce, 0));
            assert_eq!(dropped(qos0).map(|d| d.topic), Some("b/huge".into()));
            assert!(
                matches!(&packets[5], Packet::Publish(p) if p.topic == "a/edge" && dropped(p).is_none())
            );
            assert!(matches!(&packets[6], Packet::PubAck(a) if a.pkid == 9));
        }
    }

    /// Random streams of publishes of random sizes around the limit, cut at random points,
    /// and random junk: the valid streams come out as the same packets with exactly the
    /// oversized ones replaced; junk never panics.
    #[test]
    fn random_streams_and_random_junk() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n.max(1)
        };
        let limit = 5_000;
        for _ in 0..200 {
            let mut stream = Vec::new();
            let mut expected = Vec::new();
            for i in 0..(1 + next(8)) {
                let size = next(10_000) as usize;
                let qos = if next(2) == 0 {
                    QoS::AtMostOnce
                } else {
                    QoS::AtLeastOnce
                };
                let pkid = if qos == QoS::AtMostOnce {
                    0
                } else {
                    1 + i as u16
                };
                let topic = format!("t/{i}");
                let packet = publish(&topic, qos, next(2) == 0, pkid, size);
                let bytes = encode(packet.clone());
                expected.push((
                    topic,
                    bytes.len() - 1 - length_bytes(bytes.len()) > limit,
                    packet,
                ));
                stream.extend(bytes);
            }
            let mut filter = Filter::new(limit);
            let mut out = Vec::new();
            let mut rest = &stream[..];
            while !rest.is_empty() {
                let n = (1 + next(3_000) as usize).min(rest.len());
                filter.feed(&rest[..n], &mut out).expect("a valid stream");
                rest = &rest[n..];
            }
            let got = decode_all(&out);
            assert_eq!(got.len(), expected.len());
            for (packet, (topic, oversized, original)) in got.iter().zip(&expected) {
                match (packet, oversized) {
                    (Packet::Publish(p), true) => {
                        assert_eq!(dropped(p).map(|d| d.topic), Some(topic.clone()))
                    }
                    (p, false) => assert_eq!(p, original),
                    (p, true) => panic!("{p:?} is not a stand-in"),
                }
            }

            let junk: Vec<u8> = (0..next(2_000)).map(|_| next(256) as u8).collect();
            let _ = Filter::new(next(3_000) as usize).feed(&junk, &mut Vec::new());
        }
    }

    #[test]
    fn a_long_topic_is_cut_in_the_stand_in_and_junk_ends_the_stream() {
        let topic = "t".repeat(60_000);
        let stream = encode(publish(&topic, QoS::AtLeastOnce, false, 5, 1_000));
        let mut filter = Filter::new(10_000);
        let mut out = Vec::new();
        filter.feed(&stream, &mut out).expect("valid");
        let packets = decode_all(&out);
        let Packet::Publish(p) = &packets[0] else {
            panic!()
        };
        let d = dropped(p).expect("stand-in");
        assert_eq!(d.topic.len(), TOPIC_KEPT);
        assert_eq!(p.pkid, 5);

        let mut filter = Filter::new(10);
        assert_eq!(
            filter.feed(&[0x30, 0xff, 0xff, 0xff, 0xff, 0x01], &mut Vec::new()),
            Err(FilterError::RemainingLength)
        );
        let mut filter = Filter::new(10);
        assert!(matches!(
            filter.feed(&[0x36, 100, 0, 1], &mut Vec::new()),
            Err(FilterError::Qos3 { .. })
        ));
        let mut filter = Filter::new(10);
        assert!(matches!(
            filter.feed(&[0x32, 20, 0, 30], &mut Vec::new()),
            Err(FilterError::HeaderBeyondPacket { .. })
        ));
        assert_eq!(
            dropped(&rumqttc::Publish::new("a/b", QoS::AtMostOnce, vec![0; 9])),
            None
        );
    }
}
