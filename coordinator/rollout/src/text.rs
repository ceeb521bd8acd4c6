//! Words for numbers and states in the messages people read: "1 device", "2 devices",
//! "rollout fw-2 has failed". Every trace message, error and view that counts or names a state
//! goes through here, so none says "1 groups" or "is failed".

/// `n` and the noun, plural unless `n` is 1: `count(1, "group")` is "1 group",
/// `count(3, "device")` "3 devices". Every noun this crate and the CLI count takes an `s`.
pub fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// `one` when `n` is 1, else `many`: the verb (or phrase) that agrees with a [`count`],
/// `agree(n, "counts", "count")`.
pub fn agree<'a>(n: usize, one: &'a str, many: &'a str) -> &'a str {
    if n == 1 {
        one
    } else {
        many
    }
}

/// The predicate that says a rollout or group is in `state`: "has failed" for `failed`,
/// "is STATE" for every other (`is running`, `is finished`, `is paused`).
pub fn is_state(state: impl std::fmt::Display) -> String {
    match state.to_string().as_str() {
        "failed" => "has failed".to_owned(),
        other => format!("is {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_is_singular_and_every_other_count_plural() {
        assert_eq!(count(1, "group"), "1 group");
        assert_eq!(count(0, "device"), "0 devices");
        assert_eq!(count(2, "device"), "2 devices");
        assert_eq!(is_state("failed"), "has failed");
        assert_eq!(is_state("running"), "is running");
    }
}
