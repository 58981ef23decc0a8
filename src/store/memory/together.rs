//! A call charged to several tools at once: every tenant's shard locked (in shard order), then
//! every tool's cell (in name order) — the order a call of one tool takes them in, shard then
//! tool — so the plans are decided on states nobody else changes, and written only if every
//! plan is admitted.

use std::sync::{Arc, MutexGuard};

use super::{
    hash_tenant, lock, micros_ceil, note_period, write_back, MemoryStore, Packed, Shard,
    TenantEntry, ToolCell, ToolEntry,
};
use crate::admission::engine::{self, NodeState, Plan, Snapshot};
use crate::store::{Admissions, Decision};

/// One plan's place: its tenant's hash and shard, its tool's cell; and, as it is decided, its
/// states and what it admitted.
struct Place<'g> {
    hash: u64,
    shard: usize,
    cell: Arc<ToolCell>,
    period: f64,
    tool: Option<MutexGuard<'g, ToolEntry>>,
    snap: Snapshot,
    admitted: Option<engine::Admitted>,
}

/// The most tools a call is charged to (the limiter refuses more).
const MAX: usize = crate::limiter::MAX_TOOLS_PER_CALL;

/// Decides `plans` (of distinct tools) together: all admitted and written, or the first
/// refusal and nothing written.
pub(super) fn decide(store: &MemoryStore, plans: &[Plan<'_>]) -> Decision {
    let n = plans.len().min(MAX);
    let cells: Vec<Arc<ToolCell>> = plans[..n]
        .iter()
        .map(|p| store.tool_cell(p.tool.name()))
        .collect();
    let mut places: Vec<Place<'_>> = plans[..n]
        .iter()
        .zip(&cells)
        .map(|(p, cell)| place(store, p, cell.clone()))
        .collect();
    let mut order: [usize; MAX] = std::array::from_fn(|i| i);
    order[..n].sort_unstable_by_key(|&i| places[i].shard);
    let mut shards: [Option<(usize, MutexGuard<'_, Shard>)>; MAX] = Default::default();
    let mut locked = 0;
    for &i in &order[..n] {
        let shard = places[i].shard;
        if locked == 0
            || shards[locked - 1]
                .as_ref()
                .is_some_and(|(s, _)| *s != shard)
        {
            shards[locked] = Some((shard, lock(&store.shards[shard].0)));
            locked += 1;
        }
    }
    let shards = &mut shards[..locked];
    order[..n].sort_unstable_by(|&a, &b| cells[a].name.cmp(&cells[b].name));
    for &i in &order[..n] {
        places[i].tool = Some(lock(&cells[i].inner));
    }
    for (plan, place) in plans.iter().zip(places.iter_mut()) {
        read(shard_of(shards, place.shard), plan, place);
        match engine::decide(plan, &mut place.snap) {
            Ok(a) => place.admitted = Some(a),
            Err(r) => return Decision::Refused(r),
        }
    }
    let admitted = plans.iter().zip(places.iter_mut()).map(|(plan, place)| {
        let a = place.admitted.take().expect("admitted");
        let expires = a.expires.map(micros_ceil);
        let tool = place.tool.as_mut().expect("locked");
        tool.state = place.snap.tool;
        tool.expires = expires[0];
        write(store, shard_of(shards, place.shard), plan, place, expires);
        Arc::new(a.into_admission(plan.keys(), 0))
    });
    Decision::Admitted(Admissions::of(admitted).expect("a call of several tools"))
}

/// Where `plan`'s states live: its tenant's hash and shard, and its tool's `cell`.
fn place<'g>(store: &MemoryStore, plan: &Plan<'_>, cell: Arc<ToolCell>) -> Place<'g> {
    let (tool, tenant) = (plan.tool.name(), &**plan.tenant.name);
    let hash = hash_tenant(&store.hasher, tool, tenant, plan.untenanted);
    let shard = (hash >> 40) as usize & (store.shards.len() - 1);
    let period = note_period(&cell, plan);
    Place {
        hash,
        shard,
        cell,
        period,
        tool: None,
        snap: Snapshot::default(),
        admitted: None,
    }
}

fn shard_of<'a, 'g>(
    shards: &'a mut [Option<(usize, MutexGuard<'g, Shard>)>],
    index: usize,
) -> &'a mut Shard {
    let (_, guard) = shards
        .iter_mut()
        .flatten()
        .find(|(i, _)| *i == index)
        .expect("every plan's shard is locked");
    guard
}

/// The plan's states as stored (fresh where none is), into its place's snapshot.
fn read(shard: &Shard, plan: &Plan<'_>, place: &mut Place<'_>) {
    let snap = states(shard, plan, place);
    place.snap = Snapshot {
        tool: place.tool.as_ref().expect("locked").state,
        ..snap
    };
}

/// The plan's tenant and instance states as stored (fresh where none is).
fn states(shard: &Shard, plan: &Plan<'_>, place: &Place<'_>) -> Snapshot {
    let entry = shard.tenants.find(place.hash, |e| {
        e.is(plan.tool.name(), plan.tenant.name, plan.untenanted)
    });
    let instance = |e: &TenantEntry| {
        let i = plan.instance?;
        let at = e.instances.find(i.name).ok()?;
        Some(e.instances.as_slice()[at].state(place.period))
    };
    Snapshot {
        tool: NodeState::default(),
        tenant: entry.map_or_else(NodeState::default, |e| e.state.state(place.period)),
        instance: entry.and_then(|e| instance(e)).unwrap_or_default(),
    }
}

/// Writes an admitted plan's tenant and instance states, adding its tenant's entry if new.
fn write(
    store: &MemoryStore,
    shard: &mut Shard,
    plan: &Plan<'_>,
    place: &Place<'_>,
    expires: [u64; 3],
) {
    let snap = &place.snap;
    let (tool, tenant) = (plan.tool.name(), &**plan.tenant.name);
    if let Some(entry) = shard
        .tenants
        .find_mut(place.hash, |e| e.is(tool, tenant, plan.untenanted))
    {
        let slot = plan.instance.map(|i| entry.instances.find(i.name));
        write_back(entry, plan, snap, slot, expires, place.period);
        return;
    }
    let mut entry = Box::new(TenantEntry {
        tool: place.cell.clone(),
        state: Packed::new(
            tenant,
            plan.untenanted,
            &snap.tenant,
            expires[1],
            place.period,
        ),
        instances: super::Instances::None,
    });
    write_back(&mut entry, plan, snap, None, expires, place.period);
    let hasher = &store.hasher;
    shard.tenants.insert_unique(place.hash, entry, |e| {
        hash_tenant(
            hasher,
            &e.tool.name,
            super::tenant_name(e),
            e.state.untenanted(),
        )
    });
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

    fn states(store: &MemoryStore, plans: &[Plan<'_>]) -> Vec<[Option<NodeState>; 3]> {
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
