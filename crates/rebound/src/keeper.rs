//! rebound's keeper: a small process of its own that outlives rebound, so that rebound's death
//! (SIGKILL, a crash) does not take the mount with it.
//!
//! A run starts its keeper before anything else, detached (its parent exits at once, so it is
//! nobody's descendant in the run's process tree). Once the mount serves, the run hands the
//! keeper a reference to each kernel queue (`SCM_RIGHTS`), what a successor must know of the
//! run (the driver's command line, the config file, the mount point) and where the tracker's
//! journal is (`proxy::journal`); then, as they change, the mount's status (with the driver's
//! pids). A run that ends says so, and its keeper exits.
//!
//! If instead the socket closes without a word, rebound died. The requests it had read stay
//! with the kernel (the keeper's references keep the queues open). The keeper kills the
//! driver's processes, as rebound does after a crash, reads the journal into a hand-over and
//! execs `rebound run --resume`, the path a `rebound reload` takes: the successor sends the
//! kernel's requests again, starts a new driver and restores it the way it restores one after
//! a crash (the store rolled back to its last checkpoint, the redo log replayed, nodes looked
//! up, handles reopened). Applications wait and see no error.
//!
//! In fast mode the driver serves the kernel's queue itself until its first failure: the
//! keeper first takes the driver's own descriptors on the connection (the requests it read
//! live as long as one is open) and hands them on as queues, and the run's observer, pinned
//! under `/sys/fs/bpf/rebound/PID`, stays attached for the successor to read what rebound had
//! not drained.
//!
//! Owns: the keeper process, both ends of its socket, the take-over after a death. Must not:
//! touch the mount while rebound lives.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use serde::{Deserialize, Serialize};

use crate::control::{self, MountStatus};
use crate::proxy::HandOver;
use crate::supervisor::{Death, Succession};

/// The most kernel queues a run has (rebound's descriptor and its clones, one per CPU).
const MAX_QUEUES: usize = 64;
/// The largest message (a status, a mount's description).
const MAX_MESSAGE: usize = 256 << 10;
/// A status is sent at most this often.
const STATUS_EVERY: Duration = Duration::from_millis(200);

/// What a run tells its keeper.
#[derive(Debug, Serialize, Deserialize)]
enum ToKeeper {
    /// The mount serves; its kernel queues come with this message.
    Mount(KeptMount),
    Status(Box<MountStatus>),
    /// The run ends (or hands over by `rebound reload`): nothing to take over.
    End,
}

/// What a successor must know of a run, beside its status and the journal.
#[derive(Debug, Serialize, Deserialize)]
pub struct KeptMount {
    pub argv: Vec<Vec<u8>>,
    pub config: Option<PathBuf>,
    pub mountpoint: PathBuf,
    pub mounted_by_helper: bool,
    pub journal: PathBuf,
    /// The driver cgroups' `cgroup.procs` files: every process of the driver.
    pub cgroup_procs: Vec<PathBuf>,
}

/// A run's end of the socket to its keeper.
pub struct Keeper {
    socket: OwnedFd,
    /// The keeper's pid, which it sends first; `None` if it died before.
    pid: Option<u32>,
    last_status: Option<(Instant, MountStatus)>,
    ended: bool,
}

impl Keeper {
    /// Starts a keeper, detached. (Before rebound becomes child subreaper: the keeper must not
    /// be reparented to it.)
    pub fn spawn() -> anyhow::Result<Keeper> {
        let (ours, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .context("creating the keeper's socket")?;
        let exe = std::env::current_exe().context("finding rebound's binary")?;
        // It forks the keeper and exits: the keeper is then nobody's child here.
        let status = Command::new(exe)
            .arg("keep")
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .process_group(0)
            .status()
            .context("starting the keeper")?;
        anyhow::ensure!(status.success(), "the keeper did not start ({status})");
        // Its first message; only the keeper holds the other end now, so a keeper that died
        // before sending it ends the wait.
        let mut pid = [0u8; 4];
        let pid = match rustix::net::recv(&ours, &mut pid, RecvFlags::empty()) {
            Ok((4, _)) => Some(u32::from_le_bytes(pid)),
            _ => None,
        };
        Ok(Keeper {
            socket: ours,
            pid,
            last_status: None,
            ended: false,
        })
    }

    /// Gives the keeper the mount: its description and its kernel queues.
    pub fn keep_mount(&self, mount: KeptMount, queues: &[BorrowedFd<'_>]) -> io::Result<()> {
        send(&self.socket, &ToKeeper::Mount(mount), queues)
    }

    /// Sends the mount's status (taken from `snapshot`) if it changed, at most every
    /// [`STATUS_EVERY`].
    pub fn status(&mut self, snapshot: impl FnOnce() -> MountStatus) {
        if self
            .last_status
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < STATUS_EVERY)
        {
            return;
        }
        self.status_now(snapshot());
    }

    /// Sends the mount's status now if it changed.
    pub fn status_now(&mut self, status: MountStatus) {
        if self
            .last_status
            .as_ref()
            .is_none_or(|(_, last)| *last != status)
        {
            let _ = send(
                &self.socket,
                &ToKeeper::Status(Box::new(status.clone())),
                &[],
            );
        }
        self.last_status = Some((Instant::now(), status));
    }

    /// The keeper's pid, if it said it.
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// The run ends: the keeper exits without taking anything over.
    pub fn end(&mut self) {
        if !self.ended {
            self.ended = true;
            let _ = send(&self.socket, &ToKeeper::End, &[]);
        }
    }
}

impl Drop for Keeper {
    /// A run that returns (an error included) ends; only a death leaves the keeper to act.
    fn drop(&mut self) {
        self.end();
    }
}

fn send(socket: &OwnedFd, message: &ToKeeper, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let bytes = serde_json::to_vec(message)?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_QUEUES))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("too many kernel queues for the keeper"));
    }
    rustix::net::sendmsg(
        socket,
        &[IoSlice::new(&bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    Ok(())
}

/// `rebound keep`: the keeper process. Its socket is its standard input.
pub fn main(detached: bool) -> ExitCode {
    if !detached {
        // The first of two forks: the keeper's parent exits, and it is left to init.
        let spawned = std::env::current_exe().and_then(|exe| {
            Command::new(exe)
                .args(["keep", "--detached"])
                .stdout(Stdio::null())
                .process_group(0)
                .spawn()
        });
        return match spawned {
            Ok(_) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rebound: keeper: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let socket = std::io::stdin();
    let _ = rustix::net::send(
        socket.as_fd(),
        &std::process::id().to_le_bytes(),
        SendFlags::empty(),
    );
    match keep(socket.as_fd()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("keeper: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Keeps what the run sends until it ends (returns) or dies (execs a successor).
fn keep(socket: BorrowedFd<'_>) -> anyhow::Result<()> {
    let mut mount = None;
    let mut queues: Vec<OwnedFd> = Vec::new();
    let mut status = MountStatus::default();
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_QUEUES))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let received = rustix::net::recvmsg(
            socket,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        let len = match received {
            Ok(msg) => msg.bytes,
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => 0,
        };
        let mut fds = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = message {
                fds.extend(rights);
            }
        }
        if len == 0 {
            // The run is gone without a word: it died.
            return match mount {
                Some(mount) => take_over(&mount, &status, queues),
                None => Ok(()),
            };
        }
        match serde_json::from_slice(&buf[..len]).context("a message from rebound")? {
            ToKeeper::Mount(kept) => {
                mount = Some(kept);
                queues = fds;
            }
            ToKeeper::Status(s) => status = *s,
            ToKeeper::End => return Ok(()),
        }
    }
}

/// rebound died: waits for its driver, then execs a successor over the kept queues.
fn take_over(mount: &KeptMount, status: &MountStatus, queues: Vec<OwnedFd>) -> anyhow::Result<()> {
    tracing::warn!(
        "rebound (pid {}) died; its keeper takes {} over",
        status.rebound_pid,
        mount.mountpoint.display()
    );
    // As after a crash of the driver: its processes are killed, and the successor's recovery
    // rolls its store back to the last checkpoint and replays the journaled redo log. (Left
    // to exit by itself once its channel closes, a libfuse driver may never do so: its
    // teardown cancels worker threads wherever they are, and one cancelled while holding the
    // driver's own lock leaves the others waiting forever; fuse2fs and passthrough_ll did.)
    let mut queues = queues;
    queues.extend(drivers_devices(&driver_processes(mount, status)));
    kill_drivers(mount, status);
    let numbers: Vec<i32> = queues.iter().map(AsRawFd::as_raw_fd).collect();
    let pins = pins_of(status.rebound_pid);
    let proxy = HandOver::from_journal(numbers, &mount.journal, pins.exists().then_some(pins));
    let succession = Succession::after_death(
        mount,
        status.clone(),
        proxy,
        Death {
            pid: status.rebound_pid,
        },
    );
    let path = control::run_dir().join(format!("{}.handover", std::process::id()));
    std::fs::write(&path, serde_json::to_vec(&succession)?)
        .with_context(|| format!("writing {}", path.display()))?;
    let borrowed: Vec<_> = queues.iter().map(AsFd::as_fd).collect();
    rebound_sys::fuse_dev::keep_across_exec(&borrowed, true)?;
    let exe = crate::supervisor::installed_binary()?;
    let e = Command::new(&exe)
        .arg("run")
        .arg("--resume")
        .arg(&path)
        .stdin(Stdio::null())
        .exec();
    Err(e).with_context(|| format!("exec {}", exe.display()))
}

/// The dead run's live driver processes (the standby's too).
fn driver_processes(mount: &KeptMount, status: &MountStatus) -> Vec<i32> {
    let mut pids: Vec<i32> = mount
        .cgroup_procs
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|text| {
            text.lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect::<Vec<i32>>()
        })
        .chain(status.driver_pid)
        .chain(status.standby_pid)
        .filter(|&pid| alive(pid))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Fast mode: the driver's own descriptors on the connection (its clones of rebound's),
/// taken before it is killed. The requests it had read stay with the kernel only while a
/// descriptor they were read through is open; the successor has them sent again and reads
/// from these as from its own queues. (A standby's `/dev/fuse`, not mounted, is no
/// connection's: a clone of it fails, and it is left.)
fn drivers_devices(pids: &[i32]) -> Vec<OwnedFd> {
    use rustix::process::{pidfd_getfd, pidfd_open, Pid, PidfdFlags, PidfdGetfdFlags};
    let mut found = Vec::new();
    let mut holders = Vec::new();
    for &pid in pids {
        let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        let Some(pidfd) = Pid::from_raw(pid).and_then(|p| pidfd_open(p, PidfdFlags::empty()).ok())
        else {
            continue;
        };
        for entry in entries.flatten() {
            let fuse = std::fs::read_link(entry.path())
                .is_ok_and(|target| target == std::path::Path::new("/dev/fuse"));
            let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            if !fuse {
                continue;
            }
            match pidfd_getfd(&pidfd, fd, PidfdGetfdFlags::empty()) {
                Ok(device) if rebound_sys::fuse_dev::clone_connection(device.as_fd()).is_ok() => {
                    found.push(device);
                    holders.push(pid);
                }
                _ => {}
            }
        }
    }
    if !found.is_empty() {
        holders.dedup();
        tracing::info!(
            "kept {} of the driver's descriptors on the connection (of pids {holders:?}): the \
             requests it read are sent again",
            found.len()
        );
    }
    found
}

/// Kills the dead run's driver processes (the standby too) and waits, a few seconds at most,
/// until they are gone.
fn kill_drivers(mount: &KeptMount, status: &MountStatus) {
    let deadline = Instant::now() + KILL_TIMEOUT;
    loop {
        let left = driver_processes(mount, status);
        if left.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            tracing::warn!("driver processes {left:?} outlived SIGKILL; taking over anyway");
            return;
        }
        for pid in left {
            kill(pid);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// How long the dead run's driver processes may take to die.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether any thread of `pid` runs. A zombie has exited and waits for its new parent, but
/// its leader is a zombie as soon as it has exited itself, while its other threads may still
/// be writing to the driver's image: the successor must not roll the image back under them.
fn alive(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // The state follows the command, which is in parentheses and may hold any byte.
            stat.rsplit_once(')')
                .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
        })
    })
}

fn kill(pid: i32) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

/// The journal directory of the run with `pid`.
pub fn journal_dir(pid: u32) -> PathBuf {
    control::run_dir().join(format!("{pid}.journal"))
}

/// Where the BPF file system is expected (and mounted if it is not, as systemd does).
const BPF_FS: &str = "/sys/fs/bpf";
/// `BPF_FS_MAGIC`, the BPF file system's `statfs` type.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Where the run with `pid` pins its observer (fast mode), should it die: `/sys/fs/bpf/
/// rebound/PID`.
pub fn pins_of(pid: u32) -> PathBuf {
    PathBuf::from(BPF_FS).join("rebound").join(pid.to_string())
}

/// Where the host's one forget program is pinned, shared by every fast-mode run
/// (`rebound_observe`'s `shared`): `/sys/fs/bpf/rebound/forgets-1`. The number is that of
/// the layout its maps and records have: a rebound that changes it takes the next, so that
/// runs of both versions can live on one host (each version shares its own). (The BPF file
/// system refuses names with a dot.)
pub fn shared_forget_pins() -> PathBuf {
    PathBuf::from(BPF_FS).join("rebound").join("forgets-1")
}

/// [`pins_of`] this run, with the BPF file system mounted at `/sys/fs/bpf` if it was not;
/// `None` (said why) if it cannot be: the observer is then not pinned, and rebound's death
/// before the driver's first failure loses what it had not yet drained. The run's `keeper`
/// (its pid) is marked there, and pins that no live run or keeper can use any more go.
pub fn observer_pins(pid: u32, keeper: Option<u32>) -> Option<PathBuf> {
    let is_bpf_fs = || rustix::fs::statfs(BPF_FS).is_ok_and(|s| s.f_type == BPF_FS_MAGIC);
    if !is_bpf_fs() {
        let mounted = rustix::mount::mount(
            "bpf",
            BPF_FS,
            "bpf",
            rustix::mount::MountFlags::NOSUID
                | rustix::mount::MountFlags::NODEV
                | rustix::mount::MountFlags::NOEXEC,
            c"mode=700",
        );
        match mounted {
            Ok(()) => tracing::info!("mounted the BPF file system on {BPF_FS}"),
            Err(e) => {
                tracing::warn!(
                    "no BPF file system on {BPF_FS} ({e}): should rebound die before the \
                     driver's first failure, its successor may miss what the observer saw last"
                );
                return None;
            }
        }
    }
    remove_stale_pins();
    // A run that died with this pid and was never taken over may have left its pins here;
    // pinning over them would fail (and with it fast mode).
    let dir = pins_of(pid);
    rebound_observe::remove_pins(&dir);
    if let Some(keeper) = keeper {
        if let Err(e) = std::fs::create_dir_all(dir.join(format!("{KEEPER_MARK}{keeper}"))) {
            tracing::debug!("marking the keeper by the observer's pins: {e}");
        }
    }
    Some(dir)
}

/// How a pins directory names the keeper that may take them over: `keeper-PID`.
const KEEPER_MARK: &str = "keeper-";

/// Removes the pins of runs that are gone and whose keeper is gone too (both killed): nothing
/// will ever drain them, and pinned, their programs stay attached and run at every FUSE
/// request and `kfree` of the host.
fn remove_stale_pins() {
    // (A zombie is gone: a killed keeper is nobody's child, and may wait to be reaped.)
    let alive = |pid: &str| pid.parse().is_ok_and(crate::supervisor::runs_on);
    let root = PathBuf::from(BPF_FS).join("rebound");
    for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.parse::<u32>().is_err() || alive(&name) {
            continue;
        }
        let kept = std::fs::read_dir(entry.path())
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                let mark = e.file_name().to_string_lossy().into_owned();
                mark.strip_prefix(KEEPER_MARK).is_some_and(alive)
            });
        if !kept {
            tracing::info!(
                "removing the observer pinned by run {name}, which is gone with its keeper"
            );
            rebound_observe::remove_pins(&entry.path());
        }
    }
}
