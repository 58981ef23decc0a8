//! Admission: the fair-share decision and the refusals it gives.
//!
//! Callers of the limiter only meet [`Refusal`], [`Reason`] and [`Scope`]. Store implementers
//! find everything a store needs in [`engine`].
//!
//! The decision is pure — policy, stored numbers and `now` in; new numbers and what was
//! charged out, or a refusal — and lives in rooms along its seams: `plan` (the call and its
//! keys), `state` (what a store keeps per level, what a call charged), `bucket` (token-bucket
//! arithmetic), `template` (template callers counted), `walk` (a call's levels at its instant,
//! and which bucket of which level each unit is drawn from), `decide` (the decision) and
//! `adjust` (corrections and permits after it).
//!
//! The algorithm — three buckets per caller, the pool, borrowing, the window counts, template
//! callers and their banks — is stated for users in `docs/semantics.md` (*How it works*);
//! each room's docs say which part of it lives there.
//!
//! Every number is an `f64`, and this is the only place the arithmetic is written: every
//! store runs it.

mod adjust;
mod bucket;
mod decide;
pub mod engine;
mod plan;
mod refusal;
mod state;
mod template;
mod walk;

pub use plan::CallKeys;
pub(crate) use refusal::{echoed, Kept};
pub use refusal::{Reason, Refusal, RefusalDetails, Scope};
