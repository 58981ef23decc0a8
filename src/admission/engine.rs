//! Everything a [`Store`](crate::store::Store) implementer needs, in one place.
//!
//! A store keeps a [`NodeState`] per level (tool, tenant, instance); nothing else (which
//! template callers count, and how many, is in the parents' states). To decide a call it reads
//! the states of the levels in the [`Plan`] into a [`Snapshot`] and runs [`decide`] — pure: the
//! same plan and snapshot always give the same answer — and, only if it admits, writes the
//! snapshot's states back, all atomically (no other decision of the same tool in between). A
//! refusal writes nothing. [`Deciding`] runs [`decide`] in its two steps — the call committed
//! to the states, then its answer made from them — for a store that lets go of a lock in
//! between. A state may be forgotten after the time [`Admitted::expires`] gives for it, unless
//! it holds permits. Afterwards [`adjust`] corrects a charge (actual cost, refund) and
//! [`release`] gives a concurrency permit back, level by level.

pub use super::adjust::{adjust, count_in_window, release};
pub use super::decide::{decide, decided_at, Admitted, BudgetUse, LevelFigures};
pub use super::plan::{LevelRef, OwnedPlan, Plan};
pub use super::state::{
    Admission, BudgetCounter, Budgets, Charge, ChargedBudgets, LevelCharge, LevelView, NodeState,
    PlanCounts, Snapshot, Stored,
};
pub use super::walk::Deciding;

pub(crate) use super::bucket::aligned_window;
#[cfg(feature = "redis")]
pub(crate) use super::bucket::roll_window;
pub(crate) use super::decide::explain;
pub(crate) use super::template::counts as template_counts;
