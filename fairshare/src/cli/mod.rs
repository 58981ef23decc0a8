//! The `serve` and `demo` commands of `fairshare`: a reference axum gateway in front of
//! [`FairShareLayer`](tower_fairshare::FairShareLayer), and a self-contained run of the
//! acceptance test against it over loopback HTTP.

pub(crate) mod demo;
pub(crate) mod keys;
pub(crate) mod serve;
