//! `rebound observe MOUNTPOINT`: the requests of any FUSE mount as they end, with what each
//! changes (names, node ids, handles) and its outcome, and the forgets its driver reads — seen
//! from beside the path by `rebound-observe` (its cost on a driver's stat latency was within
//! this machine's noise, bench/results/fast-path-spike-2026-11-25.md). It is the view
//! rebound's fast path will keep its tracker with; a user gets a FUSE-level trace of a mount
//! that rebound need not serve.
//!
//! Owns: printing the events. Must not: attach anything itself (`rebound-observe` does).

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use fuse_wire::change::{direntplus_entries, entry_node};
use fuse_wire::{Change, Request};
use rebound_observe::{Event, Observer};

/// How often the ring is drained.
const DRAIN_EVERY: Duration = Duration::from_millis(20);

pub fn run(mountpoint: &Path, seconds: Option<u64>) -> anyhow::Result<()> {
    let mut observer = Observer::attach(
        &crate::paths::in_mount_table(mountpoint),
        u64::MAX,
        None,
        None,
    )?;
    eprintln!(
        "observing {}{}",
        mountpoint.display(),
        seconds.map_or(" until interrupted".into(), |s| format!(" for {s} s"))
    );
    let end = seconds.map(|s| Instant::now() + Duration::from_secs(s));
    // Node ids this connection's driver gave (forgets are seen for every connection).
    let mut known: HashSet<u64> = HashSet::from([1]);
    let mut out = std::io::stdout().lock();
    loop {
        std::thread::sleep(DRAIN_EVERY);
        for event in observer.drain() {
            let line = match event {
                Event::Request {
                    request,
                    reply,
                    cut,
                } => describe(&request, &reply, cut, &mut known),
                Event::Forget {
                    node,
                    count,
                    reader,
                } if known.contains(&node) => Some(format!(
                    "FORGET node {node} count {count} (read by pid {reader})"
                )),
                Event::Forget { .. } => None,
            };
            if let Some(line) = line {
                writeln!(out, "{line}").context("writing to standard output")?;
            }
        }
        out.flush().context("writing to standard output")?;
        if end.is_some_and(|end| Instant::now() >= end) {
            return Ok(());
        }
    }
}

/// One line for a request that ended; records the node ids its reply gave.
fn describe(request: &[u8], reply: &[u8], cut: bool, known: &mut HashSet<u64>) -> Option<String> {
    let request = Request::parse(request).ok()?;
    let error = reply
        .get(4..8)
        .map_or(0, |e| i32::from_le_bytes(e.try_into().unwrap_or_default()));
    let body = reply.get(16..).unwrap_or_default();
    let name = request.opcode.map_or_else(
        || format!("opcode {}", request.header.opcode),
        |op| format!("{op:?}").to_uppercase(),
    );
    let mut line = format!(
        "{name} unique {} node {}",
        request.header.unique, request.header.nodeid
    );
    let text = |name: &[u8]| String::from_utf8_lossy(name).into_owned();
    match request.change() {
        Change::Entry { name, .. } | Change::Create { name, .. } => {
            line += &format!(" '{}'", text(name));
            if error == 0 {
                if let Some(node) = entry_node(body) {
                    known.insert(node);
                    line += &format!(" -> node {node}");
                }
            }
        }
        Change::Remove { name, .. } => line += &format!(" '{}'", text(name)),
        Change::Rename {
            name,
            new_parent,
            new_name,
            ..
        } => {
            line += &format!(
                " '{}' -> node {new_parent} '{}'",
                text(name),
                text(new_name)
            )
        }
        Change::Release { fh, .. } => line += &format!(" fh {fh}"),
        Change::ReaddirPlus { .. } if error == 0 => {
            let entries: Vec<String> = direntplus_entries(body)
                .filter(|(_, node, _)| *node != 0)
                .map(|(_, node, name)| {
                    known.insert(node);
                    format!("'{}' -> node {node}", text(name))
                })
                .collect();
            line += &format!(" [{}]", entries.join(", "));
        }
        _ => {}
    }
    line += &match error {
        0 => " ok".to_string(),
        e => format!(" error {}", std::io::Error::from_raw_os_error(-e)),
    };
    if cut {
        line += " (arguments cut)";
    }
    Some(line)
}
