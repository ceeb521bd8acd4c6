//! Pages of the list commands (`list_devices`, `rollout_status`, `pending_devices`): how many
//! items a page holds, where it ends, and the cursor of the next one.
//!
//! A cursor is the key of the last item a page holds (a device id, a rollout name), and the
//! next page starts after it in key order. Lists are read from sorted maps, so an item that
//! joins or leaves between two pages changes neither which of the others the next page holds
//! nor their order: nothing that stayed repeats or goes missing. An offset would shift by one
//! for every device that came or went before it.
//!
//! A page ends at the requested size (capped at [`MAX_PAGE_LIMIT`]) or where one more item
//! would make the reply larger than one message may carry ([`MAX_PACKET_SIZE`]), whichever
//! comes first, so a page always fits whatever the items weigh.
//!
//! ```
//! use flotilla_coordinator::service::page::Pager;
//! use flotilla_protocol::control::PageQuery;
//! let pager = Pager::new(&PageQuery::first(2), 0).expect("valid");
//! let page = pager.collect(["a", "b", "c"].into_iter(), |s| s.to_string());
//! assert_eq!((page.items, page.next.as_deref()), (vec!["a", "b"], Some("b")));
//! ```

use flotilla_protocol::control::{Page, PageQuery, DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT};
use flotilla_protocol::MAX_PACKET_SIZE;

/// Room in a message for what surrounds the items: the reply's id, `ok`, the field names and
/// the cursor (an id of at most a few hundred bytes).
const ENVELOPE_BYTES: usize = 4 * 1024;

/// How one page is cut: at most `limit` items in at most `budget` bytes of JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pager {
    pub limit: usize,
    pub budget: usize,
}

impl Pager {
    /// The pager for `query`, when `reserved` bytes of the reply are taken by other fields
    /// (the rollout's status beside its devices). A limit of 0 is refused; a larger one than
    /// [`MAX_PAGE_LIMIT`] is lowered to it.
    pub fn new(query: &PageQuery, reserved: usize) -> Result<Pager, String> {
        let limit = match query.limit {
            Some(0) => return Err("limit: 0 is not a page size; ask for 1 or more".to_owned()),
            Some(n) => n.min(MAX_PAGE_LIMIT),
            None => DEFAULT_PAGE_LIMIT,
        };
        let budget = MAX_PACKET_SIZE.saturating_sub(reserved + ENVELOPE_BYTES);
        Ok(Pager { limit, budget })
    }

    /// The first items of `items` (already after the cursor and filtered) that fit, and the
    /// cursor after the last of them when more follow. An item too large for a page on its own
    /// still makes a page of one, which the reply check then refuses with its size.
    pub fn collect<T: serde::Serialize>(
        &self,
        items: impl Iterator<Item = T>,
        key: impl Fn(&T) -> String,
    ) -> Page<T> {
        let mut page = Vec::new();
        // `[]` and a comma between items.
        let mut bytes = 2;
        let mut items = items.peekable();
        while let Some(item) = items.peek() {
            let size = serde_json::to_vec(item).map_or(0, |v| v.len()) + 1;
            let full = page.len() >= self.limit || (!page.is_empty() && bytes + size > self.budget);
            if full {
                break;
            }
            bytes += size;
            page.extend(items.next());
        }
        let next = match (items.peek(), page.last()) {
            (Some(_), Some(last)) => Some(key(last)),
            _ => None,
        };
        Page { items: page, next }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::ops::Bound;

    use super::*;

    /// Pages through `fleet` (id -> phase) with `limit`, letting `between` change the fleet
    /// after every page, and returns every id in the order the pages held them.
    fn page_through(
        fleet: &mut BTreeMap<String, String>,
        limit: usize,
        phase: Option<&str>,
        mut between: impl FnMut(usize, &mut BTreeMap<String, String>),
    ) -> Vec<String> {
        let pager = Pager::new(&PageQuery::first(limit), 0).expect("valid");
        let mut after: Option<String> = None;
        let mut seen = Vec::new();
        for n in 0.. {
            let start = after.clone().map_or(Bound::Unbounded, Bound::Excluded);
            let page = pager.collect(
                fleet
                    .range((start, Bound::Unbounded))
                    .filter(|(_, p)| phase.is_none_or(|want| p.as_str() == want))
                    .map(|(id, _)| id.clone()),
                |id| id.clone(),
            );
            assert!(page.items.len() <= limit, "page {n} over its limit");
            seen.extend(page.items);
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
            between(n, fleet);
        }
        seen
    }

    fn fleet(n: usize) -> BTreeMap<String, String> {
        (0..n)
            .map(|i| {
                let phase = if i % 3 == 0 { "failed" } else { "ready" };
                (format!("dev-{i:05}"), phase.to_owned())
            })
            .collect()
    }

    #[test]
    fn pages_add_up_to_the_list_in_id_order() {
        let mut all = fleet(1234);
        let seen = page_through(&mut all, 100, None, |_, _| {});
        assert_eq!(seen, all.keys().cloned().collect::<Vec<_>>());
        // An exact multiple of the page size ends without an empty last page.
        let mut even = fleet(300);
        let pager = Pager::new(&PageQuery::first(100), 0).expect("valid");
        let last = pager.collect(even.keys().skip(200).cloned(), |id| id.clone());
        assert_eq!((last.items.len(), last.next), (100, None));
        assert_eq!(page_through(&mut even, 100, None, |_, _| {}).len(), 300);
    }

    #[test]
    fn devices_that_come_and_go_between_pages_neither_repeat_nor_hide_the_others() {
        let mut all = fleet(1000);
        let before = all.clone();
        let mut removed = Vec::new();
        let seen = page_through(&mut all, 64, None, |n, fleet| {
            // After every page: a device already listed leaves, one not yet listed leaves, a
            // new one joins ahead of the cursor and one behind it.
            let listed = format!("dev-{:05}", n * 64);
            let ahead = format!("dev-{:05}", 999 - n);
            fleet.remove(&listed);
            if fleet.remove(&ahead).is_some() {
                removed.push(ahead);
            }
            fleet.insert(format!("dev-{:05}a", n * 64 + 1), "ready".into());
            fleet.insert(format!("dev-{:05}b", 998 - n), "ready".into());
        });
        let mut unique = seen.clone();
        unique.dedup();
        assert_eq!(unique.len(), seen.len(), "a device repeated");
        // Every device present from start to end was listed once, in order.
        let stayed: Vec<&String> = before.keys().filter(|id| all.contains_key(*id)).collect();
        let listed: Vec<&String> = seen.iter().filter(|id| stayed.contains(id)).collect();
        assert_eq!(listed, stayed);
        // What left before its turn is not listed; what joined ahead of the cursor is.
        assert!(removed.iter().all(|id| !seen.contains(id)));
        assert!(seen.contains(&"dev-00998b".to_owned()));
    }

    #[test]
    fn filters_apply_before_the_page_is_cut() {
        let mut all = fleet(1000);
        let failed = page_through(&mut all, 50, Some("failed"), |_, _| {});
        assert_eq!(failed.len(), 334);
        assert!(failed.iter().all(|id| all[id] == "failed"));
        assert!(page_through(&mut all, 50, Some("canceled"), |_, _| {}).is_empty());
    }

    #[test]
    fn a_page_stops_before_it_outgrows_a_message() {
        let pager = Pager::new(&PageQuery::first(MAX_PAGE_LIMIT), 1000).expect("valid");
        let big = "x".repeat(1000);
        let page = pager.collect((0..1000).map(|i| format!("{i:04}{big}")), |s| s[..4].into());
        let bytes = serde_json::to_vec(&page).expect("encodes").len();
        assert!(bytes + 1000 <= MAX_PACKET_SIZE, "{bytes} bytes");
        assert!(page.items.len() > 200 && page.items.len() < 1000);
        assert_eq!(
            page.next.as_deref(),
            Some(&page.items.last().expect("some")[..4])
        );
    }

    #[test]
    fn page_sizes_are_capped_and_zero_is_refused() {
        assert_eq!(
            Pager::new(&PageQuery::first(1_000_000), 0)
                .expect("valid")
                .limit,
            MAX_PAGE_LIMIT
        );
        assert_eq!(
            Pager::new(&PageQuery::default(), 0).expect("valid").limit,
            DEFAULT_PAGE_LIMIT
        );
        let err = Pager::new(&PageQuery::first(0), 0).expect_err("zero");
        assert!(err.starts_with("limit: 0"), "{err}");
    }
}
