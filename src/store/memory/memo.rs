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
use std::time::Duration;

use super::ToolCell;
use crate::admission::engine::Plan;
use crate::admission::Refusal;
use crate::policy::ToolPolicy;
use crate::store::CallKeys;

/// Slots per shard: a call's slot is picked by its hash, and a newer refusal takes the slot
/// of an older one.
const SLOTS: usize = 32;

/// A shard's remembered refusals (no room taken until the first one).
#[derive(Default)]
pub(super) struct Memo {
    slots: Vec<Option<Box<Remembered>>>,
}

struct Remembered {
    keys: CallKeys,
    /// The policy the refusal was decided under.
    policy: Arc<ToolPolicy>,
    /// The tool's state, with its count of give-backs.
    cell: Arc<ToolCell>,
    /// The count of give-backs read before the call was decided.
    given_back: u64,
    cost: f64,
    /// Valid from `from` until `until` (µs of the plan's clock).
    from: u64,
    until: u64,
    refusal: Refusal,
}

/// Where a call's refusal is remembered, from its tenant's hash and its instance's.
pub(super) fn slot(tenant_hash: u64, instance_hash: u64) -> usize {
    // Bits the shard and its table do not index by.
    ((tenant_hash ^ instance_hash) >> 20) as usize % SLOTS
}

impl Memo {
    /// Whether a refusal was ever remembered here (until then a call looks for none).
    pub(super) fn holds_any(&self) -> bool {
        !self.slots.is_empty()
    }

    /// The refusal remembered for this call in `slot`, if it still stands at `plan.now`
    /// (`same` tells whether remembered keys are the call's).
    pub(super) fn recall(
        &mut self,
        slot: usize,
        plan: &Plan<'_>,
        same: impl FnOnce(&CallKeys) -> bool,
    ) -> Option<Refusal> {
        let kept = self.slots.get_mut(slot)?;
        let r = kept.as_deref()?;
        if !same(&r.keys) || !Refusal::stands_for(&r.policy, r.cost, plan) {
            return None;
        }
        let now = plan.now.as_micros();
        if now >= r.from && now < r.until && r.cell.given_back.load(Acquire) == r.given_back {
            return Some(r.refusal.again(Duration::from_micros(r.until - now)));
        }
        // Over, or something was given back: decided afresh from now on.
        *kept = None;
        None
    }

    /// Remembers `refusal` of the call in `slot` for as long as it surely stands, if it
    /// names such a wait; `given_back` is the tool's count read before the call was decided.
    pub(super) fn remember(
        &mut self,
        slot: impl FnOnce() -> usize,
        plan: &Plan<'_>,
        keys: impl FnOnce() -> CallKeys,
        cell: &Arc<ToolCell>,
        given_back: u64,
        refusal: &Refusal,
    ) {
        let Some(wait) = refusal.remember_for(plan) else {
            return;
        };
        if self.slots.is_empty() {
            self.slots.resize_with(SLOTS, || None);
        }
        let from = plan.now.as_micros();
        self.slots[slot()] = Some(Box::new(Remembered {
            keys: keys(),
            policy: plan.tool.clone(),
            cell: cell.clone(),
            given_back,
            cost: plan.cost,
            from,
            until: from.saturating_add(wait.as_micros() as u64),
            refusal: refusal.clone(),
        }));
    }

    /// Forgets the refusals whose wait is over at `now`.
    pub(super) fn sweep(&mut self, now: u64) {
        for s in &mut self.slots {
            if s.as_ref().is_some_and(|r| r.until <= now) {
                *s = None;
            }
        }
    }
}
