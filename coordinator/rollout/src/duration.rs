//! Durations as operators write them in specs and configs: `30s`, `15m`, `12h`, `7d`, and
//! compounds of them, largest unit first or not, like `2h30m` or `1d12h`.

/// Parses `30s`, `15m`, `12h`, `7d`, a compound such as `2h30m` (each part a number and a unit,
/// added up), or a bare number of seconds, into seconds.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text.parse().map_err(|_| format!("{text} is too large"));
    }
    let mut rest = text;
    let mut total: u64 = 0;
    if rest.is_empty() {
        return Err("expected a number followed by s, m, h or d, like 7d or 2h30m".into());
    }
    while !rest.is_empty() {
        let split = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let (digits, after) = rest.split_at(split);
        if digits.is_empty() {
            return Err(format!(
                "expected a number before {after:?}: a duration is numbers followed by s, m, h \
                 or d, like 7d or 2h30m"
            ));
        }
        let unit_len = after
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_len);
        let scale = match unit {
            "s" => 1,
            "m" => 60,
            "h" => 3600,
            "d" => 86_400,
            "" => return Err(format!("{digits} needs a unit after it: s, m, h or d")),
            other => return Err(format!("unknown unit {other:?}; use s, m, h or d")),
        };
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("{digits} is too large"))?;
        total = n
            .checked_mul(scale)
            .and_then(|part| total.checked_add(part))
            .ok_or_else(|| format!("{text} is too large"))?;
        rest = next;
    }
    Ok(total)
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
        assert!(parse_duration("").is_err());
        assert!(parse_duration("99999999999999999999d").is_err());
    }

    #[test]
    fn compound_durations_add_up_their_parts() {
        assert_eq!(parse_duration("2h30m"), Ok(9_000));
        assert_eq!(parse_duration("1d12h"), Ok(129_600));
        assert_eq!(parse_duration("1m30s"), Ok(90));
        assert_eq!(parse_duration(" 1h1m1s "), Ok(3_661));
        let err = parse_duration("2h30").expect_err("a part without a unit");
        assert!(err.contains("30 needs a unit"), "{err}");
        let err = parse_duration("2h30x").expect_err("unknown unit");
        assert!(err.contains("\"x\""), "{err}");
        assert!(parse_duration("h30m").is_err());
        assert!(parse_duration("999999999999999d1s").is_err());
    }
}
