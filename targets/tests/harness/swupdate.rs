//! The conformance harnesses of the `swupdate` target: Debian's real SWUpdate on a dual-copy
//! device in miniature, with CMS-signed `.swu` images built by the openssl and cpio CLIs, once
//! with `swupdate -i` ([`SwupdateHarness`]) and once through a running SWUpdate daemon's IPC
//! socket ([`SwupdateDaemonHarness`]).
//!
//! SWUpdate binds the abstract socket `@NotifyServer`, one name for the whole machine, so no two
//! SWUpdate processes may run at once: every harness holds [`swupdate_lock`] (a lock file, so
//! other test binaries wait too) while it lives. The daemon's install and progress sockets are
//! private: it runs with its own `TMPDIR`.

use super::*;

/// A dual-copy device in miniature, updated by the real `swupdate -i`. The device runs copy `a`
/// or `b` (`current`, the bootloader's answer at the last boot; `next`, its variable for the
/// next boot). Each `.swu` holds one collection per copy, selected with `-e stable,copy-X`,
/// with a `files` entry and a `postinst` script that sets `next` to that copy. The program the
/// target runs is the operator's thin wrapper that picks the copy not running and remembers the
/// running one as `previous`. So `reboot = true`, and the rollback command points `next` back
/// at `previous`.
pub struct SwupdateHarness {
    pub dir: tempfile::TempDir,
    _one_swupdate: fs::File,
}

/// Waits until no other test on this machine runs SWUpdate, and keeps it that way until the
/// returned file is dropped.
pub fn swupdate_lock() -> fs::File {
    let path = std::env::temp_dir().join("flotilla-swupdate-tests.lock");
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .expect("the SWUpdate test lock file");
    file.lock().expect("lock the SWUpdate test lock file");
    file
}

/// The tools the SWUpdate suite drives: Debian's swupdate, with openssl and cpio to build images.
pub fn swupdate_tools() -> Result<(), String> {
    tool_runs("swupdate", "--version", "swupdate")?;
    tool_runs("cpio", "--version", "cpio")?;
    tool_runs("openssl", "version", "openssl")
}

/// Makes a throwaway signing certificate (keyUsage digitalSignature, extendedKeyUsage
/// emailProtection, as SWUpdate's CMS check wants) as `cert.pem` and `key.pem` in `dir`.
pub fn make_signing_cert(dir: &Path) {
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
}

/// Builds a `.swu` in `build` (a fresh directory): `sw-description`, its CMS signature made with
/// `dir/cert.pem` and `dir/key.pem`, then `members`, as a `crc` cpio archive. `tamper` changes
/// `sw-description` after it was signed.
pub fn build_swu(
    dir: &Path,
    build: &Path,
    sw_description: &str,
    members: &[(&str, &[u8])],
    tamper: bool,
) -> PathBuf {
    fs::create_dir_all(build).expect("build dir");
    fs::write(build.join("sw-description"), sw_description).expect("sw-description");
    let out = Command::new("openssl")
        .current_dir(build)
        .args(["cms", "-sign", "-in", "sw-description"])
        .args(["-out", "sw-description.sig", "-signer"])
        .arg(dir.join("cert.pem"))
        .arg("-inkey")
        .arg(dir.join("key.pem"))
        .args(["-outform", "DER", "-nosmimecap", "-binary"])
        .output()
        .expect("openssl runs");
    assert!(out.status.success(), "openssl cms: {out:?}");
    if tamper {
        let forged = sw_description.replace("version = \"", "version = \"6.6.6-");
        fs::write(build.join("sw-description"), forged).expect("tamper");
    }
    let mut names = String::from("sw-description\nsw-description.sig\n");
    for (name, bytes) in members {
        fs::write(build.join(name), bytes).expect("member");
        names.push_str(name);
        names.push('\n');
    }
    let swu = build.with_extension("swu");
    let mut cpio = Command::new("cpio")
        .current_dir(build)
        .args(["-o", "-H", "crc", "--quiet", "-O"])
        .arg(&swu)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("cpio runs");
    use std::io::Write as _;
    cpio.stdin
        .take()
        .expect("stdin")
        .write_all(names.as_bytes())
        .expect("names to cpio");
    assert!(cpio.wait().expect("cpio").success(), "cpio failed");
    swu
}

impl SwupdateHarness {
    pub fn make(initial: Option<&[u8]>) -> Box<dyn Harness> {
        Box::new(Self::new(initial))
    }

    pub fn new(initial: Option<&[u8]>) -> Self {
        let one_swupdate = swupdate_lock();
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path();
        for d in ["copy-a", "copy-b", "downloads", "builds"] {
            fs::create_dir_all(p.join(d)).expect("device dirs");
        }
        if let Some(content) = initial {
            fs::write(p.join("copy-a/app.conf"), content).expect("seed");
        }
        fs::write(p.join("current"), "a").expect("current");
        make_signing_cert(p);
        let wrapper = p.join("swupdate-dual-copy");
        fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nset -eu\ndev='{}'\ncurrent=$(cat \"$dev/current\")\n\
                 case \"$current\" in a) other=b ;; *) other=a ;; esac\n\
                 printf %s \"$current\" > \"$dev/previous\"\n\
                 exec swupdate -e \"stable,copy-$other\" \"$@\"\n",
                p.display()
            ),
        )
        .expect("wrapper");
        fs::set_permissions(
            &wrapper,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("chmod");
        Self {
            dir,
            _one_swupdate: one_swupdate,
        }
    }

    pub fn config(&self) -> SwupdateConfig {
        let p = self.dir.path();
        let mut config = SwupdateConfig::new(p.join("swupdate-state"));
        config.program = p.join("swupdate-dual-copy");
        config.args = vec![
            "-k".to_owned(),
            p.join("cert.pem").display().to_string(),
            "-H".to_owned(),
            "board:1.0".to_owned(),
        ];
        config.reboot = true;
        // The harness plays the reboot (Harness::reboot); the command only has to succeed.
        config.reboot_command = Some(vec!["true".to_owned()]);
        config.rollback_command = Some(vec![
            "sh".to_owned(),
            "-c".to_owned(),
            format!("cp '{0}/previous' '{0}/next'", p.display()),
        ]);
        config
    }

    /// The bootloader variable the image sets for copy `c` (a `postinst` script here; on a
    /// device SWUpdate's `bootenv` section or a script doing `fw_setenv`).
    pub fn boot_script(&self, c: &str) -> String {
        format!(
            "#!/bin/sh\n[ \"$1\" = postinst ] && printf {c} > '{}'\nexit 0\n",
            self.dir.path().join("next").display()
        )
    }

    pub fn sw_description(&self, payload: &[u8], version: &str) -> String {
        let sha = |bytes: &[u8]| flotilla_protocol::hex::encode(&flotilla_protocol::sha256(bytes));
        let copy = |c: &str| {
            format!(
                "\t\tcopy-{c} = {{\n\t\t\tfiles: ( {{ filename = \"payload\"; path = \"{}\"; \
                 sha256 = \"{}\"; }} );\n\t\t\tscripts: ( {{ filename = \"boot-{c}.sh\"; \
                 type = \"shellscript\"; sha256 = \"{}\"; }} );\n\t\t}};\n",
                self.dir.path().join(format!("copy-{c}/app.conf")).display(),
                sha(payload),
                sha(self.boot_script(c).as_bytes()),
            )
        };
        format!(
            "software =\n{{\n\tversion = \"{version}\";\n\
             \thardware-compatibility: [ \"1.0\" ];\n\tstable = {{\n{}{}\t}};\n}}\n",
            copy("a"),
            copy("b")
        )
    }

    pub fn swu(&self, name: &str, content: &[u8], tamper: bool) -> PathBuf {
        let build = self.dir.path().join("builds").join(name);
        let (boot_a, boot_b) = (self.boot_script("a"), self.boot_script("b"));
        let swu = build_swu(
            self.dir.path(),
            &build,
            &self.sw_description(content, "2.4.0"),
            &[
                ("payload", content),
                ("boot-a.sh", boot_a.as_bytes()),
                ("boot-b.sh", boot_b.as_bytes()),
            ],
            tamper,
        );
        let path = self.dir.path().join("downloads").join(name);
        fs::rename(swu, &path).expect("move the image to the downloads");
        path
    }

    pub fn running_copy(&self) -> String {
        fs::read_to_string(self.dir.path().join("current")).expect("current copy")
    }
}

impl Harness for SwupdateHarness {
    fn open(&self) -> Box<dyn UpdateTarget> {
        Box::new(SwupdateTarget::new(self.config()).expect("valid swupdate config"))
    }

    fn artifact(&self, name: &str, content: &[u8]) -> PathBuf {
        self.swu(name, content, false)
    }

    /// What the copy the device booted holds.
    fn installed(&self) -> Option<Vec<u8>> {
        let copy = self.running_copy();
        read_installed(&self.dir.path().join(format!("copy-{copy}/app.conf")))
    }

    /// The bootloader boots `next` if it is set.
    fn reboot(&self) {
        let p = self.dir.path();
        if let Ok(next) = fs::read_to_string(p.join("next")) {
            fs::write(p.join("current"), next).expect("boot");
        }
    }
}

conformance_suite!(
    swupdate,
    SwupdateHarness::make,
    requires swupdate_tools
);

/// A running SWUpdate daemon (`swupdate` without `-i`), its sockets in a private `TMPDIR`, its
/// output in `daemon.log`. Stopped (with its children) when dropped.
pub struct SwupdateDaemon {
    child: std::process::Child,
    tmpdir: PathBuf,
}

impl SwupdateDaemon {
    /// Starts `swupdate <args>` with a `TMPDIR` of its own under `dir` and waits until its
    /// install socket answers. Each start gets a new `TMPDIR`: what a killed daemon left behind
    /// (children that outlive it and, cleaning up, unlink the sockets) can then never remove the
    /// next daemon's socket, which would send the target to `swupdate -i`.
    pub fn start(dir: &Path, args: &[String]) -> Self {
        use std::os::unix::process::CommandExt as _;
        static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let tmpdir = dir.join(format!("tmp-{n}"));
        fs::create_dir_all(&tmpdir).expect("daemon TMPDIR");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("daemon.log"))
            .expect("daemon log");
        let child = Command::new("swupdate")
            .args(args)
            .env("TMPDIR", &tmpdir)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("swupdate starts");
        let mut daemon = Self { child, tmpdir };
        let socket = daemon.socket();
        for _ in 0..300 {
            if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
                return daemon;
            }
            if let Ok(Some(status)) = daemon.child.try_wait() {
                panic!(
                    "the SWUpdate daemon exited ({status}): {}",
                    fs::read_to_string(dir.join("daemon.log")).unwrap_or_default()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        daemon.stop();
        panic!("the SWUpdate daemon did not listen on {}", socket.display());
    }

    /// Its install socket.
    pub fn socket(&self) -> PathBuf {
        self.tmpdir.join("sockinstctrl")
    }

    /// Stops it and the processes it started (they share its process group). SIGKILL, as a
    /// power cut would: SWUpdate 2022.12's SIGTERM handler only cancels its network thread, and
    /// its children then unlink the sockets while the main process stays.
    pub fn stop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.child.id())])
                .status();
            let _ = self.child.wait();
        }
    }
}

impl Drop for SwupdateDaemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The dual-copy device of [`SwupdateHarness`], its SWUpdate running as a daemon that the target
/// reaches through the `socket` setting. The daemon is started with `-e stable,copy-X` for the
/// copy not running (what the wrapper does for `-i`), so the harness restarts it at every
/// reboot, as the device's init would; the rollback command points `next` back at the copy
/// the last switch came from.
pub struct SwupdateDaemonHarness {
    // Dropped first: the daemon stops before the device's directory and the lock go.
    daemon: std::sync::Mutex<Option<SwupdateDaemon>>,
    pub device: SwupdateHarness,
}

impl SwupdateDaemonHarness {
    pub fn make(initial: Option<&[u8]>) -> Box<dyn Harness> {
        Box::new(Self::new(initial))
    }

    pub fn new(initial: Option<&[u8]>) -> Self {
        let h = Self {
            daemon: std::sync::Mutex::new(None),
            device: SwupdateHarness::new(initial),
        };
        let p = h.device.dir.path();
        fs::write(p.join("previous"), h.device.running_copy()).expect("previous");
        h.boot();
        h
    }

    /// (Re)starts the daemon for the copy that runs now.
    fn boot(&self) {
        let mut daemon = self.daemon.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mut old) = daemon.take() {
            old.stop();
        }
        let p = self.device.dir.path();
        let current = self.device.running_copy();
        let other = if current == "a" { "b" } else { "a" };
        let mut args = self.device.config().args;
        args.extend(["-e".to_owned(), format!("stable,copy-{other}")]);
        *daemon = Some(SwupdateDaemon::start(&p.join("daemon"), &args));
    }

    /// The running daemon's install socket.
    pub fn socket(&self) -> PathBuf {
        let daemon = self.daemon.lock().unwrap_or_else(|p| p.into_inner());
        daemon
            .as_ref()
            .map(SwupdateDaemon::socket)
            .unwrap_or_else(|| self.device.dir.path().join("daemon/no-daemon/sockinstctrl"))
    }

    /// The target's configuration: the daemon's socket, and a program that fails loudly, so a
    /// fallback to `swupdate -i` cannot pass for an install through the socket.
    pub fn config(&self) -> SwupdateConfig {
        let mut config = self.device.config();
        config.socket = Some(self.socket());
        config.program = PathBuf::from("/bin/false");
        config.install_timeout = std::time::Duration::from_secs(300);
        config
    }

    /// What the daemon printed so far.
    pub fn daemon_log(&self) -> String {
        fs::read_to_string(self.device.dir.path().join("daemon/daemon.log")).unwrap_or_default()
    }
}

impl Harness for SwupdateDaemonHarness {
    fn open(&self) -> Box<dyn UpdateTarget> {
        Box::new(SwupdateTarget::new(self.config()).expect("valid swupdate config"))
    }

    fn artifact(&self, name: &str, content: &[u8]) -> PathBuf {
        self.device.artifact(name, content)
    }

    fn installed(&self) -> Option<Vec<u8>> {
        self.device.installed()
    }

    /// The bootloader switches to `next` and remembers the copy it came from as `previous` (with
    /// `-i` the wrapper records it at each install; a daemon installs without it).
    fn reboot(&self) {
        let p = self.device.dir.path();
        let current = self.device.running_copy();
        if fs::read_to_string(p.join("next")).is_ok_and(|next| next != current) {
            fs::write(p.join("previous"), current).expect("previous");
        }
        self.device.reboot();
        self.boot();
    }
}

conformance_suite!(
    swupdate_socket,
    SwupdateDaemonHarness::make,
    requires swupdate_tools
);

/// Runs `test` when the SWUpdate tools are here; otherwise skips loudly, or fails in CI.
pub fn with_swupdate(test: impl FnOnce()) {
    match swupdate_tools() {
        Ok(()) => test(),
        Err(why) if std::env::var("FLOTILLA_REQUIRE_TOOLS").is_ok_and(|v| v == "1") => {
            panic!("SKIPPED swupdate test: {why} (FLOTILLA_REQUIRE_TOOLS=1)")
        }
        Err(why) => {
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr().lock(),
                "\n!!!! SKIPPED swupdate test: {why}"
            );
        }
    }
}
