//! What the driver is: its command line, the parts of its program its sandbox shows, and its
//! executable, held open from the run's start.
//!
//! MINIX 3 keeps its drivers in memory so that a restart never depends on the disk. Here the
//! executable is opened once and every restart and standby runs that open file (through
//! `/proc/self/fd`), so a package upgrade that replaces or removes the file does not change
//! or break what a restart runs; `rebound upgrade` is how a new binary is taken. A script is
//! run by its path (its interpreter reopens it by name).
//!
//! Owns: the command line, opening the executable, building the `Command` that runs it.
//! Must not: start processes or confine them (`start_driver` and the sandbox do).

use std::ffi::OsString;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;

use crate::sandbox::program::Part;

/// The driver a run starts, at every start.
pub struct DriverCommand {
    /// The driver's command line, as given.
    pub argv: Vec<OsString>,
    /// argv[0], for the log.
    pub name: String,
    /// What its sandbox shows of its program (see `sandbox::program`).
    pub program: Vec<Part>,
    /// The executable, open since the run's start, and where it was found; `None` for a
    /// script.
    executable: Option<(File, PathBuf)>,
}

impl DriverCommand {
    /// The command line as bytes (for a successor: argv need not be UTF-8).
    pub fn argv_bytes(&self) -> Vec<Vec<u8>> {
        use std::os::unix::ffi::OsStrExt;
        self.argv.iter().map(|a| a.as_bytes().to_vec()).collect()
    }

    /// The driver `argv` names, its executable found as `execvp` would from the current
    /// directory and opened. Fails, naming it, if there is no such file.
    pub fn new(argv: Vec<OsString>) -> anyhow::Result<DriverCommand> {
        let program = argv.first().context("no driver command given")?;
        let name = program.to_string_lossy().into_owned();
        let cwd = std::env::current_dir().unwrap_or_else(|_| "/".into());
        let path = std::env::var_os("PATH");
        let found = crate::sandbox::program::executable(Path::new(program), &cwd, path.as_deref())
            .with_context(|| format!("driver `{name}`: no such program in PATH"))?;
        let mut file = File::open(&found)
            .with_context(|| format!("driver `{name}`: opening {}", found.display()))?;
        let mut magic = [0u8; 4];
        let elf = file.read_exact(&mut magic).is_ok() && magic == *b"\x7fELF";
        let program = crate::sandbox::program::find(&argv, &cwd, &|var| std::env::var_os(var));
        Ok(DriverCommand {
            argv,
            name,
            program,
            executable: elf.then_some((file, found)),
        })
    }

    /// A `Command` that runs the driver: by its path while the file there is still the one
    /// held open (its process then has its usual name), else the held executable through
    /// `/proc/self/fd/N` with its own argv[0] (its process is then named `N`), or a script by
    /// its path. (The descriptor is close-on-exec; `execve` resolves `/proc/self/fd/N` before
    /// it closes it, as `fexecve` does.)
    pub fn command(&self) -> Command {
        let (program, args) = self.argv.split_first().expect("checked in new");
        let mut command = match &self.executable {
            Some((file, path)) if !same_file(file, path) => {
                tracing::warn!(
                    "{} was replaced or removed since the run started: the driver runs the \
                     program it started with (`rebound upgrade` takes the new one)",
                    path.display()
                );
                let mut command = Command::new(format!("/proc/self/fd/{}", file.as_raw_fd()));
                command.arg0(program);
                command
            }
            Some((_, path)) => {
                let mut command = Command::new(path);
                command.arg0(program);
                command
            }
            None => Command::new(program),
        };
        command.args(args);
        for variable in crate::service::PRIVATE_VARIABLES {
            command.env_remove(variable);
        }
        command
    }

    /// Whether the command line names `mountpoint` as one of its arguments (the driver it
    /// runs would serve it).
    pub fn names(&self, mountpoint: &Path) -> bool {
        let wanted = crate::paths::mount_point_forms(mountpoint);
        self.argv.iter().skip(1).any(|arg| {
            crate::paths::mount_point_forms(Path::new(arg))
                .iter()
                .any(|form| wanted.contains(form))
        })
    }
}

/// Whether `path` still names the file `file` has open.
fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(held), Ok(now)) => (held.dev(), held.ino()) == (now.dev(), now.ino()),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_program_is_named() {
        let err = DriverCommand::new(vec!["no-such-driver-xyz".into(), "/mnt".into()])
            .err()
            .expect("refused");
        assert!(err.to_string().contains("no-such-driver-xyz"), "{err}");
    }

    #[test]
    fn an_elf_driver_runs_by_its_path_until_the_file_there_is_replaced() {
        let dir = std::env::temp_dir().join(format!("rebound-command-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let copy = dir.join("true");
        let system_true = DriverCommand::new(vec!["true".into()]).unwrap();
        let (_, found) = system_true.executable.as_ref().unwrap();
        std::fs::copy(found, &copy).unwrap();
        let command = DriverCommand::new(vec![copy.clone().into(), "x".into()]).unwrap();
        assert_eq!(command.command().get_program(), copy.as_os_str());
        // Replaced as a package manager does: a new file renamed over it.
        std::fs::copy(found, dir.join("new")).unwrap();
        std::fs::rename(dir.join("new"), &copy).unwrap();
        let program = command
            .command()
            .get_program()
            .to_string_lossy()
            .into_owned();
        assert!(program.starts_with("/proc/self/fd/"), "{program}");
        assert!(command.command().status().expect("runs").success());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_mount_point_is_found_among_the_arguments() {
        let command =
            DriverCommand::new(vec!["true".into(), "disk.img".into(), "/mnt/x/".into()]).unwrap();
        assert!(command.names(Path::new("/mnt/x")));
        assert!(!command.names(Path::new("/mnt/y")));
    }
}
