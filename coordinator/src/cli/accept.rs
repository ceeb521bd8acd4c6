//! `flotilla devices accept`: which key the request pins.
//!
//! The coordinator accepts a device only with the key the operator compared with the one the
//! device prints (`flotilla-agent identity`), and refuses when the waiting key is another one
//! (`service::enrollment`, `Registry::accept`). `--key` gives it. Without `--key`, on a terminal,
//! the CLI shows the key waiting now with what its state claims and asks; a yes pins exactly that
//! key, so a key some other client shows while the operator reads is refused by the coordinator.
//! Anywhere else (a script, a pipe) it refuses to guess and names the flag.

use std::io::{BufRead, IsTerminal as _, Write};

use flotilla_protocol::control::{EnrollmentInfo, PageQuery};

use crate::cli::client::{ClientError, ControlClient, DEFAULT_TIMEOUT};

/// Why no key could be pinned.
#[derive(Debug, thiserror::Error)]
pub enum AcceptError {
    #[error(
        "accepting device {device} needs the key you compared with the one the device prints \
         (`flotilla-agent identity`): pass --key KEY, the full hex or its first 16 hex digits \
         (`flotilla devices pending` lists the waiting keys); without --key the key is shown \
         and asked about only on a terminal"
    )]
    NeedsKey { device: String },
    #[error(
        "device {device} is not waiting for an operator (`flotilla devices pending` lists the \
         devices and new keys that are)"
    )]
    NotWaiting { device: String },
    #[error("nothing was accepted: key {key} of device {device} was not confirmed")]
    NotConfirmed { device: String, key: String },
    #[error("cannot ask on the terminal: {0}")]
    Terminal(std::io::Error),
    #[error(transparent)]
    Client(#[from] ClientError),
}

/// The key to send with the accept request: `given`, or the waiting key once the operator
/// confirmed it on the terminal.
pub async fn key_to_pin(
    client: &ControlClient,
    device: &str,
    given: Option<String>,
) -> Result<String, AcceptError> {
    if let Some(key) = given {
        return Ok(key);
    }
    if !std::io::stdin().is_terminal() {
        return Err(AcceptError::NeedsKey {
            device: device.to_owned(),
        });
    }
    let waiting = client
        .pending_devices(PageQuery::default(), DEFAULT_TIMEOUT)
        .await?
        .into_iter()
        .find(|info| info.device == device)
        .ok_or_else(|| AcceptError::NotWaiting {
            device: device.to_owned(),
        })?;
    // Reading the terminal blocks; the MQTT link keeps running on the runtime meanwhile.
    let asked = tokio::task::spawn_blocking(move || {
        let confirmed = ask(
            &waiting,
            &mut std::io::stdin().lock(),
            &mut std::io::stderr(),
        )?;
        Ok::<_, std::io::Error>((waiting, confirmed))
    })
    .await
    .map_err(|e| AcceptError::Terminal(std::io::Error::other(e)))?;
    let (waiting, confirmed) = asked.map_err(AcceptError::Terminal)?;
    let key = waiting_key(&waiting).to_owned();
    if confirmed {
        Ok(key)
    } else {
        Err(AcceptError::NotConfirmed {
            device: device.to_owned(),
            key,
        })
    }
}

/// The key an accept would accept: a known device's new key, else the pending one.
fn waiting_key(info: &EnrollmentInfo) -> &str {
    info.new_key.as_deref().unwrap_or(&info.key)
}

/// Shows the waiting key and what its state claims, and asks; true only for `y` or `yes`.
fn ask(
    info: &EnrollmentInfo,
    input: &mut impl BufRead,
    out: &mut impl Write,
) -> std::io::Result<bool> {
    let what = match &info.new_key {
        Some(_) => format!(
            "device {} ({}, key {}) shows a new key",
            info.device, info.status, info.key
        ),
        None => format!("device {} ({}) waits with key", info.device, info.status),
    };
    writeln!(out, "{what}\n  {}", waiting_key(info))?;
    if let Some(hardware) = &info.hardware_id {
        writeln!(out, "  its state claims hardware {hardware}")?;
    }
    if !info.labels.is_empty() {
        let labels: Vec<String> = info
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        writeln!(out, "  and labels {}", labels.join(","))?;
    }
    write!(
        out,
        "Is this the key `flotilla-agent identity` prints on the device? Accept it [y/N]: "
    )?;
    out.flush()?;
    let mut answer = String::new();
    input.read_line(&mut answer)?;
    Ok(matches!(
        answer.trim().to_ascii_lowercase().as_str(),
        "y" | "yes"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(new_key: Option<&str>) -> EnrollmentInfo {
        EnrollmentInfo {
            device: "pi-1".into(),
            status: if new_key.is_some() {
                "accepted"
            } else {
                "pending"
            }
            .into(),
            key: "aa".repeat(32),
            via: None,
            since: 1,
            new_key: new_key.map(str::to_owned),
            hardware_id: Some("pi4".into()),
            labels: [("site".to_owned(), "berlin".to_owned())].into(),
        }
    }

    fn asked(info: &EnrollmentInfo, answer: &str) -> (bool, String) {
        let mut out = Vec::new();
        let yes = ask(info, &mut answer.as_bytes(), &mut out).expect("asks");
        (yes, String::from_utf8(out).expect("text"))
    }

    #[test]
    fn the_prompt_shows_the_whole_waiting_key_and_only_yes_accepts() {
        let (yes, shown) = asked(&info(None), "y\n");
        assert!(yes);
        assert!(
            shown.contains(&"aa".repeat(32))
                && shown.contains("pi4")
                && shown.contains("site=berlin")
                && shown.contains("[y/N]"),
            "{shown}"
        );
        for answer in ["\n", "n\n", "", "yess\n", "ok\n"] {
            assert!(!asked(&info(None), answer).0, "{answer:?} is not a yes");
        }
        assert!(asked(&info(None), " YES \n").0);
    }

    #[test]
    fn a_new_key_of_a_known_device_is_the_one_shown_and_pinned() {
        let new = "bb".repeat(32);
        let info = info(Some(&new));
        let (_, shown) = asked(&info, "n\n");
        assert!(
            shown.contains("shows a new key") && shown.contains(&new),
            "{shown}"
        );
        assert_eq!(waiting_key(&info), new);
    }
}
