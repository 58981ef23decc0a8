//! The conformance suite against the in-process store.

mod conformance;

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
