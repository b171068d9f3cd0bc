//! Behaviour where CUDA is absent (every CI machine): opening the backend is a clear
//! error naming the missing piece, never a panic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_kernels::{CudaBackend, DeviceError};

use pdserve_kernels::device::driver_present;

#[test]
fn missing_driver_is_a_clear_error() {
    if driver_present() {
        eprintln!("SKIPPED: a CUDA driver is present on this machine");
        return;
    }
    let err = CudaBackend::new(0, None).unwrap_err();
    assert!(matches!(err, DeviceError::NoDriver), "{err:?}");
    assert!(err.to_string().contains("libcuda"), "{err}");
}

#[test]
fn device_ordinal_past_the_last_device_is_refused() {
    if !driver_present() {
        eprintln!("SKIPPED: no CUDA driver here");
        return;
    }
    match CudaBackend::new(1 << 20, None) {
        Err(DeviceError::NoDevice { ordinal, .. }) => assert_eq!(ordinal, 1 << 20),
        Err(other) => eprintln!("SKIPPED: CUDA present but not usable: {other}"),
        Ok(_) => panic!("device 2^20 opened"),
    }
}
