//! Fault injection (`fixtures/faults.toml` on `fixtures/node.toml`) and
//! configurations that must make `nvmlInit` fail. Each test runs in its own
//! process, so its scenario clock starts at its own first init.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::ffi::OsStr;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{
    FAULTS_VAR, GIB, NODE_VAR, SCENARIO_VAR, fixture, in_child, in_configured_child, init, library,
    scenario,
};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::PcieUtilCounter;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{Device, Nvml};

const FAULTS: Option<&str> = Some("faults.toml");

/// Sleeps until `seconds` after `start` (the test's first init).
fn until(start: Instant, seconds: f64) {
    let at = start + Duration::from_secs_f64(seconds);
    if let Some(left) = at.checked_duration_since(Instant::now()) {
        thread::sleep(left);
    }
}

/// Scenario time starts inside nvmlInit, so the clock starts after it: a
/// slow init (a loaded machine) must not make the test ask too early.
fn start() -> (Instant, Nvml) {
    let nvml = init();
    (Instant::now(), nvml)
}

#[test]
fn a_lost_gpu_answers_gpu_lost_and_the_others_still_work() {
    if in_configured_child(
        "a_lost_gpu_answers_gpu_lost_and_the_others_still_work",
        FAULTS,
    )
    .is_some()
    {
        return;
    }
    let (start, nvml) = start();
    let gpu3 = nvml.device_by_index(3).unwrap();
    let uuid = gpu3.uuid().unwrap();
    assert!(gpu3.memory_info().is_ok(), "not lost before after_s");

    until(start, 0.6);
    assert!(matches!(gpu3.memory_info(), Err(NvmlError::GpuLost)));
    assert!(matches!(gpu3.name(), Err(NvmlError::GpuLost)));
    assert!(matches!(
        gpu3.running_compute_processes(),
        Err(NvmlError::GpuLost)
    ));
    assert!(matches!(nvml.device_by_index(3), Err(NvmlError::GpuLost)));
    assert!(matches!(
        nvml.device_by_uuid(uuid.as_str()),
        Err(NvmlError::GpuLost)
    ));
    assert_eq!(nvml.device_count().unwrap(), 4, "still counted");
    let gpu0 = nvml.device_by_index(0).unwrap();
    assert_eq!(gpu0.memory_info().unwrap().total, 80 * GIB);
}

#[test]
fn a_hung_call_blocks_for_its_duration_while_others_answer() {
    if in_configured_child(
        "a_hung_call_blocks_for_its_duration_while_others_answer",
        FAULTS,
    )
    .is_some()
    {
        return;
    }
    let (_, nvml) = start();
    let (sender, receiver) = mpsc::channel();
    thread::scope(|scope| {
        let nvml = &nvml;
        scope.spawn(move || {
            let began = Instant::now();
            let memory = nvml.device_by_index(1).and_then(|gpu| gpu.memory_info());
            sender.send((memory, began.elapsed())).unwrap();
        });

        assert!(
            matches!(
                receiver.recv_timeout(Duration::from_millis(300)),
                Err(mpsc::RecvTimeoutError::Timeout)
            ),
            "still blocked after 300 ms"
        );
        // Other calls on the same GPU, and the same call on another, answer.
        let gpu1 = nvml.device_by_index(1).unwrap();
        assert_eq!(gpu1.name().unwrap(), "NVIDIA H100 80GB HBM3");
        assert!(nvml.device_by_index(0).unwrap().memory_info().is_ok());

        let (memory, took) = receiver.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(memory.unwrap().used, 20 * GIB, "then answers normally");
        assert!(took >= Duration::from_millis(1400), "{took:?}");
    });
}

#[test]
fn pcie_counters_can_be_unsupported_on_one_gpu() {
    if in_configured_child("pcie_counters_can_be_unsupported_on_one_gpu", FAULTS).is_some() {
        return;
    }
    let (_, nvml) = start();
    let fields = [FieldId(197), FieldId(198)];
    let gpu1 = nvml.device_by_index(1).unwrap();
    for sample in gpu1.field_values_for(&fields).unwrap() {
        let sample = sample.unwrap();
        assert!(
            matches!(sample.value, Err(NvmlError::NotSupported)),
            "{sample:?}"
        );
    }
    assert!(gpu1.pcie_throughput(PcieUtilCounter::Send).unwrap() > 0);
    let gpu0 = nvml.device_by_index(0).unwrap();
    for sample in gpu0.field_values_for(&fields).unwrap() {
        let sample = sample.unwrap();
        assert!(
            matches!(sample.value, Ok(SampleValue::U64(_))),
            "{sample:?}"
        );
    }
}

fn register<'n>(nvml: &'n Nvml, device: &Device<'n>) -> EventSet<'n> {
    let set = nvml.create_event_set().unwrap();
    device
        .register_events(EventTypes::CRITICAL_XID_ERROR, set)
        .map_err(|e| e.error)
        .unwrap()
}

#[test]
fn xids_reach_the_sets_registered_for_them_once() {
    if in_configured_child("xids_reach_the_sets_registered_for_them_once", FAULTS).is_some() {
        return;
    }
    let (start, nvml) = start();
    let gpu0 = nvml.device_by_index(0).unwrap();
    assert!(
        gpu0.supported_event_types()
            .unwrap()
            .contains(EventTypes::CRITICAL_XID_ERROR)
    );
    let on_gpu0 = register(&nvml, &gpu0);
    let on_gpu1 = register(&nvml, &nvml.device_by_index(1).unwrap());
    let on_gpu3 = register(&nvml, &nvml.device_by_index(3).unwrap());
    let unsupported = nvml.create_event_set().unwrap();
    assert!(
        gpu0.register_events(EventTypes::PSTATE_CHANGE, unsupported)
            .is_err_and(|e| matches!(e.error, NvmlError::NotSupported))
    );

    let event = on_gpu0.wait(3000).unwrap();
    assert!(
        start.elapsed() >= Duration::from_millis(950),
        "not before at_s"
    );
    assert_eq!(event.device.uuid().unwrap(), gpu0.uuid().unwrap());
    assert!(event.event_type.contains(EventTypes::CRITICAL_XID_ERROR));
    assert_eq!(event.event_data, Some(XidError::Value(79)));
    assert!(matches!(on_gpu0.wait(200), Err(NvmlError::Timeout)), "once");
    assert!(matches!(on_gpu1.wait(100), Err(NvmlError::Timeout)));
    assert!(
        matches!(on_gpu3.wait(100), Err(NvmlError::Timeout)),
        "due after the GPU was lost"
    );

    // Registered after the XID was due: not delivered.
    let late = register(&nvml, &gpu0);
    assert!(matches!(late.wait(200), Err(NvmlError::Timeout)));
}

/// The XID on gpu 2 carries MIG instance ids, which only the raw event
/// struct shows.
#[test]
#[allow(unsafe_code)]
fn an_xid_can_name_a_mig_instance() {
    use nvml_wrapper_sys::bindings::{NvmlLib, nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t};
    use std::ptr;

    if in_configured_child("an_xid_can_name_a_mig_instance", FAULTS).is_some() {
        return;
    }
    // SAFETY: loading the fake library, whose initialisers do nothing.
    let lib = unsafe { NvmlLib::new(library()) }.unwrap();
    // SAFETY: pointers to live locals and handles this library issued.
    unsafe {
        assert_eq!(lib.nvmlInit_v2(), 0);
        let mut gpu2: nvmlDevice_t = ptr::null_mut();
        assert_eq!(lib.nvmlDeviceGetHandleByIndex_v2(2, &mut gpu2), 0);
        let mut set: nvmlEventSet_t = ptr::null_mut();
        assert_eq!(lib.nvmlEventSetCreate(&mut set), 0);
        assert_eq!(lib.nvmlDeviceRegisterEvents(gpu2, 8, set), 0);
        let mut data: nvmlEventData_t = std::mem::zeroed();
        assert_eq!(lib.nvmlEventSetWait_v2(set, &mut data, 3000), 0);
        assert_eq!(
            (
                data.eventType,
                data.eventData,
                data.gpuInstanceId,
                data.computeInstanceId
            ),
            (8, 48, 1, 0)
        );
        assert_eq!(data.device, gpu2);
        assert_eq!(lib.nvmlEventSetWait_v2(set, &mut data, 0), 10, "TIMEOUT");
        assert_eq!(lib.nvmlEventSetFree(set), 0);
        assert_eq!(lib.nvmlEventSetFree(set), 2, "already freed");
        assert_eq!(lib.nvmlShutdown(), 0);
    }
}

#[test]
fn mig_reconfiguration_replaces_the_layout() {
    if in_configured_child("mig_reconfiguration_replaces_the_layout", FAULTS).is_some() {
        return;
    }
    let scenario = scenario();
    let old = &scenario.node("test-node").unwrap().inventory()[2];
    let (start, nvml) = start();
    let gpu0 = nvml.device_by_index(0).unwrap();
    let gpu2 = nvml.device_by_index(2).unwrap();
    let old_instance = gpu2.mig_device_by_index(0).unwrap();
    assert_eq!(old_instance.uuid().unwrap(), old.mig[0].uuid);
    assert_eq!(gpu0.mig_mode().unwrap().current, 0);

    until(start, 1.1);
    // gpu 2: one 7g.80gb instance, fresh, empty.
    assert_eq!(gpu2.mig_mode().unwrap().current, 1);
    let new_instance = gpu2.mig_device_by_index(0).unwrap();
    assert_eq!(
        new_instance.name().unwrap(),
        "NVIDIA A100-SXM4-80GB MIG 7g.80gb"
    );
    let uuid = new_instance.uuid().unwrap();
    assert!(
        uuid.starts_with("MIG-") && old.mig.iter().all(|m| m.uuid != uuid),
        "{uuid}"
    );
    let memory = new_instance.memory_info().unwrap();
    assert_eq!((memory.total, memory.used), (80 * GIB, 0));
    assert!(matches!(
        gpu2.mig_device_by_index(1),
        Err(NvmlError::NotFound)
    ));
    assert!(
        matches!(old_instance.uuid(), Err(NvmlError::InvalidArg)),
        "destroyed"
    );
    assert!(gpu2.running_compute_processes().unwrap().is_empty());

    // gpu 0: MIG mode on with two 3g.40gb instances; its processes are gone,
    // only the memory no process accounts for stays used.
    assert_eq!(gpu0.mig_mode().unwrap().current, 1);
    let second = gpu0.mig_device_by_index(1).unwrap();
    assert_eq!(second.name().unwrap(), "NVIDIA H100 80GB HBM3 MIG 3g.40gb");
    assert_eq!(second.memory_info().unwrap().total, 40 * GIB);
    assert!(gpu0.running_compute_processes().unwrap().is_empty());
    assert_eq!(gpu0.memory_info().unwrap().used, GIB);

    until(start, 2.1);
    // gpu 2: profiles = [] turned MIG mode off.
    assert_eq!(gpu2.mig_mode().unwrap().current, 0);
    assert_eq!(gpu2.mig_device_count().unwrap(), 0);
    assert!(matches!(
        gpu2.mig_device_by_index(0),
        Err(NvmlError::NotFound)
    ));
    assert!(matches!(new_instance.name(), Err(NvmlError::InvalidArg)));
}

#[test]
fn counters_can_start_near_the_wrap() {
    if in_configured_child(
        "counters_can_start_near_the_wrap",
        Some("faults-near-wrap.toml"),
    )
    .is_some()
    {
        return;
    }
    let (start, nvml) = start();
    let gpu1 = nvml.device_by_index(1).unwrap();
    let read = || match gpu1
        .field_values_for(&[FieldId(197)])
        .unwrap()
        .remove(0)
        .unwrap()
        .value
    {
        Ok(SampleValue::U64(bytes)) => bytes,
        ref other => panic!("{other:?}"),
    };
    let before = read();
    assert!(before > u64::MAX - 3 * GIB, "{before}");
    until(start, 2.6);
    let after = read();
    assert!(after < before, "wrapped: {before} -> {after}");
    // A wrap-safe delta is the ~1 GB/s × 2.6 s that went by.
    let delta = after.wrapping_sub(before) as f64;
    assert!((1.5e9..4.0e9).contains(&delta), "{delta}");
}

/// Runs `test` in a child whose `nvmlInit` must fail, and returns the
/// child's stderr.
fn init_failure(test: &str, env: &[(&str, &OsStr)]) -> Option<String> {
    let output = in_child(test, env)?;
    Some(String::from_utf8_lossy(&output.stderr).into_owned())
}

fn init_fails() {
    let result = Nvml::builder().lib_path(library().as_os_str()).init();
    assert!(matches!(result, Err(NvmlError::Unknown)), "{result:?}");
}

#[test]
fn a_missing_scenario_file_fails_init() {
    let missing = OsStr::new("/nonexistent/scenario.toml");
    let env = [(SCENARIO_VAR, missing)];
    let Some(stderr) = init_failure("a_missing_scenario_file_fails_init", &env) else {
        return init_fails();
    };
    let line = stderr
        .lines()
        .find(|line| line.starts_with("headroom-fake-nvml:"))
        .unwrap_or_else(|| panic!("no error line in {stderr}"));
    assert!(
        line.contains(SCENARIO_VAR) && line.contains("/nonexistent/scenario.toml"),
        "{line}"
    );
}

#[test]
fn an_unknown_faults_key_fails_init() {
    let scenario = common::scenario_path();
    let faults = fixture("faults-unknown-key.toml");
    let env = [
        (SCENARIO_VAR, scenario.as_os_str()),
        (FAULTS_VAR, faults.as_os_str()),
    ];
    let Some(stderr) = init_failure("an_unknown_faults_key_fails_init", &env) else {
        return init_fails();
    };
    assert!(
        stderr.contains("faults-unknown-key.toml") && stderr.contains("after_seconds"),
        "{stderr}"
    );
}

#[test]
fn a_bad_gpu_index_fails_init() {
    let scenario = common::scenario_path();
    let faults = fixture("faults-bad-gpu.toml");
    let env = [
        (SCENARIO_VAR, scenario.as_os_str()),
        (FAULTS_VAR, faults.as_os_str()),
    ];
    let Some(stderr) = init_failure("a_bad_gpu_index_fails_init", &env) else {
        return init_fails();
    };
    assert!(stderr.contains("xid[0]: gpu = 9"), "{stderr}");
}

#[test]
fn an_unknown_node_fails_init() {
    let scenario = common::scenario_path();
    let env = [
        (SCENARIO_VAR, scenario.as_os_str()),
        (NODE_VAR, OsStr::new("no-such-node")),
    ];
    let Some(stderr) = init_failure("an_unknown_node_fails_init", &env) else {
        return init_fails();
    };
    assert!(
        stderr.contains("no-such-node") && stderr.contains("test-node"),
        "{stderr}"
    );
}
