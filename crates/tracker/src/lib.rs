//! The object tracker (Nooks): everything the kernel holds through the driver.
//!
//! Owns: pure bookkeeping data structures, shared by the proxy's threads.
//! Must not: do I/O, or know about processes and descriptors.

pub mod inflight;

pub use inflight::{Inflight, InflightTable};
