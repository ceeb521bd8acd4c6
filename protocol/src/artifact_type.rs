//! What kind of payload an artifact is, as its release says: a RAUC bundle, a SWUpdate image, or
//! a payload for one Mender update module. An artifact without a type is plain bytes that any
//! target may take, as every artifact was before types existed.
//!
//! The type travels in the signed manifest (section 2 of its extension, see [`crate::manifest`]).
//! An agent refuses an action whose artifact is typed for another kind of target than the one
//! it names, before it downloads anything (decision 0054). The text form is what operators type
//! and what `release inspect` and the JSON documents show:
//!
//! ```text
//! rauc-bundle           a RAUC bundle (`rauc` targets)
//! swu                   a SWUpdate image (`swupdate` targets)
//! mender:<module>       a payload for the Mender update module <module>, e.g. mender:single-file
//!                       (`mender-module` targets running that module)
//! ```

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The longest Mender module name a type may carry (Mender's own names are under 30 bytes).
pub const MAX_MODULE_NAME: usize = 64;

/// The payload format of one artifact.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ArtifactType {
    /// A RAUC bundle, installed by a `rauc` target.
    RaucBundle,
    /// A SWUpdate image (`.swu`), installed by a `swupdate` target.
    Swu,
    /// A payload for the Mender update module of this name, installed by a `mender-module` target
    /// running that module. In Mender, an artifact's type is the name of the module that
    /// installs it; the same holds here.
    MenderModule(String),
}

/// Why a type could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArtifactTypeError {
    #[error("unknown artifact type {0:?}: the types are \"rauc-bundle\", \"swu\" and \"mender:<module>\" (e.g. mender:single-file)")]
    Unknown(String),
    #[error("Mender module name {0:?}: must be 1 to {MAX_MODULE_NAME} characters of letters, digits, '.', '_', '-', not starting with '.'")]
    ModuleName(String),
}

impl ArtifactType {
    /// Checks what a decoded type carries (a module name is a file name on the device).
    pub fn validate(&self) -> Result<(), ArtifactTypeError> {
        match self {
            Self::MenderModule(module) if !is_module_name(module) => {
                Err(ArtifactTypeError::ModuleName(module.clone()))
            }
            _ => Ok(()),
        }
    }

    /// The kind of target (`kind = "..."` in the agent's configuration) that installs this type.
    pub fn target_kind(&self) -> &'static str {
        match self {
            Self::RaucBundle => "rauc",
            Self::Swu => "swupdate",
            Self::MenderModule(_) => "mender-module",
        }
    }
}

/// How many bytes from the start of a file [`ArtifactType::check_content`] and [`sniff`] read.
pub const HEAD_LEN: usize = CPIO_HEADER + SW_DESCRIPTION.len() + 1;

/// The first and last bytes of a file, and its length: what the content checks look at.
#[derive(Debug, Clone, Copy)]
pub struct Ends<'a> {
    /// Up to [`HEAD_LEN`] bytes from the start (fewer only when the file is shorter).
    pub head: &'a [u8],
    /// The last 8 bytes, when the file has 8.
    pub tail: Option<[u8; 8]>,
    pub len: u64,
}

const CPIO_HEADER: usize = 110;
const SW_DESCRIPTION: &[u8] = b"sw-description";

impl ArtifactType {
    /// Checks, from its ends only, that a file can be a payload of this type, saying what is
    /// wrong when it cannot. Signatures and contents stay the installer's to check: this only
    /// catches a file given for the wrong target. Mender module payloads are the module's
    /// business and always pass.
    pub fn check_content(&self, ends: Ends<'_>) -> Result<(), String> {
        match self {
            Self::RaucBundle => {
                rauc_trailer(ends).map_err(|why| format!("not a RAUC bundle: {why}"))
            }
            Self::Swu => {
                swu_head(ends.head).map_err(|why| format!("not a SWUpdate image (.swu): {why}"))
            }
            Self::MenderModule(_) => Ok(()),
        }
    }
}

/// The type a file most likely has, from its ends: a SWUpdate image (a cpio archive with
/// `sw-description` first), or a RAUC bundle (a squashfs image followed by a signature whose
/// size ends the file). `None` when it looks like neither; a Mender payload cannot be told.
pub fn sniff(ends: Ends<'_>) -> Option<ArtifactType> {
    if swu_head(ends.head).is_ok() {
        return Some(ArtifactType::Swu);
    }
    if ends.head.starts_with(b"hsqs") && rauc_trailer(ends).is_ok() {
        return Some(ArtifactType::RaucBundle);
    }
    None
}

/// Every RAUC bundle ends with the size of its CMS signature (big-endian u64), more than 0 and
/// within the file.
fn rauc_trailer(ends: Ends<'_>) -> Result<(), String> {
    let (Some(tail), true) = (ends.tail, ends.len >= 16) else {
        return Err(format!("it is only {} bytes long", ends.len));
    };
    let size = u64::from_be_bytes(tail);
    if size == 0 || size > ends.len - 8 {
        return Err(format!(
            "its trailer gives a signature size of {size} bytes in a file of {} bytes",
            ends.len
        ));
    }
    Ok(())
}

/// A `.swu` starts with a `newc` or `crc` cpio header (SWUpdate reads those two) whose member is
/// `sw-description`.
fn swu_head(head: &[u8]) -> Result<(), String> {
    if head.len() < CPIO_HEADER || !matches!(&head[..6], b"070701" | b"070702") {
        return Err(
            "it does not start with a newc or crc cpio header (magic 070701 or 070702)".into(),
        );
    }
    let name_size = std::str::from_utf8(&head[94..102])
        .ok()
        .and_then(|hex| usize::from_str_radix(hex, 16).ok());
    let name = &head[CPIO_HEADER..];
    if name_size != Some(SW_DESCRIPTION.len() + 1)
        || name.get(..SW_DESCRIPTION.len()) != Some(SW_DESCRIPTION)
        || name.get(SW_DESCRIPTION.len()) != Some(&0)
    {
        return Err("its first member is not sw-description".into());
    }
    Ok(())
}

fn is_module_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_MODULE_NAME
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl fmt::Display for ArtifactType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RaucBundle => f.write_str("rauc-bundle"),
            Self::Swu => f.write_str("swu"),
            Self::MenderModule(module) => write!(f, "mender:{module}"),
        }
    }
}

impl FromStr for ArtifactType {
    type Err = ArtifactTypeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parsed = match s {
            "rauc-bundle" => Self::RaucBundle,
            "swu" => Self::Swu,
            _ => match s.strip_prefix("mender:") {
                Some(module) => Self::MenderModule(module.to_string()),
                None => return Err(ArtifactTypeError::Unknown(s.to_string())),
            },
        };
        parsed.validate()?;
        Ok(parsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_form_round_trips_and_names_the_target_kind() {
        for (text, kind) in [
            ("rauc-bundle", "rauc"),
            ("swu", "swupdate"),
            ("mender:single-file", "mender-module"),
            ("mender:deb", "mender-module"),
        ] {
            let ty: ArtifactType = text.parse().expect(text);
            assert_eq!(ty.to_string(), text);
            assert_eq!(ty.target_kind(), kind);
        }
    }

    fn cpio(magic: &str, name: &str) -> Vec<u8> {
        let mut h = format!("{magic}{}", "0".repeat(88)).into_bytes();
        h.extend(format!("{:08x}", name.len() + 1).into_bytes());
        h.extend(b"00000000");
        h.extend(name.as_bytes());
        h.push(0);
        h
    }

    fn ends(head: &[u8], tail: Option<[u8; 8]>, len: u64) -> Ends<'_> {
        Ends { head, tail, len }
    }

    #[test]
    fn contents_are_told_apart_by_their_ends() {
        let swu = cpio("070701", "sw-description");
        assert_eq!(sniff(ends(&swu, None, 4096)), Some(ArtifactType::Swu));
        assert_eq!(
            ArtifactType::Swu.check_content(ends(&swu, None, 4096)),
            Ok(())
        );
        let other = cpio("070701", "rootfs.ext4");
        let err = ArtifactType::Swu
            .check_content(ends(&other, None, 4096))
            .expect_err("refused");
        assert_eq!(
            err,
            "not a SWUpdate image (.swu): its first member is not sw-description"
        );
        let bundle = ends(b"hsqs\0\0\0\0", Some(1500u64.to_be_bytes()), 1 << 20);
        assert_eq!(sniff(bundle), Some(ArtifactType::RaucBundle));
        assert_eq!(ArtifactType::RaucBundle.check_content(bundle), Ok(()));
        // A squashfs root file system padded with zeros is no bundle.
        let rootfs = ends(b"hsqs\0\0\0\0", Some([0; 8]), 1 << 20);
        assert_eq!(sniff(rootfs), None);
        let err = ArtifactType::RaucBundle
            .check_content(rootfs)
            .expect_err("refused");
        assert!(err.contains("signature size of 0 bytes"), "{err}");
        let err = ArtifactType::RaucBundle
            .check_content(ends(b"hsqs", Some([0; 8]), 8))
            .expect_err("refused");
        assert!(err.contains("only 8 bytes"), "{err}");
        let module = ArtifactType::MenderModule("single-file".into());
        assert_eq!(module.check_content(rootfs), Ok(()));
        assert_eq!(sniff(ends(b"plain text", Some(*b"the end."), 18)), None);
    }

    #[test]
    fn bad_types_are_refused_naming_what_is_wrong() {
        let err = "raucb".parse::<ArtifactType>().expect_err("unknown");
        assert!(err.to_string().contains("\"raucb\""), "{err}");
        assert!(err.to_string().contains("mender:<module>"), "{err}");
        for module in ["", "../rootfs", ".hidden", "a b", &"m".repeat(65)] {
            let err = format!("mender:{module}")
                .parse::<ArtifactType>()
                .expect_err(module);
            assert!(matches!(err, ArtifactTypeError::ModuleName(_)), "{err}");
        }
        assert!(ArtifactType::MenderModule("../x".into())
            .validate()
            .is_err());
    }
}
