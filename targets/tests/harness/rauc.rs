//! The conformance harness of the `rauc` target: Debian's real RAUC service on a private D-Bus
//! system bus, two file-backed raw slots and a `custom` bootloader backend (a script keeping the
//! primary slot and each slot's state in files). A reboot stops the service, boots the primary
//! slot (the other one if the primary is marked bad) and starts the service again with
//! `--override-boot-slot`. Bundles are plain, built with `rauc bundle` and signed with a
//! throwaway certificate that is also the keyring.
//!
//! A raw slot has no file length, so an image is a 4-byte big-endian length and the content;
//! a slot whose length is 0 holds nothing.

use std::process::{Child, Stdio};
use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use flotilla_targets::{RaucConfig, RaucTarget};

use super::*;

/// The tools the RAUC suite drives.
pub fn rauc_tools() -> Result<(), String> {
    tool_runs("rauc", "--version", "rauc")?;
    tool_runs("mksquashfs", "-version", "squashfs-tools")?;
    tool_runs("dbus-daemon", "--version", "dbus")?;
    tool_runs("flock", "--version", "util-linux")?;
    tool_runs("openssl", "version", "openssl")
}

const BACKEND: &str = r#"#!/bin/sh
d=$(dirname "$0")
case "$1" in
get-primary) cat "$d/primary" ;;
set-primary) echo "$2" > "$d/primary"; echo good > "$d/state-$2" ;;
get-state) cat "$d/state-$2" ;;
set-state) echo "$3" > "$d/state-$2" ;;
get-current) cat "$d/booted" ;;
*) exit 1 ;;
esac
"#;

pub struct RaucHarness {
    pub dir: tempfile::TempDir,
    bus: u32,
    service: Mutex<Option<Child>>,
}

impl RaucHarness {
    pub fn make(initial: Option<&[u8]>) -> Box<dyn Harness> {
        Box::new(Self::new(initial))
    }

    pub fn new(initial: Option<&[u8]>) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().to_path_buf();
        let d = p.display();
        fs::create_dir_all(p.join("downloads")).expect("downloads");
        for (slot, content) in [("A", initial), ("B", None)] {
            let mut image = framed(content.unwrap_or_default());
            image.resize(1 << 20, 0x5a);
            fs::write(p.join(format!("slot-{slot}")), image).expect("slot");
        }
        for (name, text) in [
            ("primary", "A\n"),
            ("booted", "A\n"),
            ("state-A", "good\n"),
            ("state-B", "good\n"),
        ] {
            fs::write(p.join(name), text).expect("backend state");
        }
        let out = Command::new("openssl")
            .current_dir(&p)
            .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes"])
            .args(["-keyout", "key.pem", "-out", "cert.pem", "-days", "30"])
            .args(["-subj", "/CN=flotilla test signer"])
            .output()
            .expect("openssl runs");
        assert!(out.status.success(), "openssl req: {out:?}");
        fs::write(
            p.join("system.conf"),
            format!(
                "[system]\ncompatible=flotilla-conformance\nbootloader=custom\n\
                 bundle-formats=plain\ndata-directory={d}/rauc-data\n\n\
                 [handlers]\nbootloader-custom-backend={d}/backend.sh\n\n\
                 [keyring]\npath={d}/cert.pem\n\n\
                 [slot.rootfs.0]\ndevice={d}/slot-A\ntype=raw\nbootname=A\n\n\
                 [slot.rootfs.1]\ndevice={d}/slot-B\ntype=raw\nbootname=B\n"
            ),
        )
        .expect("system.conf");
        // The agent's environment on the device names the bus; here each harness has its own.
        // Installs take turns: each mounts its bundle on a loop device, and a container may
        // have only a few loop device nodes (/dev/loop0-7) for all the suite's RAUC services.
        let lock = std::env::temp_dir().join("flotilla-rauc-install.lock");
        let rauc = format!(
            "#!/bin/sh\nexport DBUS_SYSTEM_BUS_ADDRESS='unix:path={d}/bus.sock'\n\
             if [ \"$1\" = install ]; then exec flock '{}' rauc \"$@\"; fi\n\
             exec rauc \"$@\"\n",
            lock.display()
        );
        for (name, text) in [("backend.sh", BACKEND), ("rauc", rauc.as_str())] {
            fs::write(p.join(name), text).expect("script");
            fs::set_permissions(
                p.join(name),
                std::os::unix::fs::PermissionsExt::from_mode(0o755),
            )
            .expect("chmod");
        }
        fs::write(
            p.join("bus.conf"),
            format!(
                "<!DOCTYPE busconfig PUBLIC \"-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN\"\n \
                 \"http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd\">\n\
                 <busconfig><type>system</type><listen>unix:path={d}/bus.sock</listen>\
                 <auth>EXTERNAL</auth><policy context=\"default\"><allow user=\"*\"/>\
                 <allow own=\"*\"/><allow send_destination=\"*\"/><allow receive_sender=\"*\"/>\
                 </policy></busconfig>\n"
            ),
        )
        .expect("bus config");
        let out = Command::new("dbus-daemon")
            .arg(format!("--config-file={d}/bus.conf"))
            .args(["--fork", "--print-pid"])
            .output()
            .expect("dbus-daemon runs");
        assert!(out.status.success(), "dbus-daemon: {out:?}");
        let bus = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("dbus-daemon's pid");
        let h = Self {
            dir,
            bus,
            service: Mutex::new(None),
        };
        h.start_service();
        h
    }

    pub fn config(&self) -> RaucConfig {
        let p = self.dir.path();
        let mut config = RaucConfig::new(p.join("rauc-state"));
        config.program = p.join("rauc");
        // The harness plays the reboot (Harness::reboot); the command only has to succeed.
        config.reboot_command = vec!["true".to_owned()];
        config
    }

    /// What the backend keeps in `name` (`primary`, `booted`, `state-B`).
    pub fn backend(&self, name: &str) -> String {
        fs::read_to_string(self.dir.path().join(name))
            .expect("backend file")
            .trim()
            .to_owned()
    }

    fn start_service(&self) {
        let p = self.dir.path();
        let booted = self.backend("booted");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p.join("rauc-service.log"))
            .expect("service log");
        let child = Command::new("rauc")
            .arg(format!("--conf={}", p.join("system.conf").display()))
            .arg(format!("--override-boot-slot={booted}"))
            .arg("service")
            .env(
                "DBUS_SYSTEM_BUS_ADDRESS",
                format!("unix:path={}", p.join("bus.sock").display()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("rauc service runs");
        *self.service.lock().expect("service lock") = Some(child);
        // Ready when it answers on the bus.
        for _ in 0..600 {
            let answers = Command::new(p.join("rauc"))
                .arg("status")
                .output()
                .is_ok_and(|o| o.status.success());
            if answers {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "rauc service never answered: {}",
            fs::read_to_string(p.join("rauc-service.log")).unwrap_or_default()
        );
    }

    fn stop_service(&self) {
        if let Some(mut child) = self.service.lock().expect("service lock").take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// A signed plain bundle whose `rootfs` image is `content`, framed.
    pub fn bundle(&self, name: &str, content: &[u8]) -> PathBuf {
        let p = self.dir.path();
        let build = p.join("builds").join(name);
        let _ = fs::remove_dir_all(&build);
        fs::create_dir_all(&build).expect("build dir");
        fs::write(build.join("rootfs.img"), framed(content)).expect("image");
        fs::write(
            build.join("manifest.raucm"),
            "[update]\ncompatible=flotilla-conformance\nversion=2.4.0\n\n[bundle]\nformat=plain\n\n\
             [image.rootfs]\nfilename=rootfs.img\n",
        )
        .expect("manifest");
        let out = p.join("downloads").join(name);
        let _ = fs::remove_file(&out);
        let output = Command::new("rauc")
            .arg(format!("--cert={}", p.join("cert.pem").display()))
            .arg(format!("--key={}", p.join("key.pem").display()))
            .arg("bundle")
            .arg(&build)
            .arg(&out)
            .output()
            .expect("rauc bundle runs");
        assert!(output.status.success(), "rauc bundle: {output:?}");
        out
    }
}

/// An image for a raw slot: the content's length (4 bytes, big-endian), then the content.
fn framed(content: &[u8]) -> Vec<u8> {
    let mut image = (content.len() as u32).to_be_bytes().to_vec();
    image.extend_from_slice(content);
    image
}

impl Harness for RaucHarness {
    fn open(&self) -> Box<dyn UpdateTarget> {
        Box::new(RaucTarget::new(self.config()).expect("valid rauc config"))
    }

    fn artifact(&self, name: &str, content: &[u8]) -> PathBuf {
        self.bundle(name, content)
    }

    /// What the slot the device booted holds.
    fn installed(&self) -> Option<Vec<u8>> {
        let slot = fs::read(
            self.dir
                .path()
                .join(format!("slot-{}", self.backend("booted"))),
        )
        .expect("booted slot");
        let len = u32::from_be_bytes(slot[..4].try_into().expect("4 bytes")) as usize;
        (len > 0).then(|| slot[4..4 + len].to_vec())
    }

    /// The bootloader boots the primary slot unless it is marked bad.
    fn reboot(&self) {
        self.stop_service();
        let mut slot = self.backend("primary");
        if self.backend(&format!("state-{slot}")) == "bad" {
            slot = if slot == "A" { "B" } else { "A" }.to_owned();
        }
        fs::write(self.dir.path().join("booted"), &slot).expect("booted");
        self.start_service();
    }

    /// The new slot does not come up: the bootloader marks it bad and boots the old one.
    fn break_confirm(&self) -> bool {
        let booted = self.backend("booted");
        fs::write(self.dir.path().join(format!("state-{booted}")), "bad\n").expect("mark bad");
        self.reboot();
        true
    }
}

impl Drop for RaucHarness {
    fn drop(&mut self) {
        self.stop_service();
        let _ = Command::new("kill").arg(self.bus.to_string()).status();
    }
}
