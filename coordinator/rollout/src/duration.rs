//! Durations as operators write them in specs and configs: `30s`, `15m`, `12h`, `7d`.

/// Parses `30s`, `15m`, `12h`, `7d` (or a bare number of seconds) into seconds.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    if digits.is_empty() {
        return Err("expected a number followed by s, m, h or d, like 7d".into());
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{digits} is too large"))?;
    let scale = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        other => return Err(format!("unknown unit {other:?}; use s, m, h or d")),
    };
    n.checked_mul(scale)
        .ok_or_else(|| format!("{text} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("7d"), Ok(604_800));
        assert_eq!(parse_duration("90"), Ok(90));
        assert_eq!(parse_duration("15m"), Ok(900));
        assert!(parse_duration("d").is_err());
        assert!(parse_duration("1y").is_err());
        assert!(parse_duration("99999999999999999999d").is_err());
    }
}
