//! Lower-case hexadecimal for digests and keys, the form they take in files, logs and JSON.

use std::fmt::Write as _;

/// Encodes bytes as lower-case hex.
pub fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        // Writing to a String cannot fail.
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// Decodes hex of exactly `N` bytes, ignoring surrounding whitespace.
pub fn decode_array<const N: usize>(text: &str) -> Result<[u8; N], HexError> {
    let text = text.trim();
    if text.len() != N * 2 {
        return Err(HexError::Length {
            expected: N * 2,
            found: text.len(),
        });
    }
    let mut out = [0u8; N];
    for (i, chunk) in text.as_bytes().chunks(2).enumerate() {
        let hi = nibble(chunk[0]).ok_or(HexError::Digit { position: i * 2 })?;
        let lo = nibble(chunk[1]).ok_or(HexError::Digit {
            position: i * 2 + 1,
        })?;
        out[i] = (hi << 4) | lo;
    }
    Ok(out)
}

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Why a hex string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HexError {
    #[error("expected {expected} hex digits, found {found}")]
    Length { expected: usize, found: usize },
    #[error("not a hex digit at position {position}")]
    Digit { position: usize },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let bytes = [0u8, 1, 0xab, 0xff];
        assert_eq!(encode(&bytes), "0001abff");
        assert_eq!(decode_array::<4>("0001ABff\n"), Ok(bytes));
    }

    #[test]
    fn refuses_bad_input() {
        assert_eq!(
            decode_array::<2>("abc"),
            Err(HexError::Length {
                expected: 4,
                found: 3
            })
        );
        assert_eq!(
            decode_array::<2>("zz00"),
            Err(HexError::Digit { position: 0 })
        );
    }
}
