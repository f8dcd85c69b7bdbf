//! Prometheus metrics of one mount: requests and their latencies by opcode (recorded by the
//! proxy), recoveries and their latencies, failures by cause, the tracker's sizes and the
//! driver's cgroup, exposed on a local HTTP listener (`GET /metrics`) and/or rewritten into a
//! text file, as `[metrics]` says (off by default).
//!
//! The request path only adds to relaxed atomic counters ([`RequestMetrics`]); everything else
//! is read from the status board at each scrape and encoded with `prometheus-client`.
//!
//! Owns: the metric names and help texts, the histograms' buckets, the listener and the file.
//! Must not: block or lock on the request path, or change the run it describes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::config::MetricsConfig;
use crate::control::StatusBoard;

/// Upper bounds of the latency buckets, in seconds (a last one, +Inf, catches the rest):
/// from a cached `stat` (tens of µs) to a slow network driver or a recovery (seconds).
const BUCKETS_S: [f64; 16] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
    250e-3, 1.0, 2.5,
];

/// A latency histogram that the request path fills without a lock.
#[derive(Debug)]
pub struct Histogram {
    /// Observations per bucket (not cumulative); the last is +Inf.
    counts: [AtomicU64; BUCKETS_S.len() + 1],
    sum_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn observe(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        let bucket = BUCKETS_S.partition_point(|&bound| bound < seconds);
        self.counts[bucket].fetch_add(1, Relaxed);
        self.sum_ns
            .fetch_add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    /// (sum in seconds, count, cumulative counts per upper bound, +Inf last).
    fn cumulative(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let mut total = 0;
        let buckets = self
            .counts
            .iter()
            .zip(BUCKETS_S.iter().copied().chain([f64::INFINITY]))
            .map(|(count, bound)| {
                total += count.load(Relaxed);
                (bound, total)
            })
            .collect();
        (self.sum_ns.load(Relaxed) as f64 / 1e9, total, buckets)
    }
}

/// Opcodes below this have series of their own; the rare others (CUSE) share the last. The
/// observer of fast mode counts the same way.
const OPCODE_SLOTS: usize = rebound_observe::OPCODE_SLOTS;

/// Requests forwarded to the driver and the latency of its replies, by opcode.
#[derive(Debug)]
pub struct RequestMetrics {
    requests: [AtomicU64; OPCODE_SLOTS],
    latency: [Histogram; OPCODE_SLOTS],
}

impl Default for RequestMetrics {
    fn default() -> Self {
        RequestMetrics {
            requests: std::array::from_fn(|_| AtomicU64::new(0)),
            latency: std::array::from_fn(|_| Histogram::default()),
        }
    }
}

fn slot(opcode: u32) -> usize {
    (opcode as usize).min(OPCODE_SLOTS - 1)
}

impl RequestMetrics {
    /// A request of `opcode` is forwarded to the driver.
    pub fn request(&self, opcode: u32) {
        self.requests[slot(opcode)].fetch_add(1, Relaxed);
    }

    /// The driver answered a request of `opcode` sent at `sent`.
    pub fn reply(&self, opcode: u32, sent: Instant) {
        self.latency[slot(opcode)].observe(sent.elapsed());
    }

    /// Fast mode: the requests that ended while the driver served the kernel's queue, as the
    /// observer counted them by opcode (no latency: rebound does not see them sent).
    pub fn observed(&self, ended: &[u64; OPCODE_SLOTS]) {
        for (count, &ended) in self.requests.iter().zip(ended) {
            count.store(ended, Relaxed);
        }
    }
}

fn opcode_name(slot: usize) -> String {
    if slot == OPCODE_SLOTS - 1 {
        return "other".into();
    }
    match fuse_wire::abi::Opcode::from_raw(slot as u32) {
        Some(op) => format!("{op:?}").to_lowercase(),
        None => slot.to_string(),
    }
}

/// The metrics of the mount `board` describes, as `prometheus-client` asks them of a
/// collector at each scrape.
struct MountCollector {
    board: Arc<StatusBoard>,
}

impl std::fmt::Debug for MountCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MountCollector")
    }
}

type Labels<'a> = Vec<(&'static str, &'a str)>;

/// One metric family: its descriptor, then a sample per label set.
fn family<'a, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    samples: impl IntoIterator<Item = (Labels<'a>, M)>,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in samples {
        value.encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

fn histogram<'a>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (Labels<'a>, (f64, u64, Vec<(f64, u64)>))>,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, (sum, count, buckets)) in samples {
        metric
            .encode_family(&labels)?
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                sum, count, &buckets, None,
            )?;
    }
    Ok(())
}

impl Collector for MountCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.board.snapshot();
        let mount = || vec![("mountpoint", s.mountpoint.as_str())];
        let counter = |v: u64| [(mount(), ConstCounter::new(v))];
        let gauge = |v: i64| [(mount(), ConstGauge::new(v))];
        let e = &mut encoder;
        let names: Vec<String> = (0..OPCODE_SLOTS).map(opcode_name).collect();
        if let Some(stats) = self.board.stats() {
            let by = &stats.by_opcode;
            let used = || (0..OPCODE_SLOTS).filter(|&i| by.requests[i].load(Relaxed) > 0);
            family(
                e,
                "rebound_requests",
                "Requests forwarded to the driver, by opcode",
                MetricType::Counter,
                used().map(|i| {
                    let mut labels = mount();
                    labels.push(("opcode", names[i].as_str()));
                    (labels, ConstCounter::new(by.requests[i].load(Relaxed)))
                }),
            )?;
            histogram(
                e,
                "rebound_request_duration_seconds",
                "Time from a request's sending to the driver to its reply, by opcode",
                used().map(|i| {
                    let mut labels = mount();
                    labels.push(("opcode", names[i].as_str()));
                    (labels, by.latency[i].cumulative())
                }),
            )?;
        }
        histogram(
            e,
            "rebound_recovery_duration_seconds",
            "Time from a driver's failure to the first request its successor served",
            [(mount(), self.board.recoveries.cumulative())],
        )?;
        family(
            e,
            "rebound_driver_failures",
            "Driver failures by cause (crash, hang, refused_reply, second_opinion, hoarding, \
             operator, upgrade, during_restore)",
            MetricType::Counter,
            s.failures_by_cause.iter().map(|(cause, n)| {
                let mut labels = mount();
                labels.push(("cause", cause.as_str()));
                (labels, ConstCounter::new(*n))
            }),
        )?;
        let counters: [(&str, &str, u64); 7] = [
            (
                "rebound_restarts",
                "Driver restarts that served",
                u64::from(s.restarts),
            ),
            (
                "rebound_upgrades",
                "Upgrades whose new driver served",
                s.upgrades,
            ),
            (
                "rebound_lost_objects",
                "Nodes and handles recoveries could not restore",
                s.lost_objects,
            ),
            (
                "rebound_refused_replies",
                "Driver messages refused by validation",
                s.refused_replies,
            ),
            (
                "rebound_second_opinions",
                "Error replies asked again of a restarted driver",
                s.second_opinions,
            ),
            (
                "rebound_second_opinions_confirmed",
                "Second opinions that gave the same error",
                s.second_opinions_confirmed,
            ),
            (
                "rebound_standby_takeovers",
                "Recoveries a standby successor served",
                s.standby_takeovers,
            ),
        ];
        for (name, help, value) in counters {
            family(e, name, help, MetricType::Counter, counter(value))?;
        }
        let gauges: [(&str, &str, u64); 8] = [
            (
                "rebound_nodes",
                "Nodes the kernel holds through the driver",
                s.nodes as u64,
            ),
            (
                "rebound_open_handles",
                "Open file and directory handles",
                s.open_handles as u64,
            ),
            (
                "rebound_redo_log_entries",
                "Acknowledged changes no checkpoint covers yet",
                s.redo_log_entries,
            ),
            (
                "rebound_standby_lacking_changes",
                "Logged changes the standby on the image's spare has not been given yet",
                s.standby_lacks,
            ),
            (
                "rebound_serving",
                "1 while the driver serves the mount",
                u64::from(s.state == "serving"),
            ),
            (
                "rebound_driver_memory_bytes",
                "Anonymous memory of the driver's cgroup",
                s.driver_memory_bytes,
            ),
            (
                "rebound_driver_tasks",
                "Processes and threads of the driver's cgroup",
                s.driver_tasks,
            ),
            (
                "rebound_driver_cpu_milliseconds",
                "CPU time of the current driver's cgroup",
                s.driver_cpu_ms,
            ),
        ];
        for (name, help, value) in gauges {
            let value = i64::try_from(value).unwrap_or(i64::MAX);
            family(e, name, help, MetricType::Gauge, gauge(value))?;
        }
        Ok(())
    }
}

/// The metrics of `board` in the OpenMetrics text format.
pub fn render(board: &Arc<StatusBoard>) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(MountCollector {
        board: board.clone(),
    }));
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    text
}

/// Starts what `config` asks for: the listener, the text file's writer. Each runs on a
/// thread of its own for the life of the run.
pub fn start(config: &MetricsConfig, board: &Arc<StatusBoard>) -> anyhow::Result<()> {
    if let Some(addr) = config.listen_addr() {
        let listener =
            TcpListener::bind(addr).with_context(|| format!("metrics: listening on {addr}"))?;
        let board = board.clone();
        std::thread::Builder::new()
            .name("metrics-http".into())
            .spawn(move || {
                for conn in listener.incoming().flatten() {
                    answer(conn, &board);
                }
            })?;
        tracing::info!("metrics on http://{addr}/metrics");
    }
    if let Some(path) = config.textfile.clone() {
        let board = board.clone();
        let every = Duration::from_millis(config.textfile_interval_ms);
        std::thread::Builder::new()
            .name("metrics-file".into())
            .spawn(move || loop {
                if let Err(e) = write_file(&path, &render(&board)) {
                    tracing::warn!("metrics: writing {}: {e}", path.display());
                }
                std::thread::sleep(every);
            })?;
    }
    Ok(())
}

/// Answers one HTTP request: the metrics for `GET /metrics`, 404 otherwise. (One local GET
/// needs no HTTP library.)
fn answer(mut conn: TcpStream, board: &Arc<StatusBoard>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = conn.set_write_timeout(Some(Duration::from_secs(2)));
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, target) = (words.next(), words.next());
    let (status, kind, body) = match (method, target) {
        (Some(b"GET"), Some(b"/metrics")) => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            render(board),
        ),
        _ => ("404 Not Found", "text/plain", "only GET /metrics\n".into()),
    };
    let _ = write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// Replaces `path` with `text` at once (written beside it, then renamed over it).
fn write_file(path: &Path, text: &str) -> std::io::Result<()> {
    let mut tmp = PathBuf::from(path);
    tmp.as_mut_os_string().push(".tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_counts_into_cumulative_buckets() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(5));
        h.observe(Duration::from_micros(30));
        h.observe(Duration::from_secs(10));
        let (sum, count, buckets) = h.cumulative();
        assert_eq!(count, 3);
        assert!((sum - 10.000035).abs() < 1e-9, "{sum}");
        assert_eq!(buckets[0], (10e-6, 1));
        assert_eq!(buckets[2], (50e-6, 2));
        assert_eq!(*buckets.last().unwrap(), (f64::INFINITY, 3));
    }

    #[test]
    fn the_board_is_rendered_with_its_figures() {
        let board = Arc::new(StatusBoard::default());
        board.update(|s| {
            s.mountpoint = "/mnt/x".into();
            s.state = "serving".into();
            s.restarts = 2;
            s.failures_by_cause.insert("crash".into(), 2);
        });
        let text = render(&board);
        assert!(
            text.contains("rebound_restarts_total{mountpoint=\"/mnt/x\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("rebound_driver_failures_total{mountpoint=\"/mnt/x\",cause=\"crash\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("rebound_serving{mountpoint=\"/mnt/x\"} 1"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
