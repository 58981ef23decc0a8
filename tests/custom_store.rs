//! A store written the way a user would write one, from the public engine API alone
//! (`admission::engine`): read a snapshot, `decide`, write back what it says, all under one
//! lock. It must pass the same conformance suite as the stores the crate ships.

mod conformance;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tower_fairshare::admission::engine::{self, NodeState, Plan, PlanCounts, Snapshot};
use tower_fairshare::store::{Admission, Admissions, Answer, CallKeys, Decision, Stored};
use tower_fairshare::{Store, Timestamp};

/// Every level's state by its store key: all a store keeps.
#[derive(Default)]
struct Inner {
    /// State and when it may be forgotten (µs).
    states: HashMap<String, (NodeState, f64)>,
    /// A tool's plans' counts, by its store key (they go with its state).
    plans: HashMap<String, PlanCounts>,
}

#[derive(Default)]
struct MapStore(Mutex<Inner>);

impl Inner {
    fn state(&self, key: &Option<String>) -> NodeState {
        key.as_ref()
            .and_then(|k| self.states.get(k))
            .map(|(s, _)| *s)
            .unwrap_or_default()
    }

    fn plans(&self, tool: &Option<String>) -> PlanCounts {
        let found = tool.as_ref().and_then(|k| self.plans.get(k));
        found.copied().unwrap_or_default()
    }
}

impl Store for MapStore {
    fn decide(&self, plans: &[Plan<'_>]) -> Answer<Decision> {
        let mut inner = self.0.lock().unwrap();
        // Every plan decided on the states as they are; written only if all are admitted.
        let mut writes = Vec::new();
        let mut counts: Vec<(String, PlanCounts)> = Vec::new();
        let mut admitted = Vec::new();
        for plan in plans {
            let keys = plan.keys();
            let [tool, tenant, instance] = keys.encoded();
            let mut snapshot = Snapshot {
                tool: inner.state(&tool),
                plans: inner.plans(&tool),
                tenant: inner.state(&tenant),
                instance: inner.state(&instance),
            };
            let a = match engine::decide(plan, &mut snapshot) {
                Ok(a) => a,
                Err(r) => return Answer::Now(Ok(Decision::Refused(r))),
            };
            counts.push((tool.clone().unwrap(), snapshot.plans));
            writes.push((tool.unwrap(), (snapshot.tool, a.expires[0])));
            writes.push((tenant.unwrap(), (snapshot.tenant, a.expires[1])));
            if let (Some(i), true) = (instance, plan.instance.is_some()) {
                writes.push((i, (snapshot.instance, a.expires[2])));
            }
            admitted.push(a.admission);
        }
        inner.states.extend(writes);
        inner.plans.extend(counts);
        Answer::Now(Ok(Decision::Admitted(Admissions::of(admitted).unwrap())))
    }

    fn adjust(&self, admission: &Arc<Admission>, factor: f64, now: Timestamp) -> Answer<()> {
        let mut inner = self.0.lock().unwrap();
        for (level, key) in admission.keys.encoded().iter().enumerate() {
            if let Some((s, _)) = key.as_ref().and_then(|k| inner.states.get_mut(k)) {
                engine::adjust(s, &admission.charge, level, factor, now);
            }
        }
        Answer::Now(Ok(()))
    }

    fn release(&self, admission: &Arc<Admission>) -> Answer<()> {
        let mut inner = self.0.lock().unwrap();
        for (level, key) in admission.keys.encoded().iter().enumerate() {
            if !admission.charge.levels[level].permit {
                continue;
            }
            if let Some((s, _)) = key.as_ref().and_then(|k| inner.states.get_mut(k)) {
                engine::release(s);
            }
        }
        Answer::Now(Ok(()))
    }

    fn inspect(&self, keys: &CallKeys) -> Answer<Stored> {
        let inner = self.0.lock().unwrap();
        let [tool, tenant, instance] = keys.encoded();
        let state = |k: Option<String>| k.and_then(|k| inner.states.get(&k).map(|(s, _)| *s));
        Answer::Now(Ok(Stored {
            plans: inner.plans(&tool),
            levels: [state(tool), state(tenant), state(instance)],
        }))
    }
}

struct Custom;

impl conformance::Factory for Custom {
    type S = MapStore;
    fn store(&self) -> MapStore {
        MapStore::default()
    }
    fn count_states(&self, store: &MapStore) -> usize {
        store.0.lock().unwrap().states.len()
    }
    fn expire(&self, store: &MapStore, now: Timestamp) {
        let now = now.as_micros() as f64;
        let mut inner = store.0.lock().unwrap();
        inner
            .states
            .retain(|_, (s, expires)| *expires > now || s.in_flight > 0.0);
        let inner = &mut *inner;
        inner.plans.retain(|k, _| inner.states.contains_key(k));
    }
}

suite!(Custom);

/// The same suite with every tool leasing, as by default: the grants a limiter asks for are
/// decided by the custom store like any call.
mod leased {
    use super::{conformance, Custom, MapStore};
    use crate::suite;
    use tower_fairshare::Timestamp;

    struct LeasedCustom;

    impl conformance::Factory for LeasedCustom {
        type S = MapStore;
        fn store(&self) -> MapStore {
            Custom.store()
        }
        fn count_states(&self, store: &MapStore) -> usize {
            Custom.count_states(store)
        }
        fn expire(&self, store: &MapStore, now: Timestamp) {
            Custom.expire(store, now)
        }
        fn leased(&self) -> bool {
            true
        }
    }

    suite!(LeasedCustom);
}
