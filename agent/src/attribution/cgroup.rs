//! Who owns a process, read from its cgroup path alone.
//!
//! Container runtimes, the kubelet and Slurm each name cgroups in their own
//! way; the path is the one place all of them leave a trace that a host-side
//! reader can see without talking to the runtime. Everything here is a pure
//! function on strings so each layout is pinned by a test.
//!
//! Matching goes by path component, anywhere in the path, never by absolute
//! prefix: the kubelet may use a non-default cgroup root (kind nests
//! `kubelet.slice/kubelet-kubepods.slice/...`), and when the agent runs in its
//! own cgroup namespace the kernel shows other processes' paths relative to it
//! (`/../../kubepods-burstable-pod<uid>.slice/...`).
//!
//! Which component names map to which runtime:
//!
//! | component                                  | runtime      |
//! |--------------------------------------------|--------------|
//! | `docker-<id>.scope`, `<id>` under `docker` | Docker       |
//! | `cri-containerd-<id>.scope`                | Containerd   |
//! | `nerdctl-<id>.scope`, `<id>` under `default` (nerdctl's namespace) | Containerd |
//! | `crio-<id>.scope`, `crio-<id>` (cgroupfs)  | CriO         |
//! | `libpod-<id>.scope`, `libpod-<id>`         | Podman       |
//! | `libpod-payload-<id>` (under a Quadlet unit's `<name>.service`, `--cgroups=split`) | Podman |
//! | `<slice>:<prefix>:<id>` (runc's systemd path taken literally, as k3s and containerd-in-a-container show it) | by prefix |
//! | any other bare `<id>` (the kubelet's cgroupfs driver, `--cgroup-parent`) | the daemon another line of the file sits in, else Unknown |
//!
//! `<id>` is always 64 lowercase hex digits. `crio-conmon-*` and
//! `libpod-conmon-*` hold the runtimes' monitor processes, not the container,
//! and `containerd.service` holds the daemon and its shims.

/// The container runtime, as far as the cgroup name tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ContainerRuntime {
    Docker,
    Containerd,
    CriO,
    Podman,
    /// A bare container id: the kubelet's cgroupfs driver names container
    /// cgroups by id alone, whatever runtime sits beneath it.
    Unknown,
}

impl ContainerRuntime {
    /// As it travels on the wire and shows in the API.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Docker => "docker",
            Self::Containerd => "containerd",
            Self::CriO => "cri-o",
            Self::Podman => "podman",
            Self::Unknown => "unknown",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Container {
    pub runtime: ContainerRuntime,
    /// The full 64-hex id, which `docker ps --no-trunc` and `crictl ps`
    /// print as a prefix of.
    pub id: String,
}

/// Kubernetes QoS class of a pod: the kubelet files pods under a cgroup per
/// class, and it decides who is evicted first under memory pressure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QosClass {
    Guaranteed,
    Burstable,
    BestEffort,
}

impl QosClass {
    /// As it travels on the wire and shows in the API.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Guaranteed => "guaranteed",
            Self::Burstable => "burstable",
            Self::BestEffort => "besteffort",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Pod {
    /// As the API server spells it: dashed UUID, or 32 hex digits for a
    /// static pod (its UID is a hash of the manifest).
    pub uid: String,
    /// `None` when the class is not in the visible path: with the cgroupfs
    /// driver seen from inside a cgroup namespace, the levels shared with the
    /// agent's own cgroup collapse into `..`.
    pub qos: Option<QosClass>,
}

/// What one cgroup path says about its process; every field may be absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupOwner {
    pub container: Option<Container>,
    pub pod: Option<Pod>,
    pub slurm_job_id: Option<String>,
}

impl CgroupOwner {
    fn is_empty(&self) -> bool {
        self.container.is_none() && self.pod.is_none() && self.slurm_job_id.is_none()
    }
}

/// Classifies a whole `/proc/<pid>/cgroup` file.
///
/// On cgroup v1 each controller has its own line and runtimes do not place
/// the process alike in all of them (Slurm may constrain only `freezer` and
/// `cpuset`; Docker's cgroupfs driver leaves the unified `0::` line of a
/// hybrid host at `containerd.service`). So lines are tried in order of how
/// reliably runtimes manage them, and the first that says anything wins
/// whole: mixing fields from different lines could pair a pod with a
/// container that is not its own. Malformed lines are skipped.
///
/// A container named by its id alone (the kubelet's cgroupfs driver) gets
/// its runtime from a line that sits in a runtime daemon's service: on a
/// hybrid host the unified `0::` line stays with the daemon that started the
/// container's shim (`containerd.service`, k3s' embedded containerd,
/// `crio.service`) while the v1 controllers carry the pod path.
pub fn classify_cgroup_file(contents: &str) -> CgroupOwner {
    let mut lines: Vec<(u8, &str)> = contents
        .lines()
        .filter_map(|line| {
            let (controllers, path) = parse_line(line)?;
            Some((line_rank(controllers), path))
        })
        .collect();
    lines.sort_by_key(|&(rank, _)| rank);
    let mut owner = lines
        .iter()
        .map(|&(_, path)| classify_path(path))
        .find(|owner| !owner.is_empty())
        .unwrap_or_default();
    if let Some(container) = owner
        .container
        .as_mut()
        .filter(|c| c.runtime == ContainerRuntime::Unknown)
        && let Some(runtime) = lines.iter().find_map(|&(_, path)| daemon_runtime(path))
    {
        container.runtime = runtime;
    }
    owner
}

/// The runtime whose daemon's systemd service a path is in.
fn daemon_runtime(path: &str) -> Option<ContainerRuntime> {
    path.split('/').find_map(|component| match component {
        "containerd.service"
        | "snap.microk8s.daemon-containerd.service"
        | "k3s.service"
        | "k3s-agent.service"
        | "rke2-server.service"
        | "rke2-agent.service" => Some(ContainerRuntime::Containerd),
        "crio.service" => Some(ContainerRuntime::CriO),
        "docker.service" | "cri-docker.service" => Some(ContainerRuntime::Docker),
        _ => None,
    })
}

/// Splits `hierarchy-ID:controllers:path`; the path may itself hold `:`.
fn parse_line(line: &str) -> Option<(&str, &str)> {
    let mut fields = line.splitn(3, ':');
    let hierarchy = fields.next()?;
    let controllers = fields.next()?;
    let path = fields.next()?;
    if hierarchy.is_empty() || !hierarchy.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !path.starts_with('/') {
        return None;
    }
    Some((controllers, path))
}

/// Lower is tried first.
fn line_rank(controllers: &str) -> u8 {
    let has = |name: &str| controllers.split(',').any(|c| c == name);
    if has("memory") {
        0
    } else if has("pids") {
        1
    } else if has("cpu") || has("cpuacct") {
        2
    } else if has("name=systemd") {
        3
    } else if controllers.is_empty() {
        // The unified hierarchy: the only line on pure cgroup v2.
        4
    } else {
        5
    }
}

/// Classifies one cgroup path such as
/// `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope`.
pub fn classify_path(path: &str) -> CgroupOwner {
    let components: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    let mut owner = CgroupOwner::default();
    for (i, &component) in components.iter().enumerate() {
        let parent = i.checked_sub(1).and_then(|p| components.get(p)).copied();
        if let Some((pod, container)) = colon_form(component) {
            owner.pod = owner.pod.or(pod);
            owner.container = Some(container);
            continue;
        }
        if owner.pod.is_none() {
            owner.pod = pod_slice(component).or_else(|| pod_dir(component, parent));
        }
        // The innermost container wins: Podman puts the process in a
        // `container` child of its scope, and Docker-in-Docker nests ids.
        if let Some(container) = container_component(component, parent) {
            owner.container = Some(container);
        }
        if owner.slurm_job_id.is_none() && components[..i].iter().any(|c| is_slurm_root(c)) {
            owner.slurm_job_id = slurm_job(component);
        }
    }
    owner
}

/// runc's systemd cgroup path `<slice>:<prefix>:<id>`, shown verbatim when
/// the runtime was told to use systemd but systemd does not manage that tree
/// (k3s, containerd running inside a container).
fn colon_form(component: &str) -> Option<(Option<Pod>, Container)> {
    let mut parts = component.splitn(3, ':');
    let slice = parts.next()?;
    let prefix = parts.next()?;
    let id = parts.next()?;
    let runtime = match prefix {
        "cri-containerd" | "nerdctl" => ContainerRuntime::Containerd,
        "crio" => ContainerRuntime::CriO,
        "docker" => ContainerRuntime::Docker,
        "libpod" => ContainerRuntime::Podman,
        _ => return None,
    };
    is_container_id(id).then(|| {
        let container = Container {
            runtime,
            id: id.to_owned(),
        };
        (pod_slice(slice), container)
    })
}

fn container_component(component: &str, parent: Option<&str>) -> Option<Container> {
    let name = component.strip_suffix(".scope").unwrap_or(component);
    const PREFIXES: [(&str, ContainerRuntime); 6] = [
        ("cri-containerd-", ContainerRuntime::Containerd),
        ("nerdctl-", ContainerRuntime::Containerd),
        ("crio-", ContainerRuntime::CriO),
        ("docker-", ContainerRuntime::Docker),
        // `--cgroups=split` (Quadlet's default): the payload in a child of
        // the unit's own cgroup, conmon in the unit's.
        ("libpod-payload-", ContainerRuntime::Podman),
        ("libpod-", ContainerRuntime::Podman),
    ];
    let (runtime, id) = PREFIXES
        .iter()
        .find_map(|&(prefix, runtime)| Some((runtime, name.strip_prefix(prefix)?)))
        .unwrap_or_else(|| {
            let runtime = match parent {
                Some("docker") => ContainerRuntime::Docker,
                // nerdctl's cgroupfs parent is its containerd namespace.
                Some("default") => ContainerRuntime::Containerd,
                _ => ContainerRuntime::Unknown,
            };
            (runtime, name)
        });
    // `crio-conmon-<id>` and `libpod-conmon-<id>` fail here: not hex.
    is_container_id(id).then(|| Container {
        runtime,
        id: id.to_owned(),
    })
}

/// A systemd-driver pod slice. systemd spells the slice's ancestry into its
/// name with `-` as separator, which is why the kubelet swaps the UID's
/// dashes for underscores: `kubepods-burstable-pod<uid>.slice`, or with a
/// custom cgroup root `kubelet-kubepods-besteffort-pod<uid>.slice`.
fn pod_slice(component: &str) -> Option<Pod> {
    let name = component.strip_suffix(".slice")?;
    let tokens: Vec<&str> = name.split('-').collect();
    let kubepods = tokens.iter().position(|&t| t == "kubepods")?;
    let (qos, pod) = match &tokens[kubepods + 1..] {
        [pod] => (QosClass::Guaranteed, *pod),
        ["burstable", pod] => (QosClass::Burstable, *pod),
        ["besteffort", pod] => (QosClass::BestEffort, *pod),
        _ => return None,
    };
    let uid = pod.strip_prefix("pod")?.replace('_', "-");
    is_pod_uid(&uid).then_some(Pod {
        uid,
        qos: Some(qos),
    })
}

/// A cgroupfs-driver pod directory: `kubepods/pod<uid>` (Guaranteed),
/// `kubepods/{burstable,besteffort}/pod<uid>`, or `../pod<uid>` when seen
/// from inside a cgroup namespace.
fn pod_dir(component: &str, parent: Option<&str>) -> Option<Pod> {
    let uid = component.strip_prefix("pod")?;
    let qos = match parent? {
        "kubepods" => Some(QosClass::Guaranteed),
        "burstable" => Some(QosClass::Burstable),
        "besteffort" => Some(QosClass::BestEffort),
        ".." => None,
        _ => return None,
    };
    is_pod_uid(uid).then(|| Pod {
        uid: uid.to_owned(),
        qos,
    })
}

/// Slurm's cgroup tree roots: v1 `slurm` or `slurm_<nodename>`; v2
/// `slurmstepd.scope` or `<nodename>_slurmstepd.scope`.
fn is_slurm_root(component: &str) -> bool {
    component == "slurm"
        || component.starts_with("slurm_")
        || component == "slurmstepd.scope"
        || component.ends_with("_slurmstepd.scope")
}

fn slurm_job(component: &str) -> Option<String> {
    let id = component.strip_prefix("job_")?;
    (!id.is_empty() && id.bytes().all(|b| b.is_ascii_digit())).then(|| id.to_owned())
}

fn is_container_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn is_hex(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A dashed UUID, or 32 hex digits (static pods).
fn is_pod_uid(s: &str) -> bool {
    if s.len() == 32 {
        return is_hex(s);
    }
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, len)| g.len() == len && is_hex(g))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f4e1a2b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6b";
    const ID2: &str = "d4e8e05a546c86b6443f101966c618e47753ed01fa9929cae00d3b692f7a9f80";
    const POD: &str = "1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d";
    const POD_US: &str = "1a2b3c4d_5e6f_4a7b_8c9d_0e1f2a3b4c5d";

    fn container(runtime: ContainerRuntime, id: &str) -> Option<Container> {
        Some(Container {
            runtime,
            id: id.to_owned(),
        })
    }

    fn pod(qos: Option<QosClass>) -> Option<Pod> {
        Some(Pod {
            uid: POD.to_owned(),
            qos,
        })
    }

    fn only_container(runtime: ContainerRuntime, id: &str) -> CgroupOwner {
        CgroupOwner {
            container: container(runtime, id),
            ..CgroupOwner::default()
        }
    }

    fn in_pod(qos: Option<QosClass>, runtime: ContainerRuntime) -> CgroupOwner {
        CgroupOwner {
            container: container(runtime, ID),
            pod: pod(qos),
            slurm_job_id: None,
        }
    }

    fn slurm(job: &str) -> CgroupOwner {
        CgroupOwner {
            slurm_job_id: Some(job.to_owned()),
            ..CgroupOwner::default()
        }
    }

    #[test]
    fn docker_cgroupfs_driver() {
        assert_eq!(
            classify_path(&format!("/docker/{ID}")),
            only_container(ContainerRuntime::Docker, ID)
        );
    }

    #[test]
    fn docker_systemd_driver() {
        assert_eq!(
            classify_path(&format!("/system.slice/docker-{ID}.scope")),
            only_container(ContainerRuntime::Docker, ID)
        );
    }

    #[test]
    fn docker_rootless_systemd_driver() {
        let path =
            format!("/user.slice/user-1000.slice/user@1000.service/user.slice/docker-{ID}.scope");
        assert_eq!(
            classify_path(&path),
            only_container(ContainerRuntime::Docker, ID)
        );
    }

    #[test]
    fn docker_in_docker_reports_the_innermost_container() {
        assert_eq!(
            classify_path(&format!("/docker/{ID2}/docker/{ID}")),
            only_container(ContainerRuntime::Docker, ID)
        );
    }

    #[test]
    fn containerd_daemon_and_shims_are_not_containers() {
        assert_eq!(
            classify_path("/system.slice/containerd.service"),
            CgroupOwner::default()
        );
    }

    #[test]
    fn nerdctl_cgroupfs_namespace_path() {
        assert_eq!(
            classify_path(&format!("/default/{ID}")),
            only_container(ContainerRuntime::Containerd, ID)
        );
    }

    #[test]
    fn nerdctl_systemd_scope() {
        assert_eq!(
            classify_path(&format!("/system.slice/nerdctl-{ID}.scope")),
            only_container(ContainerRuntime::Containerd, ID)
        );
    }

    #[test]
    fn crio_scope_and_cgroupfs_name() {
        assert_eq!(
            classify_path(&format!("/machine.slice/crio-{ID}.scope")),
            only_container(ContainerRuntime::CriO, ID)
        );
        assert_eq!(
            classify_path(&format!("/crio-{ID}")),
            only_container(ContainerRuntime::CriO, ID)
        );
    }

    #[test]
    fn crio_conmon_is_not_the_container() {
        let path = format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_US}.slice/crio-conmon-{ID}.scope"
        );
        assert_eq!(
            classify_path(&path),
            CgroupOwner {
                pod: pod(Some(QosClass::BestEffort)),
                ..CgroupOwner::default()
            }
        );
    }

    #[test]
    fn podman_rootful() {
        assert_eq!(
            classify_path(&format!("/machine.slice/libpod-{ID}.scope/container")),
            only_container(ContainerRuntime::Podman, ID)
        );
    }

    #[test]
    fn podman_rootless() {
        let path = format!(
            "/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope/container"
        );
        assert_eq!(
            classify_path(&path),
            only_container(ContainerRuntime::Podman, ID)
        );
    }

    #[test]
    fn podman_pod_is_not_a_kubernetes_pod() {
        let path =
            format!("/machine.slice/machine-libpod_pod_{ID2}.slice/libpod-{ID}.scope/container");
        assert_eq!(
            classify_path(&path),
            only_container(ContainerRuntime::Podman, ID)
        );
    }

    #[test]
    fn podman_quadlet_payload_under_its_unit() {
        for path in [
            format!("/system.slice/inference.service/libpod-payload-{ID}"),
            // Rootless, from a user unit.
            format!(
                "/user.slice/user-1000.slice/user@1000.service/app.slice/inference.service/libpod-payload-{ID}"
            ),
            // A Quadlet `.pod`: the pod's unit holds its containers' payloads.
            format!("/system.slice/trainers-pod.service/libpod-payload-{ID}"),
        ] {
            assert_eq!(
                classify_path(&path),
                only_container(ContainerRuntime::Podman, ID),
                "{path}"
            );
        }
        // Podman's cgroupfs manager, without systemd.
        assert_eq!(
            classify_path(&format!("/libpod_parent/libpod-{ID}")),
            only_container(ContainerRuntime::Podman, ID)
        );
        // conmon stays in the unit's own cgroup: no container.
        assert_eq!(
            classify_path("/system.slice/inference.service"),
            CgroupOwner::default()
        );
    }

    #[test]
    fn podman_conmon_is_not_the_container() {
        assert_eq!(
            classify_path(&format!("/machine.slice/libpod-conmon-{ID}.scope")),
            CgroupOwner::default()
        );
    }

    #[test]
    fn kubernetes_systemd_driver_guaranteed() {
        let path = format!("/kubepods.slice/kubepods-pod{POD_US}.slice/cri-containerd-{ID}.scope");
        assert_eq!(
            classify_path(&path),
            in_pod(Some(QosClass::Guaranteed), ContainerRuntime::Containerd)
        );
    }

    #[test]
    fn kubernetes_systemd_driver_burstable() {
        let path = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_US}.slice/cri-containerd-{ID}.scope"
        );
        assert_eq!(
            classify_path(&path),
            in_pod(Some(QosClass::Burstable), ContainerRuntime::Containerd)
        );
    }

    #[test]
    fn kubernetes_systemd_driver_besteffort_crio() {
        let path = format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_US}.slice/crio-{ID}.scope"
        );
        assert_eq!(
            classify_path(&path),
            in_pod(Some(QosClass::BestEffort), ContainerRuntime::CriO)
        );
    }

    #[test]
    fn kubernetes_systemd_driver_docker() {
        let path = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_US}.slice/docker-{ID}.scope"
        );
        assert_eq!(
            classify_path(&path),
            in_pod(Some(QosClass::Burstable), ContainerRuntime::Docker)
        );
    }

    #[test]
    fn kubernetes_systemd_driver_under_a_custom_root() {
        // kind: the kubelet's cgroup root is kubelet.slice.
        let path = format!(
            "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{POD_US}.slice/cri-containerd-{ID}.scope"
        );
        assert_eq!(
            classify_path(&path),
            in_pod(Some(QosClass::BestEffort), ContainerRuntime::Containerd)
        );
    }

    #[test]
    fn kubernetes_systemd_driver_seen_from_a_cgroup_namespace() {
        let path = format!("/../../kubepods-burstable-pod{POD_US}.slice/cri-containerd-{ID}.scope");
        assert_eq!(
            classify_path(&path),
            in_pod(Some(QosClass::Burstable), ContainerRuntime::Containerd)
        );
    }

    #[test]
    fn kubernetes_colon_form_under_containerd_service() {
        let path = format!(
            "/system.slice/containerd.service/kubepods-besteffort-pod{POD_US}.slice:cri-containerd:{ID}"
        );
        assert_eq!(
            classify_path(&path),
            in_pod(Some(QosClass::BestEffort), ContainerRuntime::Containerd)
        );
    }

    #[test]
    fn kubernetes_cgroupfs_driver_guaranteed() {
        assert_eq!(
            classify_path(&format!("/kubepods/pod{POD}/{ID}")),
            in_pod(Some(QosClass::Guaranteed), ContainerRuntime::Unknown)
        );
    }

    #[test]
    fn kubernetes_cgroupfs_driver_burstable() {
        assert_eq!(
            classify_path(&format!("/kubepods/burstable/pod{POD}/{ID}")),
            in_pod(Some(QosClass::Burstable), ContainerRuntime::Unknown)
        );
    }

    #[test]
    fn kubernetes_cgroupfs_driver_besteffort() {
        assert_eq!(
            classify_path(&format!("/kubepods/besteffort/pod{POD}/{ID}")),
            in_pod(Some(QosClass::BestEffort), ContainerRuntime::Unknown)
        );
    }

    #[test]
    fn kubernetes_cgroupfs_driver_crio_names_its_containers() {
        assert_eq!(
            classify_path(&format!("/kubepods/burstable/pod{POD}/crio-{ID}")),
            in_pod(Some(QosClass::Burstable), ContainerRuntime::CriO)
        );
    }

    #[test]
    fn kubernetes_cgroupfs_driver_seen_from_a_cgroup_namespace_loses_qos() {
        assert_eq!(
            classify_path(&format!("/../../pod{POD}/{ID}")),
            in_pod(None, ContainerRuntime::Unknown)
        );
    }

    #[test]
    fn kubernetes_static_pod_uid_is_a_hash() {
        let uid = "6e0b6e0f0c3a4d2b8e1f9a7c5b3d1e2f";
        assert_eq!(
            classify_path(&format!("/kubepods/burstable/pod{uid}/{ID}")).pod,
            Some(Pod {
                uid: uid.to_owned(),
                qos: Some(QosClass::Burstable),
            })
        );
    }

    #[test]
    fn kubernetes_pod_level_cgroup_has_a_pod_and_no_container() {
        let path = format!("/kubepods.slice/kubepods-pod{POD_US}.slice");
        assert_eq!(
            classify_path(&path),
            CgroupOwner {
                pod: pod(Some(QosClass::Guaranteed)),
                ..CgroupOwner::default()
            }
        );
    }

    #[test]
    fn slurm_v1() {
        assert_eq!(
            classify_path("/slurm/uid_1000/job_12345/step_0/task_0"),
            slurm("12345")
        );
    }

    #[test]
    fn slurm_v1_with_node_name() {
        assert_eq!(
            classify_path("/slurm_gpu-node-07/uid_1000/job_12345/step_batch/task_0"),
            slurm("12345")
        );
    }

    #[test]
    fn slurm_v2() {
        assert_eq!(
            classify_path("/system.slice/slurmstepd.scope/job_12345/step_0/user/task_0"),
            slurm("12345")
        );
    }

    #[test]
    fn slurm_v2_with_node_name() {
        assert_eq!(
            classify_path("/gpu-node-07_slurmstepd.scope/job_12345/step_extern/user/task_special"),
            slurm("12345")
        );
    }

    #[test]
    fn slurmstepd_itself_is_in_no_job() {
        assert_eq!(
            classify_path("/system.slice/slurmstepd.scope/system"),
            CgroupOwner::default()
        );
    }

    #[test]
    fn job_outside_slurm_is_not_a_slurm_job() {
        assert_eq!(
            classify_path("/system.slice/job_12345"),
            CgroupOwner::default()
        );
    }

    #[test]
    fn plain_host_processes_have_no_owner() {
        for path in [
            "/",
            "/init.scope",
            "/user.slice/user-1000.slice/session-3.scope",
            "/system.slice/docker.service",
            "/kubepods.slice",
            "/kubepods.slice/kubepods-burstable.slice",
        ] {
            assert_eq!(classify_path(path), CgroupOwner::default(), "{path}");
        }
    }

    #[test]
    fn ids_that_are_not_64_lowercase_hex_are_rejected() {
        let short = &ID[..63];
        let long = format!("{ID}0");
        let upper = ID.to_uppercase();
        let not_hex = format!("{}g", &ID[..63]);
        for id in [short, long.as_str(), upper.as_str(), not_hex.as_str()] {
            assert_eq!(
                classify_path(&format!("/system.slice/docker-{id}.scope")),
                CgroupOwner::default(),
                "{id}"
            );
            assert_eq!(
                classify_path(&format!("/docker/{id}")),
                CgroupOwner::default()
            );
        }
    }

    #[test]
    fn malformed_pod_uids_are_rejected() {
        for uid in [
            "",
            "1a2b3c4d",
            "1a2b3c4d_5e6f_4a7b_8c9d",
            "zzzzzzzz-5e6f-4a7b-8c9d-0e1f2a3b4c5d",
        ] {
            let path = format!("/kubepods.slice/kubepods-pod{uid}.slice");
            assert_eq!(classify_path(&path).pod, None, "{path}");
            assert_eq!(classify_path(&format!("/kubepods/pod{uid}")).pod, None);
        }
    }

    #[test]
    fn cgroup_v2_file() {
        let file = format!("0::/system.slice/docker-{ID}.scope\n");
        assert_eq!(
            classify_cgroup_file(&file),
            only_container(ContainerRuntime::Docker, ID)
        );
    }

    #[test]
    fn cgroup_v1_file_prefers_the_memory_line() {
        // A hybrid host with Docker's cgroupfs driver: the unified line stays
        // at the shim's cgroup, the v1 controllers carry the container. A
        // stale `cpu` line pointing elsewhere must not win over `memory`.
        let file = format!(
            "12:cpu,cpuacct:/docker/{ID2}\n\
             11:memory:/docker/{ID}\n\
             10:devices:/docker/{ID}\n\
             1:name=systemd:/docker/{ID}\n\
             0::/system.slice/containerd.service\n"
        );
        assert_eq!(
            classify_cgroup_file(&file),
            only_container(ContainerRuntime::Docker, ID)
        );
    }

    #[test]
    fn hybrid_host_names_the_runtime_from_the_daemon_line() {
        // The kubelet's cgroupfs driver on a hybrid host: the v1 lines carry
        // the pod path with a bare id, the unified line the daemon that
        // started the shim.
        let hybrid = |daemon: &str| {
            format!(
                "12:memory:/kubepods/burstable/pod{POD}/{ID}\n\
                 11:pids:/kubepods/burstable/pod{POD}/{ID}\n\
                 9:cpu,cpuacct:/kubepods/burstable/pod{POD}/{ID}\n\
                 1:name=systemd:/kubepods/burstable/pod{POD}/{ID}\n\
                 0::{daemon}\n"
            )
        };
        for (daemon, runtime) in [
            (
                "/system.slice/containerd.service",
                ContainerRuntime::Containerd,
            ),
            (
                "/system.slice/k3s-agent.service",
                ContainerRuntime::Containerd,
            ),
            ("/system.slice/crio.service", ContainerRuntime::CriO),
            ("/system.slice/cri-docker.service", ContainerRuntime::Docker),
            (
                "/user.slice/user-0.slice/session-1.scope",
                ContainerRuntime::Unknown,
            ),
        ] {
            assert_eq!(
                classify_cgroup_file(&hybrid(daemon)),
                in_pod(Some(QosClass::Burstable), runtime),
                "{daemon}"
            );
        }
    }

    #[test]
    fn a_runtime_the_path_names_is_kept_whatever_the_daemon_line_says() {
        // Docker's shims run under containerd.service on many hosts.
        let file = format!("11:memory:/docker/{ID}\n0::/system.slice/containerd.service\n");
        assert_eq!(
            classify_cgroup_file(&file),
            only_container(ContainerRuntime::Docker, ID)
        );
    }

    #[test]
    fn cgroup_v1_file_falls_back_to_any_line_that_matches() {
        // Slurm constraining only freezer and cpuset.
        let file = "11:memory:/system.slice/slurmd.service\n\
                    7:freezer:/slurm/uid_1000/job_12345/step_0/task_0\n\
                    5:cpuset:/slurm/uid_1000/job_12345/step_0\n\
                    1:name=systemd:/system.slice/slurmd.service\n";
        assert_eq!(classify_cgroup_file(file), slurm("12345"));
    }

    #[test]
    fn cgroup_file_skips_malformed_lines() {
        let file = format!(
            "garbage\n\
             x:memory:/docker/{ID2}\n\
             11:memory\n\
             11:memory:relative/{ID2}\n\
             \n\
             9:pids:/docker/{ID}\n"
        );
        assert_eq!(
            classify_cgroup_file(&file),
            only_container(ContainerRuntime::Docker, ID)
        );
    }

    #[test]
    fn empty_cgroup_file_has_no_owner() {
        assert_eq!(classify_cgroup_file(""), CgroupOwner::default());
        assert_eq!(classify_cgroup_file("0::/\n"), CgroupOwner::default());
    }
}
