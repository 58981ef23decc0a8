//! The Redis store (work in progress).

/// Keeps admission state in Redis, shared by every replica.
#[derive(Debug)]
pub struct RedisStore {
    _private: (),
}
