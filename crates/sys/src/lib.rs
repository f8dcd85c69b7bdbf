//! The only crate of rebound that contains `unsafe`: system interfaces that no safe crate
//! wraps. Every `unsafe` block carries a `SAFETY:` reason.
//!
//! Owns: the seccomp user-notification filter that lets rebound see a driver's `mount(2)` and
//! `umount2(2)` and denies what no driver needs ([`seccomp`]), confining a driver (cgroups,
//! rlimits, namespaces, capabilities; [`sandbox`]), spawning a driver with both in place
//! ([`spawn`]), cloning a FUSE connection into more queues ([`fuse_dev`]), reading what a dead
//! reader left in a BPF ring buffer ([`bpf_ring`]), reading BPF maps' memory ([`bpf_map`]), and
//! buffers the kernel fills without a page fault ([`resident`]).
//! Must not: contain policy (what to do with a notification is the supervisor's business).

pub mod bpf_map;
pub mod bpf_ring;
pub mod fuse_dev;
pub mod resident;
pub mod sandbox;
pub mod seccomp;
pub mod spawn;
