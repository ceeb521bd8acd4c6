//! SWUpdate for end-to-end tests: a throwaway signing certificate and CMS-signed `.swu` archives
//! built with the openssl and cpio command-line tools, as Debian's `swupdate` (built for signed
//! images only) accepts them; a SWUpdate daemon with private sockets; and the machine-wide lock
//! every test running SWUpdate holds, because SWUpdate binds the abstract socket
//! `@NotifyServer`, one name for the whole machine.

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Waits until no other test on this machine runs SWUpdate (the conformance suite takes the same
/// lock file), and keeps it that way until the returned file is dropped.
pub fn swupdate_lock() -> fs::File {
    crate::machine_lock("swupdate-tests")
}

/// A running SWUpdate daemon (`swupdate` without `-i`), as on a device that keeps it for its web
/// server or suricatta. Its sockets are in a private `TMPDIR`; its output in `daemon.log`.
/// Killed with its children when dropped.
pub struct SwupdateDaemon {
    child: Child,
    dir: PathBuf,
}

impl SwupdateDaemon {
    /// Starts `swupdate <args>` in `dir` and waits until its install socket answers.
    pub fn start(dir: &Path, args: &[&str]) -> SwupdateDaemon {
        use std::os::unix::process::CommandExt as _;
        let tmpdir = dir.join("tmp");
        fs::create_dir_all(&tmpdir).expect("daemon TMPDIR");
        let log = fs::File::create(dir.join("daemon.log")).expect("daemon log");
        let child = Command::new("swupdate")
            .args(args)
            .env("TMPDIR", &tmpdir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("daemon log"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("swupdate starts");
        let mut daemon = SwupdateDaemon {
            child,
            dir: dir.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(daemon.socket()).is_err() {
            if let Ok(Some(status)) = daemon.child.try_wait() {
                panic!("the SWUpdate daemon exited ({status}): {}", daemon.log());
            }
            assert!(
                Instant::now() < deadline,
                "the SWUpdate daemon does not listen: {}",
                daemon.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        daemon
    }

    /// Its install socket, for the agent's `socket` setting.
    pub fn socket(&self) -> PathBuf {
        self.dir.join("tmp/sockinstctrl")
    }

    /// What it printed so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }
}

impl Drop for SwupdateDaemon {
    /// SIGKILL to its process group: SWUpdate 2022.12's SIGTERM handler does not end it.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.child.id())])
                .status();
            let _ = self.child.wait();
        }
    }
}

/// Whether a test that needs SWUpdate can run: `swupdate`, `cpio` and `openssl` are installed.
/// With `FLOTILLA_REQUIRE_TOOLS=1` (CI, whose `.ci/run` installs them) a missing one fails the
/// test; elsewhere the skip is loud.
pub fn require_swupdate(test: &str) -> bool {
    let missing: Vec<&str> = [
        ("swupdate", "--version"),
        ("cpio", "--version"),
        ("openssl", "version"),
    ]
    .into_iter()
    .filter(|(program, arg)| {
        !Command::new(program)
            .arg(arg)
            .output()
            .is_ok_and(|o| o.status.success())
    })
    .map(|(program, _)| program)
    .collect();
    if missing.is_empty() {
        return true;
    }
    if std::env::var_os("FLOTILLA_REQUIRE_TOOLS").is_some() {
        panic!("{test}: {missing:?} not installed; .ci/run must install them");
    }
    eprintln!("SKIPPED {test}: {missing:?} not installed (apt-get install swupdate cpio openssl)");
    false
}

/// A signing certificate and key in a directory: `cert.pem` is what the device's SWUpdate gets
/// with `-k`.
pub struct Signer {
    dir: PathBuf,
}

impl Signer {
    /// Makes a self-signed certificate (keyUsage digitalSignature, extendedKeyUsage
    /// emailProtection, as SWUpdate's CMS check wants) in `dir`, which is created.
    pub fn new(dir: &Path) -> Signer {
        fs::create_dir_all(dir).expect("signer directory");
        fs::write(
            dir.join("cert.cnf"),
            "[req]\ndistinguished_name=dn\n[dn]\n[v3]\nkeyUsage=digitalSignature\n\
             extendedKeyUsage=emailProtection\nbasicConstraints=CA:FALSE\n",
        )
        .expect("openssl config");
        let out = Command::new("openssl")
            .current_dir(dir)
            .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes"])
            .args(["-keyout", "key.pem", "-out", "cert.pem", "-days", "30"])
            .args(["-subj", "/CN=flotilla test signer", "-config", "cert.cnf"])
            .args(["-extensions", "v3"])
            .output()
            .expect("openssl runs");
        assert!(out.status.success(), "openssl req: {out:?}");
        Signer {
            dir: dir.to_path_buf(),
        }
    }

    /// The certificate the device verifies images with.
    pub fn cert(&self) -> PathBuf {
        self.dir.join("cert.pem")
    }

    /// Builds `out` (a `.swu`): a signed `sw-description` for hardware revision `1.0` whose one
    /// `files` entry writes `payload` to `dest`, as a `crc` cpio archive.
    pub fn file_image(&self, out: &Path, version: &str, dest: &Path, payload: &[u8]) {
        let sha = flotilla_protocol::hex::encode(&flotilla_protocol::sha256(payload));
        let description = format!(
            "software =\n{{\n\tversion = \"{version}\";\n\thardware-compatibility: [ \"1.0\" ];\n\
             \tfiles: (\n\t\t{{\n\t\t\tfilename = \"payload\";\n\t\t\tpath = \"{}\";\n\
             \t\t\tsha256 = \"{sha}\";\n\t\t}}\n\t);\n}}\n",
            dest.display()
        );
        let build = out.with_extension("build");
        fs::create_dir_all(&build).expect("build directory");
        fs::write(build.join("sw-description"), description).expect("sw-description");
        fs::write(build.join("payload"), payload).expect("payload");
        let signed = Command::new("openssl")
            .current_dir(&build)
            .args(["cms", "-sign", "-in", "sw-description"])
            .args(["-out", "sw-description.sig", "-signer"])
            .arg(self.dir.join("cert.pem"))
            .arg("-inkey")
            .arg(self.dir.join("key.pem"))
            .args(["-outform", "DER", "-nosmimecap", "-binary"])
            .output()
            .expect("openssl runs");
        assert!(signed.status.success(), "openssl cms: {signed:?}");
        let mut cpio = Command::new("cpio")
            .current_dir(&build)
            .args(["-o", "-H", "crc", "--quiet", "-O"])
            .arg(out)
            .stdin(Stdio::piped())
            .spawn()
            .expect("cpio runs");
        cpio.stdin
            .take()
            .expect("cpio stdin")
            .write_all(b"sw-description\nsw-description.sig\npayload\n")
            .expect("names to cpio");
        assert!(cpio.wait().expect("cpio").success(), "cpio failed");
    }
}

/// Flips one byte of `marker` inside the image at `swu`, as a damaged download or a bad storage
/// block would.
pub fn corrupt(swu: &Path, marker: &[u8]) {
    let mut bytes = fs::read(swu).expect("read image");
    let at = bytes
        .windows(marker.len())
        .position(|w| w == marker)
        .expect("marker in the image");
    bytes[at] ^= 0x20;
    fs::write(swu, bytes).expect("write corrupt image");
}
