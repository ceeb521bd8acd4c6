//! Where maintenance windows get their time zone rules: the [`ZoneSource`] trait, and
//! [`SystemZones`], the system's zone database. This is the only file access in the crate, kept
//! behind the trait so the rest stays free of I/O and tests can hand in their own zones.

use std::path::PathBuf;

/// Where time zone rules come from: the one thing a maintenance window needs from outside the
/// process.
pub trait ZoneSource {
    /// The TZif bytes of the zone `name`, a plain IANA name like `Europe/Berlin` (never `UTC`,
    /// never a path: `Window::parse` refuses those before asking), or why there are none.
    /// `jiff::tz::TimeZone::tzif` reads them, and refuses bytes that are not a TZif file.
    fn tzif(&self, name: &str) -> Result<Vec<u8>, String>;
}

/// Reads TZif files from `$TZDIR/<name>`, by default `/usr/share/zoneinfo/<name>` (Debian's
/// `tzdata`).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemZones;

impl ZoneSource for SystemZones {
    fn tzif(&self, name: &str) -> Result<Vec<u8>, String> {
        let dir = std::env::var_os("TZDIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/share/zoneinfo"));
        let path = dir.join(name);
        std::fs::read(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                format!("unknown time zone (no file {})", path.display())
            } else {
                format!("cannot read {}: {e}", path.display())
            }
        })
    }
}
