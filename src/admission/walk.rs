//! A call's levels at the decision's instant ([`Deciding`]: their numbers and buckets), and
//! the walk from the caller up to the tool: which bucket of which level each unit of a call
//! is drawn from, share first or floor first, with the borrowing bar, or why it cannot pass.
//! `decide` builds the levels and commits the walk's takes.

use super::bucket::{wait_for, Bucket, Buckets, EPS};
use super::plan::Plan;
use super::refusal::{Reason, Scope};
use super::state::{LevelView, Snapshot};
use super::template::Standing;
use crate::clock::Timestamp;
use crate::policy::numbers::{instance_numbers, level_numbers, LevelNumbers};

/// A level of the call as the decision sees it: what it is owed now and its buckets.
#[derive(Copy, Clone)]
pub(super) struct Level {
    pub(super) scope: Scope,
    pub(super) numbers: LevelNumbers,
    /// Floor, share and ceiling buckets (at the tool: the pool).
    pub(super) buckets: Buckets,
    /// A template caller not counted at its parent (new, or back after two windows away):
    /// its bank starts with no more than its parent can back, and its first call, up to its
    /// bank's depth, is served as within its share: an advance its bank pays back as it
    /// refills.
    pub(super) fresh: bool,
}

impl Level {
    pub(super) fn share_b(&self) -> &Bucket {
        &self.buckets[1]
    }
    pub(super) fn ceil_b(&self) -> &Bucket {
        &self.buckets[2]
    }
    /// The numbers an answer shows of this level.
    pub(super) fn view(&self) -> LevelView {
        LevelView {
            weight: self.numbers.weight,
            floor: self.numbers.floor,
            share: self.numbers.share,
            ceiling: self.numbers.ceiling,
        }
    }
}

/// The window a refusal names: the tool's period, or a fixed word. Rendered only when the
/// refusal is built, so a draw that fails and is retried allocates nothing.
#[derive(Copy, Clone)]
pub(super) enum Label {
    Period,
    Word(&'static str),
}

/// Why a call cannot pass, before it is a [`Refusal`](super::Refusal).
#[derive(Copy, Clone)]
pub(super) struct Fail {
    pub(super) reason: Reason,
    pub(super) scope: Scope,
    pub(super) wait: f64,
    pub(super) window: Label,
    pub(super) window_secs: Option<u64>,
    pub(super) limit: f64,
    pub(super) used: f64,
    pub(super) reset_at: Option<f64>,
    /// A wait the same call surely cannot pass before (0: none known).
    pub(super) sure_wait: f64,
}

impl Fail {
    /// `used` of `limit` in `window` at `scope`, passable in `wait` µs; no window length,
    /// reset time or sure wait known.
    pub(super) fn new(
        reason: Reason,
        scope: Scope,
        window: Label,
        limit: f64,
        used: f64,
        wait: f64,
    ) -> Fail {
        Fail {
            reason,
            scope,
            wait,
            window,
            window_secs: None,
            limit,
            used,
            reset_at: None,
            sure_wait: 0.0,
        }
    }

    /// Keeps in `worst` the failure with the longest wait (the first one on a tie).
    pub(super) fn keep_worse(worst: &mut Option<Fail>, f: Fail) {
        match worst {
            Some(w) if f.wait <= w.wait => {}
            _ => *worst = Some(f),
        }
    }
}

/// One call being decided ([`engine::decide`](super::engine::decide) in steps): its levels at
/// the decision's instant — their numbers, their states brought up to date, how the caller
/// stands among its parents' template children — and, once committed, what it took where.
///
/// A store that holds a tool's state under a lock shared by all its callers can let go of it
/// between [`commit`](Self::commit) (which reads and writes the states) and
/// [`answer`](Self::answer) (which makes the admitted call's record from them):
///
/// ```
/// # use tower_fairshare::admission::engine::{Deciding, Plan, Snapshot, Admitted};
/// # fn store(plan: &Plan<'_>, mut snap: Snapshot) -> Result<Admitted, tower_fairshare::Refusal> {
/// // The tool's state is read into `snap` under its lock, then:
/// let mut call = Deciding::new(plan, &snap);
/// call.commit(&mut snap)?;
/// // ... `snap`'s tool state written back, with `call.tool_expires()`, and the lock let go.
/// Ok(call.answer(&snap))
/// # }
/// ```
pub struct Deciding<'p, 'a> {
    pub(super) plan: &'p Plan<'a>,
    /// The instant the call is decided at: its own, or its states' latest.
    pub(super) at: Timestamp,
    pub(super) levels: [Level; 3],
    pub(super) n: usize,
    /// What each level holds back for its children's share banks.
    pub(super) banks: [f64; 3],
    pub(super) now: f64,
    pub(super) period: f64,
    pub(super) window: f64,
    pub(super) next_window: f64,
    /// How the tenant and the instance stood among their parents' template children before
    /// this call (template callers only).
    pub(super) standing: [Standing; 2],
    /// Once committed: what each level took (floor, share, ceiling).
    pub(super) takes: [[f64; 3]; 3],
    /// Once committed: until when each level's state must be kept for the template counts
    /// (µs; 0: no bound).
    pub(super) counted_until: [f64; 3],
    /// Once committed: when the tool's state may be forgotten (µs).
    pub(super) tool_expires: f64,
}

impl std::fmt::Debug for Deciding<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deciding")
            .field("at", &self.at)
            .field("takes", &self.takes)
            .finish_non_exhaustive()
    }
}

impl Deciding<'_, '_> {
    /// The whole walk, caller first, on the states in `snap`: what each level takes (floor,
    /// share, ceiling), share first (or floor first), or why the call cannot pass.
    pub(super) fn walk(&self, snap: &Snapshot, share_first: bool) -> Result<[[f64; 3]; 3], Fail> {
        let (states, leaf) = (snap.levels(), self.n - 1);
        let mut takes = [[0.0; 3]; 3];
        // What is left to place higher up; whether everything so far was within its share;
        // the borrowing bar the level below sets.
        let (mut rem, mut own_chain, mut child_threshold) = (self.plan.cost, true, 0.5);
        for idx in (0..self.n).rev() {
            if rem <= EPS {
                break;
            }
            let (l, s) = (&self.levels[idx], states[idx]);
            // The level's own floor (a caller's floor, a tenant's residual floor), for what
            // its share cannot cover.
            let own_floor = l.numbers.own_floor;
            if own_floor > 0.0 {
                // The share covers the whole of what is left or none of it: a share bank that
                // holds part of a call leaves the call to the floor, which gives it whole when
                // its bucket holds it, so fractions of floors do not stay reserved at a
                // window's end.
                let share = s.share.min(s.ceiling);
                let covered = match share_first && idx > 0 && share + EPS >= rem {
                    true => rem,
                    false => 0.0,
                };
                let x = (rem - covered)
                    .min(s.floor)
                    .min(own_floor - s.floor_used)
                    .max(0.0);
                takes[idx][0] = x;
                rem -= x;
                if rem <= EPS {
                    break;
                }
            }
            // Then non-floor: the level's ceiling bucket (the pool, at the tool). A borrow may
            // only take what lies above every other child's share bank (the borrower's own
            // bank is its own to spend), so the pool always holds the share tokens its
            // children have banked; inside that lending room, heavier borrowers see a lower
            // bar.
            let banks = if idx < leaf {
                self.banks[idx] - self.levels[idx + 1].share_b().depth
            } else {
                0.0
            };
            let threshold = if idx < leaf && !own_chain {
                banks + child_threshold * (l.ceil_b().depth - banks - rem).max(0.0)
            } else {
                0.0
            };
            let need = rem + threshold;
            // Only the tool counts non-floor units per aligned window (at most `C − Σ
            // floors`); borrowers also leave the banks' worth of the window to own-share draws.
            let window_cap = match (idx, threshold > 0.0) {
                (0, true) => l.numbers.ceiling_rate - banks,
                (0, false) => l.numbers.ceiling_rate,
                _ => f64::INFINITY,
            };
            let bucket_ok = s.ceiling + EPS >= need;
            let window_ok = s.non_floor + rem <= window_cap + EPS;
            if !(bucket_ok && window_ok) {
                return Err(self.fail(snap, idx, need, rem, window_ok));
            }
            takes[idx][2] = rem;
            if idx > 0 {
                if s.share + EPS >= rem || (l.fresh && rem <= l.share_b().depth + EPS) {
                    takes[idx][1] = rem;
                } else {
                    own_chain = false;
                }
                child_threshold = self.plan.policy(idx).map_or(0.5, |p| p.borrow_threshold);
            }
        }
        Ok(takes)
    }

    /// Why level `idx` refuses a draw of `rem` units that needs `need` in its bucket.
    fn fail(&self, snap: &Snapshot, idx: usize, need: f64, rem: f64, window_ok: bool) -> Fail {
        let states = snap.levels();
        let (l, s) = (&self.levels[idx], states[idx]);
        let mut wait = wait_for(s.ceiling, need, l.ceil_b(), self.period);
        if !window_ok {
            wait = wait.max(if rem > l.numbers.ceiling_rate + EPS {
                f64::INFINITY
            } else {
                self.next_window - self.now
            });
        }
        // A borrow the bar blocks can still pass once the caller's own share covers the
        // call: no later than its share bank refills.
        if need > rem + EPS && !wait.is_finite() {
            wait = self.own_share_wait(snap);
            if !wait.is_finite() {
                // Larger than its bank: it can pass once fewer callers are counted.
                wait = self.next_window - self.now;
            }
        }
        // Could the whole call be served by the caller's floor later instead?
        let leaf = self.n - 1;
        let (lf, sf) = (&self.levels[leaf], states[leaf]);
        let c = self.plan.cost;
        if lf.numbers.own_floor + EPS >= c {
            let mut fw = wait_for(sf.floor, c, &lf.buckets[0], self.period);
            if sf.floor_used + c > lf.numbers.own_floor + EPS {
                fw = fw.max(self.next_window - self.now);
            }
            wait = wait.min(fw);
        }
        let (limit, window) = (l.numbers.ceiling, Label::Period);
        Fail {
            window_secs: Some(self.plan.tool.period.as_secs_ceil()),
            ..Fail::new(Reason::RateLimited, l.scope, window, limit, s.total, wait)
        }
    }

    /// When the caller's own share bank (at every level below the tool) covers the whole
    /// call, so it passes without the borrowing bar: the longest of the levels' refills.
    fn own_share_wait(&self, snap: &Snapshot) -> f64 {
        let mut wait: f64 = 0.0;
        for (l, s) in self.levels[..self.n].iter().zip(snap.levels()).skip(1) {
            wait = wait.max(wait_for(s.share, self.plan.cost, l.share_b(), self.period));
        }
        wait
    }

    /// A lower bound of the time before any path could pass the level that refused (`f`,
    /// from the floor-first walk): the least it must draw there once every floor at and below
    /// it is full, at the highest rate its ceiling can reach (the fewest template callers
    /// counted), with no borrowing bar. A store may remember the refusal that long: it never
    /// refuses a call the decision would admit.
    pub(super) fn sure_wait(&self, snap: &Snapshot, f: &Fail) -> f64 {
        let at = match f.scope {
            Scope::Tool => 0,
            Scope::Tenant => 1,
            Scope::Instance => 2,
        };
        let (l, s) = (&self.levels[at], snap.levels()[at]);
        let mut rem = self.plan.cost;
        for below in &self.levels[at..self.n] {
            rem -= below.numbers.own_floor;
        }
        if rem <= EPS {
            return 0.0;
        }
        let mut b = *l.ceil_b();
        if at > 0 {
            let fastest = self.fastest_ceiling(at);
            if fastest.rate > b.rate {
                b = fastest;
            }
        }
        let mut sure = wait_for(s.ceiling, rem, &b, self.period);
        if at == 0 && s.non_floor + rem > l.numbers.ceiling_rate + EPS {
            sure = sure.max(self.next_window - self.now);
        }
        sure.min(f.wait)
    }

    /// The ceiling bucket level `at` (tenant 1, instance 2) has with the fewest template
    /// callers counted (only this caller): the fastest its ceiling can refill.
    fn fastest_ceiling(&self, at: usize) -> Bucket {
        let (tool, t) = (self.plan.tool, self.plan.tenant.policy);
        let n_t = if t.template { 1.0 } else { 0.0 };
        let tn = level_numbers(t, tool.spare(), tool.configured_weight + t.weight * n_t);
        match self.plan.instance.filter(|_| at == 2) {
            Some(i) => {
                let n_i = if i.policy.template { 1.0 } else { 0.0 };
                let rate = instance_numbers(t, tn, i.policy, n_i).ceiling_rate;
                Bucket {
                    rate,
                    depth: i.policy.burst,
                }
            }
            None => Bucket {
                rate: tn.ceiling_rate,
                depth: t.burst,
            },
        }
    }
}
