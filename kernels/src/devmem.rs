//! [`DevMem`]: device memory a kernel argument can point at. Outside a decode step it
//! owns a `CudaSlice`; inside one it is a view into the step arena or staging buffer
//! (see `alloc`), which stay at fixed addresses so a captured graph can replay them.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

/// Device memory of `len` values of `T` at `ptr`.
#[derive(Debug)]
pub struct DevMem<T> {
    ptr: u64,
    len: usize,
    /// The allocation, when this value owns one (it is freed with it).
    _owner: Option<CudaSlice<T>>,
}

impl<T> DevMem<T> {
    pub(crate) fn owned(slice: CudaSlice<T>, stream: &CudaStream, len: usize) -> Self {
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(stream);
            ptr
        };
        DevMem {
            ptr,
            len,
            _owner: Some(slice),
        }
    }

    /// A view of memory owned elsewhere (the step arena or staging buffer, or a tensor
    /// that outlives the view).
    pub(crate) fn view(ptr: u64, len: usize) -> Self {
        DevMem {
            ptr,
            len,
            _owner: None,
        }
    }

    /// A view of the values from index `first` on.
    pub(crate) fn view_from(&self, first: usize) -> DevMem<T> {
        let first = first.min(self.len);
        DevMem::view(
            self.ptr + (first * std::mem::size_of::<T>()) as u64,
            self.len - first,
        )
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
