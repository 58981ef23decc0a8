//! An admitted call's step at its tool, and that step done again on the tool's state as it
//! stands when the call is written.
//!
//! Most of a decision is the caller's own: its tenant's and its instance's buckets, windows
//! and budgets. The tool's state enters it in two ways only: its counts of template tenants
//! (which set every caller's numbers) and the tool's own step (its pool, its window's
//! non-floor cap, its permits and budgets). So a store may decide a call on a copy of its
//! tool's state, with only its caller's states held, and write it if the tool's state is
//! still the copy; if another call of the tool was written in between, [`ToolStep::redo`]
//! does the call's step again on the tool's state as it is now: with the same counts and the
//! same walk through the caller's levels, the call passes at the tool as it did (its draw,
//! its bar, its window cap, its budgets and permits checked again), or the store decides it
//! again from the start. A call whose tool moved on in time meanwhile is charged there at the
//! tool's instant, as a call decided a little later than it was made (see `decided_at`).

use super::bucket::{aligned_window, bucket, calendar_window, expiry, refill, roll_window, EPS};
use super::plan::Plan;
use super::refusal::Scope;
use super::state::{BudgetCounter, NodeState, PlanCounts};
use super::template::{self, Standing};
use super::walk::{Level, PoolDraw};
use crate::clock::Timestamp;
use crate::policy::numbers::LevelNumbers;
use crate::policy::Budget;

/// What an admitted call did at its tool: at which instant, what it took and asked of the
/// pool, the floor units it drew below, and whether its tenant was counted there.
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct ToolStep {
    pub(super) at: Timestamp,
    pub(super) take: [f64; 3],
    pub(super) pool: PoolDraw,
    pub(super) floor_below: f64,
    /// The tenant counted as a template child of the tool: its slot, how it stood before.
    pub(super) counted: Option<(usize, Standing)>,
    /// Whether the walk was share first; one that fell back to floor first is decided again
    /// from the start (on the tool as it is now, share first might pass).
    pub(super) share_first: bool,
}

impl ToolStep {
    /// Does this call's step at its tool again on `tool` (with its plans' counts), the tool's
    /// state as it stands now, after the call was decided on a state whose template counts
    /// were `read`: the tool's expiry (µs) with the call written into `tool`, or `None`,
    /// leaving `tool` as it was, when the call must be decided again from the start — the tool
    /// counts its template tenants otherwise (the caller's numbers could differ), moved on to
    /// a later window, or would not take the call as it did.
    pub(crate) fn redo(
        &self,
        plan: &Plan<'_>,
        read: &TemplateCounts,
        tool: &mut NodeState,
        plans: &mut PlanCounts,
    ) -> Option<f64> {
        let clock = Instant::of(self.at, plan);
        let (period, window) = (clock.period, clock.window);
        let later = tool.live && aligned_window(tool.t, period) > window;
        if !self.share_first || *read != TemplateCounts::of(tool, plans) || later {
            return None;
        }
        let (mut s, mut p) = (*tool, *plans);
        template::roll(&mut s, &mut p, window);
        let level = tool_level(plan);
        refill(&mut s, &level.buckets, clock.now, period);
        roll_window(&mut s, window);
        let c = plan.cost;
        let capped = plan
            .cap(0)
            .is_some_and(|cap| s.in_flight + 1.0 > cap as f64);
        let spent = plan.tool.budgets.iter().any(|b| {
            let start = calendar_window(b.period, self.at).0;
            s.budgets.used_in(b.period, start) + c > b.max + EPS
        });
        let rem = self.take[2];
        let pool_ok = rem <= EPS
            || (s.ceiling + EPS >= self.pool.need
                && s.non_floor + rem <= self.pool.window_cap + EPS);
        if capped || spent || !pool_ok {
            return None;
        }
        let charging = Charging {
            cost: c,
            permit: plan.takes_permit(0),
            budgets: &plan.tool.budgets,
            at: self.at,
            level: &level,
            clock,
        };
        let mut until = charge_level(&mut s, self.take, &charging);
        s.floor_used += self.floor_below;
        if let Some((slot, before)) = self.counted {
            template::count_child(&mut s, &mut p, slot, before, window);
            until = until.max(template::counts_until(&s, &p, period));
        }
        (*tool, *plans) = (s, p);
        Some(until)
    }
}

/// A tool's counts of its template tenants, as stored: what every caller's numbers are
/// worked out from.
#[derive(Copy, Clone, Debug, PartialEq)]
pub(crate) struct TemplateCounts {
    window: f64,
    in_window: f64,
    counted: f64,
    plans: PlanCounts,
}

impl TemplateCounts {
    /// The counts of a tool whose state is `s`, its plans' `plans`.
    pub(crate) fn of(s: &NodeState, plans: &PlanCounts) -> TemplateCounts {
        TemplateCounts {
            window: s.template_window,
            in_window: s.template_in_window,
            counted: s.template_counted,
            plans: *plans,
        }
    }
}

/// A call's instant, as its decision counts it: µs, the tool's period, the aligned window
/// that holds it and the next one's start.
#[derive(Copy, Clone, Debug)]
pub(super) struct Instant {
    pub(super) now: f64,
    pub(super) period: f64,
    pub(super) window: f64,
    pub(super) next_window: f64,
}

impl Instant {
    pub(super) fn of(at: Timestamp, plan: &Plan<'_>) -> Instant {
        let now = at.as_micros() as f64;
        let period = plan.tool.period.as_micros() as f64;
        let window = aligned_window(now, period);
        Instant {
            now,
            period,
            window,
            next_window: (window + 1.0) * period,
        }
    }
}

/// How a call is charged at one level: its cost, whether it takes a permit there, the
/// level's budgets, its instant, the level's buckets.
pub(super) struct Charging<'a> {
    pub(super) cost: f64,
    pub(super) permit: bool,
    pub(super) budgets: &'a [Budget],
    pub(super) at: Timestamp,
    pub(super) level: &'a Level,
    pub(super) clock: Instant,
}

/// Takes `take` (floor, share, ceiling) from a level's state `s`, counts the call in its
/// windows and budgets; when the state may be forgotten (µs).
pub(super) fn charge_level(s: &mut NodeState, [f, h, k]: [f64; 3], c: &Charging<'_>) -> f64 {
    s.floor -= f;
    s.share -= h;
    s.ceiling -= k;
    s.total += c.cost;
    s.non_floor += k;
    s.floor_used += f;
    if c.permit {
        s.in_flight += 1.0;
    }
    for b in c.budgets {
        let start = calendar_window(b.period, c.at).0;
        match s.budgets.iter_mut().find(|x| x.period == b.period) {
            Some(x) if x.start == start => x.used += c.cost,
            Some(x) => {
                x.start = start;
                x.used = c.cost;
            }
            None => s.budgets.set(BudgetCounter {
                period: b.period,
                start,
                used: c.cost,
            }),
        }
    }
    let clock = [c.clock.now, c.clock.period, c.clock.next_window];
    expiry(s, &c.level.buckets, clock)
}

/// The tool's level: its pool of `S = C − Σ floors`, as deep as the tool's burst.
pub(super) fn tool_level(plan: &Plan<'_>) -> Level {
    let tool = plan.tool;
    let spare = tool.spare();
    Level {
        scope: Scope::Tool,
        numbers: LevelNumbers {
            share: spare,
            ceiling: tool.capacity,
            ceiling_rate: spare,
            ..LevelNumbers::default()
        },
        buckets: [
            bucket(0.0, 0.0),
            bucket(0.0, 0.0),
            bucket(spare, tool.burst),
        ],
        fresh: false,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::admission::decide::{decide, Admitted};
    use crate::admission::state::Snapshot;
    use crate::identity::{Caller, Cost};
    use crate::Policy;

    /// Every limit a tool step meets: the pool, the window's cap, a tool budget, a tool
    /// concurrency cap (the calls here hold their permits), floors below, template tenants counted at the tool (two at most),
    /// template instances.
    const POLICY: &str = r#"
        [[tool]]
        name = "t"
        unit = "tokens"
        rate = { limit = 200, per = "10s" }
        max_concurrency = 1000
        budgets = [{ period = "hour", max = 1500 }]
        [tool.tenants.A]
        weight = 2
        floor = 10
        burst = 40
        budgets = [{ period = "day", max = 600 }]
        [tool.tenants.A.instances.x]
        floor = 5
        burst = 20
        [tool.tenants.A.default_instance]
        max_instances = 3
        burst = 20
        [tool.tenants.B]
        weight = 1
        floor = 20
        ceiling = 60
        burst = 30
        [tool.default_tenant]
        max_tenants = 2
        burst = 20
    "#;

    fn callers() -> Vec<Caller> {
        let mut out: Vec<Caller> = ["x", "y", "z"]
            .map(|i| Caller::new("A").with_instance(i))
            .into();
        out.extend(["B", "C", "D", "E"].map(Caller::new));
        out
    }

    /// The states of one tool's levels, kept as a store keeps them.
    #[derive(Clone, Default)]
    struct States {
        tool: NodeState,
        plans: PlanCounts,
        callers: HashMap<(String, Option<String>), NodeState>,
    }

    impl States {
        fn keys(plan: &Plan<'_>) -> [(String, Option<String>); 2] {
            let tenant = plan.tenant.name.to_string();
            let instance = plan.instance.map(|i| i.name.to_string());
            [(tenant.clone(), None), (tenant, instance)]
        }

        fn snapshot(&self, plan: &Plan<'_>) -> Snapshot {
            let [t, i] = Self::keys(plan).map(|k| self.callers.get(&k).copied());
            Snapshot {
                tool: self.tool,
                plans: self.plans,
                tenant: t.unwrap_or_default(),
                instance: i.filter(|_| plan.instance.is_some()).unwrap_or_default(),
            }
        }

        /// Writes the callers' states of an admitted call.
        fn write_callers(&mut self, plan: &Plan<'_>, snap: &Snapshot) {
            let [t, i] = Self::keys(plan);
            self.callers.insert(t, snap.tenant);
            if plan.instance.is_some() {
                self.callers.insert(i, snap.instance);
            }
        }

        /// Decides a call and writes it if admitted, as a store holding every lock would.
        fn decide(&mut self, plan: &Plan<'_>) -> Option<(Admitted, Snapshot)> {
            let mut snap = self.snapshot(plan);
            let a = decide(plan, &mut snap).ok()?;
            (self.tool, self.plans) = (snap.tool, snap.plans);
            self.write_callers(plan, &snap);
            Some((a, snap))
        }
    }

    /// A call: which caller, how long after the one before (µs), its cost.
    fn calls(n: usize) -> impl Strategy<Value = Vec<(usize, u64, u32)>> {
        prop::collection::vec((0usize..7, 0u64..400_000, 1u32..12), 1..n)
    }

    const T0: u64 = 1_767_225_600_000_000;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Done again on the state it was decided on, a call's step at its tool writes what
        /// the decision wrote there (or, when its walk fell back to floor first, is declined).
        #[test]
        fn redone_on_the_state_read_it_writes_what_the_decision_wrote(calls in calls(60)) {
            let policy = Policy::from_toml_str(POLICY).expect("valid");
            let who = callers();
            let mut states = States::default();
            let mut now = T0;
            for (k, dt, cost) in calls {
                now += dt;
                let Ok(plan) = who[k].charged_as(&policy, "t", Cost(f64::from(cost)), Timestamp(now))
                else {
                    continue;
                };
                let (mut tool, mut plans) = (states.tool, states.plans);
                let read = TemplateCounts::of(&tool, &plans);
                let Some((a, snap)) = states.decide(&plan) else {
                    continue;
                };
                let redone = a.at_tool.redo(&plan, &read, &mut tool, &mut plans);
                if a.at_tool.share_first {
                    prop_assert_eq!(redone, Some(a.expires[0]));
                    prop_assert_eq!((tool, plans), (snap.tool, snap.plans));
                } else {
                    prop_assert_eq!(redone, None);
                }
            }
        }

        /// A call decided on a copy of its tool's state, then done again at the tool after
        /// another tenant's call (made no later) was written there, ends as if it had been
        /// decided after that call: the same states at every level and the same expiry. And
        /// a call that, so decided, would be refused is never done again at the tool.
        #[test]
        fn redone_after_another_call_it_ends_as_if_decided_after_it(
            before in calls(16),
            (a, b) in (0usize..7, 0usize..7),
            (dt, cost_a, cost_b) in (0u64..50_000, 1u32..12, 1u32..12),
        ) {
            let policy = Policy::from_toml_str(POLICY).expect("valid");
            let who = callers();
            let tenant = |k: usize| who[k].tenant().map(str::to_owned);
            if tenant(a) == tenant(b) {
                return Ok(());
            }
            let mut states = States::default();
            let mut now = T0;
            for (k, step, cost) in before {
                now += step;
                if let Ok(plan) =
                    who[k].charged_as(&policy, "t", Cost(f64::from(cost)), Timestamp(now))
                {
                    states.decide(&plan);
                }
            }
            let at = |us: u64, k: usize, cost: u32| {
                who[k].charged_as(&policy, "t", Cost(f64::from(cost)), Timestamp(us))
            };
            let (Ok(plan_b), Ok(plan_a)) = (at(now, b, cost_b), at(now + dt, a, cost_a)) else {
                return Ok(());
            };
            // A decided on the tool as read; B decided and written meanwhile.
            let read = TemplateCounts::of(&states.tool, &states.plans);
            let mut on_copy = states.snapshot(&plan_a);
            let decided = decide(&plan_a, &mut on_copy);
            let mut after_b = states.clone();
            if after_b.decide(&plan_b).is_none() {
                return Ok(());
            }
            // A decided after B, every lock held.
            let mut serial = after_b.clone();
            let serially = serial.decide(&plan_a);
            let Ok(a_copy) = decided else {
                return Ok(());
            };
            let (mut tool, mut plans) = (after_b.tool, after_b.plans);
            let redone = a_copy.at_tool.redo(&plan_a, &read, &mut tool, &mut plans);
            match (redone, serially) {
                (Some(until), Some((a_serial, s))) => {
                    prop_assert_eq!(until, a_serial.expires[0]);
                    prop_assert_eq!((tool, plans), (s.tool, s.plans));
                    prop_assert_eq!((on_copy.tenant, on_copy.instance), (s.tenant, s.instance));
                    prop_assert_eq!(&a_copy.expires[1..], &a_serial.expires[1..]);
                }
                (Some(_), None) => prop_assert!(false, "done again where it would be refused"),
                (None, _) => {}
            }
        }
    }

    /// Two listed tenants that share a tool of 20 calls a minute, with `limits` (a budget, a
    /// concurrency cap): each alone within its share.
    fn two(limits: &str) -> Policy {
        let tool = "[[tool]]\nname = \"p\"\nunit = \"calls\"\nrate = { limit = 20, per = \"1m\" }";
        let tenants = "[tool.tenants.C]\nceiling = 20\nburst = 20\n[tool.tenants.D]\nceiling = 20\nburst = 20";
        Policy::from_toml_str(&format!("{tool}\n{limits}\n{tenants}")).expect("valid")
    }

    /// C's call of `cost` decided on a copy of the tool's state at `T0`; then D's calls (µs
    /// after `T0`, 5 each) written: whether C's step at the tool is done again, and whether
    /// C's call, decided after D's, is admitted.
    fn after_d(limits: &str, d_at: &[u64], cost: f64) -> (bool, bool) {
        let policy = two(limits);
        let (c, d) = (Caller::new("C"), Caller::new("D"));
        let plan = |who, cost, us| {
            Caller::charged_as(who, &policy, "p", Cost(cost), Timestamp(T0 + us)).expect("planned")
        };
        let mut states = States::default();
        let read = TemplateCounts::of(&states.tool, &states.plans);
        let mut snap = states.snapshot(&plan(&c, cost, 0));
        let a = decide(&plan(&c, cost, 0), &mut snap).expect("admitted on the copy");
        for us in d_at {
            states.decide(&plan(&d, 5.0, *us)).expect("D admitted");
        }
        let (mut tool, mut plans) = (states.tool, states.plans);
        let redone = a
            .at_tool
            .redo(&plan(&c, cost, 0), &read, &mut tool, &mut plans);
        if redone.is_none() {
            assert_eq!((tool, plans), (states.tool, states.plans), "left as it was");
        }
        (
            redone.is_some(),
            states.decide(&plan(&c, cost, 0)).is_some(),
        )
    }

    /// A pool another tenant's calls emptied since is not drawn on again: the call is
    /// decided again (and refused).
    #[test]
    fn a_pool_emptied_since_is_decided_again() {
        assert_eq!(after_d("", &[0; 3], 5.0), (true, true), "room for C");
        assert_eq!(
            after_d("", &[0; 4], 5.0),
            (false, false),
            "no room left for C"
        );
    }

    /// A tool budget another tenant's calls spent since is checked again: the call is
    /// decided again (and refused).
    #[test]
    fn a_budget_spent_since_is_decided_again() {
        let budget = "budgets = [{ period = \"hour\", max = 12 }]";
        let d_at = [0, 30_000_000];
        assert_eq!(after_d(budget, &d_at, 2.0), (true, true), "12 of 12");
        assert_eq!(after_d(budget, &d_at, 5.0), (false, false), "15 of 12");
    }

    /// A tool's concurrency cap another tenant's calls filled since is checked again.
    #[test]
    fn a_cap_filled_since_is_decided_again() {
        let cap = "max_concurrency = 3";
        assert_eq!(after_d(cap, &[0; 1], 5.0), (true, true), "3 of 3");
        assert_eq!(after_d(cap, &[0; 3], 5.0), (false, false), "4 of 3");
    }

    /// A tool that counts another template tenant since the call read it is not stepped on
    /// again: the caller's share was worked out on the old count.
    #[test]
    fn a_tool_counting_another_tenant_since_is_decided_again() {
        let policy = Policy::from_toml_str(POLICY).expect("valid");
        let (c, d) = (Caller::new("C"), Caller::new("D"));
        let plan =
            |who| Caller::charged_as(who, &policy, "t", Cost(1.0), Timestamp(T0)).expect("planned");
        let states = States::default();
        let read = TemplateCounts::of(&states.tool, &states.plans);
        let mut snap = states.snapshot(&plan(&c));
        let a = decide(&plan(&c), &mut snap).expect("admitted");
        let mut after_d = states.clone();
        after_d.decide(&plan(&d)).expect("admitted");
        let (mut tool, mut plans) = (after_d.tool, after_d.plans);
        assert_eq!(
            a.at_tool.redo(&plan(&c), &read, &mut tool, &mut plans),
            None
        );
        assert_eq!(
            (tool, plans),
            (after_d.tool, after_d.plans),
            "left as it was"
        );
    }
}
