//! Host memory behind the simulated device's segments, when [`SimConfig::host_memory`] asks for
//! it: one zeroed host block per reserved segment, so that memset, copies and the repository's
//! fill kernels have effect and copies back to the host read what was written.
//!
//! Blocks come from the allocator's zeroed allocation (`calloc`), so untouched pages cost
//! nothing until written; a block the host cannot give is reported, not aborted on, and the
//! segment is then refused as out of memory.
//!
//! [`SimConfig::host_memory`]: super::SimConfig::host_memory

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::BTreeMap;
use std::ptr::NonNull;

/// One segment's host block: `len` zeroed bytes owned until drop.
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

/// The host blocks of every live segment, by segment base address.
#[derive(Debug, Default)]
pub(crate) struct HostMemory {
    blocks: BTreeMap<u64, Block>,
}

impl HostMemory {
    /// Backs a new segment; `false` when the host cannot give `size` bytes.
    pub(crate) fn reserve(&mut self, base: u64, size: u64) -> bool {
        let Some(block) = usize::try_from(size).ok().and_then(Block::new) else { return false };
        self.blocks.insert(base, block);
        true
    }

    /// Drops the block of a released segment.
    pub(crate) fn release(&mut self, base: u64) {
        self.blocks.remove(&base);
    }

    /// The bytes `[offset, offset + len)` of the segment at `base`. The caller has checked that
    /// the range lies inside a live allocation of that segment.
    pub(crate) fn bytes_mut(&mut self, base: u64, offset: u64, len: usize) -> &mut [u8] {
        let block = self.blocks.get_mut(&base).expect("every segment of a host-backed device has a block");
        let start = offset as usize;
        &mut block.bytes_mut()[start..start + len]
    }
}
