//! What travels between Rust and the Lua scripts: packed little-endian doubles (never text, so
//! every number round-trips bit for bit), the keys of one call, and the replies.

use std::time::Duration;

use redis::Value;

use super::super::{Admission, CallKeys, Decision, StoreError};
use crate::admission::engine::{BudgetCounter, Charge, LevelCharge, LevelView, NodeState, Plan};
use crate::admission::{Reason, Refusal, Scope};
use crate::clock::Timestamp;
use crate::policy::numbers::{level_numbers, LevelNumbers};
use crate::policy::{Budget, BudgetPeriod, LevelPolicy};

pub(super) fn period_code(p: BudgetPeriod) -> f64 {
    match p {
        BudgetPeriod::Hour => 1.0,
        BudgetPeriod::Day => 2.0,
        BudgetPeriod::Month => 3.0,
    }
}

fn period_of(code: f64) -> Option<BudgetPeriod> {
    match code as i64 {
        1 => Some(BudgetPeriod::Hour),
        2 => Some(BudgetPeriod::Day),
        3 => Some(BudgetPeriod::Month),
        _ => None,
    }
}

fn cap(c: Option<u32>) -> f64 {
    c.map_or(-1.0, f64::from)
}

/// The key of the tracker of a level's template children: its state key and `#`. Never a key
/// [`crate::key`] builds (a complete key followed by a byte that cannot start a part), so the
/// spaces never meet, and it keeps the tool's hash tag.
pub(super) fn tracker_key(state_key: &str) -> String {
    suffixed(state_key, '#')
}

/// The key of a level's concurrency permits: its state key and `!` (see [`tracker_key`]).
pub(super) fn permits_key(state_key: &str) -> String {
    suffixed(state_key, '!')
}

/// The key of a tool's epoch marker: its state key and `@` (see [`tracker_key`]).
pub(super) fn epoch_key(tool_key: &str) -> String {
    suffixed(tool_key, '@')
}

fn suffixed(key: &str, mark: char) -> String {
    let mut k = String::with_capacity(key.len() + 1);
    k.push_str(key);
    k.push(mark);
    k
}

/// Packs doubles, little-endian, straight into the argument bytes.
pub(super) struct Packer(pub(super) Vec<u8>);

impl Packer {
    pub(super) fn put(&mut self, values: &[f64]) {
        for x in values {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }

    fn level(&mut self, p: &LevelPolicy) {
        self.put(&[
            f64::from(u8::from(p.template)),
            p.max_tracked as f64,
            p.weight,
            p.floor,
            f64::from(u8::from(p.ceiling.is_some())),
            p.ceiling.unwrap_or(0.0),
            p.reserved_floor,
            p.children_floor,
            p.burst,
            p.borrow_threshold,
            cap(p.max_concurrency),
            p.configured_child_weight,
            p.default_child.as_ref().map_or(0.0, |d| d.weight),
            p.configured_child_burst,
            p.default_child.as_ref().map_or(0.0, |d| d.burst),
        ]);
    }

    fn budgets(&mut self, list: &[Budget]) {
        self.put(&[list.len() as f64]);
        for b in list {
            self.put(&[period_code(b.period), b.max]);
        }
    }
}

pub(super) fn pack(v: &[f64]) -> Vec<u8> {
    let mut p = Packer(Vec::with_capacity(v.len() * 8));
    p.put(v);
    p.0
}

/// The plan, as the admission script reads it (see the top of `admit.lua`).
pub(super) fn encode_plan(plan: &Plan<'_>, now: f64, permit_ttl_ms: f64) -> Vec<u8> {
    let tool = plan.tool;
    let budgets = tool.budgets.len()
        + plan.tenant.policy.budgets.len()
        + plan.instance.map_or(0, |i| i.policy.budgets.len());
    let mut p = Packer(Vec::with_capacity(8 * (13 + 2 * 15 + 3 + 2 * budgets)));
    p.put(&[
        now,
        plan.cost,
        tool.period.as_micros() as f64,
        tool.spare(),
        tool.capacity,
        tool.burst,
        tool.configured_weight,
        tool.default_tenant.as_ref().map_or(0.0, |d| d.weight),
        tool.configured_tenant_burst,
        tool.default_tenant.as_ref().map_or(0.0, |d| d.burst),
        cap(tool.max_concurrency),
        permit_ttl_ms,
        f64::from(u8::from(plan.instance.is_some())),
    ]);
    p.level(plan.tenant.policy);
    if let Some(i) = plan.instance {
        p.level(i.policy);
    }
    p.budgets(&tool.budgets);
    p.budgets(&plan.tenant.policy.budgets);
    if let Some(i) = plan.instance {
        p.budgets(&i.policy.budgets);
    }
    p.0
}

/// Every key one call touches: per level its state, its tracker of template children and its
/// permits (`None` for the instance level of a call without one).
#[derive(Clone, Debug)]
pub(super) struct LevelKeys {
    pub(super) state: [Option<String>; 3],
}

impl LevelKeys {
    pub(super) fn new(encoded: [Option<String>; 3]) -> Self {
        LevelKeys { state: encoded }
    }

    /// The admission script's KEYS (see the top of `admit.lua`).
    pub(super) fn for_admission(&self) -> Vec<String> {
        let [tool, tenant, instance] = &self.state;
        let tool = tool.clone().unwrap_or_default();
        let tenant = tenant.clone().unwrap_or_default();
        let mut keys = Vec::with_capacity(8);
        keys.push(tracker_key(&tool));
        keys.push(tenant.clone());
        keys.push(tracker_key(&tenant));
        let tool_permits = permits_key(&tool);
        let tenant_permits = permits_key(&tenant);
        keys.insert(0, tool);
        match instance {
            Some(i) => {
                keys.push(i.clone());
                keys.push(tool_permits);
                keys.push(tenant_permits);
                keys.push(permits_key(i));
            }
            None => {
                // KEYS[5] is never read without an instance; the permits stay at 6 and 7.
                keys.push(keys[2].clone());
                keys.push(tool_permits);
                keys.push(tenant_permits);
            }
        }
        keys
    }

    /// The release script's KEYS for the levels of `charge` that took a permit: pairs of
    /// (permits, state).
    pub(super) fn for_release(&self, charge: &Charge) -> Vec<String> {
        let mut keys = Vec::new();
        for (level, key) in self.state.iter().enumerate() {
            if let (Some(key), true) = (key, charge.levels[level].permit) {
                keys.push(permits_key(key));
                keys.push(key.clone());
            }
        }
        keys
    }

    /// The permits keys of the levels of `charge` that took a permit.
    pub(super) fn permits(&self, charge: &Charge) -> Vec<String> {
        self.state
            .iter()
            .enumerate()
            .filter(|(level, _)| charge.levels[*level].permit)
            .filter_map(|(_, k)| k.as_deref().map(permits_key))
            .collect()
    }
}

/// The adjust script's arguments for `factor` × `charge` (see the top of `adjust.lua`), and
/// the keys it touches; `None` when no level was charged.
pub(super) fn encode_adjustment(
    keys: &LevelKeys,
    charge: &Charge,
    factor: f64,
    now: f64,
    permit_ttl_ms: f64,
) -> Option<(Vec<String>, Vec<u8>)> {
    let mut v = vec![now, factor, charge.cost, charge.window, permit_ttl_ms];
    let mut key_list = Vec::with_capacity(3);
    for (level, key) in keys.state.iter().enumerate() {
        let lc = &charge.levels[level];
        let Some(key) = key else { continue };
        if !lc.present {
            continue;
        }
        key_list.push(key.clone());
        v.extend_from_slice(&[
            level as f64,
            lc.floor,
            lc.floor_depth,
            lc.share,
            lc.share_depth,
            lc.ceiling,
            lc.ceiling_depth,
            lc.budgets.len() as f64,
        ]);
        for (p, start) in &lc.budgets {
            v.push(period_code(*p));
            v.push(*start);
        }
    }
    (!key_list.is_empty()).then(|| (key_list, pack(&v)))
}

/// What a call charges where, known before the script runs: enough to rebuild the charge from
/// the script's numbers alone (so an admission nobody received can be given back).
#[derive(Copy, Clone, Debug)]
pub(super) struct Shape {
    cost: f64,
    period: f64,
    levels: usize,
    permits: [bool; 3],
    /// Each level's budget periods, in the policy's order (at most one of each period).
    budgets: [[Option<BudgetPeriod>; 3]; 3],
}

impl Shape {
    pub(super) fn of(plan: &Plan<'_>) -> Shape {
        let periods = |list: &[Budget]| {
            let mut out = [None; 3];
            for (slot, b) in out.iter_mut().zip(list) {
                *slot = Some(b.period);
            }
            out
        };
        let tool = plan.tool;
        let mut shape = Shape {
            cost: plan.cost,
            period: tool.period.as_micros() as f64,
            levels: 2,
            permits: [
                tool.max_concurrency.is_some(),
                plan.tenant.policy.max_concurrency.is_some(),
                false,
            ],
            budgets: [
                periods(&tool.budgets),
                periods(&plan.tenant.policy.budgets),
                [None; 3],
            ],
        };
        if let Some(i) = plan.instance {
            shape.levels = 3;
            shape.permits[2] = i.policy.max_concurrency.is_some();
            shape.budgets[2] = periods(&i.policy.budgets);
        }
        shape
    }

    pub(super) fn holds_permits(&self) -> bool {
        self.permits.iter().any(|p| *p)
    }

    /// The charge of an admitted call, from the script's numbers.
    pub(super) fn charge(&self, a: &AdmittedNumbers) -> Charge {
        let at = Timestamp(a.now as u64);
        let mut charge = Charge {
            cost: self.cost,
            window: (a.now / self.period).floor(),
            levels: Default::default(),
        };
        for (level, lc) in charge.levels.iter_mut().enumerate().take(self.levels) {
            let takes = a.takes[level];
            let depths = a.depths[level];
            *lc = LevelCharge {
                present: true,
                floor: takes[0],
                floor_depth: depths[0],
                share: takes[1],
                share_depth: depths[1],
                ceiling: takes[2],
                ceiling_depth: depths[2],
                permit: self.permits[level],
                budgets: self.budgets[level]
                    .iter()
                    .flatten()
                    .map(|p| (*p, p.window(at).0.as_micros() as f64))
                    .collect(),
            };
        }
        charge
    }
}

/// The admission script's numbers for an admitted call.
#[derive(Clone, Debug)]
pub(super) struct AdmittedNumbers {
    pub(super) now: f64,
    remaining: f64,
    slack: f64,
    tenants: f64,
    instances: f64,
    /// Floor, share and ceiling taken at tool, tenant, instance.
    takes: [[f64; 3]; 3],
    /// The depths of those buckets.
    depths: [[f64; 3]; 3],
}

/// The admission script's numbers for a refusal.
#[derive(Clone, Debug)]
pub(super) struct RefusedNumbers {
    now: f64,
    reason: Reason,
    scope: Scope,
    wait: f64,
    limit: f64,
    used: f64,
    reset_at: Option<f64>,
    window_secs: f64,
    /// A lower bound of the time before the same call could pass (for the refusal cache).
    pub(super) sure_wait: f64,
    label: String,
}

/// The admission script's answer.
#[derive(Clone, Debug)]
pub(super) enum Reply {
    Admitted(AdmittedNumbers),
    Refused(RefusedNumbers),
}

fn unpack(bytes: &[u8]) -> Result<Vec<f64>, StoreError> {
    if bytes.len() % 8 != 0 {
        return Err(StoreError::Protocol(format!(
            "a packed value of {} bytes is not whole doubles",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

struct Reader<'a> {
    v: &'a [f64],
    at: usize,
}

impl Reader<'_> {
    fn next(&mut self) -> Result<f64, StoreError> {
        let x = self.v.get(self.at).copied().ok_or_else(|| {
            StoreError::Protocol("the script's answer is shorter than expected".into())
        })?;
        self.at += 1;
        Ok(x)
    }

    fn triples(&mut self) -> Result<[[f64; 3]; 3], StoreError> {
        let mut out = [[0.0f64; 3]; 3];
        for x in out.iter_mut().flatten() {
            *x = self.next()?;
        }
        Ok(out)
    }
}

fn bad(what: &str) -> StoreError {
    StoreError::Protocol(format!("the script answered {what}"))
}

/// Reads the admission script's answer.
pub(super) fn parse_reply(reply: Value) -> Result<Reply, StoreError> {
    let Value::Array(items) = reply else {
        return Err(bad("something other than an array"));
    };
    let mut it = items.into_iter();
    let kind = match it.next() {
        Some(Value::Int(k)) => k,
        _ => return Err(bad("no verdict")),
    };
    let blob = match it.next() {
        Some(Value::BulkString(b)) => b,
        _ => return Err(bad("no numbers")),
    };
    let v = unpack(&blob)?;
    let mut r = Reader { v: &v, at: 0 };
    let now = r.next()?;
    if kind == 0 {
        let label = match it.next() {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
            Some(Value::SimpleString(s)) => s,
            _ => String::new(),
        };
        let reason = match r.next()? as i64 {
            1 => Reason::RateLimited,
            2 => Reason::CapExceeded,
            3 => Reason::ConcurrencyExceeded,
            _ => return Err(bad("an unknown refusal reason")),
        };
        let scope = match r.next()? as i64 {
            0 => Scope::Tool,
            1 => Scope::Tenant,
            _ => Scope::Instance,
        };
        let wait = r.next()?;
        let limit = r.next()?;
        let used = r.next()?;
        let has_reset = r.next()? == 1.0;
        let reset_at = r.next()?;
        let window_secs = r.next()?;
        let sure_wait = r.next()?;
        return Ok(Reply::Refused(RefusedNumbers {
            now,
            reason,
            scope,
            wait,
            limit,
            used,
            reset_at: has_reset.then_some(reset_at),
            window_secs,
            sure_wait,
            label,
        }));
    }
    Ok(Reply::Admitted(AdmittedNumbers {
        now,
        remaining: r.next()?,
        slack: r.next()?,
        tenants: r.next()?,
        instances: r.next()?,
        takes: r.triples()?,
        depths: r.triples()?,
    }))
}

/// The refusal the script's numbers describe.
pub(super) fn refusal(n: RefusedNumbers, plan: &Plan<'_>) -> Refusal {
    let mut refusal = Refusal::new(n.reason, &plan.tool.name);
    refusal.tenant = (!plan.untenanted).then(|| plan.tenant.name.to_owned());
    refusal.instance = if plan.untenanted {
        Some(plan.tenant.name.to_owned())
    } else {
        plan.instance.map(|i| i.name.to_owned())
    };
    refusal.scope = Some(n.scope);
    refusal.window_secs = if n.label.is_empty() {
        Some(plan.tool.period.as_secs_ceil())
    } else {
        (n.window_secs >= 0.0).then_some(n.window_secs as u64)
    };
    refusal.window = Some(if n.label.is_empty() {
        plan.tool.period.to_string()
    } else {
        n.label
    });
    refusal.limit = Some(n.limit);
    refusal.used = Some(n.used);
    if n.wait.is_finite() {
        let wait = n.wait.max(1.0).ceil();
        refusal.retry_after = Some(Duration::from_micros(wait as u64));
        refusal.reset_at = Some(Timestamp(n.reset_at.unwrap_or(n.now + wait) as u64));
        refusal.retryable = true;
    }
    refusal
}

/// The admission the script's numbers describe. The numbers owed at each level (for headers
/// and logs) follow from the policy and the tracked counts, exactly as the engine computes
/// them (same functions, same f64 operations): the script need not send them.
pub(super) fn admission(
    n: &AdmittedNumbers,
    plan: &Plan<'_>,
    keys: &CallKeys,
    shape: &Shape,
    call: u128,
) -> Decision {
    let tool = plan.tool;
    let now = n.now;
    let period = tool.period.as_micros() as f64;
    let next_window = ((now / period).floor() + 1.0) * period;
    let t_pol = plan.tenant.policy;
    let tn = level_numbers(
        t_pol,
        tool.spare(),
        tool.configured_weight + tool.default_tenant.as_ref().map_or(0.0, |d| d.weight) * n.tenants,
    );
    let view = |n: &LevelNumbers| LevelView {
        weight: n.weight,
        floor: n.floor,
        share: n.share,
        ceiling: n.ceiling,
    };
    let mut views = [view(&tn), LevelView::default()];
    let mut quota = tn.ceiling;
    if let Some(i) = plan.instance {
        let inner_spare = (tn.ceiling - t_pol.children_floor).max(0.0);
        let inner_weight = t_pol.configured_child_weight
            + t_pol.default_child.as_ref().map_or(0.0, |d| d.weight) * n.instances;
        let inn = level_numbers(i.policy, inner_spare, inner_weight);
        views[1] = view(&inn);
        quota = inn.ceiling;
    }
    Decision::Admitted(Box::new(Admission {
        keys: keys.clone(),
        charge: shape.charge(n),
        remaining: n.remaining,
        quota,
        reset_in: next_window - now,
        slack: n.slack,
        views,
        at: Timestamp(now as u64),
        call,
    }))
}

/// The mark that opens a state of the current layout (see `admit.lua`).
const STATE_MARK: f64 = -2.0;

/// A level's stored state (`in_flight` is the caller's to fill: the permits live elsewhere).
pub(super) fn decode_state(bytes: &[u8]) -> Result<Option<NodeState>, StoreError> {
    let v = unpack(bytes)?;
    let mut r = Reader { v: &v, at: 0 };
    if r.next()? != STATE_MARK {
        // Another layout's state: the scripts read it as absent, and so do we.
        return Ok(None);
    }
    let mut s = NodeState {
        live: true,
        t: r.next()?,
        floor: r.next()?,
        share: r.next()?,
        ceiling: r.next()?,
        window: r.next()?,
        total: r.next()?,
        non_floor: r.next()?,
        floor_used: r.next()?,
        in_flight: r.next()?,
        budgets: Vec::new(),
    };
    // until, key_until, and its tracker's count, least score and expiry.
    for _ in 0..5 {
        r.next()?;
    }
    let nb = r.next()? as usize;
    // expires, deadline, three rates, three depths, period.
    for _ in 0..9 {
        r.next()?;
    }
    for _ in 0..nb {
        let period = period_of(r.next()?).ok_or_else(|| bad("an unknown budget period"))?;
        s.budgets.push(BudgetCounter {
            period,
            start: r.next()?,
            used: r.next()?,
        });
    }
    Ok(Some(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixed_keys_stay_in_the_tools_slot_and_never_meet() {
        let tool = crate::key::tool_key("t");
        let tag = crate::key::hash_tag(&tool).to_owned();
        let keys = [
            tracker_key(&tool),
            permits_key(&tool),
            epoch_key(&tool),
            tool.clone(),
        ];
        for k in &keys {
            assert_eq!(crate::key::hash_tag(k), tag, "{k}");
            assert!(crate::key::decode(k).is_none() || *k == tool, "{k}");
        }
        let mut sorted = keys.to_vec();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), keys.len());
    }

    #[test]
    fn admission_keys_keep_the_permits_at_six_to_eight() {
        let with = LevelKeys::new([Some("T".into()), Some("t".into()), Some("i".into())]);
        assert_eq!(
            with.for_admission(),
            ["T", "T#", "t", "t#", "i", "T!", "t!", "i!"]
        );
        let without = LevelKeys::new([Some("T".into()), Some("t".into()), None]);
        assert_eq!(
            without.for_admission(),
            ["T", "T#", "t", "t#", "t", "T!", "t!"]
        );
    }
}
