//! `headroom-collector status` against a running collector.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests fail loudly by design

use std::sync::Arc;

use headroom_collector::Collector;
use headroom_collector::ingest::validate::{self, Limits};
use headroom_proto::v1 as pb;
use headroom_store::Store;

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// `headroom-collector status ARGS`, run off the runtime's workers (the
/// collector it asks serves on them).
async fn status(args: &[&str]) -> std::process::Output {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_headroom-collector"))
            .arg("status")
            .args(args)
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_prints_the_fullest_gpu_first() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("s.db").display());
    let store: Arc<dyn Store> = headroom_store::connect(&url).await.unwrap();
    let gib = 1u64 << 30;
    let gpu = |uuid: &str, index| pb::Gpu {
        uuid: uuid.into(),
        index,
        name: "NVIDIA H100 80GB HBM3".into(),
        memory_total_bytes: 80 * gib,
        pcie_generation: 5,
        pcie_width: 16,
        mig_instances: vec![],
    };
    let reg = pb::RegisterRequest {
        node: "node-a".into(),
        boot_id: "b".into(),
        agent_version: "t".into(),
        driver_version: "550".into(),
        gpus: vec![gpu("GPU-a0", 0), gpu("GPU-a1", 1)],
        sample_interval_ms: 1000,
    };
    let session = store
        .register(
            &validate::registration(&reg, &Limits::default()).unwrap(),
            now_ms(),
        )
        .await
        .unwrap();
    let sample = |uuid: &str, used: u64| pb::GpuSample {
        uuid: uuid.into(),
        timestamp_ms: now_ms() - 1000,
        interval_ms: 1000,
        poll_count: 10,
        memory_used_last_bytes: used,
        memory_used_min_bytes: used,
        memory_used_max_bytes: used,
        memory_reserved_bytes: 0,
        memory_total_bytes: 80 * gib,
        utilization_pct: None,
        pcie_tx_bytes_per_s: None,
        pcie_rx_bytes_per_s: None,
    };
    let batch = pb::Batch {
        node: "node-a".into(),
        boot_id: "b".into(),
        seq: 1,
        gpu_samples: vec![sample("GPU-a0", 10 * gib), sample("GPU-a1", 76 * gib)],
        process_samples: vec![],
        events: vec![],
    };
    let rows = validate::batch(batch, &session, now_ms(), &Limits::default()).unwrap();
    store.write_batch(&rows).await.unwrap();

    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http_addr = http.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(Collector::builder(store).build().await.unwrap().serve(
        grpc,
        http,
        async move {
            let _ = stopped.await;
        },
    ));

    let url = format!("http://{http_addr}");
    let out = status(&["--url", &url]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with(
            "1 nodes, 2 GPUs (0 MIG instances): 86.0 GiB of 160.0 GiB used; 1 GPUs below 10 %"
        ),
        "{text}"
    );
    assert!(lines[2].starts_with("NODE"), "{text}");
    assert!(
        lines[3].starts_with("node-a")
            && lines[3].contains("76.0 GiB")
            && lines[3].contains("5.0 %"),
        "{text}"
    );
    assert!(lines[4].contains("10.0 GiB"), "{text}");

    // The fullest only, where asked: the rest are named, not listed.
    let out = status(&["--fullest", "1", "--url", &url]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("76.0 GiB") && !text.contains("10.0 GiB"),
        "{text}"
    );
    assert!(
        text.contains("(1 of the fleet's 2 devices with data"),
        "{text}"
    );

    // A collector that is not there is named in the error.
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    let out = status(&["--url", &url]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach the collector"));
}
