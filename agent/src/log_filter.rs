//! `RUST_LOG` for the agent: which log events the binary prints.
//!
//! The syntax is tracing-subscriber's `EnvFilter` (`info`, `warn,flotilla_agent=debug`,
//! `flotilla_agent::fetch_blocks=trace`, `[{artifact}]=debug`), read into a
//! [`tracing_subscriber::filter::Targets`], which matches on an event's target, level and field
//! names; `EnvFilter` and the regular-expression engine it brings were about 260 KB of the
//! aarch64 binary (docs/decisions/0032-agent-size-log-filter.md). `EnvFilter`'s other directives name a span
//! (`[fetch]=debug`) or a span field's value (`[{peer="a"}]=debug`) and only enable events
//! inside such spans; nothing in the agent opens a span, so they never matched anything and are
//! skipped here. The rest behaves as before:
//!
//! - unset: `info`;
//! - empty (or only commas): nothing is printed;
//! - any directive that does not parse: the whole value is ignored and `info` applies, with a
//!   warning on stderr.

use tracing_subscriber::filter::{LevelFilter, Targets};

/// The filter for `RUST_LOG`'s value (`None`: unset), and a warning to print when the value
/// was refused.
pub fn parse(value: Option<&str>) -> (Targets, Option<String>) {
    let default = Targets::new().with_default(LevelFilter::INFO);
    let Some(value) = value else {
        return (default, None);
    };
    let directives: Vec<&str> = value
        .split(',')
        .filter(|d| !d.is_empty() && !names_span(d))
        .collect();
    match directives.join(",").parse::<Targets>() {
        Ok(targets) if !directives.is_empty() => (targets, None),
        Ok(_) => (Targets::new(), None),
        Err(e) => (
            default,
            Some(format!(
                "RUST_LOG={value:?} ignored ({e}); logging at the info level"
            )),
        ),
    }
}

/// Whether `directive` selects spans (`target[span]`, `[span{field}]`, `[{field=value}]`),
/// which `EnvFilter` applies only to events inside a matching span.
fn names_span(directive: &str) -> bool {
    let Some(open) = directive.find('[') else {
        return false;
    };
    let selector = &directive[open..];
    let selector = selector.find(']').map_or(selector, |end| &selector[..=end]);
    !selector.starts_with("[{") || selector.contains('=')
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::Level;

    /// Whether `filter` prints an event at `level` from `target` with these field names.
    fn prints(filter: &Targets, target: &str, level: Level) -> bool {
        filter.would_enable(target, &level)
    }

    #[test]
    fn unset_logs_info_and_above() {
        let (filter, warning) = parse(None);
        assert!(warning.is_none());
        assert!(prints(&filter, "flotilla_agent::link", Level::INFO));
        assert!(prints(&filter, "flotilla_agent::link", Level::WARN));
        assert!(!prints(&filter, "flotilla_agent::link", Level::DEBUG));
    }

    #[test]
    fn levels_and_targets_as_env_filter_reads_them() {
        let (filter, warning) = parse(Some("warn,flotilla_agent::fetch_blocks=debug"));
        assert!(warning.is_none());
        assert!(prints(
            &filter,
            "flotilla_agent::fetch_blocks",
            Level::DEBUG
        ));
        assert!(!prints(
            &filter,
            "flotilla_agent::fetch_blocks",
            Level::TRACE
        ));
        assert!(!prints(&filter, "flotilla_agent::link", Level::INFO));
        assert!(prints(&filter, "flotilla_agent::link", Level::WARN));

        // A bare target enables every level for it; level names ignore case; `off` silences.
        let (filter, _) = parse(Some("flotilla_agent,flotilla_agent::link=OFF"));
        assert!(prints(&filter, "flotilla_agent::machine", Level::TRACE));
        assert!(!prints(&filter, "flotilla_agent::link", Level::ERROR));
        assert!(!prints(&filter, "flotilla_targets", Level::ERROR));
    }

    #[test]
    fn empty_prints_nothing() {
        for value in ["", ",", ",,"] {
            let (filter, warning) = parse(Some(value));
            assert!(warning.is_none(), "{value:?}");
            assert!(
                !prints(&filter, "flotilla_agent", Level::ERROR),
                "{value:?}"
            );
        }
    }

    #[test]
    fn span_directives_are_skipped_and_the_rest_applies() {
        let (filter, warning) = parse(Some(
            "warn,[fetch]=trace,flotilla_agent[step{action=\"a1\"}]=trace,[{peer=\"p\"}]=debug",
        ));
        assert!(warning.is_none());
        assert!(prints(&filter, "flotilla_agent", Level::WARN));
        assert!(!prints(&filter, "flotilla_agent", Level::INFO));
        assert!(!prints(&filter, "rumqttc", Level::DEBUG));
    }

    /// Every event [`emit_all`] sends that `filter` lets through, as "target level fields".
    fn seen_through<L>(filter: L) -> Vec<String>
    where
        L: tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync + 'static,
    {
        use std::sync::{Arc, Mutex};
        use tracing_subscriber::layer::SubscriberExt as _;

        struct Record(Arc<Mutex<Vec<String>>>);
        impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Record {
            fn on_event(
                &self,
                event: &tracing::Event<'_>,
                _: tracing_subscriber::layer::Context<'_, S>,
            ) {
                let meta = event.metadata();
                let fields: Vec<&str> = meta.fields().iter().map(|f| f.name()).collect();
                let line = format!("{} {} {}", meta.target(), meta.level(), fields.join(" "));
                self.0.lock().expect("record").push(line);
            }
        }

        let seen = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry()
            .with(filter)
            .with(Record(seen.clone()));
        tracing::subscriber::with_default(subscriber, emit_all);
        let seen = seen.lock().expect("record").clone();
        seen
    }

    /// One event at every level for a few targets the agent logs under, some with the fields
    /// the agent's events carry.
    fn emit_all() {
        macro_rules! at_every_level {
            ($target:literal $(, $field:ident = $value:literal)*) => {
                tracing::event!(target: $target, Level::TRACE, $($field = $value,)* "m");
                tracing::event!(target: $target, Level::DEBUG, $($field = $value,)* "m");
                tracing::event!(target: $target, Level::INFO, $($field = $value,)* "m");
                tracing::event!(target: $target, Level::WARN, $($field = $value,)* "m");
                tracing::event!(target: $target, Level::ERROR, $($field = $value,)* "m");
            };
        }
        at_every_level!("flotilla_agent");
        at_every_level!("flotilla_agent::link");
        at_every_level!("flotilla_agent::fetch_blocks", artifact = "app");
        at_every_level!("flotilla_agent::machine", artifact = "app", attempt = 2);
        at_every_level!("flotilla_targets::script");
    }

    /// The agent's filter lets through exactly the events `EnvFilter` (what the agent used
    /// before decision 0032, and what the coordinator uses) lets through, for the directives a
    /// user writes and the ones that only select spans.
    #[test]
    fn the_same_events_pass_as_through_env_filter() {
        use tracing_subscriber::EnvFilter;
        let values = [
            "info",
            "warn",
            "TRACE",
            "off",
            "flotilla_agent=debug",
            "warn,flotilla_agent::fetch_blocks=debug",
            "error,flotilla_targets=info,flotilla_agent::link=trace",
            "flotilla_agent",
            "flotilla_agent,flotilla_agent::link=off",
            "warn,[{artifact}]=debug",
            "info,flotilla_agent::machine[{attempt}]=trace",
            "warn,[fetch]=trace",
            "warn,flotilla_agent[step{action=\"a1\"}]=trace,[{peer=\"p\"}]=debug",
            "",
            ",",
        ];
        for value in values {
            let (filter, warning) = parse(Some(value));
            assert!(warning.is_none(), "{value:?}");
            let env_filter = EnvFilter::builder()
                .parse(value)
                .expect("EnvFilter parses it");
            assert_eq!(
                seen_through(filter),
                seen_through(env_filter),
                "RUST_LOG={value:?}"
            );
        }
        // Unset, and a value that does not parse: both were `EnvFilter::new("info")`.
        for value in [None, Some("warn,flotilla_agent=loud")] {
            assert_eq!(
                seen_through(parse(value).0),
                seen_through(EnvFilter::new("info")),
                "RUST_LOG={value:?}"
            );
        }
    }

    #[test]
    fn a_bad_directive_falls_back_to_info_with_a_warning() {
        let (filter, warning) = parse(Some("warn,flotilla_agent=loud"));
        let warning = warning.expect("a warning");
        assert!(warning.contains("RUST_LOG"), "{warning}");
        assert!(prints(&filter, "flotilla_agent", Level::INFO));
        assert!(!prints(&filter, "flotilla_agent", Level::DEBUG));
    }
}
