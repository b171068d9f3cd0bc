//! Raw NCCL point-to-point bandwidth between two GPUs of this machine: the physical
//! reference `pdserve bench transfer` prints beside the KV transfer paths (one send of
//! the same bytes from a buffer on one GPU into a buffer on the other, nothing else).
//! One process drives both ranks (`ncclCommInitAll`), which is enough for one stream of
//! sends.

use crate::device::DeviceError;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::safe::{group_end, group_start, Comm};
use std::sync::Arc;
use std::time::Instant;

/// Rank 0 on the sending GPU, rank 1 on the receiving one.
pub struct NcclPair {
    comms: Vec<Comm>,
}

fn nccl_err(what: &str) -> impl Fn(cudarc::nccl::result::NcclError) -> DeviceError + '_ {
    move |e| DeviceError::Driver(format!("NCCL {what}: {e:?}"))
}

fn driver_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> DeviceError + '_ {
    move |e| DeviceError::Driver(format!("{what}: {e:?}"))
}

/// Why raw NCCL cannot run here, if it cannot: no library, or fewer than two devices.
#[allow(unsafe_code)]
pub fn unavailable(devices: [usize; 2]) -> Option<String> {
    // SAFETY: these only try to load the dynamic libraries.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Some("no CUDA driver library".into());
    }
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Some(
            "libnccl.so is not on the library path (the nvidia-nccl wheels ship libnccl.so.2 only: scripts/cuda-libs.sh links it)"
                .into(),
        );
    }
    let n = match crate::device::count() {
        Ok(n) => n,
        Err(e) => return Some(e.to_string()),
    };
    if devices[0] == devices[1] {
        return Some(format!(
            "both ranks on cuda:{} (NCCL needs two devices)",
            devices[0]
        ));
    }
    devices
        .iter()
        .find(|&&d| d >= n)
        .map(|d| format!("cuda:{d} does not exist ({n} CUDA device(s))"))
}

impl NcclPair {
    /// One communicator of two ranks, on `devices[0]` (sender) and `devices[1]`.
    pub fn open(devices: [usize; 2]) -> Result<Self, DeviceError> {
        if let Some(why) = unavailable(devices) {
            return Err(DeviceError::Driver(format!("raw NCCL: {why}")));
        }
        let mut streams: Vec<Arc<CudaStream>> = Vec::new();
        for &d in &devices {
            let ctx = CudaContext::new(d).map_err(driver_err("opening a device for NCCL"))?;
            streams.push(ctx.new_stream().map_err(driver_err("creating a stream"))?);
        }
        let comms = Comm::from_devices(streams).map_err(nccl_err("ncclCommInitAll"))?;
        Ok(NcclPair { comms })
    }

    fn alloc(&self, rank: usize, bytes: usize) -> Result<CudaSlice<u8>, DeviceError> {
        self.comms[rank]
            .stream()
            .alloc_zeros::<u8>(bytes)
            .map_err(driver_err("allocating a transfer buffer"))
    }

    /// Wall seconds of each of `warmup + repeats` sends of `bytes` from rank 0 to rank 1
    /// (the warmup ones left out), each timed from its issue to both streams' end. The
    /// first send's bytes are compared with the sent ones.
    pub fn time_sends(
        &self,
        bytes: usize,
        warmup: usize,
        repeats: usize,
    ) -> Result<Vec<f64>, DeviceError> {
        let pattern: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
        let src = self.comms[0]
            .stream()
            .clone_htod(&pattern)
            .map_err(driver_err("uploading the pattern"))?;
        let mut dst = self.alloc(1, bytes)?;
        let sync = |rank: usize| {
            self.comms[rank]
                .stream()
                .synchronize()
                .map_err(driver_err("waiting for a send"))
        };
        sync(0)?;
        sync(1)?;
        let mut times = Vec::with_capacity(repeats);
        for i in 0..warmup + repeats {
            let t = Instant::now();
            group_start().map_err(nccl_err("group start"))?;
            self.comms[0].send(&src, 1).map_err(nccl_err("send"))?;
            self.comms[1].recv(&mut dst, 0).map_err(nccl_err("recv"))?;
            group_end().map_err(nccl_err("group end"))?;
            sync(0)?;
            sync(1)?;
            let seconds = t.elapsed().as_secs_f64();
            if i == 0 {
                let got = self.comms[1]
                    .stream()
                    .clone_dtoh(&dst)
                    .map_err(driver_err("downloading the received bytes"))?;
                if got != pattern {
                    return Err(DeviceError::Driver(format!(
                        "raw NCCL: the {bytes} bytes received differ from those sent"
                    )));
                }
            }
            if i >= warmup {
                times.push(seconds);
            }
        }
        Ok(times)
    }
}
