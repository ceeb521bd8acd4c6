//! A private PostgreSQL for a test (Debian's `postgresql`): its own cluster in a temporary
//! directory, on a free port of the loopback interface, trusting the `flotilla` user.
//!
//! ```no_run
//! let Some(pg) = flotilla_tests::postgres::Postgres::start() else { return }; // SKIPPED
//! let url = pg.url(); // postgres://flotilla@127.0.0.1:PORT/postgres
//! pg.crash();         // pg_ctl -m immediate stop
//! pg.start_again();
//! ```
//!
//! PostgreSQL refuses to run as root: as root, the cluster's directory belongs to `postgres`
//! and `initdb`/`pg_ctl` run through `runuser -u postgres --`. The binaries are found on PATH or
//! in `/usr/lib/postgresql/*/bin` (where Debian puts them, off PATH). When they are missing a
//! test skips loudly, or fails under `FLOTILLA_REQUIRE_TOOLS=1` (CI installs them).

use std::path::PathBuf;
use std::process::Command;

use crate::free_port;

/// A running PostgreSQL cluster, stopped on drop.
pub struct Postgres {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    as_postgres: bool,
    /// The CA file, when the server speaks TLS.
    ca_file: Option<PathBuf>,
}

impl std::fmt::Debug for Postgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Postgres")
            .field("dir", &self.dir.path())
            .field("port", &self.port)
            .finish()
    }
}

/// The directory holding `initdb`, `pg_ctl` and `psql`, if PostgreSQL is installed.
pub fn bin_dir() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .find(|d| d.join("initdb").is_file() && d.join("pg_ctl").is_file());
    if on_path.is_some() {
        return on_path;
    }
    // Debian: /usr/lib/postgresql/<major>/bin, newest major first.
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let major = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((major, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

impl Postgres {
    /// A fresh cluster, started and taking connections. `None` (after a loud `SKIPPED` line)
    /// when PostgreSQL is not installed, unless `FLOTILLA_REQUIRE_TOOLS=1`.
    pub fn start() -> Option<Postgres> {
        Postgres::start_with(false)
    }

    /// Like [`Postgres::start`], with TLS on (`ssl=on`): a private CA and a server certificate
    /// for 127.0.0.1 from `deploy/mosquitto/make-certs.sh`; [`Postgres::ca_file`] names the CA.
    /// Plain connections are still accepted.
    pub fn start_tls() -> Option<Postgres> {
        Postgres::start_with(true)
    }

    fn start_with(tls: bool) -> Option<Postgres> {
        let Some(bin) = bin_dir() else {
            let notice = "SKIPPED: PostgreSQL is not installed (no initdb on PATH or in \
                          /usr/lib/postgresql/*/bin; apt-get install postgresql)";
            if std::env::var("FLOTILLA_REQUIRE_TOOLS").is_ok_and(|v| v == "1") {
                panic!("{notice} (FLOTILLA_REQUIRE_TOOLS=1)");
            }
            eprintln!("\n!!!! {notice}\n");
            return None;
        };
        let dir = tempfile::Builder::new()
            .prefix("flotilla-pg-")
            .tempdir()
            .expect("temporary directory for PostgreSQL");
        let as_postgres = is_root();
        let ca_file = tls.then(|| {
            let certs = dir.path().join("tls");
            let script = crate::secure::deploy_dir().join("make-certs.sh");
            run(Command::new("sh").arg(&script).arg(&certs).arg("ca"));
            run(Command::new("sh").arg(&script).arg(&certs).args([
                "server",
                "server",
                "IP:127.0.0.1",
                "DNS:localhost",
            ]));
            certs.join("ca.crt")
        });
        if as_postgres {
            run(Command::new("chown")
                .arg("-R")
                .arg("postgres:")
                .arg(dir.path()));
        }
        let pg = Postgres {
            bin,
            dir,
            port: free_port(),
            as_postgres,
            ca_file,
        };
        run(pg.tool("initdb").arg("-D").arg(pg.data()).args([
            "--auth=trust",
            "-U",
            "flotilla",
            "-E",
            "UTF8",
            "--no-sync",
        ]));
        pg.start_again();
        Some(pg)
    }

    /// `postgres://flotilla@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://flotilla@127.0.0.1:{}/postgres", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The CA the server's certificate chains to (servers from [`Postgres::start_tls`]).
    pub fn ca_file(&self) -> Option<PathBuf> {
        self.ca_file.clone()
    }

    /// Stops the server the way a crash does (`pg_ctl -m immediate stop`): no checkpoint, every
    /// connection dropped.
    pub fn crash(&self) {
        run(self
            .tool("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "stop"]));
    }

    /// Starts the server (again), on the same port, and waits until it takes connections.
    pub fn start_again(&self) {
        let mut options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.path().display()
        );
        if self.ca_file.is_some() {
            let certs = self.dir.path().join("tls");
            options.push_str(&format!(
                " -c ssl=on -c ssl_cert_file={} -c ssl_key_file={}",
                certs.join("server.crt").display(),
                certs.join("server.key").display()
            ));
        }
        run(self
            .tool("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.log())
            .args(["-o", &options, "-w", "-t", "60", "start"]));
    }

    /// Runs `sql` with `psql` and returns its unaligned output (`a|b` per row), trimmed. Panics,
    /// with psql's message, when the statement fails.
    pub fn sql(&self, sql: &str) -> String {
        let psql = self.bin.join("psql");
        let psql = if psql.is_file() {
            psql
        } else {
            PathBuf::from("psql")
        };
        let output = Command::new(psql)
            .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1"])
            .args([
                "-p",
                &self.port.to_string(),
                "-U",
                "flotilla",
                "-d",
                "postgres",
            ])
            .arg("-c")
            .arg(sql)
            .output()
            .expect("run psql");
        assert!(
            output.status.success(),
            "psql {sql:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// The server's log so far, for messages when a test fails.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    fn tool(&self, name: &str) -> Command {
        let path = self.bin.join(name);
        if self.as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(path);
            command
        } else {
            Command::new(path)
        }
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if self.data().join("postmaster.pid").exists() {
            let _ = self
                .tool("pg_ctl")
                .arg("-D")
                .arg(self.data())
                .args(["-m", "immediate", "-w", "stop"])
                .output();
        }
    }
}

fn run(command: &mut Command) {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
