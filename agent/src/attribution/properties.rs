//! Property tests of the `/proc` and cgroup parsers: any bytes give a value
//! or nothing, never a panic, and what real files encode comes back out.
//! `PROPTEST_CASES=100000 cargo test -p headroom-agent --lib properties`
//! for a longer hunt.

use proptest::prelude::*;

use super::cgroup::{ContainerRuntime, classify_cgroup_file, classify_path};
use super::process::{parse_btime, parse_cmdline, parse_stat, parse_status, printable};

fn hex64() -> impl Strategy<Value = String> {
    "[0-9a-f]{64}"
}

proptest! {
    #[test]
    fn proc_parsers_take_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let text = String::from_utf8_lossy(&bytes);
        let _ = parse_stat(&bytes);
        let _ = parse_status(&text);
        let _ = parse_btime(&text);
        if let Some(command) = parse_cmdline(&bytes) {
            prop_assert!(!printable(command).chars().any(char::is_control));
        }
        let _ = classify_cgroup_file(&text);
        let _ = classify_path(&text);
    }

    #[test]
    fn stat_gives_back_any_comm_and_start_time(
        comm in "[ -~]{0,15}",
        start in any::<u64>(),
        pid in 1u32..4_194_304,
    ) {
        // Fields 4 to 21, then starttime, the 22nd.
        let middle: Vec<String> = (4..22).map(|i| i.to_string()).collect();
        let line = format!("{pid} ({comm}) S {} {start} 0 0\n", middle.join(" "));
        let parsed = parse_stat(line.as_bytes());
        prop_assert!(parsed.is_some(), "{}", line);
        let parsed = parsed.unwrap_or_else(|| unreachable!());
        prop_assert_eq!(parsed.comm, comm);
        prop_assert_eq!(parsed.start_ticks, start);
    }

    #[test]
    fn a_container_scope_anywhere_in_the_path_names_its_id(
        id in hex64(),
        runtime in prop_oneof![
            Just(("docker-", ContainerRuntime::Docker)),
            Just(("cri-containerd-", ContainerRuntime::Containerd)),
            Just(("crio-", ContainerRuntime::CriO)),
            Just(("libpod-", ContainerRuntime::Podman)),
        ],
        depth in proptest::collection::vec("[a-z]{1,8}\\.slice", 0..3),
    ) {
        let (prefix, expected) = runtime;
        let path = format!("/{}/{prefix}{id}.scope", depth.join("/"));
        let owner = classify_path(&path);
        let container = owner.container;
        prop_assert!(container.is_some(), "{}", path);
        let container = container.unwrap_or_else(|| unreachable!());
        prop_assert_eq!(container.id, id);
        prop_assert_eq!(container.runtime, expected);
    }
}
