use super::*;

/// Paths that differ in any name, in where a name stands, or in their shape hash apart:
/// 20,100 paths of short and long names, no two the same hash, and the shards they fall in
/// evenly used.
#[test]
fn paths_hash_apart_and_spread_over_the_shards() {
    let seed = &RandomState::default();
    let names: Vec<String> = (0..100)
        .map(|i| match i % 4 {
            0 => format!("t{i}"),
            1 => format!("team-{i}"),
            2 => format!("tenant-number-{i}"),
            _ => format!("a-rather-long-tenant-name-{i}-of-some-org"),
        })
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut shards = vec![0u32; 512];
    let mut paths = 0;
    for (a, tenant) in names.iter().enumerate() {
        for (b, other) in names.iter().enumerate() {
            let instance = (a != b).then_some(other.as_str());
            for (tool, untenanted) in [("search", false), ("report", false), ("search", true)] {
                if untenanted && instance.is_some() {
                    continue;
                }
                let p = Path {
                    tool,
                    tenant,
                    instance,
                    untenanted,
                };
                let h = hash_path(seed, p);
                assert!(
                    seen.insert(h),
                    "two paths hash alike: {tool} {tenant} {instance:?}"
                );
                shards[(h >> 48) as usize & 511] += 1;
                paths += 1;
            }
        }
    }
    assert!(paths >= 20_000, "{paths} paths");
    let (min, max) = (shards.iter().min().unwrap(), shards.iter().max().unwrap());
    let mean = paths as f64 / 512.0;
    // Even use is a Poisson count of ~39 a shard: over 512 shards the fullest passes 1.7× the
    // mean for about one random seed in 55, 2× for about one in 100,000.
    assert!(
        f64::from(*min) > mean * 0.3 && f64::from(*max) < mean * 2.0,
        "shards used unevenly: {min}..{max} around {mean}"
    );
    // A name moved to another place in the path is another path.
    let swap = |t: &str, i: &str| {
        let p = Path {
            tool: "search",
            tenant: t,
            instance: Some(i),
            untenanted: false,
        };
        hash_path(seed, p)
    };
    assert_ne!(swap("acme", "bot"), swap("bot", "acme"));
}

fn grant(at: u64, reset_in: f64) -> Admission {
    Admission {
        keys: CallKeys {
            tool: "t".into(),
            group: None,
            tenant: "a".into(),
            instance: None,
            untenanted: false,
        },
        reset_in,
        at: Timestamp(at),
        ..Admission::default()
    }
}

/// Leases holding one grant of 10 units (one of them spent by the call that asked) for
/// tenant `a` of the tool `t` that `policy` lists, under policy version 3 and `tier`, swept
/// at `now` (a sweep due would send a call the whole way).
fn granted_to_a(policy: &str, tier: Option<&str>, now: u64) -> Leases {
    let policy = crate::Policy::from_toml_str(policy).expect("valid");
    let tool = policy.tool("t").expect("listed");
    let name = Arc::from("a");
    let plan = Plan {
        now: Timestamp(now),
        cost: 1.0,
        tool,
        tenant: crate::admission::engine::LevelRef {
            name: &name,
            policy: tool.tenant("a").expect("the template"),
        },
        instance: None,
        untenanted: false,
    };
    let leases = Leases::new();
    let caller = match tier {
        Some(t) => Caller::new("a").with_tier(t),
        None => Caller::new("a"),
    };
    let terms = GrantTerms::new(3, &caller, &plan);
    let mut back = Vec::new();
    let call = leases.granted(
        &plan,
        terms,
        Arc::new(grant(now, 500_000.0)),
        10.0,
        &mut back,
    );
    assert!(call.is_ok() && back.is_empty());
    leases.swept_at.store(now, Relaxed);
    leases
}

/// One unit of tool `t` spent from `caller`'s lease at `at` under policy `version`.
fn spend_one(leases: &Leases, version: u64, caller: &Caller, at: Timestamp) -> bool {
    leases
        .spend(version, "t", caller, 1.0, || at, || false)
        .is_some()
}

/// The tool `t` with leases and a template tenant.
const LEASING: &str =
    "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = { limit = 1000, per = \"1s\" }\n\
     lease = { max = 64 }\n[tool.default_tenant]\nmax_tenants = 10\n";

/// A lease is spent before the call is resolved only under the policy version and for the
/// tier it was granted under.
#[test]
fn a_lease_is_spent_unresolved_only_under_its_version_and_tier() {
    let now = 1_767_225_600_000_000;
    let leases = granted_to_a(LEASING, Some("gold"), now);
    let gold = Caller::new("a").with_tier("gold");
    let at = Timestamp(now + 10);
    let spend = |version, caller: &Caller| spend_one(&leases, version, caller, at);
    assert!(!spend(4, &gold), "a later policy version");
    assert!(!spend(3, &Caller::new("a")), "another tier");
    assert!(spend(3, &gold));
    assert_eq!(leases.held(), 8.0);
}

/// A tenant that does not limit its instances has one lease for all of them: a call from any
/// of its instances is spent from it before the call is resolved. A tenant that does limit
/// them never lends an instance its tenant-wide lease.
#[test]
fn instances_of_a_tenant_that_does_not_limit_them_spend_its_one_lease() {
    let now = 1_767_225_600_000_000;
    let at = Timestamp(now + 10);
    for (limits_instances, spent) in [(false, true), (true, false)] {
        let mut policy = String::from(LEASING);
        if limits_instances {
            policy.push_str("[tool.default_tenant.default_instance]\nmax_instances = 10\n");
        }
        let leases = granted_to_a(&policy, None, now);
        let bot = Caller::new("a").with_instance("bot");
        assert_eq!(
            spend_one(&leases, 3, &bot, at),
            spent,
            "instances limited: {limits_instances}"
        );
        assert_eq!(leases.held(), if spent { 8.0 } else { 9.0 });
    }
}

/// The store's clock (Redis's) may run ahead of the limiter's: a lease still ends when the
/// window ends by the store's count, on the limiter's clock — early, never late.
#[test]
fn a_lease_ends_on_the_callers_clock_whatever_the_stores_says() {
    let now = 1_767_225_600_000_000;
    // Decided 300 ms ahead of the caller's clock, 50 ms before its window ends.
    assert_eq!(ends(&grant(now + 300_000, 50_000.0), now), now + 50_000);
    // Behind it: the same span from the caller's instant (it ends early).
    assert_eq!(ends(&grant(now - 300_000, 50_000.0), now), now + 50_000);
    // A long window: the lifetime ends it first.
    assert_eq!(ends(&grant(now, 1e12), now), now + LIFETIME_US);
}

/// Tools whose names are as long as a leasing tool's are told apart by their marks: a call of
/// `search` does not look for a lease because `leased` holds some (it did when a tool was
/// marked by its name's length alone). Among these common names of equal lengths, no name's
/// marks are all among another's.
#[test]
fn tools_of_names_as_long_are_marked_apart() {
    let names = [
        "search",
        "leased",
        "report",
        "lookup",
        "render",
        "upload",
        "fetch",
        "write",
        "query",
        "parse",
        "chat.tokens",
        "web_search1",
        "embeddings1",
        "chat.request",
    ];
    for a in names {
        let marks = tool_marks(a);
        assert_eq!(marks.count_ones(), 2, "{a}: two marks");
        for b in names.iter().filter(|b| **b != a) {
            let other = tool_marks(b);
            assert_ne!(marks & other, marks, "{a} is marked as if it were {b}");
        }
    }
}
