//! The object tracker (Nooks): everything the kernel holds through the driver.
//!
//! Owns: pure bookkeeping data structures, shared by the proxy's threads: requests in flight
//! ([`inflight`]), the nodes and handles the kernel holds ([`objects`]), and the changes a
//! driver acknowledged since its last checkpoint ([`redo`]).
//! Must not: do I/O, or know about processes and descriptors.

pub mod inflight;
pub mod objects;
pub mod redo;

pub use inflight::{Inflight, InflightTable, Patches, RequestBytes, RequestStore};
pub use objects::{
    reply_records, DriverForget, DriverNode, Handle, JournalError, Node, ObjectSnapshot,
    ObjectTable, PendingChange, RestorePlan, ToDriver, Untranslated, MAX_PENDING,
};
pub use redo::{Mutation, RedoLog, RedoSnapshot};
