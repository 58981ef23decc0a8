//! What the benches share (each bench is a crate of its own and includes this file with
//! `#[path]`): the policies they decide on, their callers, and polling a decision once.

// Each bench uses a part of it.
#![allow(dead_code)]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use tower_fairshare::{Caller, Limiter, MemoryStore, Policy, SystemClock};

/// Tool + tenant + instance + one budget, generous enough that every decision is admitted.
/// Every tool but `leased` decides every call at the store (`lease = "off"`): what an exact
/// decision costs.
pub const POLICY: &str = r#"
[[tool]]
name = "search"
unit = "calls"
rate = { limit = 1000000000000, per = "1s" }
lease = "off"
[tool.default_tenant]
max_tenants = 2000000
budgets = [{ period = "day", max = 1e15 }]
[tool.default_tenant.default_instance]
max_instances = 100

# As "search", with a period long enough that nothing goes idle (and is swept) while the memory
# part runs: every caller stays resident and is counted.
[[tool]]
name = "resident"
unit = "calls"
rate = { limit = 1000000000000, per = "1h" }
lease = "off"
[tool.default_tenant]
max_tenants = 2000000
budgets = [{ period = "day", max = 1e15 }]
[tool.default_tenant.default_instance]
max_instances = 1000

# As "search", with leases as by default: most decisions are spent from a lease this process
# holds.
[[tool]]
name = "leased"
unit = "calls"
rate = { limit = 1000000000000, per = "1s" }
[tool.default_tenant]
max_tenants = 2000000
budgets = [{ period = "day", max = 1e15 }]
[tool.default_tenant.default_instance]
max_instances = 100

# As "search" without the budget and the instance level: a decision of two levels (the tool
# and a template tenant), for instruction counts by policy shape (`FS_TOOL=flat`).
[[tool]]
name = "flat"
unit = "calls"
rate = { limit = 1000000000000, per = "1s" }
lease = "off"
[tool.default_tenant]
max_tenants = 2000000

# A model call's two tools, charged together (`Limiter::admit_all`): each as "search", decided
# at the store; and the same pair leasing, as by default.
[[tool]]
name = "chat.requests"
group = "chat"
unit = "calls"
rate = { limit = 1000000000000, per = "1s" }
lease = "off"
[tool.default_tenant]
max_tenants = 2000000
budgets = [{ period = "day", max = 1e15 }]
[tool.default_tenant.default_instance]
max_instances = 100

[[tool]]
name = "chat.tokens"
group = "chat"
unit = "tokens"
rate = { limit = 1000000000000, per = "1s" }
lease = "off"
[tool.default_tenant]
max_tenants = 2000000
budgets = [{ period = "day", max = 1e15 }]
[tool.default_tenant.default_instance]
max_instances = 100

[[tool]]
name = "leased.requests"
group = "leased.chat"
unit = "calls"
rate = { limit = 1000000000000, per = "1s" }
[tool.default_tenant]
max_tenants = 2000000
budgets = [{ period = "day", max = 1e15 }]
[tool.default_tenant.default_instance]
max_instances = 100

[[tool]]
name = "leased.tokens"
group = "leased.chat"
unit = "tokens"
rate = { limit = 1000000000000, per = "1s" }
[tool.default_tenant]
max_tenants = 2000000
budgets = [{ period = "day", max = 1e15 }]
[tool.default_tenant.default_instance]
max_instances = 100

[[tool]]
name = "exhausted"
unit = "calls"
rate = { limit = 60, per = "1m" }
lease = "off"
[tool.default_tenant]
ceiling = 1
burst = 1
"#;

/// 120 tenants with floors, weights and ceilings; a daily budget on the tool; template
/// instances: the shape of a real, busy multi-tenant tool.
pub fn saturated_policy() -> String {
    let mut p = String::from(
        "[[tool]]\nname = \"saturated\"\nunit = \"calls\"\nrate = { limit = 6000, per = \"1m\" }\nlease = \"off\"\n\
         budgets = [{ period = \"day\", max = 5000000 }]\n",
    );
    for t in 0..120 {
        p.push_str(&format!(
            "[tool.tenants.team-{t}]\nweight = {}\nfloor = {}\nceiling = {}\n\
             [tool.tenants.team-{t}.default_instance]\nmax_instances = 10\n",
            1 + t % 5,
            5 + t % 10,
            60 + 4 * (t % 10),
        ));
    }
    p
}

/// A limiter on the saturated policy and its 120 tenants' callers (an instance of seven
/// each), to call in turn.
pub fn saturated() -> (Limiter<MemoryStore, SystemClock>, Vec<Caller>) {
    let l = Limiter::new(Policy::from_toml_str(&saturated_policy()).expect("valid"));
    let crowd = (0..120)
        .map(|t| Caller::new(format!("team-{t}")).with_instance(format!("agent-{}", t % 7)))
        .collect();
    (l, crowd)
}

pub fn limiter() -> Limiter<MemoryStore, SystemClock> {
    Limiter::new(Policy::from_toml_str(POLICY).expect("the bench policy is valid"))
}

pub fn callers(prefix: &str, n: usize) -> Vec<Caller> {
    (0..n)
        .map(|i| Caller::new(format!("{prefix}{i}")).with_instance("agent"))
        .collect()
}

/// Polls a future once: every one the benches time is ready at its first poll (the in-process
/// store, a lease, `service_fn` over an async block, tower's limit layers with capacity), so no
/// runtime is in the measurement.
pub fn now<F: std::future::IntoFuture>(f: F) -> F::Output {
    let mut f = pin!(f.into_future());
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("every future in this bench is ready at once"),
    }
}

// ---------------------------------------------------------------------------------------------
// The baselines: what a user composes from governor instead.

/// governor's keyed limiter, on quanta's clock (governor's default) or `C`.
pub type Keyed<K, C = governor::clock::DefaultClock> = governor::RateLimiter<
    K,
    governor::state::keyed::DefaultKeyedStateStore<K>,
    C,
    governor::middleware::NoOpMiddleware<<C as governor::clock::Clock>::Instant>,
>;

/// Three keyed governors chained, as a user limits tool, tenant and instance without a nested
/// limiter: each call checks the tool's, then the tenant's, then the tenant's instance's.
pub struct Chained<C: governor::clock::Clock = governor::clock::DefaultClock> {
    tool: Keyed<String, C>,
    tenant: Keyed<String, C>,
    instance: Keyed<(String, String), C>,
}

/// A caller's keys for [`Chained`]: (tool, tenant, (tenant, instance)).
pub type ChainedKey = (String, String, (String, String));

impl Chained {
    /// Chained governors on governor's default clock.
    pub fn new(quota: governor::Quota) -> Self {
        Chained::with_clock(quota, governor::clock::DefaultClock::default())
    }

    /// Each caller's keys: the tool (`search`), its tenant, its tenant and instance.
    pub fn keys(callers: &[Caller]) -> Vec<ChainedKey> {
        callers
            .iter()
            .map(|c| {
                let tenant = c.tenant().unwrap_or_default().to_owned();
                let instance = c.instance().unwrap_or_default().to_owned();
                ("search".to_owned(), tenant.clone(), (tenant, instance))
            })
            .collect()
    }
}

impl<C: governor::clock::Clock + Clone> Chained<C> {
    /// Chained governors reading `clock`.
    pub fn with_clock(quota: governor::Quota, clock: C) -> Self {
        Chained {
            tool: governor::RateLimiter::dashmap_with_clock(quota, clock.clone()),
            tenant: governor::RateLimiter::dashmap_with_clock(quota, clock.clone()),
            instance: governor::RateLimiter::dashmap_with_clock(quota, clock),
        }
    }

    /// Whether all three admit the call (the tool's first; one that refuses ends the check).
    pub fn check(&self, k: &ChainedKey) -> bool {
        self.tool.check_key(&k.0).is_ok()
            && self.tenant.check_key(&k.1).is_ok()
            && self.instance.check_key(&k.2).is_ok()
    }
}

/// A quota no decision of a bench reaches: every call is admitted, as by the crate's
/// generous policies.
pub fn generous_quota() -> governor::Quota {
    governor::Quota::per_second(std::num::NonZeroU32::new(1_000_000_000).expect("non-zero"))
}
