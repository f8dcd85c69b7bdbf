//! Compiles the observer's BPF program with clang (`scripts/deps.sh` installs it).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let source = "bpf/observe.bpf.c";
    println!("cargo:rerun-if-changed={source}");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("observe.bpf.o");
    let status = Command::new("clang")
        .args([
            "-O2", "-g", "-target", "bpf", "-Wall", "-Werror", "-c", source, "-o",
        ])
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("clang failed to compile {source} ({s})"),
        Err(e) => panic!(
            "clang, needed to compile {source}, could not run: {e} (scripts/deps.sh installs it)"
        ),
    }
}
