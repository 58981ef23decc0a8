//! Refusals the in-process store remembers: after a refusal with a sure wait (see
//! `Refusal::remember_for`), the same call is refused from here until that wait is over,
//! without deciding it again. A flood of calls that cannot pass costs a lookup each, not a
//! decision.
//!
//! A remembered refusal stands only for the same call: the same keys, cost and tool policy
//! (a reload decides afresh), at an instant between the refusal and the end of its sure wait,
//! and while nothing was given back to the tool (a refund, a correction downwards, a permit
//! or a lease returned: each bumps the tool's count of give-backs, and a refusal remembered
//! under an older count is forgotten).
//!
//! The memo keeps locks of its own, apart from the tools': a flood of remembered refusals
//! never takes its tool's lock. Each slot also shows the tag of the call it holds (a hash of
//! the call's names) to anyone without a lock, so a call with nothing remembered takes no lock
//! here at all; a call whose tag is shown takes the slot's lock and compares the names.

use std::sync::atomic::{
    AtomicU64, AtomicUsize,
    Ordering::{Acquire, Relaxed},
};
use std::sync::{Arc, Mutex};

use super::{keys_of, lock, Padded};
use crate::admission::engine::Plan;
use crate::admission::{Kept, Refusal};
use crate::store::CallKeys;

/// Sets of slots per lock: a call's set is picked by its tag, and it may sit in either slot of
/// the set (two callers whose tags meet do not evict each other); a newer refusal takes the
/// slot of the same call, an empty one, or the one whose wait ends first.
const SETS: usize = 64;
const WAYS: usize = 2;

/// The refusals remembered for a store's calls.
pub(super) struct Memo {
    /// Each lock's slots.
    locks: Box<[Padded<Mutex<Slots>>]>,
    /// The tag of the call in each slot (0: empty), read without a lock.
    tags: Box<[AtomicU64]>,
    /// How many slots hold a refusal: while none does, a call looks for none.
    held: AtomicUsize,
}

/// A lock's slots, `SETS` × `WAYS` (no room taken until its first refusal).
type Slots = Vec<Option<Box<Remembered>>>;

struct Remembered {
    keys: CallKeys,
    /// The tool's count of give-backs, and its value read before the call was decided.
    given_back: Arc<AtomicU64>,
    count: u64,
    kept: Kept,
}

/// A call's tag: never 0 (an empty slot's).
pub(super) fn tag(hash: u64) -> u64 {
    hash | 1
}

impl Memo {
    /// A memo of `locks` locks (a power of two).
    pub(super) fn new(locks: usize) -> Memo {
        Memo {
            locks: (0..locks).map(|_| Padded(Mutex::default())).collect(),
            tags: (0..locks * SETS * WAYS)
                .map(|_| AtomicU64::new(0))
                .collect(),
            held: AtomicUsize::new(0),
        }
    }

    /// Whether any refusal is remembered.
    pub(super) fn holds_any(&self) -> bool {
        self.held.load(Relaxed) > 0
    }

    /// Sets the tag of slot `at` (of all), keeping count of the slots that hold one.
    fn set_tag(&self, at: usize, tag: u64) {
        let was = self.tags[at].swap(tag, Relaxed);
        match (was, tag) {
            (0, t) if t != 0 => self.held.fetch_add(1, Relaxed),
            (w, 0) if w != 0 => self.held.fetch_sub(1, Relaxed),
            _ => 0,
        };
    }

    /// The lock and the first slot (within the lock's, and among all) of `tag`'s set: bits of
    /// the hash that the tag's own low bit does not set.
    fn place(&self, tag: u64) -> (usize, usize, usize) {
        let set = (tag >> 8) as usize % SETS;
        let at = (tag >> 16) as usize & (self.locks.len() - 1);
        (at, set * WAYS, (at * SETS + set) * WAYS)
    }

    /// The refusal remembered for the call `plan` makes (tagged `tag`), if it still stands at
    /// `plan.now`.
    pub(super) fn recall(&self, tag: u64, plan: &Plan<'_>) -> Option<Refusal> {
        let (at, first, global) = self.place(tag);
        let tags = &self.tags[global..global + WAYS];
        if !tags.iter().any(|t| t.load(Relaxed) == tag) {
            return None;
        }
        let mut slots = lock(&self.locks[at].0);
        let ways = slots.get_mut(first..first + WAYS)?;
        let w = ways
            .iter()
            .position(|k| k.as_deref().is_some_and(|r| keys_of(&r.keys, plan)))?;
        let r = ways[w].as_deref()?;
        if !r.kept.stands_for(plan) {
            return None;
        }
        if let Some(left) = r.kept.left_at(plan.now) {
            if r.given_back.load(Acquire) == r.count {
                return Some(r.kept.again(left));
            }
        }
        // Over, or something was given back: decided afresh from now on.
        ways[w] = None;
        self.set_tag(global + w, 0);
        None
    }

    /// Remembers `refusal` of the call `plan` makes (tagged `tag`) for as long as it surely
    /// stands, if it names such a wait; `count` is the tool's count of give-backs read before
    /// the call was decided.
    pub(super) fn remember(
        &self,
        tag: u64,
        plan: &Plan<'_>,
        given_back: &Arc<AtomicU64>,
        count: u64,
        refusal: &Refusal,
    ) {
        let Some(kept) = Kept::new(refusal, plan) else {
            return;
        };
        let (at, first, global) = self.place(tag);
        let mut slots = lock(&self.locks[at].0);
        if slots.is_empty() {
            slots.resize_with(SETS * WAYS, || None);
        }
        let ways = &mut slots[first..first + WAYS];
        // The same call's slot, else an empty one, else the one whose wait ends first.
        let w = ways
            .iter()
            .position(|k| k.as_deref().is_some_and(|r| keys_of(&r.keys, plan)))
            .or_else(|| ways.iter().position(Option::is_none))
            .unwrap_or_else(|| {
                (0..WAYS)
                    .min_by_key(|&w| ways[w].as_deref().map_or(0, |r| r.kept.until()))
                    .unwrap_or(0)
            });
        ways[w] = Some(Box::new(Remembered {
            keys: plan.keys(),
            given_back: given_back.clone(),
            count,
            kept,
        }));
        self.set_tag(global + w, tag);
    }

    /// Forgets the refusals whose wait is over at `now`.
    pub(super) fn sweep(&self, now: u64) {
        for (at, l) in self.locks.iter().enumerate() {
            let mut slots = lock(&l.0);
            for (i, s) in slots.iter_mut().enumerate() {
                if s.as_ref().is_some_and(|r| r.kept.until() <= now) {
                    *s = None;
                    self.set_tag(at * SETS * WAYS + i, 0);
                }
            }
        }
    }
}
