//! RedisStore on a local 3-master Redis Cluster that the tests start: the whole conformance
//! suite (the scripts run unchanged), how keys land on the masters, and exactness across
//! replicas.

// Needs the `redis` feature: `cargo test --features redis` (or --all-features).
#![cfg(feature = "redis")]

mod conformance;
mod support;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::RedisCluster;
/// The virtual start of the tests: 2026-01-01T00:00:00Z, aligned to every period and calendar window.
const EPOCH: tower_fairshare::Timestamp = tower_fairshare::Timestamp(1_767_225_600_000_000);
use tower_fairshare::store::RedisStore;
use tower_fairshare::{Caller, Cost, Limiter, ManualClock, Policy, Store, SystemClock, Timestamp};

/// One cluster per test function; every case starts from an empty key space of its own (a
/// namespace, not a flush: a store of an earlier case whose background work is still running
/// would otherwise write into the next case's keys).
struct Cluster {
    cluster: RedisCluster,
    /// The namespace of the current case, and how many cases there were.
    case: Mutex<(String, u64)>,
    /// Whether the suite's tools lease (as by default) or decide every call at the store.
    leased: bool,
}

impl Cluster {
    fn new() -> Self {
        Cluster {
            cluster: RedisCluster::start(),
            case: Mutex::new((String::new(), 0)),
            leased: false,
        }
    }

    fn leased() -> Self {
        Cluster {
            leased: true,
            ..Self::new()
        }
    }
}

impl conformance::Factory for Cluster {
    type S = RedisStore;
    fn store(&self) -> RedisStore {
        unreachable!("a RedisStore is made inside the runtime that drives it: store_in")
    }
    fn store_in(&self, rt: &tokio::runtime::Runtime) -> RedisStore {
        let namespace = {
            let mut case = self.case.lock().unwrap();
            case.1 += 1;
            case.0 = format!("case{}:", case.1);
            case.0.clone()
        };
        rt.block_on(
            RedisStore::cluster_builder(self.cluster.urls())
                .injected_clock()
                .namespace(namespace)
                .timeout(Duration::from_secs(10))
                .connect(),
        )
        .expect("connect to the cluster")
    }
    fn count_states(&self, _store: &RedisStore) -> usize {
        let namespace = self.case.lock().unwrap().0.clone();
        self.cluster.state_keys_in(&namespace)
    }
    fn expire(&self, _store: &RedisStore, now: Timestamp) {
        // Sweep each master through a store connected to it alone, from a runtime of our own.
        let urls = self.cluster.urls();
        let namespace = self.case.lock().unwrap().0.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                for url in urls {
                    let node = RedisStore::builder(url)
                        .injected_clock()
                        .namespace(namespace.clone())
                        .connect()
                        .await
                        .unwrap();
                    node.sweep(now).await.unwrap();
                }
            })
        })
        .join()
        .unwrap();
    }
    fn cases(&self) -> u32 {
        4
    }
    fn leased(&self) -> bool {
        self.leased
    }
}

suite!(Cluster::new());

/// The same suite with every tool leasing, as by default.
mod leased {
    use super::{conformance, Cluster};
    use crate::suite;

    suite!(Cluster::leased());
}

/// Every key of one tool is in one slot (so on one master), and tools spread over the masters.
#[test]
fn a_tools_keys_share_one_slot_and_tools_spread_over_the_masters() {
    let cluster = RedisCluster::start();
    let mut toml = String::new();
    for t in 0..12 {
        toml += &format!(
            "[[tool]]\nname = \"tool-{t}\"\nunit = \"calls\"\nrate = {{ limit = 100, per = \"1m\" }}\nmax_concurrency = 5\n\
             [tool.tenants.A]\nfloor = 10\n[tool.tenants.A.default_instance]\nmax_instances = 4\n\
             [tool.default_tenant]\nmax_tenants = 5\n"
        );
    }
    let policy = Policy::from_toml_str(&toml).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = RedisStore::cluster_builder(cluster.urls())
            .injected_clock()
            .connect()
            .await
            .unwrap();
        let limiter = Limiter::with_store(policy, store, ManualClock::new(EPOCH));
        for t in 0..12 {
            let tool = format!("tool-{t}");
            for c in [
                Caller::new("A").with_instance("i1"),
                Caller::new("A").with_instance("i2"),
                Caller::new("guest"),
            ] {
                let ticket = limiter.admit(&c, &tool, Cost(1.0)).await.unwrap();
                limiter.release(&ticket).await;
                let state = limiter
                    .store()
                    .inspect(&limiter.call_keys(&c, &tool).unwrap())
                    .await
                    .unwrap();
                assert!(state[0].is_some() && state[1].is_some());
            }
        }
    });
    let mut node_of_tag: HashMap<String, HashSet<usize>> = HashMap::new();
    let mut total = 0;
    for (i, node) in cluster.nodes.iter().enumerate() {
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut node.conn()).unwrap();
        // The replicas' entries (one key, on one master) aside.
        let keys: Vec<String> = keys
            .into_iter()
            .filter(|k| !k.ends_with("fs{replicas}@"))
            .collect();
        total += keys.len();
        for k in keys {
            node_of_tag
                .entry(hash_tag(&k).to_owned())
                .or_default()
                .insert(i);
        }
    }
    // Per tool: tool + epoch marker, A + 2 instances, guest (template callers are counted in
    // their parents' records: no other key).
    assert_eq!(total, 12 * 6);
    assert_eq!(node_of_tag.len(), 12);
    assert!(node_of_tag.values().all(|nodes| nodes.len() == 1));
    let used: HashSet<usize> = node_of_tag.values().flatten().copied().collect();
    assert!(
        used.len() >= 2,
        "12 tools all on one master: {node_of_tag:?}"
    );
}

/// Tools of one group keep their keys in one slot and are decided in one step on the
/// cluster; a store asked to decide tools of different groups together says what to change
/// (instead of the cluster's `CROSSSLOT`), and nothing is charged.
#[test]
fn a_group_is_decided_in_one_slot_and_tools_apart_are_refused_clearly() {
    use tower_fairshare::admission::engine::{LevelRef, Plan};
    use tower_fairshare::StoreError;
    let cluster = RedisCluster::start();
    let mut toml = String::new();
    for (name, group) in [
        ("chat.requests", "chat"),
        ("chat.tokens", "chat"),
        ("search", "search"),
    ] {
        toml += &format!(
            "[[tool]]\nname = \"{name}\"\ngroup = \"{group}\"\nunit = \"calls\"\nrate = {{ limit = 100, per = \"1m\" }}\nlease = \"off\"\n[tool.tenants.A]\nceiling = 10\n"
        );
    }
    let policy = Policy::from_toml_str(&toml).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = RedisStore::cluster_builder(cluster.urls())
            .injected_clock()
            .connect()
            .await
            .unwrap();
        let limiter = Limiter::with_store(policy.clone(), store.clone(), ManualClock::new(EPOCH));
        let a = Caller::new("A");
        let both = [("chat.requests", Cost(1.0)), ("chat.tokens", Cost(1.0))];
        let tickets = limiter.admit_all(&a, &both).await.unwrap();
        assert_eq!(tickets.len(), 2);
        let keys = |tool| limiter.call_keys(&a, tool).unwrap().encoded();
        let [req_tool, req_tenant, _] = keys("chat.requests");
        let [tok_tool, ..] = keys("chat.tokens");
        let tags: HashSet<&str> = [&req_tool, &req_tenant, &tok_tool]
            .iter()
            .map(|k| hash_tag(k.as_deref().unwrap()))
            .collect();
        assert_eq!(tags.len(), 1, "one slot for the group: {tags:?}");
        // Tools apart, asked of the store directly.
        let name: Arc<str> = Arc::from("A");
        let plan = |tool: &str| {
            let tp = policy.tool(tool).unwrap();
            Plan {
                now: EPOCH,
                cost: 1.0,
                tool: tp,
                tenant: LevelRef {
                    name: &name,
                    policy: tp.tenant(&name).unwrap(),
                },
                instance: None,
                untenanted: false,
            }
        };
        let r = store.decide(&[plan("chat.requests"), plan("search")]).await;
        match r {
            Err(StoreError::Protocol(m)) => assert!(m.contains("group"), "{m}"),
            other => panic!("tools apart were decided: {other:?}"),
        }
        let search = limiter.call_keys(&a, "search").unwrap();
        assert!(
            store.inspect(&search).await.unwrap()[1].is_none(),
            "nothing charged"
        );
    });
}

/// Exactness on the cluster: 2 replicas, 32 tasks each, Redis TIME.
#[test]
fn replicas_on_a_cluster_share_one_exact_budget() {
    let cluster = RedisCluster::start();
    let policy = Policy::from_toml_str(
        r#"
        [[tool]]
        name = "search"
        unit = "calls"
        rate = { limit = 200, per = "1s" }
        burst = 10
        [tool.tenants.heavy]
        weight = 3
        floor = 20
        ceiling = 200
        [tool.default_tenant]
        max_tenants = 40
        "#,
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let admitted: Arc<Mutex<Vec<u64>>> = Arc::default();
    rt.block_on(async {
        let stop = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::new();
        for r in 0..2 {
            let store = RedisStore::cluster_builder(cluster.urls())
                .timeout(Duration::from_secs(2))
                .connect()
                .await
                .unwrap();
            let limiter = Limiter::with_store(policy.clone(), store, SystemClock);
            for k in 0..32 {
                let (limiter, stop, admitted) = (limiter.clone(), stop.clone(), admitted.clone());
                let caller = if k % 4 == 0 {
                    Caller::new(format!("guest-{r}-{k}"))
                } else {
                    Caller::new("heavy")
                };
                handles.push(tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        match limiter.admit(&caller, "search", Cost(1.0)).await {
                            Ok(t) => admitted
                                .lock()
                                .unwrap()
                                .push(t.admission().unwrap().at.as_micros()),
                            Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
                        }
                    }
                }));
            }
        }
        tokio::time::sleep(Duration::from_millis(2000)).await;
        stop.store(true, Ordering::Relaxed);
        for h in handles {
            h.await.unwrap();
        }
    });
    let mut times = admitted.lock().unwrap().clone();
    times.sort_unstable();
    let span = (times[times.len() - 1] - times[0]) as f64 / 1e6;
    eprintln!("admitted {} over {span:.2} s on the cluster", times.len());
    assert!(times.len() as f64 > 200.0 * span * 0.8, "not saturated");
    let mut worst = f64::NEG_INFINITY;
    for i in 0..times.len() {
        for j in i..times.len() {
            let bound = 200.0 * (times[j] - times[i]) as f64 / 1e6 + 10.0 + 20.0 + 1e-6;
            worst = worst.max((j - i + 1) as f64 - bound);
        }
    }
    assert!(worst <= 0.0, "capacity bound broken by {worst}");
}

/// The `{...}` hash tag of a key (what Redis Cluster places it by): the text between the first
/// `{` and the next `}`, or the whole key when it has none.
fn hash_tag(key: &str) -> &str {
    key.find('{')
        .and_then(|a| key[a + 1..].find('}').map(|b| &key[a + 1..a + 1 + b]))
        .filter(|t| !t.is_empty())
        .unwrap_or(key)
}
