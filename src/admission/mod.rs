//! Admission: the fair-share decision and the refusals it gives.
//!
//! Callers of the limiter only meet [`Refusal`], [`Reason`] and [`Scope`]. Store implementers
//! find everything a store needs in [`engine`].
//!
//! The decision is pure — policy, stored numbers and `now` in; new numbers and what was
//! charged out, or a refusal — and lives in rooms along its seams: `plan` (the call and its
//! keys), `state` (what a store keeps per level, what a call charged), `bucket` (token-bucket
//! arithmetic), `template` (template callers counted), `walk` (which bucket of which level each
//! unit is drawn from), `decide` (the decision) and `adjust` (corrections and permits after
//! it).
//!
//! # The algorithm
//!
//! Each caller (a tenant, or an instance inside a tenant) owns three token buckets, refilled
//! continuously per period P of its tool:
//!
//! * **floor** `F` — rate and depth = its own floor. Private: nobody else ever draws it, and
//!   the tool's shared pool is sized `C − Σ floors`, so floors are reserved, never lent.
//! * **share** `H` — rate = its nominal share `S × w / Σw`. It marks which of its non-floor
//!   draws are within its share (they have priority over borrowing).
//! * **ceiling** `K` — rate = ceiling − floor, depth = burst. Every non-floor draw takes it.
//!
//! The tool owns the **pool**: rate `S = C − Σ floors`, depth = the tool's burst. A call of
//! cost `c` takes from the caller's share when its share bank holds all of `c` (with its `K`
//! and the pool), else from its floor first and the rest beyond it, and retries floor-first if
//! that path is blocked. Above the caller, the non-floor part passes its tenant (residual
//! floor, then `K`) and the pool.
//!
//! A draw beyond the share of any level is *borrowing*. It may only take pool tokens above the
//! sum of the other children's share banks (their bursts; the borrower's own bank is its own to
//! spend), so the pool always holds every other child's banked share token and an own-share
//! draw never fails for a borrower's sake; inside that lending room a
//! weight-ranked threshold (half the room for the heaviest, nearly all of it for the lightest)
//! lets heavier borrowers draw first. The tool also counts units per aligned window of length
//! P: floors at most the floor, non-floor at most `S` (borrowers leave the banks' worth), which
//! makes "at most C per period" exact even from a cold start with every bucket full. Budgets
//! (calendar windows) and concurrency caps are counters checked alongside. Nothing is written
//! unless every check passes.
//!
//! Template callers (`default_tenant`, `default_instance`) share by how many of them are
//! active: one counts at its parent from its first admitted call in an aligned window to the
//! end of the next window, and the parent keeps the counts in its own state (`template`), so
//! a store keeps nothing but the levels' states.
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
