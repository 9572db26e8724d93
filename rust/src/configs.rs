//! The configs of `spawn_sandbox` and `exec_in` as Python classes: typed, keyword-only
//! constructors (defaults where one is sensible), checked once when made; the calls take them
//! as they are. A class holds the core's own config, read without copying.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::cgview::CgMount;
use crate::enter::ExecConfig;
use crate::harden::{self, Rlimit};
use crate::spawn::{Overlay, SpawnConfig};

/// `{name: n | (soft, hard)}` (names as in prlimit: nofile, core, ...) -> the core's limits.
fn rlimits(d: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<Rlimit>> {
    let Some(m) = d else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (k, v) in m.iter() {
        let name: String = k
            .extract()
            .map_err(|_| PyValueError::new_err("rlimit names are str"))?;
        let (soft, hard) = if let Ok(n) = v.extract::<i128>() {
            (n, n)
        } else if let Ok(pair) = v.extract::<(i128, i128)>() {
            pair
        } else {
            return Err(PyValueError::new_err(format!(
                "rlimit {name}: expected an int or a (soft, hard) pair"
            )));
        };
        out.push(harden::rlimit(&name, soft, hard)?);
    }
    Ok(out)
}

/// One overlay mount of a new sandbox: `target` inside it ("/" first), lowerdirs top-first.
#[pyclass(name = "Overlay", module = "corral._core", frozen)]
pub struct PyOverlay(pub Overlay);

#[pymethods]
impl PyOverlay {
    #[new]
    #[pyo3(signature = (*, target, lower, upper, work, options = Vec::new()))]
    fn new(
        target: String,
        lower: Vec<String>,
        upper: String,
        work: String,
        options: Vec<String>,
    ) -> Self {
        Self(Overlay {
            target,
            lower,
            upper,
            work,
            options,
        })
    }
}

/// `spawn_sandbox`'s config: a new sandbox, its init started (see spawn::SpawnConfig).
#[pyclass(name = "SpawnConfig", module = "corral._core", frozen)]
pub struct PySpawnConfig(pub SpawnConfig);

#[pymethods]
impl PySpawnConfig {
    #[new]
    #[pyo3(signature = (
        *, init_fd, root, overlays, hostname = "sandbox".to_string(), cgroup_procs = Vec::new(),
        rlimits = None, netns_fd = None, unix_only = false, mask_dir = None,
        proc_readonly = Vec::new(), proc_mask_files = Vec::new(), proc_mask_dirs = Vec::new(),
        proc_binds = Vec::new(), sys_dir = None, cgroup_mounts = Vec::new(), tmp_size_mb = None,
        tmp_tmpfs = true, dev_dir = None, shm_dir = None, detach = Vec::new()
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        init_fd: i32,
        root: String,
        overlays: Vec<Bound<'_, PyOverlay>>,
        hostname: String,
        cgroup_procs: Vec<String>,
        rlimits: Option<Bound<'_, PyDict>>,
        netns_fd: Option<i32>,
        unix_only: bool,
        mask_dir: Option<String>,
        proc_readonly: Vec<String>,
        proc_mask_files: Vec<String>,
        proc_mask_dirs: Vec<String>,
        proc_binds: Vec<(String, String)>,
        sys_dir: Option<String>,
        cgroup_mounts: Vec<CgMount>,
        tmp_size_mb: Option<u64>,
        tmp_tmpfs: bool,
        dev_dir: Option<String>,
        shm_dir: Option<String>,
        detach: Vec<String>,
    ) -> PyResult<Self> {
        Ok(Self(SpawnConfig {
            init_fd,
            root,
            overlays: overlays.iter().map(|o| o.get().0.clone()).collect(),
            hostname,
            cgroup_procs,
            rlimits: self::rlimits(rlimits.as_ref())?,
            netns_fd,
            unix_only,
            mask_dir,
            proc_readonly,
            proc_mask_files,
            proc_mask_dirs,
            proc_binds,
            sys_dir,
            cgroup_mounts,
            tmp_size_mb,
            tmp_tmpfs,
            dev_dir,
            shm_dir,
            detach,
        }))
    }
}

/// `exec_in`'s config: a command started in a live sandbox by the daemon's own path (see
/// enter::ExecConfig).
#[pyclass(name = "ExecConfig", module = "corral._core", frozen)]
pub struct PyExecConfig(pub ExecConfig);

#[pymethods]
impl PyExecConfig {
    #[new]
    #[pyo3(signature = (
        *, init_pid, pidfd, argv, root_fd = None, env = Vec::new(), cwd = "/".to_string(),
        uid = 0, gid = 0, groups = Vec::new(), stdin = -1, stdout = -1, stderr = -1,
        cgroup_procs = Vec::new(), rlimits = None, tty = false, unix_only = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        init_pid: i32,
        pidfd: i32,
        argv: Vec<String>,
        root_fd: Option<i32>,
        env: Vec<String>,
        cwd: String,
        uid: u32,
        gid: u32,
        groups: Vec<u32>,
        stdin: i32,
        stdout: i32,
        stderr: i32,
        cgroup_procs: Vec<String>,
        rlimits: Option<Bound<'_, PyDict>>,
        tty: bool,
        unix_only: bool,
    ) -> PyResult<Self> {
        Ok(Self(ExecConfig {
            init_pid,
            pidfd,
            root_fd,
            argv,
            env,
            cwd,
            uid,
            gid,
            groups,
            stdin,
            stdout,
            stderr,
            cgroup_procs,
            rlimits: self::rlimits(rlimits.as_ref())?,
            tty,
            unix_only,
        }))
    }
}
