//! Building `CUmemPoolProps` without knowing its layout.
//!
//! The struct grew fields over CUDA releases (`maxSize` in 12.2, `usage` in 12.6) by carving them
//! out of a zeroed `reserved` tail, and stayed 88 bytes. Starting from all zeroes and setting
//! only what is asked for therefore gives props that every driver since 11.2 reads correctly.

use crate::bindings::{
    CUdevice, CUmemAllocationHandleType, CUmemAllocationType, CUmemLocation, CUmemLocationType, CUmemPoolProps,
};

/// A builder of [`CUmemPoolProps`] for a device-resident pool of pinned memory.
///
/// ```
/// use steppool_sys::PoolProps;
/// let props = PoolProps::device(0).max_size(8 << 30).build();
/// assert_eq!(props.location.id, 0);
/// assert_eq!(props.maxSize, 8 << 30);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct PoolProps {
    device: CUdevice,
    handle_types: CUmemAllocationHandleType,
    max_size: usize,
}

impl PoolProps {
    /// Props for a pool of memory on `device`, not exportable, with no size cap.
    pub fn device(device: CUdevice) -> Self {
        Self { device, handle_types: CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE, max_size: 0 }
    }

    /// Makes the pool exportable to other processes with these handle types (IPC).
    pub fn handle_types(mut self, handle_types: CUmemAllocationHandleType) -> Self {
        self.handle_types = handle_types;
        self
    }

    /// Caps the pool's reserved memory at `bytes` (CUDA 12.2 and later; 0 means no cap).
    pub fn max_size(mut self, bytes: usize) -> Self {
        self.max_size = bytes;
        self
    }

    /// The props, zeroed except for the fields set here.
    pub fn build(self) -> CUmemPoolProps {
        CUmemPoolProps {
            allocType: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: self.handle_types,
            location: CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: self.device },
            maxSize: self.max_size,
            ..CUmemPoolProps::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn props_have_the_88_byte_layout_and_zeroed_tail() {
        assert_eq!(std::mem::size_of::<CUmemPoolProps>(), 88);
        let props = PoolProps::device(3).build();
        assert_eq!(props.allocType, CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED);
        assert_eq!(props.location.type_, CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE);
        assert_eq!(props.location.id, 3);
        assert_eq!(props.handleTypes, CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE);
        assert!(props.win32SecurityAttributes.is_null());
        assert_eq!((props.maxSize, props.usage), (0, 0));
        assert!(props.reserved.iter().all(|&b| b == 0));
    }
}
