//! Log lines in proportion to events, not to calls: a kind of line (a store error, a
//! fallback) is written at most a few times a second per tool; the lines held back are counted
//! and said with the next line written. The metrics count every one.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use arc_swap::ArcSwap;

/// Lines of one kind written per tool and second at most.
const PER_SECOND: u32 = 2;
/// Kinds × tools tracked at most (more forget them all and start over).
const MAX_TRACKED: usize = 4096;

/// One kind of line for one tool, this second.
struct Slot {
    second: u64,
    written: u32,
    held_back: u64,
}

struct Gate {
    started: Instant,
    slots: Mutex<HashMap<(&'static str, String), Slot>>,
}

fn gate() -> &'static Gate {
    static GATE: OnceLock<Gate> = OnceLock::new();
    GATE.get_or_init(|| Gate {
        started: Instant::now(),
        slots: Mutex::new(HashMap::new()),
    })
}

/// Whether a line of `kind` about `tool` is to be written now: `Some(n)`, with how many
/// were held back since the last one written, or `None` when it is held back itself.
pub(crate) fn let_through(kind: &'static str, tool: &str) -> Option<u64> {
    let g = gate();
    let second = g.started.elapsed().as_secs();
    let mut slots = g.slots.lock().unwrap_or_else(|e| e.into_inner());
    if slots.len() >= MAX_TRACKED && !slots.contains_key(&(kind, tool.to_owned())) {
        slots.clear();
    }
    let slot = slots.entry((kind, tool.to_owned())).or_insert(Slot {
        second,
        written: 0,
        held_back: 0,
    });
    if slot.second != second {
        slot.second = second;
        slot.written = 0;
    }
    if slot.written >= PER_SECOND {
        slot.held_back += 1;
        return None;
    }
    slot.written += 1;
    Some(std::mem::take(&mut slot.held_back))
}

/// Path prefixes (first segments) remembered at most: past them, no more first lines.
const MAX_PREFIXES: usize = 256;

/// Whether `path`'s first segment (`/health` of `/health/live`) is seen for the first time.
/// The prefixes seen are read without a lock: a request of a prefix seen before (nearly every
/// one) looks it up in a set that is copied only to add a prefix.
pub(crate) fn first_of_prefix(path: &str) -> bool {
    type Seen = HashSet<Box<str>, foldhash::fast::RandomState>;
    static SEEN: OnceLock<ArcSwap<Seen>> = OnceLock::new();
    let prefix = match path.get(1..).and_then(|p| p.find('/')) {
        Some(end) => &path[..end + 1],
        None => path,
    };
    let seen = SEEN.get_or_init(Default::default);
    let full = |s: &Seen| s.len() >= MAX_PREFIXES || s.contains(prefix);
    if full(&seen.load()) {
        return false;
    }
    let mut first = false;
    seen.rcu(|s| {
        first = !full(s);
        let mut next = Seen::clone(s);
        if first {
            next.insert(prefix.into());
        }
        next
    });
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flood of one kind of line about one tool lets a few through a second; the next
    /// line through says how many were held back; another tool or kind has its own count.
    #[test]
    fn a_flood_of_lines_lets_a_few_through_and_counts_the_rest() {
        let through = (0..1000)
            .filter(|_| let_through("test-flood", "t").is_some())
            .count();
        // Two a second (the loop may straddle a second).
        assert!((2..=4).contains(&through), "{through}");
        assert_eq!(let_through("test-flood", "other"), Some(0));
        assert_eq!(let_through("test-other-kind", "t"), Some(0));
    }

    /// A path prefix is said once, whatever follows it.
    #[test]
    fn each_path_prefix_is_first_once() {
        assert!(first_of_prefix("/gate-test/a"));
        assert!(!first_of_prefix("/gate-test/b?x=1"));
        assert!(!first_of_prefix("/gate-test"));
        assert!(first_of_prefix("/gate-test-2"));
    }
}
