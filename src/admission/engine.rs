//! Everything a [`Store`](crate::store::Store) implementer needs, in one place.
//!
//! A store keeps a [`NodeState`] per level (tool, tenant, instance); nothing else (which
//! template callers count, and how many, is in the parents' states). To decide a call it reads
//! the states of the levels in the [`Plan`] into a [`Snapshot`], runs [`decide`] — pure: the
//! same plan and snapshot always give the same [`Verdict`] — and, only if it admits, writes
//! the new states back, all atomically (no other decision of the same tool in between). A
//! refusal writes nothing. A state may be forgotten after the time [`Admitted::expires`] gives
//! for it, unless it holds permits. Afterwards [`adjust`] corrects a charge (actual cost,
//! refund) and [`release`] gives a concurrency permit back, level by level.
//!
//! `MemoryStore` runs the same decision split at the tool, so that it holds the tool's lock
//! for the tool's part only; the Redis store reads the states of a batch of calls, decides them
//! one after the other with [`decide`] and writes them back only if no record changed since.

pub use super::adjust::{adjust, count_in_window, release};
pub use super::decide::{decide, decided_at, Admitted, LevelRef, Plan, Snapshot, Verdict};
pub use super::state::{
    BudgetCounter, Budgets, Charge, ChargedBudgets, LevelCharge, LevelView, NodeState, PlanCounts,
};

pub(crate) use super::bucket::aligned_window;
pub(crate) use super::decide::explain;
pub(crate) use super::phases::{above, below, commit_below, Below, Report, Top};
pub(crate) use super::template::{counts as template_counts, Counted};
