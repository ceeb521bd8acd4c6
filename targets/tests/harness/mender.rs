//! The conformance harness of the `mender-module` target: unchanged update modules from Debian's
//! `mender-client` installing into a temporary directory.

use super::*;

/// Debian's `mender-client` puts the update modules here.
pub const MENDER_MODULES: &str = "/usr/share/mender/modules/v3";

/// The `mender-module` target running an unchanged module from Debian's `mender-client` on
/// `<dir>/opt/app/app.conf`.
pub struct MenderHarness {
    pub dir: tempfile::TempDir,
    module: MenderModule,
}

impl MenderHarness {
    pub fn make(module: MenderModule, initial: Option<&[u8]>) -> Box<dyn Harness> {
        Box::new(Self::new(module, initial))
    }

    pub fn new(module: MenderModule, initial: Option<&[u8]>) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(dir.path().join("downloads")).expect("downloads");
        if let Some(content) = initial {
            fs::create_dir_all(dir.path().join("opt/app")).expect("dest dir");
            fs::write(dir.path().join("opt/app/app.conf"), content).expect("seed");
        }
        Self { dir, module }
    }

    pub fn dest(&self) -> PathBuf {
        self.dir.path().join("opt/app/app.conf")
    }
}

impl Harness for MenderHarness {
    fn open(&self) -> Box<dyn UpdateTarget> {
        let name = match self.module {
            MenderModule::SingleFile => "single-file",
            MenderModule::Directory => "directory",
        };
        let mut config = MenderModuleConfig::new(
            Path::new(MENDER_MODULES).join(name),
            self.dir.path().join("state"),
        );
        let dest_dir = self.dir.path().join("opt/app").display().to_string();
        config.files.insert("dest_dir".into(), dest_dir);
        match self.module {
            MenderModule::SingleFile => {
                config.payload_file = Some("app.conf".into());
                config.files.insert("filename".into(), "app.conf".into());
                config.files.insert("permissions".into(), "0640".into());
            }
            MenderModule::Directory => config.payload_file = Some("update.tar".into()),
        }
        Box::new(MenderModuleTarget::new(config).expect("valid mender-module config"))
    }

    fn artifact(&self, name: &str, content: &[u8]) -> PathBuf {
        let path = self.dir.path().join("downloads").join(name);
        match self.module {
            MenderModule::SingleFile => fs::write(&path, content).expect("write artifact"),
            MenderModule::Directory => {
                let src = self.dir.path().join(format!("src-{name}"));
                fs::create_dir_all(&src).expect("src");
                fs::write(src.join("app.conf"), content).expect("content");
                let status = Command::new("tar")
                    .arg("-cf")
                    .arg(&path)
                    .arg("-C")
                    .arg(&src)
                    .arg(".")
                    .status()
                    .expect("tar runs");
                assert!(status.success(), "tar of the directory payload");
            }
        }
        path
    }

    fn installed(&self) -> Option<Vec<u8>> {
        match fs::read(self.dest()) {
            Ok(bytes) => Some(bytes),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => panic!("cannot read {}: {e}", self.dest().display()),
        }
    }

    fn rollback_removes_first_install(&self) -> bool {
        self.module != MenderModule::SingleFile
    }
}

pub fn mender_module_installed(name: &str) -> Result<(), String> {
    let path = Path::new(MENDER_MODULES).join(name);
    if path.is_file() {
        Ok(())
    } else {
        Err(format!(
            "{} is missing; install it with `apt-get install mender-client`",
            path.display()
        ))
    }
}
