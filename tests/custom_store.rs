//! A store written the way a user would write one, from the public engine API alone
//! (`admission::engine`): read a snapshot, `decide`, write back what it says, all under one
//! lock. It must pass the same conformance suite as the stores the crate ships.

mod conformance;

use std::collections::HashMap;
use std::sync::Mutex;

use tower_fairshare::admission::engine::{self, NodeState, Plan, Snapshot, Verdict};
use tower_fairshare::store::{Admission, CallKeys, Decision};
use tower_fairshare::{Store, StoreError, Timestamp};

/// Every level's state by its store key: all a store keeps.
#[derive(Default)]
struct Inner {
    /// State and when it may be forgotten (µs).
    states: HashMap<String, (NodeState, f64)>,
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
}

impl Store for MapStore {
    async fn decide(&self, plan: &Plan<'_>, keys: &CallKeys) -> Result<Decision, StoreError> {
        let [tool, tenant, instance] = keys.encoded();
        let (tool_key, tenant_key) = (tool.clone().unwrap(), tenant.clone().unwrap());
        let mut inner = self.0.lock().unwrap();
        let snapshot = Snapshot {
            tool: inner.state(&tool),
            tenant: inner.state(&tenant),
            instance: inner.state(&instance),
        };
        match engine::decide(plan, &snapshot) {
            Verdict::Refuse(r) => Ok(Decision::Refused(r)),
            Verdict::Admit(a) => {
                let a = *a;
                inner.states.insert(tool_key, (a.tool, a.expires[0]));
                inner.states.insert(tenant_key, (a.tenant, a.expires[1]));
                if let (Some(i), true) = (&instance, plan.instance.is_some()) {
                    inner.states.insert(i.clone(), (a.instance, a.expires[2]));
                }
                Ok(Decision::Admitted(std::sync::Arc::new(
                    a.into_admission(keys.clone(), 0),
                )))
            }
        }
    }

    async fn adjust(
        &self,
        admission: &Admission,
        factor: f64,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let mut inner = self.0.lock().unwrap();
        for (level, key) in admission.keys.encoded().iter().enumerate() {
            if let Some((s, _)) = key.as_ref().and_then(|k| inner.states.get_mut(k)) {
                engine::adjust(s, &admission.charge, level, factor, now);
            }
        }
        Ok(())
    }

    async fn release(&self, admission: &Admission) -> Result<(), StoreError> {
        let mut inner = self.0.lock().unwrap();
        for (level, key) in admission.keys.encoded().iter().enumerate() {
            if !admission.charge.levels[level].permit {
                continue;
            }
            if let Some((s, _)) = key.as_ref().and_then(|k| inner.states.get_mut(k)) {
                engine::release(s);
            }
        }
        Ok(())
    }

    async fn inspect(&self, keys: &CallKeys) -> Result<[Option<NodeState>; 3], StoreError> {
        let inner = self.0.lock().unwrap();
        Ok(keys
            .encoded()
            .map(|k| k.and_then(|k| inner.states.get(&k).map(|(s, _)| *s))))
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
    }
}

suite!(Custom);
