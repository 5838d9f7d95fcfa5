//! Wire messages for a small node: two plain GPUs and one in MIG mode.

use headroom_proto::v1 as pb;

pub const NODE: &str = "test-node-1";
pub const BOOT: &str = "boot-a";
pub const GPU0: &str = "GPU-00000000-0000-0000-0000-000000000000";
pub const GPU1: &str = "GPU-11111111-1111-1111-1111-111111111111";
pub const GPU2: &str = "GPU-22222222-2222-2222-2222-222222222222";
pub const MIG_A: &str = "MIG-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa";
pub const MIG_B: &str = "MIG-bbbbbbbb-bbbb-bbbb-bbbb-bbbbbbbbbbbb";
pub const GIB: u64 = 1 << 30;

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn gpu(uuid: &str, index: u32, mig: Vec<pb::MigInstance>) -> pb::Gpu {
    pb::Gpu {
        uuid: uuid.into(),
        index,
        name: "NVIDIA H100 80GB HBM3".into(),
        memory_total_bytes: 80 * GIB,
        pcie_generation: 5,
        pcie_width: 16,
        mig_instances: mig,
    }
}

pub fn mig(uuid: &str, gi: u32) -> pb::MigInstance {
    pb::MigInstance {
        uuid: uuid.into(),
        gpu_instance_id: gi,
        compute_instance_id: 0,
        profile: "3g.40gb".into(),
        memory_total_bytes: 40 * GIB,
    }
}

pub fn register(node: &str, boot: &str) -> pb::RegisterRequest {
    pb::RegisterRequest {
        node: node.into(),
        boot_id: boot.into(),
        agent_version: "test".into(),
        driver_version: "550.54.15".into(),
        gpus: vec![
            gpu(GPU0, 0, vec![]),
            gpu(GPU1, 1, vec![]),
            gpu(GPU2, 2, vec![mig(MIG_A, 1), mig(MIG_B, 2)]),
        ],
        sample_interval_ms: 1000,
    }
}

/// A GPU sample with used = `used` (min and max around it) on an 80 GiB GPU.
pub fn gpu_sample(uuid: &str, ts: i64, used: u64) -> pb::GpuSample {
    pb::GpuSample {
        uuid: uuid.into(),
        timestamp_ms: ts,
        interval_ms: 1000,
        poll_count: 10,
        memory_used_last_bytes: used,
        memory_used_min_bytes: used.saturating_sub(GIB),
        memory_used_max_bytes: used + GIB,
        memory_reserved_bytes: GIB / 2,
        memory_total_bytes: 80 * GIB,
        utilization_pct: Some(70),
        pcie_tx_bytes_per_s: Some(1_000_000),
        pcie_rx_bytes_per_s: Some(2_000_000),
    }
}

pub fn process_sample(uuid: &str, ts: i64, pid: u32, used: u64) -> pb::ProcessSample {
    pb::ProcessSample {
        uuid: uuid.into(),
        timestamp_ms: ts,
        pid,
        start_time_ms: ts - 60_000,
        memory_used_last_bytes: used,
        memory_used_max_bytes: used + GIB / 4,
        name: "python train.py".into(),
        uid: 1001,
        user: "alice".into(),
        container_id: "c0ffee".into(),
        pod_uid: String::new(),
        slurm_job_id: "4242".into(),
        container_runtime: "docker".into(),
        pod_qos_class: String::new(),
        allocator: None,
        slurm_account: "vision-ml".into(),
        pod_namespace: String::new(),
        process_group: pid,
        pod_labels: Default::default(),
    }
}

pub fn batch(seq: u64, ts: i64) -> pb::Batch {
    pb::Batch {
        node: NODE.into(),
        boot_id: BOOT.into(),
        seq,
        gpu_samples: vec![
            gpu_sample(GPU0, ts, 40 * GIB),
            gpu_sample(GPU1, ts, 10 * GIB),
        ],
        process_samples: vec![process_sample(GPU0, ts, 777, 39 * GIB)],
        events: vec![],
    }
}

/// A second node, with GPUs of its own: a UUID names one physical GPU, so a
/// UUID reported by another node means the GPU moved there.
pub const OTHER_NODE: &str = "test-node-2";

fn other(uuid: &str) -> String {
    format!("{uuid}-other")
}

pub fn register_other_node() -> pb::RegisterRequest {
    let mut req = register(OTHER_NODE, BOOT);
    for gpu in &mut req.gpus {
        gpu.uuid = other(&gpu.uuid);
        for mig in &mut gpu.mig_instances {
            mig.uuid = other(&mig.uuid);
        }
    }
    req
}

pub fn other_node_batch(seq: u64, ts: i64) -> pb::Batch {
    let mut b = batch(seq, ts);
    b.node = OTHER_NODE.into();
    for s in &mut b.gpu_samples {
        s.uuid = other(&s.uuid);
    }
    for p in &mut b.process_samples {
        p.uuid = other(&p.uuid);
    }
    b
}

/// Enrols a token in `store` as `headroom-collector token create` would and
/// returns its id and the token itself.
pub async fn enrol_token(
    store: &dyn headroom_store::Store,
    role: headroom_store::tokens::TokenRole,
    node: Option<&str>,
    name: Option<&str>,
) -> (i64, String) {
    let issued = headroom_collector::auth::issue_token(role);
    let id = store
        .create_token(
            &headroom_store::tokens::NewToken {
                role,
                node,
                name,
                token_sha256: &issued.sha256,
                hint: &issued.hint,
            },
            now_ms(),
        )
        .await
        .expect("enrolling a token");
    (id, issued.token)
}
