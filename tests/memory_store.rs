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
