//! The `Arena` strategy: bump allocation in slabs, reset at the boundary.

use steppool_sys::CUdeviceptr;

use super::{ALIGNMENT, Allocator, FreeSpace, Source};
use crate::error::Result;

#[derive(Clone, Copy, Debug)]
struct Slab {
    base: CUdeviceptr,
    size: u64,
}

/// Bump allocation in slabs of `slab_bytes`, used front to back: `current` is the slab being
/// bumped and `offset` its first free byte; slabs after it are untouched in this scope. A request
/// larger than a slab gets an oversize slab of its own, so it never wastes the current slab's
/// tail; oversize slabs are reused by later scopes (best fit) like the others.
#[derive(Debug)]
pub(crate) struct Arena {
    slab_bytes: u64,
    slabs: Vec<Slab>,
    current: usize,
    offset: u64,
    /// Oversize slabs and whether the current scope uses each.
    oversize: Vec<(Slab, bool)>,
}

impl Arena {
    pub(crate) fn new(slab_bytes: u64) -> Self {
        let slab_bytes = slab_bytes.max(ALIGNMENT).next_multiple_of(ALIGNMENT);
        Self { slab_bytes, slabs: Vec::new(), current: 0, offset: 0, oversize: Vec::new() }
    }

    fn held(&self) -> u64 {
        self.slabs.iter().map(|s| s.size).sum::<u64>() + self.oversize.iter().map(|(s, _)| s.size).sum::<u64>()
    }

    fn allocate_oversize(&mut self, source: &mut Source<'_>, size: u64) -> Result<CUdeviceptr> {
        let fit = self
            .oversize
            .iter()
            .enumerate()
            .filter(|(_, (slab, used))| !used && slab.size >= size)
            .min_by_key(|(_, (slab, _))| slab.size)
            .map(|(index, _)| index);
        if let Some(index) = fit {
            self.oversize[index].1 = true;
            return Ok(self.oversize[index].0.base);
        }
        let base = source.alloc(size)?;
        self.oversize.push((Slab { base, size }, true));
        Ok(base)
    }
}

impl Allocator for Arena {
    fn allocate(&mut self, source: &mut Source<'_>, bytes: u64) -> Result<CUdeviceptr> {
        let size = bytes.next_multiple_of(ALIGNMENT);
        if size > self.slab_bytes {
            return self.allocate_oversize(source, size);
        }
        // The current slab, else the next kept one (the current one's tail stays unused until
        // the reset), else a new slab.
        while let Some(slab) = self.slabs.get(self.current) {
            if slab.size - self.offset >= size {
                let ptr = slab.base + self.offset;
                self.offset += size;
                return Ok(ptr);
            }
            if self.current + 1 == self.slabs.len() {
                break;
            }
            self.current += 1;
            self.offset = 0;
        }
        let base = source.alloc(self.slab_bytes)?;
        self.slabs.push(Slab { base, size: self.slab_bytes });
        self.current = self.slabs.len() - 1;
        self.offset = size;
        Ok(base)
    }

    fn free(&mut self, _: &mut Source<'_>, _: CUdeviceptr, _: u64) -> Result<()> {
        Ok(())
    }

    /// Starts over and gives back slabs while at least `keep` bytes stay: unused oversize
    /// slabs first (largest first), then regular slabs from the back.
    fn reset(&mut self, source: &mut Source<'_>, keep: u64) -> Result<()> {
        self.current = 0;
        self.offset = 0;
        let mut held = self.held();
        self.oversize.sort_unstable_by_key(|(slab, _)| std::cmp::Reverse(slab.size));
        let mut index = 0;
        while index < self.oversize.len() {
            let slab = self.oversize[index].0;
            if held - slab.size >= keep {
                source.free(slab.base, slab.size)?;
                self.oversize.remove(index);
                held -= slab.size;
            } else {
                self.oversize[index].1 = false;
                index += 1;
            }
        }
        while let Some(last) = self.slabs.last().copied() {
            if held - last.size < keep {
                break;
            }
            source.free(last.base, last.size)?;
            self.slabs.pop();
            held -= last.size;
        }
        Ok(())
    }

    fn touched(&self) -> u64 {
        let regular = if self.current == 0 && self.offset == 0 {
            0
        } else {
            self.slabs[..=self.current].iter().map(|s| s.size).sum()
        };
        regular + self.oversize.iter().filter(|(_, used)| *used).map(|(s, _)| s.size).sum::<u64>()
    }

    fn free_space(&self) -> Option<FreeSpace> {
        let regular = self.slabs.iter().enumerate().map(|(index, slab)| match index.cmp(&self.current) {
            std::cmp::Ordering::Less => 0,
            std::cmp::Ordering::Equal => slab.size - self.offset,
            std::cmp::Ordering::Greater => slab.size,
        });
        let oversize = self.oversize.iter().map(|(slab, used)| if *used { 0 } else { slab.size });
        let (largest_free, total_free) =
            regular.chain(oversize).fold((0, 0), |(largest, total), free| (largest.max(free), total + free));
        Some(FreeSpace { largest_free, total_free })
    }

    fn release_all(&mut self, source: &mut Source<'_>) -> Result<()> {
        for slab in self.slabs.drain(..).chain(self.oversize.drain(..).map(|(slab, _)| slab)) {
            source.free(slab.base, slab.size)?;
        }
        self.current = 0;
        self.offset = 0;
        Ok(())
    }
}
