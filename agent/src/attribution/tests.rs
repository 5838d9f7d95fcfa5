//! The [`Attributor`] against procfs trees built in a temporary directory.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tempfile::TempDir;

use super::*;

const BTIME: u64 = 1_700_000_000;
const ID: &str = "3f4e1a2b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b";
const POD: &str = "1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d";
const POD_US: &str = "1a2b3c4d_5e6f_4a7b_8c9d_0e1f2a3b4c5d";

/// A procfs root with a `stat` carrying `btime`.
struct FakeProc {
    dir: TempDir,
}

/// What one fake process's files say.
#[derive(Clone)]
struct Proc {
    pid: u32,
    comm: String,
    start_ticks: u64,
    uid: u32,
    nspid: Vec<u32>,
    cmdline: Vec<u8>,
    cgroup: String,
}

impl Proc {
    fn new(pid: u32) -> Self {
        Self {
            pid,
            comm: "python3".into(),
            start_ticks: 12_345,
            uid: 1000,
            nspid: vec![pid],
            cmdline: b"python3\0train.py\0--epochs\x0010\0".to_vec(),
            cgroup: "0::/user.slice/user-1000.slice/session-3.scope\n".into(),
        }
    }

    fn cgroup(mut self, cgroup: impl Into<String>) -> Self {
        self.cgroup = cgroup.into();
        self
    }
}

impl FakeProc {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join("stat"),
            format!(
                "cpu  10 0 10 100 0 0 0 0 0 0\ncpu0 10 0 10 100 0 0 0 0 0 0\n\
                 intr 0\nctxt 42\nbtime {BTIME}\nprocesses 900\nprocs_running 1\n"
            ),
        )
        .unwrap();
        Self { dir }
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    fn pid_dir(&self, pid: u32) -> PathBuf {
        self.root().join(pid.to_string())
    }

    fn add(&self, p: &Proc) {
        let dir = self.pid_dir(p.pid);
        fs::create_dir_all(&dir).unwrap();
        self.write_stat(p.pid, &p.comm, p.start_ticks);
        let nspid: Vec<String> = p.nspid.iter().map(u32::to_string).collect();
        let nspid = nspid.join("\t");
        fs::write(
            dir.join("status"),
            format!(
                "Name:\t{comm}\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t{pid}\nNgid:\t0\n\
                 Pid:\t{pid}\nPPid:\t1\nTracerPid:\t0\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n\
                 Gid:\t{uid}\t{uid}\t{uid}\t{uid}\nFDSize:\t64\nGroups:\t{uid}\n\
                 NStgid:\t{nspid}\nNSpid:\t{nspid}\nNSpgid:\t{nspid}\nNSsid:\t{nspid}\n\
                 VmRSS:\t  204800 kB\nThreads:\t12\n",
                comm = p.comm,
                pid = p.pid,
                uid = p.uid,
            ),
        )
        .unwrap();
        fs::write(dir.join("cmdline"), &p.cmdline).unwrap();
        fs::write(dir.join("cgroup"), &p.cgroup).unwrap();
    }

    fn write_stat(&self, pid: u32, comm: &str, start_ticks: u64) {
        fs::write(
            self.pid_dir(pid).join("stat"),
            format!(
                "{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194560 1500 0 3 0 120 30 0 0 20 0 12 0 \
                 {start_ticks} 123456789 20480 18446744073709551615 1 1 0 0 0 0 0 16781312 \
                 17642 0 0 0 17 3 0 0 0 0 0 0 0 0 0 0 0 0\n"
            ),
        )
        .unwrap();
    }

    fn write(&self, pid: u32, file: &str, contents: impl AsRef<[u8]>) {
        fs::write(self.pid_dir(pid).join(file), contents).unwrap();
    }

    fn attributor(&self) -> Attributor {
        Attributor::with_user_names(self.root(), Box::new(alice))
    }
}

fn alice(uid: u32) -> Option<String> {
    (uid == 1000).then(|| "alice".to_owned())
}

fn attribute(proc: &FakeProc, p: &Proc) -> Arc<Attribution> {
    proc.add(p);
    proc.attributor()
        .attribute(p.pid)
        .expect("attribution for a live process")
}

#[test]
fn plain_host_process() {
    let proc = FakeProc::new();
    let p = Proc::new(4242);
    assert_eq!(
        *attribute(&proc, &p),
        Attribution {
            uid: 1000,
            user: "alice".into(),
            command: "python3 train.py --epochs 10".into(),
            start_time_ms: (BTIME * 1000 + 123_450) as i64,
            nspid: vec![4242],
            container: None,
            pod: None,
            slurm_job_id: None,
            process_group: Some(4242),
            slurm_account: None,
            pod_namespace: None,
        }
    );
}

/// A Slurm job's account comes from its environment and a pod's namespace
/// from the kubelet's log directory of the pod; a host process has
/// neither, even with the variable set.
#[test]
fn slurm_accounts_and_pod_namespaces() {
    let proc = FakeProc::new();
    let mut attributor = proc.attributor();
    let env = b"HOME=/home/alice\0SLURM_JOB_ID=12345\0SLURM_JOB_ACCOUNT=vision-ml\0";

    let job =
        Proc::new(5001).cgroup("0::/system.slice/slurmstepd.scope/job_12345/step_0/user/task_0\n");
    proc.add(&job);
    proc.write(job.pid, "environ", env);
    let got = attributor.attribute(job.pid).unwrap();
    assert_eq!(got.slurm_account.as_deref(), Some("vision-ml"));

    let host = Proc::new(5002);
    proc.add(&host);
    proc.write(host.pid, "environ", env);
    assert_eq!(attributor.attribute(host.pid).unwrap().slurm_account, None);

    let pod = Proc::new(5003).cgroup(format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_US}.slice/cri-containerd-{ID}.scope\n"
    ));
    proc.add(&pod);
    let logs = tempfile::tempdir().unwrap();
    fs::create_dir(logs.path().join(format!("research_trainer-0_{POD}"))).unwrap();
    let got = attributor
        .with_pod_log_dir(logs.path())
        .attribute(pod.pid)
        .unwrap();
    assert!(got.pod.is_some(), "{got:?}");
    assert_eq!(got.pod_namespace.as_deref(), Some("research"));

    // No log directory for it: the pod is still attributed.
    let elsewhere = tempfile::tempdir().unwrap();
    let got = proc
        .attributor()
        .with_pod_log_dir(elsewhere.path())
        .attribute(pod.pid)
        .unwrap();
    assert!(got.pod.is_some() && got.pod_namespace.is_none(), "{got:?}");
}

/// One process per runtime, cgroup version, Kubernetes QoS class and driver,
/// and Slurm version, each through a whole `cgroup` file as the kernel
/// writes it.
#[test]
fn owners_by_layout() {
    let v1 = |path: &str| {
        format!(
            "12:hugetlb:{path}\n11:memory:{path}\n10:pids:{path}\n9:cpu,cpuacct:{path}\n\
             8:devices:{path}\n1:name=systemd:{path}\n0::/system.slice/containerd.service\n"
        )
    };
    let v2 = |path: &str| format!("0::{path}\n");
    let container = |runtime| {
        Some(Container {
            runtime,
            id: ID.to_owned(),
        })
    };
    let pod = |qos| {
        Some(Pod {
            uid: POD.to_owned(),
            qos: Some(qos),
        })
    };
    use ContainerRuntime::*;
    use QosClass::*;
    type Case = (
        &'static str,
        String,
        Option<Container>,
        Option<Pod>,
        Option<&'static str>,
    );
    let cases: Vec<Case> = vec![
        (
            "docker v1 cgroupfs",
            v1(&format!("/docker/{ID}")),
            container(Docker),
            None,
            None,
        ),
        (
            "docker v2 systemd",
            v2(&format!("/system.slice/docker-{ID}.scope")),
            container(Docker),
            None,
            None,
        ),
        (
            "nerdctl v1 cgroupfs",
            v1(&format!("/default/{ID}")),
            container(Containerd),
            None,
            None,
        ),
        (
            "nerdctl v2 systemd",
            v2(&format!("/system.slice/nerdctl-{ID}.scope")),
            container(Containerd),
            None,
            None,
        ),
        (
            "podman v1 rootful",
            v1(&format!("/machine.slice/libpod-{ID}.scope")),
            container(Podman),
            None,
            None,
        ),
        (
            "podman v2 rootless",
            v2(&format!(
                "/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope/container"
            )),
            container(Podman),
            None,
            None,
        ),
        (
            "podman quadlet v2 system unit",
            v2(&format!(
                "/system.slice/inference.service/libpod-payload-{ID}"
            )),
            container(Podman),
            None,
            None,
        ),
        (
            "k8s v1 cgroupfs burstable on a cri-o hybrid host",
            format!(
                "11:memory:/kubepods/burstable/pod{POD}/{ID}\n\
                 1:name=systemd:/kubepods/burstable/pod{POD}/{ID}\n\
                 0::/system.slice/crio.service\n"
            ),
            container(CriO),
            pod(Burstable),
            None,
        ),
        (
            "k8s v2 systemd guaranteed containerd",
            v2(&format!(
                "/kubepods.slice/kubepods-pod{POD_US}.slice/cri-containerd-{ID}.scope"
            )),
            container(Containerd),
            pod(Guaranteed),
            None,
        ),
        (
            "k8s v2 systemd burstable containerd",
            v2(&format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_US}.slice/cri-containerd-{ID}.scope"
            )),
            container(Containerd),
            pod(Burstable),
            None,
        ),
        (
            "k8s v2 systemd besteffort crio",
            v2(&format!(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_US}.slice/crio-{ID}.scope"
            )),
            container(CriO),
            pod(BestEffort),
            None,
        ),
        (
            "k8s v1 systemd burstable crio",
            v1(&format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_US}.slice/crio-{ID}.scope"
            )),
            container(CriO),
            pod(Burstable),
            None,
        ),
        (
            "k8s v1 cgroupfs guaranteed",
            v1(&format!("/kubepods/pod{POD}/{ID}")),
            container(Containerd),
            pod(Guaranteed),
            None,
        ),
        (
            "k8s v1 cgroupfs burstable",
            v1(&format!("/kubepods/burstable/pod{POD}/{ID}")),
            container(Containerd),
            pod(Burstable),
            None,
        ),
        (
            "k8s v1 cgroupfs besteffort",
            v1(&format!("/kubepods/besteffort/pod{POD}/{ID}")),
            container(Containerd),
            pod(BestEffort),
            None,
        ),
        (
            "slurm v1",
            "11:memory:/slurm/uid_1000/job_12345/step_0/task_0\n\
             7:freezer:/slurm/uid_1000/job_12345/step_0/task_0\n\
             1:name=systemd:/system.slice/slurmd.service\n"
                .to_owned(),
            None,
            None,
            Some("12345"),
        ),
        (
            "slurm v2",
            v2("/system.slice/slurmstepd.scope/job_12345/step_0/user/task_0"),
            None,
            None,
            Some("12345"),
        ),
    ];
    let proc = FakeProc::new();
    let mut attributor = proc.attributor();
    for (i, (name, cgroup, container, pod, job)) in cases.into_iter().enumerate() {
        let p = Proc::new(1000 + i as u32).cgroup(cgroup);
        proc.add(&p);
        let got = attributor.attribute(p.pid).expect(name);
        assert_eq!(got.container, container, "{name}");
        assert_eq!(got.pod, pod, "{name}");
        assert_eq!(got.slurm_job_id.as_deref(), job, "{name}");
    }
}

#[test]
fn exited_process_is_none() {
    let proc = FakeProc::new();
    let p = Proc::new(4242);
    proc.add(&p);
    let mut attributor = proc.attributor();
    assert!(attributor.attribute(4242).is_some());
    fs::remove_dir_all(proc.pid_dir(4242)).unwrap();
    assert_eq!(attributor.attribute(4242), None);
    assert_eq!(attributor.cached(), 0, "a vanished pid leaves the cache");
    assert_eq!(attributor.attribute(99_999), None);
}

#[test]
fn process_gone_after_stat_is_none() {
    // Exited between the stat read and the others: stat left, status gone.
    let proc = FakeProc::new();
    proc.add(&Proc::new(4242));
    fs::remove_file(proc.pid_dir(4242).join("status")).unwrap();
    assert_eq!(proc.attributor().attribute(4242), None);
}

#[test]
fn cache_hit_does_not_reread() {
    let proc = FakeProc::new();
    let p = Proc::new(4242).cgroup(format!("0::/system.slice/docker-{ID}.scope\n"));
    proc.add(&p);
    let mut attributor = proc.attributor();
    let first = attributor.attribute(4242).unwrap();

    proc.write(4242, "cgroup", "0::/init.scope\n");
    proc.write(4242, "cmdline", b"something-else\0");
    let second = attributor.attribute(4242).unwrap();
    assert!(Arc::ptr_eq(&first, &second));
    assert!(second.container.is_some());
}

#[test]
fn reused_pid_is_attributed_afresh() {
    let proc = FakeProc::new();
    let p = Proc::new(4242).cgroup(format!("0::/system.slice/docker-{ID}.scope\n"));
    proc.add(&p);
    let mut attributor = proc.attributor();
    let first = attributor.attribute(4242).unwrap();

    let reused = Proc {
        comm: "bash".into(),
        start_ticks: 99_000,
        uid: 0,
        cmdline: b"bash\0".to_vec(),
        ..p.cgroup("0::/user.slice/user-0.slice/session-1.scope\n")
    };
    proc.add(&reused);
    let second = attributor.attribute(4242).unwrap();
    assert_ne!(first, second);
    assert_eq!(second.command, "bash");
    assert_eq!(second.uid, 0);
    assert_eq!(second.container, None);
    assert_eq!(second.start_time_ms, (BTIME * 1000 + 990_000) as i64);
}

#[test]
fn retain_forgets_dead_pids() {
    let proc = FakeProc::new();
    let mut attributor = proc.attributor();
    for pid in [1, 2, 3] {
        proc.add(&Proc::new(pid));
        attributor.attribute(pid).unwrap();
    }
    attributor.retain([2, 7]);
    assert_eq!(attributor.cached(), 1);
    attributor.retain(std::iter::empty());
    assert_eq!(attributor.cached(), 0);
}

#[test]
fn user_names_are_looked_up_once_per_uid() {
    let proc = FakeProc::new();
    let lookups = Arc::new(AtomicUsize::new(0));
    let counter = lookups.clone();
    let mut attributor = Attributor::with_user_names(
        proc.root(),
        Box::new(move |uid| {
            counter.fetch_add(1, Ordering::Relaxed);
            alice(uid)
        }),
    );
    for pid in [1, 2, 3] {
        proc.add(&Proc::new(pid));
        assert_eq!(attributor.attribute(pid).unwrap().user, "alice");
    }
    assert_eq!(lookups.load(Ordering::Relaxed), 1);

    // Once no live process has the uid, a new one asks again.
    attributor.retain(std::iter::empty());
    proc.add(&Proc::new(4));
    attributor.attribute(4).unwrap();
    assert_eq!(lookups.load(Ordering::Relaxed), 2);
}

#[test]
fn unknown_uid_is_reported_as_the_number() {
    let proc = FakeProc::new();
    let p = Proc {
        uid: 123_456,
        ..Proc::new(4242)
    };
    assert_eq!(attribute(&proc, &p).user, "123456");
}

#[test]
fn comm_with_spaces_and_parenthesis() {
    let proc = FakeProc::new();
    let p = Proc {
        comm: "my (weird) job".into(),
        cmdline: Vec::new(),
        ..Proc::new(4242)
    };
    let got = attribute(&proc, &p);
    assert_eq!(got.command, "my (weird) job");
    assert_eq!(got.start_time_ms, (BTIME * 1000 + 123_450) as i64);
}

#[test]
fn empty_cmdline_falls_back_to_comm() {
    let proc = FakeProc::new();
    let p = Proc {
        comm: "kworker/0:1".into(),
        cmdline: Vec::new(),
        ..Proc::new(4242)
    };
    assert_eq!(attribute(&proc, &p).command, "kworker/0:1");
}

#[test]
fn nested_pid_namespaces() {
    let proc = FakeProc::new();
    let p = Proc {
        nspid: vec![4242, 310, 7],
        ..Proc::new(4242)
    };
    assert_eq!(attribute(&proc, &p).nspid, vec![4242, 310, 7]);
}

#[test]
fn garbage_stat_is_none() {
    let proc = FakeProc::new();
    proc.add(&Proc::new(4242));
    let mut attributor = proc.attributor();
    for garbage in [
        &b""[..],
        b"4242 (x",
        b"4242 x) (y",
        b"\xff\xff\xff",
        b"(x) S",
    ] {
        proc.write(4242, "stat", garbage);
        assert_eq!(attributor.attribute(4242), None, "{garbage:?}");
    }
}

#[test]
fn garbage_status_is_none() {
    let proc = FakeProc::new();
    proc.add(&Proc::new(4242));
    proc.write(4242, "status", b"Uid:\tnobody\n\xff\xfe");
    assert_eq!(proc.attributor().attribute(4242), None);
}

#[test]
fn garbage_in_optional_files_gives_a_partial_attribution() {
    let proc = FakeProc::new();
    proc.add(&Proc::new(4242));
    proc.write(
        4242,
        "cgroup",
        b"\xff:\xfe\nnot a cgroup line\n::\n0::docker\n",
    );
    proc.write(4242, "cmdline", b"py\xffthon\0");
    proc.write(
        4242,
        "status",
        "Name:\tx\nUid:\t1000\t1000\t1000\t1000\nNSpid:\t1\tnope\n",
    );
    let got = proc.attributor().attribute(4242).unwrap();
    assert_eq!(got.uid, 1000);
    assert_eq!(got.command, "py\u{fffd}thon");
    assert!(got.nspid.is_empty());
    assert_eq!((got.container.as_ref(), got.pod.as_ref()), (None, None));
}

#[test]
fn missing_cgroup_and_cmdline_give_a_partial_attribution() {
    let proc = FakeProc::new();
    proc.add(&Proc::new(4242));
    fs::remove_file(proc.pid_dir(4242).join("cgroup")).unwrap();
    fs::remove_file(proc.pid_dir(4242).join("cmdline")).unwrap();
    let got = proc.attributor().attribute(4242).unwrap();
    assert_eq!(got.command, "python3");
    assert_eq!(got.container, None);
}

#[test]
fn missing_btime_is_none_and_read_again_later() {
    let proc = FakeProc::new();
    proc.add(&Proc::new(4242));
    let stat = fs::read(proc.root().join("stat")).unwrap();
    fs::write(proc.root().join("stat"), "cpu 1 2 3\n").unwrap();
    let mut attributor = proc.attributor();
    assert_eq!(attributor.attribute(4242), None);
    fs::write(proc.root().join("stat"), stat).unwrap();
    assert!(attributor.attribute(4242).is_some());
}

#[test]
fn huge_start_ticks_are_none_not_overflow() {
    let proc = FakeProc::new();
    proc.add(&Proc {
        start_ticks: u64::MAX,
        ..Proc::new(4242)
    });
    assert_eq!(proc.attributor().attribute(4242), None);
}

#[test]
fn long_cmdline_is_capped() {
    let proc = FakeProc::new();
    let mut cmdline = b"python3\0".to_vec();
    cmdline.extend(std::iter::repeat_n(b'x', 1 << 20));
    let got = attribute(
        &proc,
        &Proc {
            cmdline,
            ..Proc::new(4242)
        },
    );
    assert_eq!(got.command.len(), MAX_COMMAND_BYTES);
    assert!(got.command.starts_with("python3 xxx"));
}

#[test]
fn real_nss_resolver_does_not_panic() {
    let proc = FakeProc::new();
    proc.add(&Proc {
        uid: 0,
        ..Proc::new(4242)
    });
    // Whatever the machine's passwd says, root or "0".
    let user = Attributor::new(proc.root())
        .attribute(4242)
        .unwrap()
        .user
        .clone();
    assert!(user == "root" || user == "0", "{user}");
}
