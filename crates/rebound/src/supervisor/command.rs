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
use std::os::unix::process::CommandExt;
use std::path::Path;
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
    /// The executable, open since the run's start; `None` for a script.
    executable: Option<File>,
}

impl DriverCommand {
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
            executable: elf.then_some(file),
        })
    }

    /// A `Command` that runs the driver: its held executable with its own argv[0], or a
    /// script by its path. (The descriptor is close-on-exec; `execve` resolves
    /// `/proc/self/fd/N` before it closes it, as `fexecve` does.)
    pub fn command(&self) -> Command {
        let (program, args) = self.argv.split_first().expect("checked in new");
        let mut command = match &self.executable {
            Some(file) => {
                let mut command = Command::new(format!("/proc/self/fd/{}", file.as_raw_fd()));
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
    fn an_elf_driver_runs_from_its_open_file_with_its_own_name() {
        let command = DriverCommand::new(vec!["true".into(), "x".into()]).expect("true exists");
        let program = command
            .command()
            .get_program()
            .to_string_lossy()
            .into_owned();
        assert!(program.starts_with("/proc/self/fd/"), "{program}");
        let status = command.command().status().expect("runs");
        assert!(status.success());
    }

    #[test]
    fn the_mount_point_is_found_among_the_arguments() {
        let command =
            DriverCommand::new(vec!["true".into(), "disk.img".into(), "/mnt/x/".into()]).unwrap();
        assert!(command.names(Path::new("/mnt/x")));
        assert!(!command.names(Path::new("/mnt/y")));
    }
}
