use super::*;
use std::process::Command;

fn no_env(_: &str) -> Option<String> {
    None
}

/// A CA, a client certificate for `dev-1` and a stray key `other.key`, made by the shipped
/// `deploy/mosquitto/make-certs.sh`. Panics when openssl is missing: these tests must not pass
/// without running.
fn pki(dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/mosquitto/make-certs.sh");
    for args in [&["ca"][..], &["client", "dev-1"], &["client", "other"]] {
        let out = Command::new("sh")
            .arg(&script)
            .arg(dir)
            .args(args)
            .output()
            .expect("run make-certs.sh");
        assert!(
            out.status.success(),
            "make-certs.sh {args:?} (needs the openssl CLI): {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn tls_spec(ca: Option<&str>, cert: Option<&str>, key: Option<&str>) -> ConnectionSpec {
    ConnectionSpec {
        tls: Some(RawTls {
            ca_file: ca.map(PathBuf::from),
            client_cert: cert.map(PathBuf::from),
            client_key: key.map(PathBuf::from),
        }),
        ..ConnectionSpec::plain("127.0.0.1", 8883)
    }
}

#[test]
fn plain_connection_has_no_credentials_and_no_tls() {
    let c = ConnectionSpec::plain("broker.local", 1883)
        .validate(Path::new("/"), &no_env)
        .expect("valid");
    let options = c.options("dev-7");
    assert_eq!(options.client_id(), "dev-7");
    assert_eq!(options.credentials(), None);
    assert!(matches!(options.transport(), Transport::Tcp));
    assert_eq!(c.describe(), "mqtt://broker.local:1883");
}

#[test]
fn password_comes_from_a_file_or_the_environment() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("pw"), "s3cret\n").expect("write");
    let spec = ConnectionSpec {
        username: Some("dev-1".into()),
        password_file: Some("pw".into()),
        ..ConnectionSpec::plain("h", 1)
    };
    let c = spec.validate(dir.path(), &no_env).expect("valid");
    let creds = c.credentials.clone().expect("credentials");
    assert_eq!(
        creds.password.expose(),
        "s3cret",
        "trailing newline dropped"
    );
    let login = c.options("x").credentials().expect("login");
    assert_eq!(
        (login.username.as_str(), login.password.as_str()),
        ("dev-1", "s3cret")
    );
    assert!(
        !format!("{c:?}").contains("s3cret"),
        "Debug leaks the password"
    );
    assert_eq!(c.describe(), "mqtt://h:1 as dev-1");

    let spec = ConnectionSpec {
        username: Some("op".into()),
        password_env: Some("MY_PW".into()),
        ..ConnectionSpec::plain("h", 1)
    };
    let env = |name: &str| (name == "MY_PW").then(|| "from-env".to_owned());
    let c = spec.validate(dir.path(), &env).expect("valid");
    assert_eq!(
        c.credentials.expect("credentials").password.expose(),
        "from-env"
    );
}

#[test]
fn credential_errors_name_the_setting() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("empty"), "\n").expect("write");
    let cases = [
        (
            Some("u"),
            Some("missing"),
            None,
            "password_file",
            "cannot read",
        ),
        (Some("u"), Some("empty"), None, "password_file", "empty"),
        (
            Some("u"),
            None,
            Some("UNSET_VAR"),
            "password_env",
            "not set",
        ),
        (
            Some("u"),
            Some("empty"),
            Some("V"),
            "password_env",
            "not both",
        ),
        (Some("u"), None, None, "username", "needs a password"),
        (Some(" "), None, None, "username", "must not be empty"),
        (None, None, Some("SET"), "password_env", "needs a username"),
    ];
    let env = |name: &str| (name == "SET").then(|| "x".to_owned());
    for (user, file, var, field, reason) in cases {
        let spec = ConnectionSpec {
            username: user.map(str::to_owned),
            password_file: file.map(PathBuf::from),
            password_env: var.map(str::to_owned),
            ..ConnectionSpec::plain("h", 1)
        };
        let err = spec.validate(dir.path(), &env).expect_err(field);
        assert_eq!(err.field, field, "{err}");
        assert!(err.reason.contains(reason), "{err}");
    }
    let err = ConnectionSpec::plain("", 1)
        .validate(dir.path(), &no_env)
        .expect_err("host");
    assert_eq!(err.field, "host");
}

#[test]
fn tls_with_a_ca_file_and_a_client_certificate() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let c = tls_spec(Some("ca.crt"), None, None)
        .validate(dir.path(), &no_env)
        .expect("server-only TLS");
    assert!(matches!(
        c.options("x").transport(),
        Transport::Tls(TlsConfiguration::Rustls(_))
    ));
    assert_eq!(c.describe(), "mqtts://127.0.0.1:8883");
    let c = tls_spec(Some("ca.crt"), Some("dev-1.crt"), Some("dev-1.key"))
        .validate(dir.path(), &no_env)
        .expect("mutual TLS");
    assert_eq!(
        c.tls.as_ref().and_then(|t| t.client_cert.clone()),
        Some((dir.path().join("dev-1.crt"), dir.path().join("dev-1.key")))
    );
    assert!(c.describe().ends_with("with a client certificate"));
}

/// The name a broker knows a login by: the user name, else the certificate's common name (what
/// Mosquitto takes with `use_identity_as_username`), else none.
#[test]
fn the_login_name_is_the_user_name_or_the_certificates_common_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let cert = tls_spec(Some("ca.crt"), Some("dev-1.crt"), Some("dev-1.key"))
        .validate(dir.path(), &no_env)
        .expect("mutual TLS");
    assert_eq!(cert.login_name().as_deref(), Some("dev-1"));
    std::fs::write(dir.path().join("pw"), "pw").expect("write");
    let both = ConnectionSpec {
        username: Some("op".into()),
        password_file: Some("pw".into()),
        ..tls_spec(Some("ca.crt"), Some("other.crt"), Some("other.key"))
    }
    .validate(dir.path(), &no_env)
    .expect("password and certificate");
    assert_eq!(both.login_name().as_deref(), Some("op"));
    let anonymous = tls_spec(Some("ca.crt"), None, None)
        .validate(dir.path(), &no_env)
        .expect("server-only TLS");
    assert_eq!(anonymous.login_name(), None);
    assert_eq!(common_name(b"\x30\x03\x30\x01"), None, "junk is no name");
    assert_eq!(common_name(&[]), None);
}

#[test]
fn tls_errors_name_the_setting() {
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    std::fs::write(dir.path().join("junk.pem"), "not a certificate\n").expect("write");
    let cases = [
        (Some("nope.crt"), None, None, "tls.ca_file"),
        (Some("junk.pem"), None, None, "tls.ca_file"),
        (Some("ca.crt"), Some("dev-1.crt"), None, "tls.client_key"),
        (Some("ca.crt"), None, Some("dev-1.key"), "tls.client_cert"),
        (
            Some("ca.crt"),
            Some("junk.pem"),
            Some("dev-1.key"),
            "tls.client_cert",
        ),
        (
            Some("ca.crt"),
            Some("dev-1.crt"),
            Some("junk.pem"),
            "tls.client_key",
        ),
        // A key that is not the certificate's.
        (
            Some("ca.crt"),
            Some("dev-1.crt"),
            Some("other.key"),
            "tls.client_key",
        ),
    ];
    for (ca, cert, key, field) in cases {
        let err = tls_spec(ca, cert, key)
            .validate(dir.path(), &no_env)
            .expect_err(field);
        assert_eq!(err.field, field, "{ca:?} {cert:?} {key:?}: {err}");
    }
}
