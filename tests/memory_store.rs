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

    fn policy(ceiling: u32) -> Policy {
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
