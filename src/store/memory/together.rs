//! A call charged to several tools at once: the tools' shards locked (in shard order, each
//! once), so the plans are decided on states nobody else changes, and written only if every
//! plan is admitted.

use std::sync::MutexGuard;

use super::{
    add_tenant, lock, micros_ceil, stored, table_index, write_back, MemoryStore, Place, Shard,
    ToolEntry,
};
use crate::admission::engine::{self, Plan, Snapshot};
use crate::store::{Admissions, Decision};

/// The most tools a call is charged to (the limiter refuses more).
const MAX: usize = crate::limiter::MAX_TOOLS_PER_CALL;

/// The shards a call's tools live in, each locked once, with its index.
type Shards<'g> = [Option<(usize, MutexGuard<'g, Shard>)>; MAX];

/// Decides `plans` (of distinct tools) together: all admitted and written, or the first
/// refusal and nothing written.
pub(super) fn decide(store: &MemoryStore, plans: &[Plan<'_>]) -> Decision {
    let plans = &plans[..plans.len().min(MAX)];
    let places: Vec<Place> = plans
        .iter()
        .map(|p| Place::of(&store.hasher, p.tool.name(), p.tenant.name, p.untenanted))
        .collect();
    let mut shards = lock_shards(store, &places);
    // Each plan decided on its states where they lie (they are some 600 bytes a plan: moved
    // about, they would cost more than the decision), written only once every plan is admitted.
    let mut snaps: Vec<Snapshot> = Vec::with_capacity(plans.len());
    let mut admitted = Vec::with_capacity(plans.len());
    for (plan, place) in plans.iter().zip(&places) {
        let tool = tool_of(store, &mut shards, place, plan);
        tool.period = plan.tool.period.as_micros() as f64;
        snaps.push(states(tool, plan, place.tenant));
        let snap = snaps.last_mut().expect("just pushed");
        match engine::decide(plan, snap) {
            Ok(a) => admitted.push(a),
            Err(r) => return Decision::Refused(r),
        }
    }
    for ((plan, place), (snap, a)) in plans.iter().zip(&places).zip(snaps.iter().zip(&admitted)) {
        let tool = tool_of(store, &mut shards, place, plan);
        write(
            tool,
            store,
            plan,
            place.tenant,
            snap,
            a.expires.map(micros_ceil),
        );
    }
    let admissions = admitted.into_iter().map(|a| a.admission);
    Decision::Admitted(Admissions::of(admissions).expect("a call of several tools"))
}

/// The places' shards locked in shard order (the order a call of one tool takes one in).
fn lock_shards<'g>(store: &'g MemoryStore, places: &[Place]) -> Shards<'g> {
    let mut order: [usize; MAX] = std::array::from_fn(|i| i);
    let order = &mut order[..places.len()];
    let index = |i: usize| store.shard_index(places[i].tool);
    order.sort_unstable_by_key(|&i| index(i));
    let mut shards: Shards<'g> = Default::default();
    let mut locked = 0;
    for &i in order.iter() {
        let shard = index(i);
        let held = locked > 0 && matches!(&shards[locked - 1], Some((s, _)) if *s == shard);
        if !held {
            shards[locked] = Some((shard, lock(&store.shards[shard].0)));
            locked += 1;
        }
    }
    shards
}

/// The entry of `plan`'s tool, in its locked shard (added if new).
fn tool_of<'a>(
    store: &MemoryStore,
    shards: &'a mut Shards<'_>,
    place: &Place,
    plan: &Plan<'_>,
) -> &'a mut ToolEntry {
    let index = store.shard_index(place.tool);
    let (_, guard) = shards
        .iter_mut()
        .flatten()
        .find(|(i, _)| *i == index)
        .expect("every plan's shard is locked");
    guard.tool(plan.tool.name())
}

/// The plan's states as stored (fresh where none is).
fn states(tool: &mut ToolEntry, plan: &Plan<'_>, hash: u64) -> Snapshot {
    let entry =
        tool.tenants[table_index(hash)].find(hash, |e| e.is(plan.tenant.name, plan.untenanted));
    let entry = entry.map(|e| &**e);
    let slot = entry.and_then(|e| plan.instance.map(|i| e.instances.find(i.name)));
    let mut snap = stored(entry, slot, tool.period);
    (snap.tool, snap.plans) = (tool.state, tool.plans);
    snap
}

/// Writes an admitted plan's states: its tool's, and its tenant's and instance's (its tenant's
/// entry added if new).
fn write(
    tool: &mut ToolEntry,
    store: &MemoryStore,
    plan: &Plan<'_>,
    hash: u64,
    snap: &Snapshot,
    expires: [u64; 3],
) {
    (tool.state, tool.plans, tool.expires) = (snap.tool, snap.plans, expires[0]);
    let period = tool.period;
    let table = tool.table(hash);
    match table.find_mut(hash, |e| e.is(plan.tenant.name, plan.untenanted)) {
        Some(entry) => {
            let slot = plan.instance.map(|i| entry.instances.find(i.name));
            write_back(entry, plan, snap, slot, expires, period);
        }
        None => add_tenant(table, &store.hasher, hash, plan, snap, expires, period),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Timestamp;
    use crate::{Caller, Cost, Policy, Store};

    const POLICY: &str = r#"
        [[tool]]
        name = "chat.requests"
        group = "chat"
        unit = "calls"
        rate = { limit = 60, per = "1m" }
        lease = "off"
        [tool.default_tenant]
        ceiling = 3
        burst = 3
        [[tool]]
        name = "chat.tokens"
        group = "chat"
        unit = "tokens"
        rate = { limit = 10000, per = "1m" }
        lease = "off"
        [tool.default_tenant]
        ceiling = 1000
        burst = 1000
    "#;

    fn plans<'p>(policy: &'p Policy, caller: &'p Caller, tokens: f64) -> Vec<Plan<'p>> {
        let now = Timestamp(1_767_225_600_000_000);
        vec![
            caller
                .charged_as(policy, "chat.requests", Cost(1.0), now)
                .unwrap(),
            caller
                .charged_as(policy, "chat.tokens", Cost(tokens), now)
                .unwrap(),
        ]
    }

    fn states(store: &MemoryStore, plans: &[Plan<'_>]) -> Vec<crate::store::Stored> {
        plans
            .iter()
            .map(|p| match store.inspect(&p.keys()) {
                crate::store::Answer::Now(r) => r.unwrap(),
                crate::store::Answer::Later(_) => unreachable!("the memory store answers at once"),
            })
            .collect()
    }

    #[test]
    fn two_tools_are_charged_together_or_not_at_all() {
        let policy = Policy::from_toml_str(POLICY).unwrap();
        let store = MemoryStore::new();
        let acme = Caller::new("acme");
        let decide = |tokens| match store.decide(&plans(&policy, &acme, tokens)) {
            crate::store::Answer::Now(r) => r.unwrap(),
            crate::store::Answer::Later(_) => unreachable!(),
        };
        let Decision::Admitted(a) = decide(600.0) else {
            panic!("both tools have room")
        };
        assert_eq!(a.len(), 2);
        let costs: Vec<f64> = a.iter().map(|a| a.charge.cost).collect();
        assert_eq!(costs, [1.0, 600.0]);
        // 400 tokens left of the ceiling: 500 more is refused by the tokens tool, and the
        // requests tool, which had room, is charged nothing.
        let before = states(&store, &plans(&policy, &acme, 500.0));
        let Decision::Refused(r) = decide(500.0) else {
            panic!("the tokens ceiling refuses")
        };
        assert_eq!(r.tool(), "chat.tokens");
        assert_eq!(before, states(&store, &plans(&policy, &acme, 500.0)));
        assert!(matches!(decide(400.0), Decision::Admitted(_)));
    }
}
