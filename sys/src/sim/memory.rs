//! Host memory behind the simulated device's memory, when [`SimConfig::host_memory`] asks for
//! it: one zeroed host block per mapped pool unit (or physical allocation, `vmm.rs`), so that
//! memset, copies and the repository's fill kernels have effect and copies back to the host read
//! what was written.
//!
//! Blocks come from the allocator's zeroed allocation (`calloc`), so untouched pages cost
//! nothing until written; a block the host cannot give is reported, not aborted on, and the
//! unit is then refused as out of memory.
//!
//! [`SimConfig::host_memory`]: super::SimConfig::host_memory

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::BTreeMap;
use std::ptr::NonNull;

/// One unit's host block: `len` zeroed bytes owned until drop.
#[derive(Debug)]
struct Block {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `Block` owns its allocation exclusively, like a `Box<[u8]>`; it is reached only
// through `&mut HostMemory` under the simulated driver's lock.
unsafe impl Send for Block {}

impl Block {
    fn layout(len: usize) -> Option<Layout> {
        Layout::from_size_align(len, 16).ok()
    }

    fn new(len: usize) -> Option<Self> {
        let layout = Self::layout(len).filter(|l| l.size() > 0)?;
        // SAFETY: the layout has a non-zero size, as `alloc_zeroed` requires.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(Self { ptr, len })
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live allocation of `len` initialized (zeroed, then written) bytes
        // that this block owns; `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Some(layout) = Self::layout(self.len) {
            // SAFETY: `ptr` came from `alloc_zeroed` with this same layout and is freed once.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// Host blocks by key: the base address of a pool's unit, or the id of a physical allocation.
#[derive(Debug, Default)]
pub(crate) struct HostMemory {
    blocks: BTreeMap<u64, Block>,
}

impl HostMemory {
    /// Backs a new unit; `false` when the host cannot give `size` bytes.
    pub(crate) fn reserve(&mut self, base: u64, size: u64) -> bool {
        let Some(block) = usize::try_from(size).ok().and_then(Block::new) else { return false };
        self.blocks.insert(base, block);
        true
    }

    /// Drops the block of a released unit.
    pub(crate) fn release(&mut self, base: u64) {
        self.blocks.remove(&base);
    }

    /// The bytes `[offset, offset + len)` of the block at `base`. The caller has checked that
    /// the range lies inside live memory of that block.
    pub(crate) fn bytes_mut(&mut self, base: u64, offset: u64, len: usize) -> &mut [u8] {
        let block = self.blocks.get_mut(&base).expect("all mapped memory of a host-backed device has a block");
        let start = offset as usize;
        &mut block.bytes_mut()[start..start + len]
    }

    /// Calls `part` on the bytes of `[addr, addr + len)`, block by block in address order, with
    /// each part's offset in the range. The caller has checked that the range lies in live pool
    /// memory, whose units are blocks keyed by address and adjacent within a pool's range.
    pub(crate) fn for_each_part(&mut self, addr: u64, len: usize, mut part: impl FnMut(usize, &mut [u8])) {
        let end = addr + len as u64;
        let mut at = addr;
        while at < end {
            let (&base, block) = self
                .blocks
                .range_mut(..=at)
                .next_back()
                .expect("all mapped memory of a host-backed device has a block");
            let offset = (at - base) as usize;
            let take = (block.len - offset).min((end - at) as usize);
            part((at - addr) as usize, &mut block.bytes_mut()[offset..offset + take]);
            at += take as u64;
        }
    }
}
