use super::*;
use crate::admission::engine::LevelRef;

/// A policy with one tool `t` at `rate` whose tenants a template governs (at most ten), with
/// `tenant` added to the template.
fn tool_t(rate: &str, tenant: &str) -> crate::Policy {
    crate::Policy::from_toml_str(&format!(
        "[[tool]]\nname = \"t\"\nunit = \"calls\"\nrate = {{ {rate} }}\nlease = \"off\"\n\
         [tool.default_tenant]\nmax_tenants = 10\n{tenant}"
    ))
    .expect("valid")
}

fn plan<'a>(tool: &'a Arc<crate::policy::ToolPolicy>, name: &'a Arc<str>, us: u64) -> Plan<'a> {
    Plan {
        now: Timestamp(1_767_225_600_000_000 + us),
        cost: 1.0,
        tool,
        tenant: LevelRef {
            name,
            policy: tool.tenant(name).expect("the template"),
        },
        instance: None,
        untenanted: false,
    }
}

/// Two calls whose hashes pick the same set are both remembered (one in each of its slots); a
/// third takes the slot of the refusal whose wait ends first.
#[test]
fn calls_that_meet_in_a_set_are_remembered_side_by_side() {
    let policy = tool_t("limit = 60, per = \"1m\"", "");
    let tool = policy.tool("t").expect("listed");
    let cell = MemoryStore::new().tool_cell("t");
    let names: Vec<Arc<str>> = ["a", "b", "c"].into_iter().map(Arc::from).collect();
    let plans: Vec<Plan<'_>> = names.iter().map(|n| plan(tool, n, 0)).collect();
    let mut memo = memo::Memo::default();
    // Waits of 3 s, 2 s and 5 s.
    for (p, secs) in plans.iter().zip([3, 2, 5]) {
        let mut r = crate::Refusal::new(crate::Reason::RateLimited, "t");
        r.retryable = true;
        r.not_before = Some(std::time::Duration::from_secs(secs));
        memo.remember(7, p, &cell, 0, &r);
        if secs == 2 {
            assert!(memo.recall(7, &plans[0]).is_some(), "a stays");
            assert!(memo.recall(7, p).is_some(), "b beside it");
        }
    }
    assert!(
        memo.recall(7, &plans[0]).is_some(),
        "a's wait ends last of the two: kept"
    );
    assert!(
        memo.recall(7, &plans[1]).is_none(),
        "b's wait ended first: its slot went to c"
    );
    assert!(memo.recall(7, &plans[2]).is_some());
}

/// A refused call with a sure wait is remembered and the same call answered from memory until
/// that wait is over (its time left as `retry_after`); a store told not to remembers nothing
/// and decides every call.
#[test]
fn a_refusal_with_a_sure_wait_is_remembered_for_that_wait() {
    let policy = tool_t("limit = 60, per = \"1m\"", "ceiling = 1\nburst = 1\n");
    let tool = policy.tool("t").expect("listed");
    let name = Arc::from("a");
    let remembered = |s: &MemoryStore| s.shards.iter().any(|p| lock(&p.0).memo.holds_any());
    for on in [true, false] {
        let store = MemoryStore::new().refusal_cache(on);
        assert!(matches!(
            store.decide_now(&plan(tool, &name, 0)),
            Decision::Admitted(_)
        ));
        let Decision::Refused(first) = store.decide_now(&plan(tool, &name, 0)) else {
            panic!("a ceiling of 1: refused");
        };
        let sure = first.not_before.expect("a rate refusal has a sure wait");
        assert!(sure >= std::time::Duration::from_millis(1), "{sure:?}");
        assert_eq!(remembered(&store), on);
        let Decision::Refused(again) = store.decide_now(&plan(tool, &name, 1_000)) else {
            panic!("within the sure wait: refused");
        };
        if on {
            let left = sure - std::time::Duration::from_millis(1);
            assert_eq!(again.retry_after, Some(left));
            assert_eq!((again.reason, again.scope), (first.reason, first.scope));
        }
    }
}

/// A refused call of a tenant never seen keeps nothing: an identity flood that is refused
/// grows no state.
#[test]
fn a_refused_newcomer_is_not_stored() {
    let policy = tool_t("limit = 60, per = \"1m\"", "max_concurrency = 1\n");
    let tool = policy.tool("t").expect("listed");
    let store = MemoryStore::new();
    let names: Vec<Arc<str>> = (0..30).map(|i| Arc::from(format!("id-{i}"))).collect();
    let admitted = names
        .iter()
        .filter(|n| matches!(store.decide_now(&plan(tool, n, 0)), Decision::Admitted(_)))
        .count();
    assert!(admitted > 0 && admitted < names.len(), "{admitted}");
    // The tool and one state per admitted tenant: those refused left nothing behind.
    assert_eq!(store.len(), 1 + admitted);
}

/// A call refused from memory does not take its tool's lock: it is answered while another
/// thread holds it (as a long decision of that tool would).
#[test]
fn a_remembered_refusal_is_given_without_the_tools_lock() {
    let policy = tool_t("limit = 60, per = \"1m\"", "ceiling = 1\nburst = 1\n");
    let tool = policy.tool("t").expect("listed");
    let name: Arc<str> = Arc::from("a");
    let store = MemoryStore::new();
    assert!(matches!(
        store.decide_now(&plan(tool, &name, 0)),
        Decision::Admitted(_)
    ));
    assert!(matches!(
        store.decide_now(&plan(tool, &name, 0)),
        Decision::Refused(_)
    ));
    let cell = store.tool_cell("t");
    let held = lock(&cell.inner);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            let again = store.decide_now(&plan(tool, &name, 1_000));
            tx.send(matches!(again, Decision::Refused(_)))
                .expect("sent");
        });
        // A deadline, not a wait for time to pass: the answer comes at once, or never while
        // the lock is held.
        let answer = rx.recv_timeout(std::time::Duration::from_secs(10));
        drop(held);
        assert_eq!(
            answer,
            Ok(true),
            "refused from memory, the tool's lock held elsewhere"
        );
    });
}

/// Two threads deciding for distinct tenants of one tool at once: no write to the tool's
/// state is lost, and the tool admits no more than its window allows.
#[test]
fn two_threads_on_one_tool_lose_no_write_and_admit_no_more_than_it_allows() {
    let policy = tool_t("limit = 100, per = \"1m\"", "ceiling = 100\nburst = 100\n");
    let tool = policy.tool("t").expect("listed");
    let store = MemoryStore::new();
    let names: Vec<Arc<str>> = (0..8).map(|i| Arc::from(format!("tenant-{i}"))).collect();
    let admitted: usize = std::thread::scope(|s| {
        let threads: Vec<_> = names
            .chunks(4)
            .map(|mine| {
                let store = &store;
                s.spawn(move || {
                    let mut n = 0;
                    for k in 0..400 {
                        let p = plan(tool, &mine[k % mine.len()], 0);
                        n += usize::from(matches!(store.decide_now(&p), Decision::Admitted(_)));
                    }
                    n
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("no panic"))
            .sum()
    });
    let counted = lock(&store.tool_cell("t").inner).state.total;
    assert_eq!(
        counted, admitted as f64,
        "every admitted call counted at the tool"
    );
    assert!(admitted > 0 && admitted <= 100, "{admitted} of at most 100");
}
