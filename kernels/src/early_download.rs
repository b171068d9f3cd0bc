//! A device-to-host copy left in flight while more work is queued behind it: the host waits
//! for that copy alone (an event recorded after it), not for the stream, so the device
//! keeps running what was queued after it. A prefill's MoE reads its picks this way and
//! queues the shared expert before it sorts them on the host ([`crate::ops::moe`]).

use crate::device::Gpu;
use crate::devmem::DevMem;
use crate::launch::dev_err;
use cudarc::driver::{CudaEvent, DeviceRepr, PinnedHostSlice};
use pdserve_engine::backend::{BResult, BackendError};
use std::marker::PhantomData;

/// `n` values of `T` on their way into page-locked memory; [`EarlyDownload::finish`]
/// waits for them.
pub(crate) struct EarlyDownload<'g, T> {
    gpu: &'g Gpu,
    host: Option<PinnedHostSlice<u8>>,
    done: CudaEvent,
    n: usize,
    _values: PhantomData<T>,
}

impl Gpu {
    /// Start copying the first `n` values of `s` to the host (outside decode steps): the
    /// copy and an event after it go on the stream now.
    #[allow(unsafe_code)]
    pub(crate) fn download_early<T: DeviceRepr>(
        &self,
        s: &DevMem<T>,
        n: usize,
    ) -> BResult<EarlyDownload<'_, T>> {
        if self.in_step() {
            return Err(BackendError::Device(
                "a device-to-host copy inside a decode step".into(),
            ));
        }
        let n = n.min(s.len());
        let bytes = n * std::mem::size_of::<T>();
        let kept = self.early_buffer()?.take();
        let mut host = match kept {
            Some(h) if h.len() >= bytes => h,
            _ => {
                // SAFETY: plain page-locked bytes; only bytes the copy below writes are read.
                unsafe {
                    self.ctx
                        .alloc_pinned_with_flags::<u8>(bytes.max(1).next_power_of_two(), 0)
                }
                .map_err(dev_err)?
            }
        };
        if bytes > 0 {
            let ptr = host.as_mut_ptr().map_err(dev_err)?;
            // SAFETY: `host` holds at least `bytes` bytes and is neither read nor reused
            // before the event recorded after this copy has completed (`finish`).
            unsafe {
                let dst = std::slice::from_raw_parts_mut(ptr, bytes);
                cudarc::driver::result::memcpy_dtoh_async(dst, s.ptr(), self.stream.cu_stream())
            }
            .map_err(dev_err)?;
        }
        let done = self.ctx.new_event(None).map_err(dev_err)?;
        done.record(&self.stream).map_err(dev_err)?;
        Ok(EarlyDownload {
            gpu: self,
            host: Some(host),
            done,
            n,
            _values: PhantomData,
        })
    }
}

impl<T: DeviceRepr> EarlyDownload<'_, T> {
    /// The values, once the copy has completed (work queued after it may still run).
    #[allow(unsafe_code)]
    pub(crate) fn finish(mut self) -> BResult<Vec<T>> {
        self.done.synchronize().map_err(dev_err)?;
        let host = self
            .host
            .take()
            .ok_or_else(|| dev_err("an early download finished twice"))?;
        let bytes = self.n * std::mem::size_of::<T>();
        let mut v = Vec::<T>::with_capacity(self.n);
        if bytes > 0 {
            let src = host.as_ptr().map_err(dev_err)?;
            // SAFETY: the copy of `bytes` bytes of plain-old-data values (DeviceRepr) into
            // `host` has completed (the event above); capacity for exactly `n` values.
            unsafe {
                std::ptr::copy_nonoverlapping(src, v.as_mut_ptr().cast::<u8>(), bytes);
                v.set_len(self.n);
            }
        }
        *self.gpu.early_buffer()? = Some(host);
        Ok(v)
    }
}

impl<T> Drop for EarlyDownload<'_, T> {
    fn drop(&mut self) {
        // Unfinished (an error on the way): the copy may still be writing into the buffer,
        // which must outlive it.
        if self.host.is_some() {
            let _ = self.done.synchronize();
        }
    }
}
