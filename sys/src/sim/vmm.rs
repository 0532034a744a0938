//! Virtual memory management on the simulated device: address ranges reserved without memory
//! (`cuMemAddressReserve`), physical allocations (`cuMemCreate`) mapped into them (`cuMemMap`) and
//! made accessible (`cuMemSetAccess`), the mechanism a slab that grows in place is built on.
//!
//! # The model
//!
//! - **Granularity.** `cuMemGetAllocationGranularity` answers the simulated device's granule
//!   (`STEPPOOL_SIM_GRANULE`, default 2 MiB) for both the minimum and the recommended option, as an
//!   H100 answers 2 MiB for both. Reservation sizes, physical sizes, mapping addresses and sizes
//!   must be multiples of it (`CUDA_ERROR_INVALID_VALUE` otherwise).
//! - **Reserved ranges** hold no memory. They come from an address space of their own, apart from
//!   every device's slice (a real process has one virtual address space for all devices); the
//!   address hint is ignored, as the driver may ignore it, and `flags` must be 0. A range is freed
//!   whole (`ptr` and `size` as reserved); freeing a range that still has mappings is refused with
//!   `CUDA_ERROR_INVALID_VALUE` (the driver documents no code for it; the model refuses rather than
//!   drop the mappings silently).
//! - **Physical allocations** are pinned device memory on the device their location names. Their
//!   size counts against that device's capacity at once, together with its pools' segments, so
//!   `cuMemGetInfo` and a pool that wants to grow both see it; when it does not fit, every idle
//!   pool segment on the device is released first (as for a pool's growth), then the call fails
//!   with `CUDA_ERROR_OUT_OF_MEMORY`. `cuMemRelease` may be called while mappings remain, as the
//!   driver documents: the memory goes back to the device when the last mapping is unmapped.
//!   Releasing a handle twice, or one never created, is `CUDA_ERROR_INVALID_VALUE`.
//! - **Mappings.** `cuMemMap` maps the first `size` bytes of a handle (`offset` must be 0, as the
//!   driver requires today) at a granule-aligned address inside one reserved range, only where
//!   nothing is mapped: mapping over a mapped range is `CUDA_ERROR_INVALID_VALUE`, and so is
//!   mapping a released handle. A new mapping has no access. `cuMemUnmap` takes exactly one
//!   mapping, whole (the driver cannot unmap a sub-range of what one `cuMemMap` mapped; the model
//!   also refuses a range spanning several, which the runtime never asks for); anything else,
//!   an unmapped range included, is `CUDA_ERROR_INVALID_VALUE`.
//! - **Access.** `cuMemSetAccess` sets the access of devices to a contiguous mapped range (one or
//!   more whole or partial mappings with no hole; a hole is `CUDA_ERROR_INVALID_VALUE`); a device
//!   other than the memory's needs peer access (`CUDA_ERROR_INVALID_DEVICE` otherwise). Memset,
//!   copies and the fill kernels reach mapped memory only where the device they run on has
//!   read-write access, else as outside every allocation.
//! - **Host memory.** On a host-backed device each physical allocation has a zeroed host block,
//!   so what a kernel or copy writes through one mapping reads back through any other.
//!
//! The device reports virtual memory management by default, as every H100, H200 and A100 does.
//! With `vmm_supported` off in the configuration (`STEPPOOL_SIM_VMM=0`), the device attribute
//! `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` is 0 and every call here returns
//! `CUDA_ERROR_NOT_SUPPORTED`, as on a device or driver without it.
//!
//! Handles are checked like every other handle of the simulated device: one of another kind or
//! another simulated driver is refused with `CUDA_ERROR_INVALID_VALUE`.

use std::collections::BTreeMap;

use super::handle::{Kind, decode};
use super::memory::HostMemory;
use super::space::AddressSpace;
use super::state::{INVALID_DEVICE, INVALID_VALUE, NOT_SUPPORTED, OUT_OF_MEMORY, R, State};
use crate::bindings::*;

/// Size of each simulated driver's slice of reserved virtual addresses.
const VA_SPAN: u64 = 1 << 52;

/// A reserved address range.
#[derive(Debug)]
struct Reservation {
    size: u64,
    /// Mappings inside it.
    mappings: u32,
}

/// A physical allocation from `cuMemCreate`.
#[derive(Debug)]
struct Physical {
    device: usize,
    size: u64,
    /// Live mappings of it.
    mappings: u32,
    /// `cuMemRelease` was called: it goes once unmapped.
    released: bool,
}

/// One `cuMemMap`: `size` bytes of a handle at an address.
#[derive(Debug)]
struct Mapping {
    size: u64,
    handle: u32,
    reservation: u64,
    /// Devices with read-write access, one bit per ordinal.
    read_write: u64,
}

/// A piece of mapped memory behind a device range: the handle, the offset in it, the length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MappedPiece {
    handle: u32,
    offset: u64,
    len: usize,
}

/// The virtual memory management state of one simulated driver.
#[derive(Debug)]
pub(crate) struct Vmm {
    space: AddressSpace,
    reservations: BTreeMap<u64, Reservation>,
    handles: BTreeMap<u32, Physical>,
    /// Mappings by address.
    mappings: BTreeMap<u64, Mapping>,
    /// The host blocks of physical allocations, by handle id, on a host-backed device.
    host: Option<HostMemory>,
}

impl Vmm {
    /// The state of simulated driver `id` (its reserved addresses lie above every device slice
    /// of every driver instance), host-backed when `host_memory` is set.
    pub(crate) fn new(id: u64, host_memory: bool) -> Self {
        // Above the device slices of every instance (below 2^60), below 2^63 so that addresses
        // stay positive 64-bit integers in the formats that store them signed.
        let base = (0x100 + id % 0x700) << 52;
        Self {
            space: AddressSpace::new(base, VA_SPAN),
            reservations: BTreeMap::new(),
            handles: BTreeMap::new(),
            mappings: BTreeMap::new(),
            host: host_memory.then(HostMemory::default),
        }
    }

    /// The mapped pieces behind `[ptr, ptr + len)` when every byte of it is mapped and `device`
    /// has read-write access to it; `None` otherwise.
    pub(crate) fn pieces(&self, ptr: u64, len: usize, device: usize) -> Option<Vec<MappedPiece>> {
        let end = ptr.checked_add(len as u64)?;
        let mut pieces = Vec::new();
        let mut at = ptr;
        while at < end {
            let (&base, mapping) = self.mappings.range(..=at).next_back()?;
            if at >= base + mapping.size || mapping.read_write & (1 << device) == 0 {
                return None;
            }
            let take = (base + mapping.size).min(end) - at;
            pieces.push(MappedPiece { handle: mapping.handle, offset: at - base, len: take as usize });
            at += take;
        }
        Some(pieces)
    }

    /// Writes `src` through `pieces` (in order) on a host-backed device.
    pub(crate) fn write(&mut self, pieces: &[MappedPiece], src: &[u8]) {
        let Some(host) = &mut self.host else { return };
        let mut from = 0;
        for piece in pieces {
            host.bytes_mut(u64::from(piece.handle), piece.offset, piece.len)
                .copy_from_slice(&src[from..from + piece.len]);
            from += piece.len;
        }
    }

    /// Fills `pieces` with `value` on a host-backed device.
    pub(crate) fn fill(&mut self, pieces: &[MappedPiece], value: u8) {
        let Some(host) = &mut self.host else { return };
        for piece in pieces {
            host.bytes_mut(u64::from(piece.handle), piece.offset, piece.len).fill(value);
        }
    }

    /// Reads `pieces` into `dst` on a host-backed device.
    pub(crate) fn read(&mut self, pieces: &[MappedPiece], dst: &mut [u8]) {
        let Some(host) = &mut self.host else { return };
        let mut to = 0;
        for piece in pieces {
            dst[to..to + piece.len].copy_from_slice(host.bytes_mut(u64::from(piece.handle), piece.offset, piece.len));
            to += piece.len;
        }
    }

    /// Every mapping as `(device of its memory, address, size)`, by address.
    pub(crate) fn mapped(&self) -> Vec<(usize, u64, u64)> {
        self.mappings.iter().map(|(&base, m)| (self.handles[&m.handle].device, base, m.size)).collect()
    }
}

/// Whether `value` is a multiple of `granule`.
fn aligned(value: u64, granule: u64) -> bool {
    value.is_multiple_of(granule)
}

impl State {
    /// Initialized, on a driver whose devices support virtual memory management.
    fn require_vmm(&self) -> R<()> {
        self.require_init()?;
        if self.config.vmm_supported { Ok(()) } else { Err(NOT_SUPPORTED) }
    }

    fn physical(&self, raw: CUmemGenericAllocationHandle) -> R<u32> {
        let id = decode(self.tag(), Kind::Physical, raw as usize).ok_or(INVALID_VALUE)?;
        match self.vmm.handles.get(&id) {
            Some(physical) if !physical.released => Ok(id),
            _ => Err(INVALID_VALUE),
        }
    }

    /// The device a `CUmemAllocationProp` places pinned memory on.
    fn prop_device(&self, prop: &CUmemAllocationProp) -> R<usize> {
        self.require_vmm()?;
        if prop.type_ != CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED
            || prop.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
        {
            return Err(INVALID_VALUE);
        }
        self.device(prop.location.id).map_err(|code| if code == INVALID_DEVICE { INVALID_VALUE } else { code })
    }

    /// Gives a physical allocation's memory back to its device once it is released and unmapped.
    fn drop_physical_if_done(&mut self, id: u32) {
        let physical = &self.vmm.handles[&id];
        if physical.released && physical.mappings == 0 {
            let physical = self.vmm.handles.remove(&id).expect("handle");
            self.uncharge(physical.device, physical.size);
            if let Some(host) = &mut self.vmm.host {
                host.release(u64::from(id));
            }
        }
    }

    pub(crate) fn mem_get_allocation_granularity(
        &self,
        prop: &CUmemAllocationProp,
        option: CUmemAllocationGranularity_flags,
    ) -> R<usize> {
        use CUmemAllocationGranularity_flags as G;
        self.prop_device(prop)?;
        match option {
            G::CU_MEM_ALLOC_GRANULARITY_MINIMUM | G::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED => {
                Ok(self.config.granule as usize)
            }
            _ => Err(INVALID_VALUE),
        }
    }

    pub(crate) fn mem_address_reserve(&mut self, size: usize, alignment: usize, flags: u64) -> R<CUdeviceptr> {
        self.require_vmm()?;
        let (size, alignment, granule) = (size as u64, alignment as u64, self.config.granule);
        if flags != 0 || size == 0 || !aligned(size, granule) || (alignment != 0 && (!alignment.is_power_of_two())) {
            return Err(INVALID_VALUE);
        }
        // An alignment above the granule: reserve enough to align within, keep the aligned part.
        let slack = alignment.saturating_sub(granule);
        let start = self.vmm.space.reserve(size.checked_add(slack).ok_or(OUT_OF_MEMORY)?).ok_or(OUT_OF_MEMORY)?;
        let base = if slack == 0 { start } else { start.next_multiple_of(alignment) };
        if base > start {
            self.vmm.space.release(start, base - start);
        }
        if start + size + slack > base + size {
            self.vmm.space.release(base + size, start + size + slack - (base + size));
        }
        self.vmm.reservations.insert(base, Reservation { size, mappings: 0 });
        Ok(base)
    }

    pub(crate) fn mem_address_free(&mut self, ptr: CUdeviceptr, size: usize) -> R<()> {
        self.require_vmm()?;
        match self.vmm.reservations.get(&ptr) {
            Some(reservation) if reservation.size == size as u64 && reservation.mappings == 0 => {}
            _ => return Err(INVALID_VALUE),
        }
        self.vmm.reservations.remove(&ptr);
        self.vmm.space.release(ptr, size as u64);
        Ok(())
    }

    pub(crate) fn mem_create(&mut self, size: usize, prop: &CUmemAllocationProp, flags: u64) -> R<u64> {
        let device = self.prop_device(prop)?;
        let size = size as u64;
        if flags != 0 || size == 0 || !aligned(size, self.config.granule) {
            return Err(INVALID_VALUE);
        }
        if !self.charge(device, size) {
            return Err(OUT_OF_MEMORY);
        }
        let id = self.next_id();
        if let Some(host) = &mut self.vmm.host
            && !host.reserve(u64::from(id), size)
        {
            self.uncharge(device, size);
            return Err(OUT_OF_MEMORY);
        }
        self.vmm.handles.insert(id, Physical { device, size, mappings: 0, released: false });
        Ok(self.handle(Kind::Physical, id) as u64)
    }

    pub(crate) fn mem_release(&mut self, handle: CUmemGenericAllocationHandle) -> R<()> {
        self.require_vmm()?;
        let id = self.physical(handle)?;
        self.vmm.handles.get_mut(&id).expect("handle").released = true;
        self.drop_physical_if_done(id);
        Ok(())
    }

    pub(crate) fn mem_map(
        &mut self,
        ptr: CUdeviceptr,
        size: usize,
        offset: usize,
        handle: CUmemGenericAllocationHandle,
        flags: u64,
    ) -> R<()> {
        self.require_vmm()?;
        let id = self.physical(handle)?;
        let (size, granule) = (size as u64, self.config.granule);
        let end = ptr.checked_add(size).ok_or(INVALID_VALUE)?;
        if flags != 0 || offset != 0 || size == 0 || !aligned(size, granule) || !aligned(ptr, granule) {
            return Err(INVALID_VALUE);
        }
        if size > self.vmm.handles[&id].size {
            return Err(INVALID_VALUE);
        }
        let (&reservation, reserved) = self.vmm.reservations.range(..=ptr).next_back().ok_or(INVALID_VALUE)?;
        if end > reservation + reserved.size {
            return Err(INVALID_VALUE);
        }
        let below = self.vmm.mappings.range(..end).next_back();
        if below.is_some_and(|(&base, mapping)| base + mapping.size > ptr) {
            return Err(INVALID_VALUE);
        }
        self.vmm.mappings.insert(ptr, Mapping { size, handle: id, reservation, read_write: 0 });
        self.vmm.reservations.get_mut(&reservation).expect("reservation").mappings += 1;
        self.vmm.handles.get_mut(&id).expect("handle").mappings += 1;
        Ok(())
    }

    pub(crate) fn mem_unmap(&mut self, ptr: CUdeviceptr, size: usize) -> R<()> {
        self.require_vmm()?;
        match self.vmm.mappings.get(&ptr) {
            Some(mapping) if mapping.size == size as u64 => {}
            _ => return Err(INVALID_VALUE),
        }
        let mapping = self.vmm.mappings.remove(&ptr).expect("mapping");
        self.vmm.reservations.get_mut(&mapping.reservation).expect("reservation").mappings -= 1;
        self.vmm.handles.get_mut(&mapping.handle).expect("handle").mappings -= 1;
        self.drop_physical_if_done(mapping.handle);
        Ok(())
    }

    pub(crate) fn mem_set_access(&mut self, ptr: CUdeviceptr, size: usize, descriptors: &[CUmemAccessDesc]) -> R<()> {
        use CUmemAccess_flags as F;
        self.require_vmm()?;
        let end = ptr.checked_add(size as u64).ok_or(INVALID_VALUE)?;
        if size == 0 || descriptors.is_empty() {
            return Err(INVALID_VALUE);
        }
        // The mappings the range touches, which must leave no hole.
        let mut touched = Vec::new();
        let mut at = ptr;
        while at < end {
            let (&base, mapping) = self.vmm.mappings.range(..=at).next_back().ok_or(INVALID_VALUE)?;
            if at >= base + mapping.size {
                return Err(INVALID_VALUE);
            }
            touched.push((base, self.vmm.handles[&mapping.handle].device));
            at = base + mapping.size;
        }
        let mut changes = Vec::with_capacity(descriptors.len());
        for descriptor in descriptors {
            if descriptor.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE {
                return Err(INVALID_VALUE);
            }
            let device = self.device(descriptor.location.id)?;
            let read_write = match descriptor.flags {
                F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE => true,
                F::CU_MEM_ACCESS_FLAGS_PROT_NONE | F::CU_MEM_ACCESS_FLAGS_PROT_READ => false,
                _ => return Err(INVALID_VALUE),
            };
            if touched.iter().any(|&(_, owner)| owner != device) && !self.config.peer_access {
                return Err(INVALID_DEVICE);
            }
            changes.push((device, read_write));
        }
        for (base, _) in touched {
            let mapping = self.vmm.mappings.get_mut(&base).expect("mapping");
            for &(device, read_write) in &changes {
                if read_write {
                    mapping.read_write |= 1 << device;
                } else {
                    mapping.read_write &= !(1 << device);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::sim::{FaultCode, FaultPlan, SimConfig};
    use crate::{CUdeviceptr, CUmemAccess_flags, CUmemAccessDesc, CUmemLocation, CUmemLocationType, CUresult};
    use crate::{CUstream_flags, Driver, DriverError, PoolProps};

    const MIB: u64 = 1 << 20;
    const GRANULE: u64 = 2 * MIB;

    fn code(result: Result<impl std::fmt::Debug, DriverError>) -> CUresult {
        match result {
            Ok(value) => panic!("expected an error, got {value:?}"),
            Err(error) => error.code().unwrap_or_else(|| panic!("expected a driver code, got {error}")),
        }
    }

    fn current(config: SimConfig) -> Driver {
        let driver = Driver::simulated(config).unwrap();
        let ctx = driver.primary_context_retain(0).unwrap();
        // SAFETY: `ctx` was just retained from this driver.
        unsafe { driver.context_set_current(ctx) }.unwrap();
        driver
    }

    fn free_bytes(driver: &Driver) -> u64 {
        driver.mem_get_info().unwrap().0
    }

    fn read_write(device: i32) -> CUmemAccessDesc {
        CUmemAccessDesc {
            location: CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device },
            flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }

    /// Maps a fresh granule-sized handle at `ptr` with read-write access for device 0.
    fn map_granule(driver: &Driver, ptr: CUdeviceptr) -> u64 {
        let handle = driver.mem_create(0, GRANULE).unwrap();
        // SAFETY: the handle and the range come from this driver.
        unsafe {
            driver.mem_map(ptr, GRANULE, handle).unwrap();
            driver.mem_set_access(ptr, GRANULE, &[read_write(0)]).unwrap();
        }
        handle
    }

    #[test]
    fn physical_memory_counts_at_creation_and_goes_back_when_released_and_unmapped() {
        let driver = current(SimConfig::with_capacity(64 * MIB));
        assert!(driver.vmm_supported(0).unwrap());
        assert_eq!(driver.mem_allocation_granularity(0, true).unwrap(), GRANULE);
        assert_eq!(driver.mem_allocation_granularity(0, false).unwrap(), GRANULE);
        let range = driver.mem_address_reserve(16 * GRANULE, 0).unwrap();
        assert_eq!(free_bytes(&driver), 64 * MIB, "a reservation holds no memory");
        let first = map_granule(&driver, range);
        let second = map_granule(&driver, range + GRANULE);
        assert_eq!(free_bytes(&driver), 64 * MIB - 2 * GRANULE, "each handle counts at its size");
        // SAFETY: handles and ranges come from this driver; nothing runs on the device.
        unsafe {
            driver.mem_release(first).unwrap();
            assert_eq!(free_bytes(&driver), 64 * MIB - 2 * GRANULE, "released but mapped: still held");
            driver.mem_unmap(range, GRANULE).unwrap();
            assert_eq!(free_bytes(&driver), 64 * MIB - GRANULE, "unmapped and released: given back");
            driver.mem_unmap(range + GRANULE, GRANULE).unwrap();
            assert_eq!(free_bytes(&driver), 64 * MIB - GRANULE, "unmapped but not released: still held");
            driver.mem_release(second).unwrap();
            assert_eq!(free_bytes(&driver), 64 * MIB);
            driver.mem_address_free(range, 16 * GRANULE).unwrap();
        }
        assert!(driver.sim().unwrap().mapped_ranges().is_empty());
    }

    #[test]
    fn misuse_gets_the_drivers_codes() {
        let driver = current(SimConfig::with_capacity(64 * MIB));
        let invalid = CUresult::CUDA_ERROR_INVALID_VALUE;
        assert_eq!(code(driver.mem_address_reserve(GRANULE + 512, 0)), invalid, "not a granule multiple");
        assert_eq!(code(driver.mem_address_reserve(0, 0)), invalid);
        assert_eq!(code(driver.mem_create(0, MIB)), invalid, "not a granule multiple");
        assert_eq!(code(driver.mem_create(7, GRANULE)), invalid, "no such device");
        let range = driver.mem_address_reserve(4 * GRANULE, 0).unwrap();
        let handle = map_granule(&driver, range);
        let other = driver.mem_create(0, 2 * GRANULE).unwrap();
        // SAFETY: handles and ranges come from this driver (or are made-up values the simulated
        // driver refuses); nothing runs on the device.
        unsafe {
            assert_eq!(code(driver.mem_map(range, GRANULE, other)), invalid, "mapping over a mapped range");
            assert_eq!(code(driver.mem_map(range + GRANULE, 4 * GRANULE, other)), invalid, "larger than the handle");
            assert_eq!(code(driver.mem_map(range + 3 * GRANULE, 2 * GRANULE, other)), invalid, "past the range");
            assert_eq!(code(driver.mem_map(range + MIB, GRANULE, other)), invalid, "unaligned address");
            assert_eq!(code(driver.mem_map(range + GRANULE, GRANULE, 0x1234)), invalid, "made-up handle");
            assert_eq!(code(driver.mem_unmap(range + GRANULE, GRANULE)), invalid, "unmapping what is not mapped");
            driver.mem_map(range + GRANULE, 2 * GRANULE, other).unwrap();
            assert_eq!(code(driver.mem_unmap(range + GRANULE, GRANULE)), invalid, "a sub-range of one mapping");
            assert_eq!(code(driver.mem_unmap(range, 3 * GRANULE)), invalid, "two mappings at once");
            assert_eq!(code(driver.mem_set_access(range, 4 * GRANULE, &[read_write(0)])), invalid, "a hole");
            driver.mem_set_access(range, 3 * GRANULE, &[read_write(0)]).unwrap();
            assert_eq!(code(driver.mem_address_free(range, 4 * GRANULE)), invalid, "a range with mappings");
            assert_eq!(code(driver.mem_address_free(range, 2 * GRANULE)), invalid, "not the reserved size");
            driver.mem_release(handle).unwrap();
            assert_eq!(code(driver.mem_release(handle)), invalid, "released twice");
            assert_eq!(code(driver.mem_map(range + 3 * GRANULE, GRANULE, handle)), invalid, "a released handle");
            driver.mem_unmap(range, GRANULE).unwrap();
            driver.mem_unmap(range + GRANULE, 2 * GRANULE).unwrap();
            driver.mem_release(other).unwrap();
            driver.mem_address_free(range, 4 * GRANULE).unwrap();
        }
        assert_eq!(free_bytes(&driver), 64 * MIB);
    }

    #[test]
    fn physical_memory_shares_the_capacity_with_pools() {
        // The segment model, for a device of a few granules.
        let driver = current(SimConfig { pool_unit: None, ..SimConfig::with_capacity(8 * MIB) });
        let stream = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
        let pool = driver.mem_pool_create(&PoolProps::device(0).build()).unwrap();
        // SAFETY: handles come from this driver; the pool's allocation is freed and not used again.
        unsafe {
            let ptr = driver.mem_alloc_from_pool_async(6 * MIB as usize, pool, stream).unwrap();
            assert_eq!(code(driver.mem_create(0, 2 * GRANULE)), CUresult::CUDA_ERROR_OUT_OF_MEMORY);
            driver.mem_free_async(ptr, stream).unwrap();
            driver
                .mem_pool_set_attribute(pool, crate::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX)
                .unwrap();
            driver.stream_synchronize(stream).unwrap();
            assert_eq!(free_bytes(&driver), 2 * MIB, "the idle segment is still reserved");
            let handle = driver.mem_create(0, 2 * GRANULE).unwrap();
            assert_eq!(free_bytes(&driver), 4 * MIB, "the idle segment went back to make room");
            assert_eq!(
                code(driver.mem_alloc_from_pool_async(6 * MIB as usize, pool, stream)),
                CUresult::CUDA_ERROR_OUT_OF_MEMORY
            );
            driver.mem_release(handle).unwrap();
        }
    }

    #[test]
    fn copies_reach_mapped_memory_across_mappings_only_with_access() {
        let driver = current(SimConfig { host_memory: true, ..SimConfig::with_capacity(64 * MIB) });
        let sim = driver.sim().unwrap();
        let stream = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
        let range = driver.mem_address_reserve(4 * GRANULE, 0).unwrap();
        map_granule(&driver, range);
        map_granule(&driver, range + GRANULE);
        let across = range + GRANULE - 8;
        let data: Vec<u8> = (1..=16).collect();
        let mut back = [0u8; 16];
        // SAFETY: the addresses and the stream come from this driver; `data` and `back` live
        // through each call.
        unsafe {
            assert_eq!(sim.cuMemcpyHtoDAsync_v2(across, data.as_ptr().cast(), 16, stream), CUresult::CUDA_SUCCESS);
            assert_eq!(sim.cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), across, 16, stream), CUresult::CUDA_SUCCESS);
            assert_eq!(back.as_slice(), data.as_slice(), "written and read back across two mappings");
            assert_eq!(
                sim.cuMemsetD8Async(range + 2 * GRANULE - 4, 0, 8, stream),
                CUresult::CUDA_ERROR_INVALID_VALUE,
                "past the mapped memory"
            );
            let handle = driver.mem_create(0, GRANULE).unwrap();
            driver.mem_map(range + 2 * GRANULE, GRANULE, handle).unwrap();
            assert_eq!(
                sim.cuMemsetD8Async(range + 2 * GRANULE, 0, 8, stream),
                CUresult::CUDA_ERROR_INVALID_VALUE,
                "no access yet"
            );
            driver.mem_set_access(range + 2 * GRANULE, GRANULE, &[read_write(0)]).unwrap();
            assert_eq!(sim.cuMemsetD8Async(range + 2 * GRANULE, 9, 8, stream), CUresult::CUDA_SUCCESS);
        }
    }

    #[test]
    fn without_support_every_call_is_refused_and_faults_reach_the_calls() {
        let config = SimConfig { vmm_supported: false, ..SimConfig::with_capacity(64 * MIB) };
        let driver = Driver::simulated(config).unwrap();
        let ctx = driver.primary_context_retain(0).unwrap();
        // SAFETY: `ctx` was just retained from this driver.
        unsafe { driver.context_set_current(ctx) }.unwrap();
        assert!(!driver.vmm_supported(0).unwrap());
        assert_eq!(code(driver.mem_address_reserve(GRANULE, 0)), CUresult::CUDA_ERROR_NOT_SUPPORTED);
        assert_eq!(code(driver.mem_create(0, GRANULE)), CUresult::CUDA_ERROR_NOT_SUPPORTED);

        let plan = FaultPlan::nth(1, FaultCode::OutOfMemory).calls(&["cuMemMap"]);
        let driver = current(SimConfig { faults: Some(plan), ..SimConfig::with_capacity(64 * MIB) });
        let range = driver.mem_address_reserve(GRANULE, 0).unwrap();
        let handle = driver.mem_create(0, GRANULE).unwrap();
        // SAFETY: the handle and the range come from this driver.
        unsafe {
            assert_eq!(code(driver.mem_map(range, GRANULE, handle)), CUresult::CUDA_ERROR_OUT_OF_MEMORY, "injected");
            driver.mem_map(range, GRANULE, handle).unwrap();
        }
        assert_eq!(driver.sim().unwrap().faults_fired(), 1);
    }
}
