//! A pod's namespace, from the kubelet's log directories: it keeps each
//! pod's container logs in `/var/log/pods/<namespace>_<name>_<uid>/`, a
//! directory any user may list. The cgroup path gives the pod's uid only,
//! and the API server is not asked: the agent holds no Kubernetes
//! credentials.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A uid not found is looked for again after this long at the soonest: a
/// pod's log directory exists before its first container starts, so a miss
/// is a pod outside Kubernetes' layout, not one the kubelet is creating.
const RESCAN_AFTER: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub(crate) struct PodNamespaces {
    dir: PathBuf,
    by_uid: HashMap<String, String>,
    scanned_at: Option<Instant>,
}

impl PodNamespaces {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            by_uid: HashMap::new(),
            scanned_at: None,
        }
    }

    /// The namespace of the pod with `uid`, if its log directory is there.
    pub fn namespace(&mut self, uid: &str) -> Option<String> {
        if !self.by_uid.contains_key(uid)
            && self
                .scanned_at
                .is_none_or(|at| at.elapsed() >= RESCAN_AFTER)
        {
            self.rescan();
        }
        self.by_uid.get(uid).cloned()
    }

    /// Rebuilt whole, so pods that are gone drop out and the map stays the
    /// size of the node's pods.
    fn rescan(&mut self) {
        self.scanned_at = Some(Instant::now());
        self.by_uid.clear();
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            if let Some((namespace, uid)) = entry.file_name().to_str().and_then(parse_dir_name) {
                self.by_uid.insert(uid.to_owned(), namespace.to_owned());
            }
        }
    }
}

/// `<namespace>_<name>_<uid>` → (namespace, uid). Namespaces and pod names
/// are DNS-1123 names, which have no `_`; anything else is not the
/// kubelet's and is skipped.
pub(crate) fn parse_dir_name(name: &str) -> Option<(&str, &str)> {
    let mut parts = name.split('_');
    let (namespace, pod, uid) = (parts.next()?, parts.next()?, parts.next()?);
    let dns = |s: &str, max: usize| {
        !s.is_empty()
            && s.len() <= max
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && !s.starts_with('-')
    };
    let uid_ok = !uid.is_empty()
        && uid.len() <= 64
        && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-');
    (parts.next().is_none()
        && dns(namespace, 63)
        && !namespace.contains('.')
        && dns(pod, 253)
        && uid_ok)
        .then_some((namespace, uid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kubelets_directory_names_give_namespace_and_uid() {
        assert_eq!(
            parse_dir_name("research_trainer-0_1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"),
            Some(("research", "1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"))
        );
        for bad in [
            "research_trainer-0",
            "a_b_c_d",
            "Research_trainer_1a2b",
            "_trainer_1a2b",
            "research_trainer_not-hex!",
            "re.search_trainer_1a2b",
        ] {
            assert_eq!(parse_dir_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_pod_created_after_a_scan_is_found_once_the_rescan_is_due() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("ml_a-0_aaaa")).unwrap();
        let mut pods = PodNamespaces::new(dir.path().to_owned());
        assert_eq!(pods.namespace("aaaa").as_deref(), Some("ml"));
        std::fs::create_dir(dir.path().join("serving_b-0_bbbb")).unwrap();
        assert_eq!(pods.namespace("bbbb"), None, "not rescanned at once");
        pods.scanned_at = Some(Instant::now() - RESCAN_AFTER);
        assert_eq!(pods.namespace("bbbb").as_deref(), Some("serving"));
        assert_eq!(pods.namespace("aaaa").as_deref(), Some("ml"));
    }

    #[test]
    fn no_log_directory_means_no_namespace() {
        let mut pods = PodNamespaces::new(PathBuf::from("/nonexistent/headroom/pods"));
        assert_eq!(pods.namespace("aaaa"), None);
    }
}
