//! Shared copies of the strings many devices repeat (hardware ids, label keys and values,
//! release and rollout names): the registry keeps one copy of each instead of one per device.

use std::collections::HashSet;
use std::sync::Arc;

/// The strings in use, each once. Strings no device holds any more are let go when the set has
/// doubled since the last look, so a fleet whose labels change keeps no more than twice what it
/// uses.
#[derive(Debug, Default)]
pub(crate) struct Names {
    set: HashSet<Arc<str>>,
    /// The set's size after the last sweep.
    swept: usize,
}

impl Names {
    /// The shared copy of `text`.
    pub fn get(&mut self, text: &str) -> Arc<str> {
        if let Some(name) = self.set.get(text) {
            return name.clone();
        }
        if self.set.len() >= 2 * self.swept.max(1024) {
            self.set.retain(|name| Arc::strong_count(name) > 1);
            self.swept = self.set.len();
        }
        let name: Arc<str> = Arc::from(text);
        self.set.insert(name.clone());
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_copy_per_string_and_unused_ones_are_let_go() {
        let mut names = Names::default();
        let a = names.get("site");
        let b = names.get("site");
        assert!(Arc::ptr_eq(&a, &b));
        for i in 0..5000 {
            names.get(&format!("label-{i}"));
        }
        // Nothing holds the labels: the set never grew past twice its floor.
        assert!(names.set.len() <= 2048, "{}", names.set.len());
        assert!(Arc::ptr_eq(&a, &names.get("site")));
    }
}
