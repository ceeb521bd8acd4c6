//! A RAUC device for end-to-end tests: a private D-Bus system bus, Debian's `rauc service` on a
//! `system.conf` with two file-backed raw slots and a `custom` bootloader backend (a shell script
//! keeping the primary slot and each slot's state in files), a test CA and bundles signed by it.
//!
//! [`RaucDevice::launcher`] runs the agent the way a device would: with RAUC's service beside it,
//! and a reboot (the agent's reboot command, [`RaucDevice::reboot_command`]) stops both and starts
//! them again booted into the slot the bootloader backend chooses (the primary one, unless it is
//! marked bad).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Whether a test that needs RAUC can run: `rauc`, `mksquashfs`, `dbus-daemon` and `openssl`
/// are installed. With `FLOTILLA_REQUIRE_TOOLS=1` (CI, whose `.ci/run` installs them) a missing
/// one fails the test; elsewhere the skip is loud.
pub fn require_rauc(test: &str) -> bool {
    let missing: Vec<&str> = [
        ("rauc", "--version"),
        ("mksquashfs", "-version"),
        ("dbus-daemon", "--version"),
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
    eprintln!(
        "SKIPPED {test}: {missing:?} not installed (apt-get install rauc squashfs-tools dbus openssl)"
    );
    false
}

/// The `compatible` string of the test system and its bundles.
pub const COMPATIBLE: &str = "flotilla-test-board";
/// Size of each slot file.
pub const SLOT_SIZE: u64 = 8 << 20;

/// The custom bootloader backend: the primary slot's bootname in `primary`, each slot's state in
/// `state-<bootname>`. RAUC marks the slot it writes bad first; making it primary makes it
/// bootable again, as RAUC's U-Boot and barebox backends do (they reset its boot attempts).
const BACKEND: &str = r#"#!/bin/sh
d=$(dirname "$0")
case "$1" in set-*) echo "$*" >> "$d/calls" ;; esac
case "$1" in
get-primary) cat "$d/primary" ;;
set-primary) echo "$2" > "$d/primary"; echo good > "$d/state-$2" ;;
get-state) cat "$d/state-$2" ;;
set-state) echo "$3" > "$d/state-$2" ;;
get-current) cat "$d/booted" ;;
*) echo "unknown backend call: $*" >&2; exit 1 ;;
esac
"#;

/// Runs RAUC's service and the agent ("$@"); after a reboot request, both again.
const LAUNCHER: &str = r#"#!/bin/sh
d=$(dirname "$0")
export DBUS_SYSTEM_BUS_ADDRESS="unix:path=$d/bus.sock"
while :; do
  # The "bootloader": the primary slot, unless it is marked bad.
  slot=$(cat "$d/primary")
  if [ "$(cat "$d/state-$slot")" = bad ]; then
    if [ "$slot" = A ]; then slot=B; else slot=A; fi
  fi
  echo "$slot" > "$d/booted"
  rauc service --conf="$d/system.conf" --override-boot-slot="$slot" >>"$d/rauc-service.log" 2>&1 &
  echo $! > "$d/rauc.pid"
  tries=0
  until rauc status >/dev/null 2>&1 || [ $tries -ge 300 ]; do sleep 0.1; tries=$((tries+1)); done
  "$@" &
  echo $! > "$d/agent.pid"
  wait $!
  kill "$(cat "$d/rauc.pid")" 2>/dev/null
  wait
  [ -e "$d/reboot-requested" ] || exit 0
  rm "$d/reboot-requested"
  echo "reboot" >> "$d/reboots"
done
"#;

/// The agent's reboot command: asks the launcher for a reboot and stops the agent.
const REBOOT: &str = r#"#!/bin/sh
d=$(dirname "$0")
touch "$d/reboot-requested"
kill -TERM "$(cat "$d/agent.pid")"
"#;

/// One RAUC device's files and its private bus. Dropping it stops the agent, RAUC's service and
/// the bus it started.
pub struct RaucDevice {
    dir: PathBuf,
    bus_pid: Option<u32>,
}

impl RaucDevice {
    /// Sets up the device in `dir` (created): the CA, the slots (`slot-a` booted and primary,
    /// `slot-b`), `system.conf`, the backend, and a private system bus, which it starts.
    pub fn new(dir: &Path) -> RaucDevice {
        fs::create_dir_all(dir).expect("rauc device directory");
        let dir = dir.canonicalize().expect("absolute device directory");
        let sh = |args: &[&str]| {
            let out = Command::new(args[0])
                .args(&args[1..])
                .current_dir(&dir)
                .output()
                .expect("runs");
            assert!(out.status.success(), "{args:?}: {out:?}");
        };
        // A test CA (the device's keyring) and a signing certificate it issued.
        sh(
            &["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes"]
                .into_iter()
                .chain(["-keyout", "ca.key", "-out", "ca.pem", "-days", "30"])
                .chain(["-subj", "/CN=flotilla test CA"])
                .chain(["-addext", "basicConstraints=critical,CA:TRUE"])
                .chain(["-addext", "keyUsage=keyCertSign"])
                .collect::<Vec<_>>(),
        );
        sh(&[
            "openssl",
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "signer.key",
            "-out",
            "signer.csr",
            "-subj",
            "/CN=flotilla test signer",
        ]);
        fs::write(
            dir.join("signer.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n",
        )
        .expect("extensions");
        sh(&[
            "openssl",
            "x509",
            "-req",
            "-in",
            "signer.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "signer.pem",
            "-days",
            "30",
            "-extfile",
            "signer.ext",
        ]);
        for slot in ["slot-a", "slot-b"] {
            let f = fs::File::create(dir.join(slot)).expect("slot file");
            f.set_len(SLOT_SIZE).expect("slot size");
        }
        for (name, text) in [
            ("primary", "A\n"),
            ("booted", "A\n"),
            ("state-A", "good\n"),
            ("state-B", "good\n"),
        ] {
            fs::write(dir.join(name), text).expect("backend state");
        }
        let d = dir.display();
        fs::write(
            dir.join("system.conf"),
            format!(
                "[system]\ncompatible={COMPATIBLE}\nbootloader=custom\nbundle-formats=plain\n\
                 data-directory={d}/rauc-data\n\n[handlers]\nbootloader-custom-backend={d}/backend.sh\n\n\
                 [keyring]\npath={d}/ca.pem\n\n\
                 [slot.rootfs.0]\ndevice={d}/slot-a\ntype=raw\nbootname=A\n\n\
                 [slot.rootfs.1]\ndevice={d}/slot-b\ntype=raw\nbootname=B\n"
            ),
        )
        .expect("system.conf");
        for (name, text) in [
            ("backend.sh", BACKEND),
            ("device.sh", LAUNCHER),
            ("reboot.sh", REBOOT),
        ] {
            let path = dir.join(name);
            fs::write(&path, text).expect("script");
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        fs::write(
            dir.join("bus.conf"),
            format!(
                r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={d}/bus.sock</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
"#
            ),
        )
        .expect("bus config");
        let out = Command::new("dbus-daemon")
            .arg(format!("--config-file={d}/bus.conf"))
            .args(["--fork", "--print-pid"])
            .output()
            .expect("dbus-daemon runs");
        assert!(out.status.success(), "dbus-daemon: {out:?}");
        let bus_pid = String::from_utf8_lossy(&out.stdout).trim().parse().ok();
        RaucDevice { dir, bus_pid }
    }

    /// The device's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A slot file: `"a"` (rootfs.0, bootname A) or `"b"` (rootfs.1, bootname B).
    pub fn slot(&self, name: &str) -> PathBuf {
        self.dir.join(format!("slot-{name}"))
    }

    /// What the custom bootloader backend keeps in `name` (`primary`, `state-A`, `booted`, ...).
    pub fn backend(&self, name: &str) -> String {
        fs::read_to_string(self.dir.join(name))
            .unwrap_or_default()
            .trim()
            .to_owned()
    }

    /// The changes RAUC asked of the bootloader backend, one per line (`set-primary B`,
    /// `set-state B good`, ...).
    pub fn backend_calls(&self) -> Vec<String> {
        self.backend("calls").lines().map(str::to_owned).collect()
    }

    /// How many times the device rebooted.
    pub fn reboots(&self) -> usize {
        self.backend("reboots").lines().count()
    }

    /// The agent's `launcher`: the device script, then the agent binary.
    pub fn launcher(&self, agent: &Path) -> Vec<String> {
        vec![
            self.dir.join("device.sh").display().to_string(),
            agent.display().to_string(),
        ]
    }

    /// The agent's `reboot_command`.
    pub fn reboot_command(&self) -> PathBuf {
        self.dir.join("reboot.sh")
    }

    /// Builds `out`: a plain bundle for [`COMPATIBLE`] whose one image, for slot class `rootfs`,
    /// is `image`, signed with the test CA's signing certificate.
    pub fn bundle(&self, out: &Path, version: &str, image: &[u8]) {
        let content = self.dir.join(format!("bundle-{version}"));
        fs::create_dir_all(&content).expect("bundle directory");
        fs::write(content.join("rootfs.img"), image).expect("image");
        fs::write(
            content.join("manifest.raucm"),
            format!(
                "[update]\ncompatible={COMPATIBLE}\nversion={version}\n\n[bundle]\nformat=plain\n\n\
                 [image.rootfs]\nfilename=rootfs.img\n"
            ),
        )
        .expect("manifest");
        let _ = fs::remove_file(out);
        let output = Command::new("rauc")
            .arg(format!("--cert={}", self.dir.join("signer.pem").display()))
            .arg(format!("--key={}", self.dir.join("signer.key").display()))
            .arg("bundle")
            .arg(&content)
            .arg(out)
            .output()
            .expect("rauc bundle runs");
        assert!(output.status.success(), "rauc bundle: {output:?}");
    }
}

impl Drop for RaucDevice {
    fn drop(&mut self) {
        for pid_file in ["agent.pid", "rauc.pid"] {
            if let Ok(pid) = fs::read_to_string(self.dir.join(pid_file)) {
                let _ = Command::new("kill").arg("-9").arg(pid.trim()).status();
            }
        }
        if let Some(pid) = self.bus_pid {
            let _ = Command::new("kill").arg(pid.to_string()).status();
        }
    }
}

/// Overwrites `len` bytes of `path` at `offset` with `X`: inside the signed payload, so RAUC's
/// signature check refuses the bundle.
pub fn corrupt(path: &Path, offset: usize, len: usize) {
    let mut bytes = fs::read(path).expect("bundle");
    assert!(offset + len < bytes.len(), "the bundle is long enough");
    bytes[offset..offset + len].fill(b'X');
    fs::write(path, bytes).expect("corrupt bundle");
}
