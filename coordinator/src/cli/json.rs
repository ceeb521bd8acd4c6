//! `--json` output of the commands that talk to a coordinator: the control types as pretty JSON,
//! with every Unix time (a number under a key `at`, `…_at` or `last_seen`) also given as RFC 3339
//! text beside it, under the same key with `_rfc3339` appended. A script keeps the number, a
//! person reading the output gets the date, and neither has to convert.

use serde_json::Value;

/// `value` as pretty JSON with the RFC 3339 twin of every time field.
pub fn to_json<T: serde::Serialize>(value: &T) -> String {
    // The control types are plain structs of strings and numbers: serializing cannot fail.
    let mut value = serde_json::to_value(value).unwrap_or(Value::Null);
    add_times(&mut value);
    serde_json::to_string_pretty(&value).unwrap_or_default()
}

/// Whether a field of this name holds a Unix time.
fn is_time(key: &str) -> bool {
    key == "at" || key.ends_with("_at") || key == "last_seen"
}

/// Adds `KEY_rfc3339` next to every time field, at any depth.
fn add_times(value: &mut Value) {
    match value {
        Value::Object(map) => {
            let twins: Vec<(String, Value)> = map
                .iter()
                .filter(|(key, _)| is_time(key))
                .filter_map(|(key, v)| {
                    let at = v.as_u64()?;
                    Some((
                        format!("{key}_rfc3339"),
                        Value::String(flotilla_rollout::window::utc_text(at)),
                    ))
                })
                .collect();
            for v in map.values_mut() {
                add_times(v);
            }
            map.extend(twins);
        }
        Value::Array(items) => items.iter_mut().for_each(add_times),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_time_keeps_its_number_and_gains_its_rfc3339_text() {
        let value = serde_json::json!({
            "name": "fw",
            "created_at": 1_795_779_447u64,
            "groups": [{"started_at": 3600, "ended_at": null}],
            "trace": [{"at": 0, "message": "created"}],
            "total": 4,
        });
        let out: Value = serde_json::from_str(&to_json(&value)).expect("json");
        assert_eq!(out["created_at"], 1_795_779_447u64);
        assert_eq!(out["created_at_rfc3339"], "2026-11-27T11:37:27Z");
        assert_eq!(
            out["groups"][0]["started_at_rfc3339"],
            "1970-01-01T01:00:00Z"
        );
        assert!(out["groups"][0].get("ended_at_rfc3339").is_none(), "{out}");
        assert_eq!(out["trace"][0]["at_rfc3339"], "1970-01-01T00:00:00Z");
        assert!(out.get("total_rfc3339").is_none(), "{out}");
    }
}
