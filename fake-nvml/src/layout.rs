//! Each GPU's MIG layout over time: the scenario's instances, then whatever
//! `[[mig_reconfigure]]` faults switch it to. A layout's *generation* is its
//! position in that sequence (0 = the scenario's); MIG handles carry it, so
//! a handle to an instance destroyed by a reconfiguration stops working.

use headroom_sim::GpuInfo;

use crate::config::MigReconfigure;

/// At most this many MIG instances per GPU (NVML's largest parts have 7; the
/// handle encoding has room for 255).
pub(crate) const MAX_INSTANCES: usize = 255;

const GIB: u64 = 1 << 30;

/// One MIG instance of a layout: the scenario's own type, so a layout from
/// a reconfiguration looks exactly like one from the scenario.
pub(crate) type MigInstance = headroom_sim::MigInfo;

#[derive(Debug)]
pub(crate) struct GpuLayouts {
    /// `(from t, instances)`, ordered by time; the first is the scenario's
    /// layout, in force from the start.
    layouts: Vec<(f64, Vec<MigInstance>)>,
}

impl GpuLayouts {
    /// The generation in force at `t`.
    pub(crate) fn generation_at(&self, t: f64) -> usize {
        self.layouts
            .iter()
            .rposition(|(from, _)| *from <= t)
            .unwrap_or(0)
    }

    pub(crate) fn instances(&self, generation: usize) -> &[MigInstance] {
        self.layouts
            .get(generation)
            .map_or(&[], |(_, instances)| instances.as_slice())
    }
}

/// Builds every GPU's layouts from the inventory and the (validated)
/// reconfiguration faults.
pub(crate) fn build(inventory: &[GpuInfo], reconfigure: &[MigReconfigure]) -> Vec<GpuLayouts> {
    inventory
        .iter()
        .map(|gpu| {
            let initial = gpu
                .mig
                .iter()
                .map(|mig| MigInstance {
                    uuid: mig.uuid.clone(),
                    gpu_instance_id: mig.gpu_instance_id,
                    compute_instance_id: mig.compute_instance_id,
                    profile: mig.profile.clone(),
                    memory_total: mig.memory_total,
                })
                .collect();
            let mut changes: Vec<&MigReconfigure> = reconfigure
                .iter()
                .filter(|change| change.gpu == gpu.index)
                .collect();
            // Stable: of two changes at the same instant the later one listed wins.
            changes.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));

            let mut layouts = vec![(f64::NEG_INFINITY, initial)];
            for (generation, change) in (1u64..).zip(changes) {
                let instances = change
                    .profiles
                    .iter()
                    .enumerate()
                    .map(|(position, profile)| {
                        let gpu_instance_id = position as u32 + 1;
                        MigInstance {
                            uuid: mig_uuid(&gpu.uuid, generation, gpu_instance_id),
                            gpu_instance_id,
                            compute_instance_id: 0,
                            profile: profile.clone(),
                            memory_total: profile_memory(profile)
                                .unwrap_or(0)
                                .min(gpu.memory_total),
                        }
                    })
                    .collect();
                layouts.push((change.at_s, instances));
            }
            GpuLayouts { layouts }
        })
        .collect()
}

/// The memory of a MIG profile, from its `<N>g.<M>gb` name: M GiB. A suffix
/// after `+` (`1g.10gb+me`) is allowed and ignored.
pub(crate) fn profile_memory(profile: &str) -> Option<u64> {
    let base = profile.split_once('+').map_or(profile, |(base, _)| base);
    let (slices, memory) = base.split_once("g.")?;
    let gib = memory.strip_suffix("gb")?;
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(slices) || !all_digits(gib) {
        return None;
    }
    gib.parse::<u64>().ok()?.checked_mul(GIB)
}

/// A fresh `MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` for an instance created
/// by a reconfiguration: FNV-1a over (GPU UUID, generation, instance id),
/// so it is stable across runs but differs from every earlier layout's.
fn mig_uuid(gpu_uuid: &str, generation: u64, gpu_instance_id: u32) -> String {
    let hash = |domain: u8| {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let bytes = [domain]
            .into_iter()
            .chain(gpu_uuid.bytes())
            .chain(generation.to_le_bytes())
            .chain(gpu_instance_id.to_le_bytes());
        for byte in bytes {
            h ^= u64::from(byte);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // SplitMix64 finish, so nearby keys differ in every bit.
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^ (h >> 31)
    };
    let (high, low) = (hash(1), hash(2));
    format!(
        "MIG-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xffff,
        high & 0xffff,
        low >> 48,
        low & 0xffff_ffff_ffff,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_sim::MigInfo;

    fn gpu(index: u32, mig: Vec<MigInfo>) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            name: "NVIDIA A100-SXM4-80GB".into(),
            memory_total: 80 * GIB,
            pci_bus_id: String::new(),
            pcie_generation: 4,
            pcie_width: 16,
            mig,
        }
    }

    #[test]
    fn profile_memory_reads_the_gb_suffix() {
        assert_eq!(profile_memory("7g.80gb"), Some(80 * GIB));
        assert_eq!(profile_memory("1g.10gb+me"), Some(10 * GIB));
        for bad in ["", "80gb", "g.80gb", "3g.gb", "3g.40GB", "3g.40", "xg.40gb"] {
            assert_eq!(profile_memory(bad), None, "{bad}");
        }
    }

    #[test]
    fn reconfigurations_take_over_in_time_order() {
        let initial = MigInfo {
            uuid: "MIG-initial".into(),
            gpu_instance_id: 1,
            compute_instance_id: 0,
            profile: "3g.40gb".into(),
            memory_total: 40 * GIB,
        };
        let changes = [
            MigReconfigure {
                gpu: 0,
                at_s: 5.0,
                profiles: vec![],
            },
            MigReconfigure {
                gpu: 0,
                at_s: 3.0,
                profiles: vec!["2g.20gb".into(), "1g.10gb".into()],
            },
            MigReconfigure {
                gpu: 1,
                at_s: 1.0,
                profiles: vec!["7g.80gb".into()],
            },
        ];
        let layouts = build(&[gpu(0, vec![initial]), gpu(1, vec![])], &changes);

        let gpu0 = &layouts[0];
        assert_eq!(gpu0.generation_at(0.0), 0);
        assert_eq!(gpu0.instances(0)[0].uuid, "MIG-initial");
        assert_eq!(gpu0.generation_at(3.0), 1);
        let after = gpu0.instances(1);
        assert_eq!(after.len(), 2);
        assert_eq!(
            (after[1].gpu_instance_id, after[1].compute_instance_id),
            (2, 0)
        );
        assert_eq!(after[1].memory_total, 10 * GIB);
        assert!(after[0].uuid.starts_with("MIG-") && after[0].uuid != after[1].uuid);
        assert_eq!(gpu0.generation_at(6.0), 2);
        assert!(gpu0.instances(2).is_empty());

        let gpu1 = &layouts[1];
        assert!(gpu1.instances(gpu1.generation_at(0.5)).is_empty());
        assert_eq!(
            gpu1.instances(gpu1.generation_at(1.5))[0].profile,
            "7g.80gb"
        );
        assert!(gpu1.instances(7).is_empty());
    }
}
