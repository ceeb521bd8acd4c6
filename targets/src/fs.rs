//! Power-loss-safe file replacement: the one helper every part of flotilla uses to write files on a
//! device.
//!
//! A plain `fs::write` truncates the file first and writes it after, so a power cut in between
//! leaves an empty or half-written file, and an update agent that bricks its own state on a power
//! cut is worse than none. Every write here follows the same discipline:
//!
//! 1. write the new content into a temporary file **in the same directory** (a rename is only
//!    atomic within one file system),
//! 2. `fsync` the temporary file, so its data is on disk before its name is,
//! 3. `rename` it over the destination, which atomically swaps the old content for the new,
//! 4. `fsync` the directory, so the rename itself survives a power cut.
//!
//! After a crash the destination holds either the complete old content or the complete new
//! content, never a mix. What can be left behind is a temporary file named
//! `.<name>.flotilla-tmp.<pid>.<n>` beside the destination; it is never read, and the file
//! target sweeps the ones in its own state directory.
//!
//! These are Unix (Linux) helpers: they rely on `rename(2)` replacing the destination and on
//! directories being `fsync`-able.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Marks temporary files, so a sweep can recognise leftovers of an interrupted write.
pub(crate) const TEMP_MARKER: &str = ".flotilla-tmp.";

/// Replaces `path` with `contents` atomically and durably.
///
/// If `path` already exists, the new file keeps its permission bits; otherwise it gets the
/// default mode (`0o666` minus the umask), like [`std::fs::write`]. On error the destination is
/// untouched and the temporary file is removed.
pub fn atomic_write(path: impl AsRef<Path>, contents: impl AsRef<[u8]>) -> io::Result<()> {
    let path = path.as_ref();
    // Replacing a config file must not silently widen or narrow who may read it.
    let mode = match fs::metadata(path) {
        Ok(meta) => Some(meta.permissions().mode()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(e),
    };
    let mut temp = TempFile::create_beside(path, 0o666)?;
    temp.file.write_all(contents.as_ref())?;
    if let Some(mode) = mode {
        temp.file.set_permissions(Permissions::from_mode(mode))?;
    }
    temp.commit(path)
}

/// Like [`atomic_write`], but the file is readable and writable by its owner only (`0o600`),
/// from the moment the temporary file exists: for secrets such as a device's signing key.
/// An existing file at `path` is replaced and its permission bits are not kept.
pub fn atomic_write_private(path: impl AsRef<Path>, contents: impl AsRef<[u8]>) -> io::Result<()> {
    let path = path.as_ref();
    let mut temp = TempFile::create_beside(path, 0o600)?;
    temp.file.write_all(contents.as_ref())?;
    // The umask can only narrow 0o600, but make it exact.
    temp.file.set_permissions(Permissions::from_mode(0o600))?;
    temp.commit(path)
}

/// Copies `src` over `dest` atomically and durably, streaming the source so large artifacts are
/// never held in memory. Returns the number of bytes copied.
///
/// Like [`std::fs::copy`], `dest` gets the permission bits of `src`. On error `dest` is untouched
/// and the temporary file is removed.
pub fn atomic_copy(src: impl AsRef<Path>, dest: impl AsRef<Path>) -> io::Result<u64> {
    let (src, dest) = (src.as_ref(), dest.as_ref());
    let mut source = File::open(src)?;
    let meta = source.metadata()?;
    if !meta.is_file() {
        // io::copy from a directory fails with an obscure EISDIR mid-way; say it up front.
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", src.display()),
        ));
    }
    // Owner-only until the copy is complete: a half-copied secret must not be world-readable.
    let mut temp = TempFile::create_beside(dest, 0o600)?;
    let copied = io::copy(&mut source, &mut temp.file)?;
    temp.file.set_permissions(meta.permissions())?;
    temp.commit(dest)?;
    Ok(copied)
}

/// Renames `from` to `to` (replacing `to`) and makes the rename durable by syncing the directory
/// of `to` and, if it is a different one, the directory of `from`.
///
/// Both paths must be on the same file system; the rename is atomic.
pub fn atomic_rename(from: impl AsRef<Path>, to: impl AsRef<Path>) -> io::Result<()> {
    let (from, to) = (from.as_ref(), to.as_ref());
    fs::rename(from, to)?;
    let (from_dir, to_dir) = (parent_dir(from), parent_dir(to));
    fsync_dir(to_dir)?;
    // A rename across directories changes two directory entries; both must reach the disk or a
    // power cut could resurrect the source name.
    if from_dir != to_dir {
        fsync_dir(from_dir)?;
    }
    Ok(())
}

/// Flushes a directory's entries to disk, making earlier creates, renames and removals in it
/// durable.
pub fn fsync_dir(dir: impl AsRef<Path>) -> io::Result<()> {
    File::open(dir.as_ref())?.sync_all()
}

/// The directory holding `path`; `.` for a bare file name, so callers can always open it.
/// Creates a directory only its owner can read (for a target's state), fsyncing its parent so the
/// new entry survives a power cut. An existing directory is fine; anything else in the way is an
/// error.
pub(crate) fn create_private_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => fsync_dir(parent_dir(dir)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            if fs::symlink_metadata(dir)?.is_dir() {
                Ok(())
            } else {
                Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "something that is not a directory is in the way of the state directory",
                ))
            }
        }
        Err(e) => Err(e),
    }
}

/// Reads a small state file written with [`atomic_write`] and parses it; `None` when it does not
/// exist yet. Errors name the file.
pub(crate) fn read_state_file<T>(
    path: PathBuf,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<Option<T>, crate::error::TargetError> {
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(crate::error::TargetError::ReadState { path, source }),
    };
    parse(&text)
        .map(Some)
        .map_err(|reason| crate::error::TargetError::CorruptState { path, reason })
}

/// The `key=value` lines of a state file, skipping blank lines and `#` comments.
pub(crate) fn state_lines(text: &str) -> impl Iterator<Item = Result<(&str, &str), String>> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            line.split_once('=')
                .ok_or_else(|| format!("line {line:?} is not key=value"))
        })
}

pub(crate) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// A temporary file beside its final destination, removed on drop unless committed.
struct TempFile {
    path: PathBuf,
    file: File,
    committed: bool,
}

impl TempFile {
    fn create_beside(dest: &Path, mode: u32) -> io::Result<Self> {
        // pid + counter keeps concurrent writers (threads or processes) from sharing a temp file.
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let name = dest.file_name().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} does not name a file", dest.display()),
            )
        })?;
        let dir = parent_dir(dest);
        loop {
            let mut temp_name = OsString::from(".");
            temp_name.push(name);
            temp_name.push(format!(
                "{TEMP_MARKER}{}.{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            let path = dir.join(temp_name);
            // create_new: a leftover of a crashed process that had our pid must not be reused.
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&path)
            {
                Ok(file) => {
                    return Ok(Self {
                        path,
                        file,
                        committed: false,
                    })
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// fsync, rename over `dest`, fsync the directory.
    fn commit(mut self, dest: &Path) -> io::Result<()> {
        self.file.sync_all()?;
        fs::rename(&self.path, dest)?;
        self.committed = true;
        fsync_dir(parent_dir(dest))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: we are already returning the error that got us here.
            let _ = fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .expect("read dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn mode_of(path: &Path) -> u32 {
        fs::metadata(path).expect("metadata").permissions().mode() & 0o7777
    }

    #[test]
    fn atomic_write_private_is_owner_only_even_over_a_wider_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("device.key");
        fs::write(&path, b"old").expect("write");
        fs::set_permissions(&path, Permissions::from_mode(0o644)).expect("chmod");
        atomic_write_private(&path, b"secret").expect("write");
        assert_eq!(fs::read(&path).expect("read"), b"secret");
        assert_eq!(mode_of(&path), 0o600);
        assert_eq!(names_in(dir.path()), ["device.key"]);
    }

    #[test]
    fn atomic_write_creates_a_new_file_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("counter");
        atomic_write(&path, b"42").expect("write");
        assert_eq!(fs::read(&path).expect("read"), b"42");
        assert_eq!(names_in(dir.path()), ["counter"]);
    }

    #[test]
    fn atomic_write_replaces_content_and_keeps_the_mode() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("app.conf");
        fs::write(&path, "a much longer old content").expect("seed");
        fs::set_permissions(&path, Permissions::from_mode(0o640)).expect("chmod");
        atomic_write(&path, "new").expect("write");
        assert_eq!(fs::read_to_string(&path).expect("read"), "new");
        assert_eq!(mode_of(&path), 0o640);
        assert_eq!(names_in(dir.path()), ["app.conf"]);
    }

    #[test]
    fn atomic_write_into_a_missing_directory_fails_and_creates_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = atomic_write(dir.path().join("nope/file"), "x").expect_err("must fail");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert!(names_in(dir.path()).is_empty());
    }

    #[test]
    fn parent_dir_of_a_bare_file_name_is_the_current_directory() {
        assert_eq!(parent_dir(Path::new("state")), Path::new("."));
        assert_eq!(parent_dir(Path::new("/state")), Path::new("/"));
        assert_eq!(parent_dir(Path::new("a/b")), Path::new("a"));
    }

    #[test]
    fn atomic_copy_copies_content_and_mode() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (src, dest) = (dir.path().join("src"), dir.path().join("dest"));
        let content: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        fs::write(&src, &content).expect("seed");
        fs::set_permissions(&src, Permissions::from_mode(0o755)).expect("chmod");
        fs::write(&dest, "old").expect("seed dest");

        let copied = atomic_copy(&src, &dest).expect("copy");
        assert_eq!(copied, content.len() as u64);
        assert_eq!(fs::read(&dest).expect("read"), content);
        assert_eq!(mode_of(&dest), 0o755);
        assert_eq!(names_in(dir.path()), ["dest", "src"]);
    }

    #[test]
    fn atomic_copy_of_a_missing_source_leaves_dest_untouched() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dest = dir.path().join("dest");
        fs::write(&dest, "old").expect("seed");
        let err = atomic_copy(dir.path().join("missing"), &dest).expect_err("must fail");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert_eq!(fs::read_to_string(&dest).expect("read"), "old");
        assert_eq!(names_in(dir.path()), ["dest"]);
    }

    #[test]
    fn atomic_copy_of_a_directory_is_refused_without_a_trace() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dest = dir.path().join("dest");
        let err = atomic_copy(dir.path(), &dest).expect_err("must fail");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("not a regular file"), "{err}");
        assert!(names_in(dir.path()).is_empty());
    }

    #[test]
    fn atomic_rename_moves_across_directories() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = dir.path().join("sub");
        fs::create_dir(&sub).expect("mkdir");
        let (from, to) = (sub.join("staged"), dir.path().join("live"));
        fs::write(&from, "new").expect("seed");
        fs::write(&to, "old").expect("seed");
        atomic_rename(&from, &to).expect("rename");
        assert_eq!(fs::read_to_string(&to).expect("read"), "new");
        assert!(!from.exists());
    }

    #[test]
    fn fsync_dir_reports_a_missing_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        fsync_dir(dir.path()).expect("existing dir syncs");
        let err = fsync_dir(dir.path().join("missing")).expect_err("must fail");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
