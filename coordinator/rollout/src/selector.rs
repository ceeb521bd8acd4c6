//! Label selectors, as in Kubernetes: which devices a rollout or a group applies to.
//!
//! Grammar (whitespace is allowed around every token; a comma separates requirements and they
//! must all hold; commas inside parentheses belong to the set):
//!
//! ```text
//! env=prod   env==prod   env!=prod   env in (a,b)   env notin (a)   key   !key
//! ```
//!
//! `!=` and `notin` also match devices that do not carry the label at all, as in Kubernetes, so
//! "everything except prod" includes unlabelled devices. The empty selector matches every device.
//! A selector prints in a canonical form that parses back to the same selector, which is how it is
//! stored with a rollout.
//!
//! ```
//! use std::collections::BTreeMap;
//! use flotilla_rollout::selector::Selector;
//!
//! let sel = Selector::parse("hw=pi4, env in (canary, beta), !quarantined").unwrap();
//! let labels = BTreeMap::from([("hw".to_string(), "pi4".to_string()), ("env".to_string(), "beta".to_string())]);
//! assert!(sel.matches(&labels));
//! assert_eq!(sel.to_string(), "hw=pi4,env in (canary,beta),!quarantined");
//! ```

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A parsed label selector: a conjunction of requirements.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

/// One condition on one label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    /// `key=value`: the label is present with this value.
    Equals { key: String, value: String },
    /// `key!=value`: the label is absent or has another value.
    NotEquals { key: String, value: String },
    /// `key in (a,b)`: the label is present with one of these values.
    In { key: String, values: Vec<String> },
    /// `key notin (a,b)`: the label is absent or has none of these values.
    NotIn { key: String, values: Vec<String> },
    /// `key`: the label is present, whatever its value.
    Exists { key: String },
    /// `!key`: the label is absent.
    NotExists { key: String },
}

/// Why a selector did not parse. Positions are 0-based byte offsets into the selector text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    #[error("selector {input:?}: expected {expected} at position {position}, found {found:?}")]
    Unexpected {
        input: String,
        position: usize,
        expected: &'static str,
        found: String,
    },
    #[error("selector {input:?}: expected {expected} at position {position}, found the end")]
    UnexpectedEnd {
        input: String,
        position: usize,
        expected: &'static str,
    },
    #[error("selector {input:?}: the set for {key:?} at position {position} is empty")]
    EmptySet {
        input: String,
        position: usize,
        key: String,
    },
}

impl Selector {
    /// The selector that matches every device.
    pub fn everything() -> Self {
        Self::default()
    }

    /// Parses a selector; see the module documentation for the grammar.
    pub fn parse(input: &str) -> Result<Self, SelectorError> {
        Parser { input, pos: 0 }.selector()
    }

    /// Whether this selector matches nothing more than "every device".
    pub fn is_everything(&self) -> bool {
        self.requirements.is_empty()
    }

    pub fn requirements(&self) -> &[Requirement] {
        &self.requirements
    }

    /// Whether a device with these labels is selected.
    pub fn matches<L: Labels + ?Sized>(&self, labels: &L) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }
}

/// A device's labels as a selector reads them: a value by key. A `BTreeMap` is the usual
/// holder; the offline tools keep a million devices' labels in a more compact form.
pub trait Labels {
    /// The value of label `key`, if the device carries it.
    fn label(&self, key: &str) -> Option<&str>;
}

impl Labels for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

impl Requirement {
    pub fn matches<L: Labels + ?Sized>(&self, labels: &L) -> bool {
        let in_set = |values: &[String], v: &str| values.iter().any(|x| x == v);
        match self {
            Requirement::Equals { key, value } => labels.label(key) == Some(value),
            Requirement::NotEquals { key, value } => labels.label(key) != Some(value),
            Requirement::In { key, values } => labels.label(key).is_some_and(|v| in_set(values, v)),
            Requirement::NotIn { key, values } => {
                !labels.label(key).is_some_and(|v| in_set(values, v))
            }
            Requirement::Exists { key } => labels.label(key).is_some(),
            Requirement::NotExists { key } => labels.label(key).is_none(),
        }
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Requirement::Equals { key, value } => write!(f, "{key}={value}"),
            Requirement::NotEquals { key, value } => write!(f, "{key}!={value}"),
            Requirement::In { key, values } => write!(f, "{key} in ({})", values.join(",")),
            Requirement::NotIn { key, values } => write!(f, "{key} notin ({})", values.join(",")),
            Requirement::Exists { key } => write!(f, "{key}"),
            Requirement::NotExists { key } => write!(f, "!{key}"),
        }
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.requirements.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Selector {
    type Err = SelectorError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

// Stored as its canonical text: readable in the JSON store and independent of the enum layout.
impl Serialize for Selector {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Selector {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Selector::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// Characters allowed in label keys and values: Kubernetes' set plus `/` (prefixed keys) and `:`.
pub(crate) fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/' | ':')
}

struct Parser<'a> {
    input: &'a str,
    pos: usize,
}

impl Parser<'_> {
    fn rest(&self) -> &str {
        &self.input[self.pos..]
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn skip_ws(&mut self) {
        let trimmed = self.rest().trim_start();
        self.pos = self.input.len() - trimmed.len();
    }

    fn eat(&mut self, s: &str) -> bool {
        if self.rest().starts_with(s) {
            self.pos += s.len();
            true
        } else {
            false
        }
    }

    fn error(&self, expected: &'static str) -> SelectorError {
        match self.peek() {
            None => SelectorError::UnexpectedEnd {
                input: self.input.to_owned(),
                position: self.pos,
                expected,
            },
            Some(_) => {
                // Show the offending token, not the whole remainder.
                let found: String = self
                    .rest()
                    .chars()
                    .take_while(|c| !c.is_whitespace())
                    .take(16)
                    .collect();
                let found = if found.is_empty() {
                    self.rest().chars().take(1).collect()
                } else {
                    found
                };
                SelectorError::Unexpected {
                    input: self.input.to_owned(),
                    position: self.pos,
                    expected,
                    found,
                }
            }
        }
    }

    fn word(&mut self, expected: &'static str) -> Result<String, SelectorError> {
        let len: usize = self
            .rest()
            .chars()
            .take_while(|c| is_word_char(*c))
            .map(char::len_utf8)
            .sum();
        if len == 0 {
            return Err(self.error(expected));
        }
        let word = self.rest()[..len].to_owned();
        self.pos += len;
        Ok(word)
    }

    fn selector(mut self) -> Result<Selector, SelectorError> {
        let mut requirements = Vec::new();
        self.skip_ws();
        if self.peek().is_none() {
            return Ok(Selector { requirements });
        }
        loop {
            requirements.push(self.requirement()?);
            self.skip_ws();
            match self.peek() {
                None => return Ok(Selector { requirements }),
                Some(',') => {
                    self.pos += 1;
                    self.skip_ws();
                }
                Some(_) => return Err(self.error("',' or the end")),
            }
        }
    }

    fn requirement(&mut self) -> Result<Requirement, SelectorError> {
        if self.eat("!") {
            self.skip_ws();
            let key = self.word("a label key")?;
            return Ok(Requirement::NotExists { key });
        }
        let key = self.word("a label key")?;
        self.skip_ws();
        if self.eat("!=") {
            self.skip_ws();
            let value = self.word("a label value")?;
            return Ok(Requirement::NotEquals { key, value });
        }
        if self.eat("==") || self.eat("=") {
            self.skip_ws();
            let value = self.word("a label value")?;
            return Ok(Requirement::Equals { key, value });
        }
        match self.peek() {
            None | Some(',') => return Ok(Requirement::Exists { key }),
            _ => {}
        }
        let op_pos = self.pos;
        let op = self.word("'=', '!=', 'in', 'notin', ',' or the end")?;
        let negated = match op.as_str() {
            "in" => false,
            "notin" => true,
            _ => {
                self.pos = op_pos;
                return Err(self.error("'=', '!=', 'in', 'notin', ',' or the end"));
            }
        };
        let values = self.set(&key)?;
        Ok(if negated {
            Requirement::NotIn { key, values }
        } else {
            Requirement::In { key, values }
        })
    }

    fn set(&mut self, key: &str) -> Result<Vec<String>, SelectorError> {
        self.skip_ws();
        let open = self.pos;
        if !self.eat("(") {
            return Err(self.error("'('"));
        }
        self.skip_ws();
        if self.eat(")") {
            return Err(SelectorError::EmptySet {
                input: self.input.to_owned(),
                position: open,
                key: key.to_owned(),
            });
        }
        let mut values = Vec::new();
        loop {
            values.push(self.word("a label value")?);
            self.skip_ws();
            if self.eat(")") {
                return Ok(values);
            }
            if !self.eat(",") {
                return Err(self.error("',' or ')'"));
            }
            self.skip_ws();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn sel(s: &str) -> Selector {
        Selector::parse(s).unwrap_or_else(|e| panic!("{s:?} should parse: {e}"))
    }

    #[test]
    fn empty_and_blank_selectors_match_everything() {
        for s in ["", "   ", "\t"] {
            let sel = sel(s);
            assert!(sel.is_everything());
            assert!(sel.matches(&labels(&[])));
            assert!(sel.matches(&labels(&[("env", "prod")])));
            assert_eq!(sel.to_string(), "");
        }
    }

    #[test]
    fn equality_and_inequality() {
        let prod = labels(&[("env", "prod")]);
        let dev = labels(&[("env", "dev")]);
        let none = labels(&[]);
        assert!(sel("env=prod").matches(&prod));
        assert!(sel("env==prod").matches(&prod));
        assert!(!sel("env=prod").matches(&dev));
        assert!(!sel("env=prod").matches(&none));
        assert!(!sel("env!=prod").matches(&prod));
        assert!(sel("env!=prod").matches(&dev));
        // As in Kubernetes, != also selects devices without the label.
        assert!(sel("env!=prod").matches(&none));
    }

    #[test]
    fn set_membership() {
        let a = labels(&[("env", "a")]);
        let c = labels(&[("env", "c")]);
        let none = labels(&[]);
        assert!(sel("env in (a,b)").matches(&a));
        assert!(!sel("env in (a,b)").matches(&c));
        assert!(!sel("env in (a,b)").matches(&none));
        assert!(!sel("env notin (a)").matches(&a));
        assert!(sel("env notin (a)").matches(&c));
        assert!(sel("env notin (a)").matches(&none));
    }

    #[test]
    fn existence() {
        let q = labels(&[("quarantined", "")]);
        let none = labels(&[]);
        assert!(sel("quarantined").matches(&q));
        assert!(!sel("quarantined").matches(&none));
        assert!(!sel("!quarantined").matches(&q));
        assert!(sel("!quarantined").matches(&none));
    }

    #[test]
    fn commas_are_and_except_inside_sets() {
        let s = sel("hw=pi4, env in (canary, beta), !quarantined");
        assert_eq!(s.requirements().len(), 3);
        assert!(s.matches(&labels(&[("hw", "pi4"), ("env", "beta")])));
        assert!(!s.matches(&labels(&[("hw", "pi3"), ("env", "beta")])));
        assert!(!s.matches(&labels(&[("hw", "pi4"), ("env", "prod")])));
        assert!(!s.matches(&labels(&[
            ("hw", "pi4"),
            ("env", "beta"),
            ("quarantined", "yes")
        ])));
    }

    #[test]
    fn whitespace_is_tolerated_everywhere() {
        let tight = sel("env in(a,b),hw!=pi3,x");
        let loose = sel("  env   in  ( a ,  b )  ,  hw  !=  pi3 ,  x  ");
        assert_eq!(tight, loose);
        assert_eq!(sel("env = prod"), sel("env=prod"));
        assert_eq!(sel("! key"), sel("!key"));
    }

    #[test]
    fn display_round_trips() {
        for s in [
            "env=prod",
            "env!=prod",
            "env in (a,b)",
            "env notin (a)",
            "key",
            "!key",
            "example.com/tier=edge,zone in (eu-1,eu-2),!broken,fw-rev notin (1.0,1.1)",
        ] {
            let parsed = sel(s);
            assert_eq!(parsed.to_string(), s);
            assert_eq!(sel(&parsed.to_string()), parsed);
        }
        assert_eq!(sel(" env == prod , x ").to_string(), "env=prod,x");
    }

    #[test]
    fn serde_uses_the_canonical_text() {
        let s = sel("env in (a, b), !x");
        let json = serde_json::to_string(&s).expect("encodes");
        assert_eq!(json, r#""env in (a,b),!x""#);
        let back: Selector = serde_json::from_str(&json).expect("decodes");
        assert_eq!(back, s);
        let bad: Result<Selector, _> = serde_json::from_str(r#""env in ()""#);
        assert!(bad.is_err());
    }

    fn err(s: &str) -> String {
        match Selector::parse(s) {
            Ok(parsed) => panic!("{s:?} should not parse, got {parsed:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn errors_name_the_position_and_text() {
        let e = err("env=prod,");
        assert!(
            e.contains("position 9") && e.contains("label key") && e.contains("end"),
            "{e}"
        );
        let e = err("env=");
        assert!(e.contains("position 4") && e.contains("label value"), "{e}");
        let e = err("env in ()");
        assert!(
            e.contains("empty") && e.contains("\"env\"") && e.contains("position 7"),
            "{e}"
        );
        let e = err("env in (a,b");
        assert!(e.contains("',' or ')'") && e.contains("end"), "{e}");
        let e = err("env in a");
        assert!(e.contains("'('") && e.contains("\"a\""), "{e}");
        let e = err("env maybe (a)");
        assert!(e.contains("position 4") && e.contains("\"maybe\""), "{e}");
        let e = err("env=prod hw=pi4");
        assert!(e.contains("position 9") && e.contains("\"hw=pi4\""), "{e}");
        let e = err("=prod");
        assert!(e.contains("position 0") && e.contains("\"=prod\""), "{e}");
        let e = err("a,,b");
        assert!(e.contains("position 2"), "{e}");
        let e = err("env=pr*d");
        assert!(e.contains("position 6") && e.contains("*d"), "{e}");
        assert!(
            e.contains("\"env=pr*d\""),
            "the error quotes the selector: {e}"
        );
    }
}
