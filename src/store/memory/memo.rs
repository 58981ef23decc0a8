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

use std::sync::atomic::Ordering::Acquire;
use std::sync::Arc;

use super::ToolCell;
use crate::admission::engine::Plan;
use crate::admission::{Kept, Refusal};
use crate::store::CallKeys;

/// Sets of slots per shard: a call's set is picked by its hash, and it may sit in either slot
/// of the set (two callers whose hashes meet do not evict each other); a newer refusal takes
/// the slot of the same call, an empty one, or the one whose wait ends first.
const SETS: usize = 64;
const WAYS: usize = 2;

/// A shard's remembered refusals (no room taken until the first one).
#[derive(Default)]
pub(super) struct Memo {
    slots: Vec<Option<Box<Remembered>>>,
}

struct Remembered {
    keys: CallKeys,
    /// The tool's state, with its count of give-backs.
    cell: Arc<ToolCell>,
    /// The count of give-backs read before the call was decided.
    given_back: u64,
    kept: Kept,
}

/// The set of slots where a call's refusal is remembered, from its tenant's hash and its
/// instance's.
pub(super) fn set_of(tenant_hash: u64, instance_hash: u64) -> usize {
    // Bits the shard and its table do not index by.
    ((tenant_hash ^ instance_hash) >> 20) as usize % SETS
}

impl Memo {
    /// Whether a refusal was ever remembered here (until then a call looks for none).
    pub(super) fn holds_any(&self) -> bool {
        !self.slots.is_empty()
    }

    /// The refusal remembered for this call in its `set`, if it still stands at `plan.now`
    /// (`same` tells whether remembered keys are the call's).
    pub(super) fn recall(&mut self, set: usize, plan: &Plan<'_>) -> Option<Refusal> {
        let ways = self.slots.get_mut(set * WAYS..(set + 1) * WAYS)?;
        let kept = ways
            .iter_mut()
            .find(|k| k.as_deref().is_some_and(|r| super::keys_of(&r.keys, plan)))?;
        let r = kept.as_deref()?;
        if !r.kept.stands_for(plan) {
            return None;
        }
        if let Some(left) = r.kept.left_at(plan.now) {
            if r.cell.given_back.load(Acquire) == r.given_back {
                return Some(r.kept.again(left));
            }
        }
        // Over, or something was given back: decided afresh from now on.
        *kept = None;
        None
    }

    /// Remembers `refusal` of the call `plan` makes in its `set` for as long as it surely
    /// stands, if it names such a wait; `given_back` is the tool's count read before the call
    /// was decided.
    pub(super) fn remember(
        &mut self,
        set: usize,
        plan: &Plan<'_>,
        cell: &Arc<ToolCell>,
        given_back: u64,
        refusal: &Refusal,
    ) {
        let Some(kept) = Kept::new(refusal, plan) else {
            return;
        };
        if self.slots.is_empty() {
            self.slots.resize_with(SETS * WAYS, || None);
        }
        let ways = &mut self.slots[set * WAYS..(set + 1) * WAYS];
        // The same call's slot, else an empty one, else the one whose wait ends first.
        let at = ways
            .iter()
            .position(|k| k.as_deref().is_some_and(|r| super::keys_of(&r.keys, plan)))
            .or_else(|| ways.iter().position(Option::is_none))
            .unwrap_or_else(|| {
                (0..WAYS)
                    .min_by_key(|&w| ways[w].as_deref().map_or(0, |r| r.kept.until()))
                    .unwrap_or(0)
            });
        ways[at] = Some(Box::new(Remembered {
            keys: plan.keys(),
            cell: cell.clone(),
            given_back,
            kept,
        }));
    }

    /// Forgets the refusals whose wait is over at `now`.
    pub(super) fn sweep(&mut self, now: u64) {
        for s in &mut self.slots {
            if s.as_ref().is_some_and(|r| r.kept.until() <= now) {
                *s = None;
            }
        }
    }
}
