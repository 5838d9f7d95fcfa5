//! The container images, as `deploy/container/build-offline.sh` builds them
//! from this machine's Debian files (it cannot pull base images).
//!
//! No OCI runtime can start a container here: crun refuses the machine's
//! hybrid cgroup layout, and podman with `--cgroups=disabled` is refused
//! the rlimits it sets. So the test checks what a runtime would be given,
//! the image's configuration (user, entrypoint, command, working folder,
//! labels) through `skopeo inspect`, and runs each image's root file
//! system under `chroot` as its user 65532: the collector's demo serves
//! `/healthz` and its fleet, the agent without NVML exits with status 78
//! naming the library, and with a libnvidia-ml.so.1 where the NVIDIA
//! container runtime mounts it, the agent loads it and samples.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use headroom_tests::harness::{KillOnDrop, built, eventually, free_loopback_addr};
use serde_json::Value;

const USER: &str = "65532:65532";

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `command`, which must succeed; its stdout.
fn succeed(command: &mut Command) -> Vec<u8> {
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{command:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn config(layout: &Path, tag: &str) -> Value {
    let stdout = succeed(
        Command::new("skopeo")
            .args(["inspect", "--config"])
            .arg(format!("oci:{}:{tag}", layout.display())),
    );
    serde_json::from_slice(&stdout).unwrap()
}

fn unpack(layout: &Path, tag: &str, into: &Path) -> PathBuf {
    succeed(
        Command::new("umoci")
            .args(["unpack", "--image"])
            .arg(format!("{}:{tag}", layout.display()))
            .arg(into),
    );
    into.join("rootfs")
}

/// The image's entrypoint in its root file system, as its user.
fn in_image(rootfs: &Path, entrypoint: &str) -> Command {
    let mut c = Command::new("chroot");
    c.arg(format!("--userspec={USER}"))
        .arg(rootfs)
        .arg(entrypoint)
        .env_clear()
        // chroot itself is looked up on this PATH; distroless sets the same.
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .env("RUST_LOG", "info");
    c
}

async fn get(addr: SocketAddr, path: &str) -> Option<String> {
    reqwest::get(format!("http://{addr}{path}"))
        .await
        .ok()?
        .text()
        .await
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_images_run_as_their_user_with_what_their_binaries_need() {
    let missing: Vec<&str> = ["umoci", "skopeo", "objcopy", "chroot"]
        .into_iter()
        .filter(|tool| !have(tool))
        .collect();
    if !missing.is_empty() || !headroom_tests::postgres::is_root() {
        headroom_tests::skip_or_fail_under_ci(
            "the container image test",
            format!("needs root and {missing:?} (apt-get install umoci skopeo binutils)"),
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("oci");
    let bin_dir = built("headroom-collector").parent().unwrap().to_owned();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/container/build-offline.sh");
    succeed(Command::new(&script).arg(&bin_dir).arg(&layout));

    // What a runtime is told.
    for (tag, title) in [
        ("agent", "headroom-agent"),
        ("collector", "headroom-collector"),
    ] {
        let image = config(&layout, tag);
        let c = &image["config"];
        assert_eq!(c["User"], USER, "{tag} runs as nonroot");
        assert_eq!(c["Entrypoint"][0], format!("/usr/local/bin/{title}"));
        let labels = &c["Labels"];
        assert_eq!(labels["org.opencontainers.image.title"], title);
        assert_eq!(
            labels["org.opencontainers.image.version"],
            env!("CARGO_PKG_VERSION")
        );
        assert_eq!(labels["org.opencontainers.image.licenses"], "Apache-2.0");
        assert!(
            labels["org.opencontainers.image.source"]
                .as_str()
                .is_some_and(|s| s.starts_with("https://")),
            "{labels}"
        );
    }
    let collector = config(&layout, "collector");
    assert_eq!(collector["config"]["Cmd"][0], "serve");
    assert_eq!(collector["config"]["WorkingDir"], "/var/lib/headroom");

    // The collector's demo, inside its image.
    let rootfs = unpack(&layout, "collector", &dir.path().join("collector"));
    let http = free_loopback_addr();
    let demo = KillOnDrop(
        in_image(&rootfs, "/usr/local/bin/headroom-collector")
            .args(["demo", "--data-dir", "/var/lib/headroom/demo"])
            .args(["--http-listen", &http.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually("/healthz in the image", Duration::from_secs(30), || async {
        (get(http, "/healthz").await?.trim() == "ok").then_some(())
    })
    .await;
    let nodes = eventually("the demo fleet", Duration::from_secs(30), || async {
        let nodes: Value = serde_json::from_str(&get(http, "/api/v1/nodes").await?).ok()?;
        (nodes.as_array()?.len() == 4).then_some(nodes)
    })
    .await;
    assert!(nodes.to_string().contains("gpu-node-01"), "{nodes}");
    assert!(rootfs.join("var/lib/headroom/demo/headroom.db").is_file());
    demo.kill();

    // The agent without NVML: status 78 and the library named.
    let rootfs = unpack(&layout, "agent", &dir.path().join("agent"));
    let out = in_image(&rootfs, "/usr/local/bin/headroom-agent")
        .args(["--source", "nvml", "--node-name", "image-node"])
        .args(["--collector-url", "http://127.0.0.1:9"])
        .arg("--no-allocator-socket")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert!(stderr.contains("libnvidia-ml.so.1"), "{stderr}");

    // With the library where the NVIDIA container runtime mounts it (the
    // fake one here), the agent loads it and samples.
    std::fs::copy(
        headroom_tests::fake_nvml::library(),
        rootfs.join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
    )
    .unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nvml-node.toml"),
        rootfs.join("tmp/scenario.toml"),
    )
    .unwrap();
    let metrics = free_loopback_addr();
    // The fixture's one node.
    let node = "fake-node-01";
    let agent = KillOnDrop(
        in_image(&rootfs, "/usr/local/bin/headroom-agent")
            .args(["--source", "nvml", "--node-name", node])
            .args(["--collector-url", "http://127.0.0.1:9"])
            .args(["--metrics-listen", &metrics.to_string()])
            .args(["--spool-dir", "/tmp/spool"])
            .arg("--no-allocator-socket")
            .env("HEADROOM_FAKE_NVML_SCENARIO", "/tmp/scenario.toml")
            .env("HEADROOM_FAKE_NVML_NODE", node)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually(
        "the agent to sample through NVML",
        Duration::from_secs(30),
        || async {
            let text = get(metrics, "/metrics").await?;
            let polls: f64 = text
                .lines()
                .find(|l| l.starts_with("headroom_agent_polls_total"))?
                .rsplit(' ')
                .next()?
                .parse()
                .ok()?;
            (polls > 0.0).then_some(())
        },
    )
    .await;
    agent.kill();
}
