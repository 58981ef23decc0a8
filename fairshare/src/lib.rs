//! The `fairshare` command's library half: scenario simulation over a virtual clock and the
//! SVG chart of who got what. The binary (`src/main.rs`) adds `check`, `serve` and `demo`.
//!
//! Nothing here is part of `tower-fairshare`: a service that depends on the library compiles
//! none of it.

#![forbid(unsafe_code)]
#![deny(missing_docs)]
// A function reads whole: at most 80 lines of code (`clippy.toml`).
#![warn(clippy::too_many_lines)]
#![warn(missing_debug_implementations, unreachable_pub, rust_2018_idioms)]

pub mod chart;
pub mod simulate;
