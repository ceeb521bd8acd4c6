//! Identifiers that end up inside MQTT topics: device ids, rollout names, release names.
//!
//! They are restricted to a safe character set so that no id can contain a topic separator (`/`)
//! or a wildcard (`+`, `#`), and so that they are safe as file names on the coordinator.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Longest id accepted, in bytes.
pub const MAX_ID_LEN: usize = 64;

/// Checks that `id` is 1 to 64 characters of `A-Z a-z 0-9 . _ -` and does not start with `.`.
pub fn validate_id(what: &'static str, id: &str) -> Result<(), IdError> {
    if id.is_empty() {
        return Err(IdError::Empty { what });
    }
    if id.len() > MAX_ID_LEN {
        return Err(IdError::TooLong {
            what,
            id: id.to_owned(),
        });
    }
    if id.starts_with('.') {
        return Err(IdError::LeadingDot {
            what,
            id: id.to_owned(),
        });
    }
    if let Some(bad) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(IdError::Character {
            what,
            id: id.to_owned(),
            bad,
        });
    }
    Ok(())
}

/// Why an id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{what} must not be empty")]
    Empty { what: &'static str },
    #[error("{what} {id:?} is longer than {MAX_ID_LEN} characters")]
    TooLong { what: &'static str, id: String },
    #[error("{what} {id:?} must not start with '.'")]
    LeadingDot { what: &'static str, id: String },
    #[error("{what} {id:?} contains {bad:?}; allowed are letters, digits, '.', '_' and '-'")]
    Character {
        what: &'static str,
        id: String,
        bad: char,
    },
}

/// A validated device id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DeviceId(String);

impl DeviceId {
    /// Validates and wraps a device id.
    pub fn new(id: impl Into<String>) -> Result<Self, IdError> {
        let id = id.into();
        validate_id("device id", &id)?;
        Ok(Self(id))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for DeviceId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_ids() {
        for id in ["dev-1", "pi4.kitchen_01", "A"] {
            assert!(DeviceId::new(id).is_ok(), "{id}");
        }
    }

    #[test]
    fn refuses_topic_characters() {
        for id in ["", "a/b", "a+b", "#", ".hidden", "spa ce", &"x".repeat(65)] {
            let err = DeviceId::new(id).expect_err(id);
            assert!(err.to_string().contains("device id"), "{err}");
        }
    }
}
