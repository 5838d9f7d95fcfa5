//! The fake library serving `fixtures/node.toml`, read through nvml-wrapper
//! (as the agent reads it) and through the raw C entry points: every value
//! must be what `headroom_sim` says the scenario holds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{GIB, MIB, in_child, in_configured_child, init, scenario};
use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::PcieUtilCounter;
use nvml_wrapper::enums::device::{SampleValue, UsedGpuMemory};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::structs::device::FieldId;

const PCIE_TX_BYTES: FieldId = FieldId(197);
const PCIE_RX_BYTES: FieldId = FieldId(198);

fn used(process: &ProcessInfo) -> u64 {
    match process.used_gpu_memory {
        UsedGpuMemory::Used(bytes) => bytes,
        UsedGpuMemory::Unavailable => panic!("{process:?} has no memory figure"),
    }
}

/// pid → (memory, gpu instance id, compute instance id).
fn by_pid(processes: &[ProcessInfo]) -> BTreeMap<u32, (u64, Option<u32>, Option<u32>)> {
    processes
        .iter()
        .map(|p| (p.pid, (used(p), p.gpu_instance_id, p.compute_instance_id)))
        .collect()
}

#[test]
fn inventory_matches_the_scenario() {
    if in_configured_child("inventory_matches_the_scenario", None).is_some() {
        return;
    }
    let scenario = scenario();
    let node = scenario.node("test-node").unwrap();
    let want = node.inventory();
    let nvml = init();

    assert_eq!(nvml.device_count().unwrap() as usize, want.len());
    assert_eq!(nvml.sys_driver_version().unwrap(), node.driver_version);
    assert_eq!(nvml.sys_nvml_version().unwrap(), "12.550.54.15");
    for gpu in &want {
        let device = nvml.device_by_index(gpu.index).unwrap();
        assert_eq!(device.index().unwrap(), gpu.index);
        assert_eq!(device.uuid().unwrap(), gpu.uuid);
        assert_eq!(device.name().unwrap(), gpu.name);
        assert_eq!(device.max_pcie_link_gen().unwrap(), gpu.pcie_generation);
        assert_eq!(device.max_pcie_link_width().unwrap(), gpu.pcie_width);
        assert_eq!(device.current_pcie_link_gen().unwrap(), gpu.pcie_generation);
        assert_eq!(device.current_pcie_link_width().unwrap(), gpu.pcie_width);
        assert!(!device.mig_is_mig_device_handle().unwrap());
        let by_uuid = nvml.device_by_uuid(gpu.uuid.as_str()).unwrap();
        assert_eq!(by_uuid.index().unwrap(), gpu.index);
        let mig = device.mig_mode().unwrap();
        let in_mig = u32::from(!gpu.mig.is_empty());
        assert_eq!(
            (mig.current, mig.pending),
            (in_mig, in_mig),
            "gpu {}",
            gpu.index
        );
    }
    assert!(matches!(
        nvml.device_by_index(want.len() as u32),
        Err(NvmlError::InvalidArg)
    ));
    assert!(matches!(
        nvml.device_by_uuid("GPU-00000000-0000-0000-0000-000000000000"),
        Err(NvmlError::NotFound)
    ));
}

#[test]
fn memory_matches_the_scenario() {
    if in_configured_child("memory_matches_the_scenario", None).is_some() {
        return;
    }
    let scenario = scenario();
    let node = scenario.node("test-node").unwrap();
    let want = node.state_at(1.0);
    let nvml = init();
    for (index, gpu) in want.iter().enumerate() {
        let memory = nvml
            .device_by_index(index as u32)
            .unwrap()
            .memory_info()
            .unwrap();
        assert_eq!(memory.total, gpu.memory_total, "gpu {index}");
        assert_eq!(memory.reserved, gpu.memory_reserved, "gpu {index}");
        assert_eq!(memory.used, gpu.memory_used, "gpu {index}");
        assert_eq!(
            memory.free,
            gpu.memory_total - gpu.memory_reserved - gpu.memory_used,
            "gpu {index}"
        );
    }
    // Spelled out for gpu 0: two processes plus unattributed, not reserved.
    let gpu0 = nvml.device_by_index(0).unwrap().memory_info().unwrap();
    assert_eq!(gpu0.used, 16 * GIB);
    assert_eq!(gpu0.reserved, 512 * MIB);

    let utilization = nvml
        .device_by_index(0)
        .unwrap()
        .utilization_rates()
        .unwrap();
    assert!((75..=85).contains(&utilization.gpu), "{utilization:?}");
    let idle = nvml
        .device_by_index(3)
        .unwrap()
        .utilization_rates()
        .unwrap();
    assert_eq!(idle.gpu, 0);
}

#[test]
fn processes_on_a_plain_gpu() {
    if in_configured_child("processes_on_a_plain_gpu", None).is_some() {
        return;
    }
    let nvml = init();
    let gpu0 = nvml.device_by_index(0).unwrap();
    let processes = by_pid(&gpu0.running_compute_processes().unwrap());
    assert_eq!(
        processes,
        BTreeMap::from([
            (1001, (10 * GIB, None, None)),
            (1002, (5 * GIB, None, None))
        ])
    );
    assert!(gpu0.running_graphics_processes().unwrap().is_empty());
    assert_eq!(gpu0.running_compute_processes_count().unwrap(), 2);
    let idle = nvml.device_by_index(3).unwrap();
    assert!(idle.running_compute_processes().unwrap().is_empty());
    assert_eq!(nvml.sys_process_name(1001, 64).unwrap(), "python train.py");
}

#[test]
fn mig_instances_are_enumerated_with_their_memory_and_processes() {
    if in_configured_child(
        "mig_instances_are_enumerated_with_their_memory_and_processes",
        None,
    )
    .is_some()
    {
        return;
    }
    let scenario = scenario();
    let node = scenario.node("test-node").unwrap();
    let want = &node.inventory()[2];
    let nvml = init();
    let gpu = nvml.device_by_index(2).unwrap();
    assert_eq!(gpu.mig_device_count().unwrap(), 7);
    assert_eq!(
        nvml.device_by_index(0).unwrap().mig_device_count().unwrap(),
        0
    );

    let expected = [
        // (profile, total, used, gi, ci, processes)
        ("3g.40gb", 40 * GIB, 12 * GIB, 1, 0, vec![3001]),
        ("2g.20gb", 20 * GIB, 6 * GIB, 5, 1, vec![3002, 3003]),
        ("1g.10gb", 10 * GIB, 0, 3, 0, vec![]),
    ];
    for (slot, (profile, total, used_now, gi, ci, pids)) in expected.iter().enumerate() {
        let mig = gpu.mig_device_by_index(slot as u32).unwrap();
        assert!(mig.mig_is_mig_device_handle().unwrap());
        assert_eq!(mig.uuid().unwrap(), want.mig[slot].uuid);
        assert_eq!(
            mig.name().unwrap(),
            format!("NVIDIA A100-SXM4-80GB MIG {profile}")
        );
        let memory = mig.memory_info().unwrap();
        assert_eq!(
            (memory.total, memory.used, memory.reserved),
            (*total, *used_now, 0)
        );
        assert_eq!(memory.free, total - used_now);
        assert_eq!(raw_instance_ids(&nvml, &mig), (*gi, *ci), "{profile}");
        let parent = mig.mig_parent_device().unwrap();
        assert_eq!(parent.uuid().unwrap(), want.uuid);
        let processes = mig.running_compute_processes().unwrap();
        let got: Vec<u32> = processes.iter().map(|p| p.pid).collect();
        assert_eq!(&got, pids, "{profile}");
        for process in &processes {
            assert_eq!(
                (process.gpu_instance_id, process.compute_instance_id),
                (Some(*gi), Some(*ci))
            );
        }
        assert!(matches!(
            mig.utilization_rates(),
            Err(NvmlError::NotSupported)
        ));
        assert!(matches!(mig.mig_mode(), Err(NvmlError::NotSupported)));
        let by_uuid = nvml.device_by_uuid(want.mig[slot].uuid.as_str()).unwrap();
        assert_eq!(by_uuid.name().unwrap(), mig.name().unwrap());
    }
    assert!(matches!(
        gpu.mig_device_by_index(3),
        Err(NvmlError::NotFound)
    ));

    // The parent lists every instance's processes with their instance ids.
    let all = by_pid(&gpu.running_compute_processes().unwrap());
    assert_eq!(
        all,
        BTreeMap::from([
            (3001, (12 * GIB, Some(1), Some(0))),
            (3002, (4 * GIB, Some(5), Some(1))),
            (3003, (2 * GIB, Some(5), Some(1))),
        ])
    );
    assert!(matches!(
        gpu.mig_parent_device(),
        Err(NvmlError::NotSupported)
    ));
}

/// nvml-wrapper has no wrappers for the instance-id getters.
#[allow(unsafe_code)]
fn raw_instance_ids(nvml: &nvml_wrapper::Nvml, mig: &Device<'_>) -> (u32, u32) {
    let lib = nvml.lib();
    let (mut gi, mut ci) = (0, 0);
    // SAFETY: a live handle from this library and pointers to locals.
    unsafe {
        let handle = mig.handle();
        assert_eq!(lib.nvmlDeviceGetGpuInstanceId(handle, &mut gi), 0);
        assert_eq!(lib.nvmlDeviceGetComputeInstanceId(handle, &mut ci), 0);
    }
    (gi, ci)
}

#[test]
fn pcie_counters_grow_at_the_scenario_rate() {
    if in_configured_child("pcie_counters_grow_at_the_scenario_rate", None).is_some() {
        return;
    }
    let scenario = scenario();
    let node = scenario.node("test-node").unwrap();
    let started = Instant::now();
    let nvml = init();
    let gpu0 = nvml.device_by_index(0).unwrap();
    let read = || {
        let values: Vec<_> = gpu0
            .field_values_for(&[PCIE_TX_BYTES, PCIE_RX_BYTES])
            .unwrap()
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let value = |i: usize| match values[i].value {
            Ok(SampleValue::U64(bytes)) => bytes,
            ref other => panic!("{other:?}"),
        };
        (values[0].timestamp, value(0), value(1))
    };
    let (t0, tx0, rx0) = read();
    std::thread::sleep(Duration::from_millis(400));
    let (t1, tx1, rx1) = read();
    let seconds = (t1 - t0) as f64 / 1e6;
    assert!((0.3..1.0).contains(&seconds), "{seconds}");

    // The rate swings ±30 % over a minute: compare with the scenario's rate
    // mid-way (this process's first init started the scenario clock).
    let mid = started.elapsed().as_secs_f64() - 0.2;
    let want = &node.state_at(mid)[0];
    let close = |got: f64, want: u64| (got / want as f64 - 1.0).abs() < 0.1;
    let tx_rate = (tx1 - tx0) as f64 / seconds;
    let rx_rate = (rx1 - rx0) as f64 / seconds;
    assert!(
        close(tx_rate, want.pcie_tx_bytes_per_s),
        "{tx_rate} vs {want:?}"
    );
    assert!(
        close(rx_rate, want.pcie_rx_bytes_per_s),
        "{rx_rate} vs {want:?}"
    );

    let now = &node.state_at(started.elapsed().as_secs_f64())[0];
    let tx_kb = gpu0.pcie_throughput(PcieUtilCounter::Send).unwrap();
    let rx_kb = gpu0.pcie_throughput(PcieUtilCounter::Receive).unwrap();
    assert!(
        close(f64::from(tx_kb), now.pcie_tx_bytes_per_s / 1024),
        "{tx_kb}"
    );
    assert!(
        close(f64::from(rx_kb), now.pcie_rx_bytes_per_s / 1024),
        "{rx_kb}"
    );

    // Other fields, and every field on a MIG handle, are not supported.
    let other = gpu0
        .field_values_for(&[FieldId(1)])
        .unwrap()
        .remove(0)
        .unwrap();
    assert!(matches!(other.value, Err(NvmlError::NotSupported)));
    let mig = nvml
        .device_by_index(2)
        .unwrap()
        .mig_device_by_index(0)
        .unwrap();
    let on_mig = mig
        .field_values_for(&[PCIE_TX_BYTES])
        .unwrap()
        .remove(0)
        .unwrap();
    assert!(matches!(on_mig.value, Err(NvmlError::NotSupported)));
}

#[test]
fn without_configuration_it_serves_the_demo_fleet() {
    if in_child("without_configuration_it_serves_the_demo_fleet", &[]).is_some() {
        return;
    }
    let demo = headroom_sim::Scenario::demo();
    let first = &demo.nodes()[0];
    let nvml = init();
    assert_eq!(nvml.device_count().unwrap() as usize, first.gpu_count());
    assert_eq!(nvml.sys_driver_version().unwrap(), first.driver_version);
    let uuid = nvml.device_by_index(0).unwrap().uuid().unwrap();
    assert_eq!(uuid, first.inventory()[0].uuid);
}

/// What the nvml-wrapper level cannot show: init refcounting, the size
/// protocol, version checks, argument validation, the v1 entry points.
#[test]
#[allow(unsafe_code)]
fn raw_entry_points_follow_nvml_h() {
    use nvml_wrapper_sys::bindings::*;
    use std::ffi::CStr;
    use std::ptr;

    if in_configured_child("raw_entry_points_follow_nvml_h", None).is_some() {
        return;
    }
    // SAFETY: loading the fake library, whose initialisers do nothing.
    let lib = unsafe { NvmlLib::new(common::library()) }.unwrap();
    // SAFETY: every call below passes pointers to live locals (or null,
    // where the test is about null) and handles this library issued.
    unsafe {
        let mut count = 0;
        assert_eq!(lib.nvmlDeviceGetCount_v2(&mut count), 1, "uninitialized");
        assert_eq!(lib.nvmlShutdown(), 1, "nothing to shut down");
        assert_eq!(lib.nvmlInit_v2(), 0);
        assert_eq!(lib.nvmlInit(), 0);
        assert_eq!(lib.nvmlDeviceGetCount(&mut count), 0);
        assert_eq!(count, 4);
        assert_eq!(lib.nvmlDeviceGetCount_v2(ptr::null_mut()), 2);

        let mut gpu0: nvmlDevice_t = ptr::null_mut();
        assert_eq!(lib.nvmlDeviceGetHandleByIndex(0, &mut gpu0), 0);
        let mut again: nvmlDevice_t = ptr::null_mut();
        assert_eq!(lib.nvmlDeviceGetHandleByIndex_v2(0, &mut again), 0);
        assert_eq!(gpu0, again);
        assert!(!gpu0.is_null());
        let bogus = 0x1234_usize as nvmlDevice_t;
        let mut index = 0;
        assert_eq!(lib.nvmlDeviceGetIndex(bogus, &mut index), 2);
        assert_eq!(lib.nvmlDeviceGetIndex(ptr::null_mut(), &mut index), 2);
        assert_eq!(lib.nvmlDeviceGetIndex(gpu0, ptr::null_mut()), 2);

        // Processes: ask for the count, then too small, then enough.
        let mut n = 0;
        let code = lib.nvmlDeviceGetComputeRunningProcesses_v3(gpu0, &mut n, ptr::null_mut());
        assert_eq!((code, n), (7, 2), "INSUFFICIENT_SIZE with the count");
        let mut infos = [nvmlProcessInfo_t {
            pid: 0,
            usedGpuMemory: 0,
            gpuInstanceId: 0,
            computeInstanceId: 0,
        }; 4];
        n = 1;
        let code = lib.nvmlDeviceGetComputeRunningProcesses_v3(gpu0, &mut n, infos.as_mut_ptr());
        assert_eq!((code, n), (7, 2));
        n = 4;
        let code = lib.nvmlDeviceGetComputeRunningProcesses_v3(gpu0, &mut n, infos.as_mut_ptr());
        assert_eq!((code, n), (0, 2));
        assert_eq!((infos[0].pid, infos[0].gpuInstanceId), (1001, u32::MAX));
        let mut v1 = [nvmlProcessInfo_v1_t {
            pid: 0,
            usedGpuMemory: 0,
        }; 2];
        n = 2;
        let code = lib.nvmlDeviceGetComputeRunningProcesses(gpu0, &mut n, v1.as_mut_ptr());
        assert_eq!(
            (code, n, v1[1].pid, v1[1].usedGpuMemory),
            (0, 2, 1002, 5 * GIB)
        );
        n = 0;
        let code = lib.nvmlDeviceGetGraphicsRunningProcesses_v2(gpu0, &mut n, ptr::null_mut());
        assert_eq!((code, n), (0, 0), "no graphics processes: SUCCESS, 0");

        // Memory: the v2 version field is checked; v1 counts reserved as used.
        let mut memory = nvmlMemory_v2_t {
            version: 1,
            total: 0,
            reserved: 0,
            free: 0,
            used: 0,
        };
        assert_eq!(lib.nvmlDeviceGetMemoryInfo_v2(gpu0, &mut memory), 25);
        memory.version = std::mem::size_of::<nvmlMemory_v2_t>() as u32 | 2 << 24;
        assert_eq!(lib.nvmlDeviceGetMemoryInfo_v2(gpu0, &mut memory), 0);
        let mut v1_memory = nvmlMemory_t {
            total: 0,
            free: 0,
            used: 0,
        };
        assert_eq!(lib.nvmlDeviceGetMemoryInfo(gpu0, &mut v1_memory), 0);
        assert_eq!(v1_memory.used, memory.used + memory.reserved);
        assert_eq!(v1_memory.free, memory.free);

        // Strings: too small a buffer is INSUFFICIENT_SIZE.
        let mut name = [0 as std::ffi::c_char; 96];
        assert_eq!(lib.nvmlDeviceGetName(gpu0, name.as_mut_ptr(), 5), 7);
        assert_eq!(lib.nvmlDeviceGetName(gpu0, name.as_mut_ptr(), 96), 0);
        let name = CStr::from_ptr(name.as_ptr()).to_str().unwrap();
        assert_eq!(name, "NVIDIA H100 80GB HBM3");

        // Temperature, power and SM clock follow the scenario's load; what
        // it cannot answer (the memory clock), the library says so.
        let mut temperature = 0;
        assert_eq!(lib.nvmlDeviceGetTemperature(gpu0, 0, &mut temperature), 0);
        assert!((32..=72).contains(&temperature), "{temperature} C");
        assert_eq!(lib.nvmlDeviceGetTemperature(gpu0, 7, &mut temperature), 2);
        let mut power = 0;
        assert_eq!(lib.nvmlDeviceGetPowerUsage(gpu0, &mut power), 0);
        assert!((70_000..=700_000).contains(&power), "{power} mW");
        let mut clock = 0;
        assert_eq!(lib.nvmlDeviceGetClockInfo(gpu0, 1, &mut clock), 0);
        assert!(clock >= 345, "{clock} MHz");
        assert_eq!(lib.nvmlDeviceGetClockInfo(gpu0, 2, &mut clock), 3);
        let message = CStr::from_ptr(lib.nvmlErrorString(15)).to_str().unwrap();
        assert_eq!(message, "GPU is lost");

        let mut pci: nvmlPciInfo_t = std::mem::zeroed();
        assert_eq!(lib.nvmlDeviceGetPciInfo_v3(gpu0, &mut pci), 0);
        let bus_id = CStr::from_ptr(pci.busId.as_ptr()).to_str().unwrap();
        assert_eq!(bus_id, "00000000:01:00.0");

        assert_eq!(lib.nvmlShutdown(), 0);
        assert_eq!(lib.nvmlDeviceGetIndex(gpu0, &mut index), 0, "one init left");
        assert_eq!(lib.nvmlShutdown(), 0);
        assert_eq!(lib.nvmlDeviceGetIndex(gpu0, &mut index), 1, "uninitialized");
        assert_eq!(lib.nvmlShutdown(), 1);
    }
}
