//! Compiles `init/corral-init.c` (a tiny static PID 1), `init/corral-exec.c` (exec_in's
//! trampoline) and `init/corral-lockdown.c` (the gvisor substrate's lock-down) into the
//! binaries the library embeds.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    build("corral-init");
    build("corral-exec");
    build("corral-lockdown");
}

fn build(name: &str) {
    let src = PathBuf::from(format!("init/{name}.c"));
    println!("cargo:rerun-if-changed={}", src.display());
    println!("cargo:rerun-if-changed=init/syscall.h");
    println!("cargo:rerun-if-env-changed=CORRAL_INIT_CC");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR")).join(name);
    let cc = env::var("CORRAL_INIT_CC").unwrap_or_else(|_| "cc".to_string());
    let status = Command::new(&cc)
        .args([
            "-static",
            "-nostdlib",
            "-ffreestanding",
            "-fno-stack-protector",
            "-fno-pie",
            "-no-pie",
            "-Os",
            "-s",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fno-asynchronous-unwind-tables",
            // no memset/memcpy calls for loops: there is no libc to call
            "-fno-tree-loop-distribute-patterns",
            "-Wl,--build-id=none",
            "-o",
        ])
        .arg(&out)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("running {cc} to build {name}: {e}"));
    assert!(status.success(), "{cc} failed to build {name} ({status})");
}
