//! The conformance suite against the in-process store.

mod conformance;
mod ready;

use tower_fairshare::{MemoryStore, Timestamp};

struct Memory;

impl conformance::Factory for Memory {
    type S = MemoryStore;
    fn store(&self) -> MemoryStore {
        MemoryStore::new()
    }
    fn count_states(&self, store: &MemoryStore) -> usize {
        store.len()
    }
    fn expire(&self, store: &MemoryStore, now: Timestamp) {
        store.sweep(now);
    }
}

suite!(Memory);

/// The same suite with every tool leasing: the properties hold with most calls spent from
/// leases.
mod leased {
    use super::conformance;
    use crate::suite;
    use tower_fairshare::{MemoryStore, Timestamp};

    struct LeasedMemory;

    impl conformance::Factory for LeasedMemory {
        type S = MemoryStore;
        fn store(&self) -> MemoryStore {
            MemoryStore::new()
        }
        fn count_states(&self, store: &MemoryStore) -> usize {
            store.len()
        }
        fn expire(&self, store: &MemoryStore, now: Timestamp) {
            store.sweep(now);
        }
        fn leased(&self) -> bool {
            true
        }
    }

    suite!(LeasedMemory);
}

/// Remembered refusals (`MemoryStore::refusal_cache`, on by default) refuse no call that a
/// decision would admit: the same workload — calls of several costs by several callers, floors
/// and ceilings, a small calendar budget, refunds and corrections downwards, reloads — gets the
/// same admissions call for call from a store that remembers refusals and one that decides
/// every call.
mod remembered_refusals {
    use std::time::Duration;

    use crate::ready::now;
    use proptest::prelude::*;
    use tower_fairshare::{
        Caller, Cost, Limiter, ManualClock, MemoryStore, Policy, Ticket, Timestamp,
    };

    const EPOCH: Timestamp = Timestamp(1_767_225_600_000_000);

    /// Tenant `a` with a floor and template instances, `b` with an hourly budget, template
    /// tenants with a ceiling: the policy both modules decide on.
    pub(super) fn policy(ceiling: u32) -> Policy {
        Policy::from_toml_str(&format!(
            r#"
[[tool]]
name = "t"
unit = "calls"
rate = {{ limit = 40, per = "1m" }}
burst = 10
[tool.tenants.a]
floor = 10
weight = 3
[tool.tenants.a.default_instance]
max_instances = 4
ceiling = {ceiling}
[tool.tenants.b]
weight = 1
budgets = [{{ period = "hour", max = 12 }}]
[tool.default_tenant]
max_tenants = 10
ceiling = {ceiling}
burst = 3
"#
        ))
        .expect("valid")
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Caller, cost, then µs later.
        Call(usize, u8, u64),
        /// Refund the n-th last admitted call.
        Refund(usize),
        /// Correct the n-th last admitted call to half its cost.
        Halve(usize),
        /// Put the policy with this ceiling in force.
        Reload(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => (0usize..5, 1u8..4, 0u64..3_000_000).prop_map(|(c, k, g)| Op::Call(c, k, g)),
            1 => (0usize..4).prop_map(Op::Refund),
            1 => (0usize..4).prop_map(Op::Halve),
            1 => (4u32..12).prop_map(Op::Reload),
        ]
    }

    struct Side {
        limiter: Limiter<MemoryStore, ManualClock>,
        clock: ManualClock,
        tickets: Vec<Ticket>,
    }

    impl Side {
        fn new(store: MemoryStore) -> Side {
            let clock = ManualClock::new(EPOCH);
            Side {
                limiter: Limiter::with_store(policy(6), store, clock.clone()),
                clock,
                tickets: Vec::new(),
            }
        }

        /// Applies `op`; for a call, whether it was admitted.
        fn apply(&mut self, op: &Op, callers: &[Caller]) -> Option<bool> {
            let last = |n: usize, t: &[Ticket]| t.len().checked_sub(n + 1);
            match *op {
                Op::Call(c, cost, gap) => {
                    self.clock.advance(Duration::from_micros(gap));
                    let out = now(self.limiter.admit(&callers[c], "t", Cost(cost.into())));
                    let ok = out.is_ok();
                    if let Ok(t) = out {
                        self.tickets.push(t);
                    }
                    Some(ok)
                }
                Op::Refund(n) => {
                    if let Some(i) = last(n, &self.tickets) {
                        let t = self.tickets.remove(i);
                        now(self.limiter.refund(&t));
                    }
                    None
                }
                Op::Halve(n) => {
                    if let Some(i) = last(n, &self.tickets) {
                        let t = self.tickets.remove(i);
                        let half = t.cost().unwrap_or(1.0) / 2.0;
                        now(self.limiter.settle(&t, Cost(half)));
                    }
                    None
                }
                Op::Reload(ceiling) => {
                    self.limiter.set_policy(policy(ceiling));
                    None
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..Default::default() })]

        #[test]
        fn remembered_refusals_refuse_nothing_a_decision_admits(
            ops in proptest::collection::vec(op(), 1..250),
        ) {
            let callers = [
                Caller::new("a").with_instance("i1"),
                Caller::new("a").with_instance("i2"),
                Caller::new("b"),
                Caller::new("c"),
                Caller::new("d").with_instance("x"),
            ];
            let mut on = Side::new(MemoryStore::new());
            let mut off = Side::new(MemoryStore::new().refusal_cache(false));
            for (i, op) in ops.iter().enumerate() {
                let (x, y) = (on.apply(op, &callers), off.apply(op, &callers));
                prop_assert_eq!(x, y, "op {} ({:?}): remembering refusals changed the answer", i, op);
            }
        }
    }
}

/// Dropping a ticket changes no later answer: every answer reads the same — same keys, charge,
/// figures and time — whether the tickets before it were dropped at once or kept. The
/// reference side decides the same calls on a thread of its own that keeps every ticket.
mod dropped_tickets {
    use std::time::Duration;

    use crate::ready::now;
    use proptest::prelude::*;
    use tower_fairshare::{Caller, Cost, Limiter, ManualClock, MemoryStore, Timestamp};

    const EPOCH: Timestamp = Timestamp(1_767_225_600_000_000);

    fn callers() -> Vec<Caller> {
        vec![
            Caller::new("a").with_instance("i1"),
            Caller::new("a").with_instance("i2"),
            Caller::new("b"),
            Caller::new("c").with_instance("x"),
            Caller::new("d").with_instance("x"),
            Caller::untenanted().with_instance("client-7"),
        ]
    }

    /// Each call's answer as text (`None`: refused), deciding `calls` (caller, cost, µs later)
    /// in order; `keep`: every ticket is held to the end, else dropped at once.
    fn answers(calls: &[(usize, u8, u64)], keep: bool) -> Vec<Option<String>> {
        let clock = ManualClock::new(EPOCH);
        let limiter = Limiter::with_store(
            super::remembered_refusals::policy(6),
            MemoryStore::new(),
            clock.clone(),
        );
        let callers = callers();
        let mut kept = Vec::new();
        let mut out = Vec::new();
        for &(c, cost, gap) in calls {
            clock.advance(Duration::from_micros(gap));
            let answer = now(limiter.admit(&callers[c], "t", Cost(cost.into())));
            out.push(answer.as_ref().ok().map(|t| format!("{:?}", t.admission())));
            if keep {
                kept.push(answer);
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..Default::default() })]

        #[test]
        fn an_answer_reads_the_same_whether_earlier_tickets_were_dropped_or_kept(
            calls in proptest::collection::vec((0usize..6, 1u8..4, 0u64..2_000_000), 1..120),
        ) {
            let fresh = {
                let calls = calls.clone();
                std::thread::spawn(move || answers(&calls, true)).join().expect("no panic")
            };
            let dropped = answers(&calls, false);
            for (i, (r, f)) in dropped.iter().zip(&fresh).enumerate() {
                prop_assert_eq!(r, f, "call {} ({:?})", i, calls[i]);
            }
        }
    }
}
