//! Admission: the pure fair-share decision and the types it speaks in.

pub mod engine;
mod refusal;

pub use engine::{
    Admitted, BudgetCounter, Charge, LevelCharge, LevelRef, LevelView, NodeState, Plan, Snapshot,
    Tracking, Verdict,
};
pub use refusal::{Reason, Refusal, Scope};
