//! Replaying a [`Sequence`] through an [`Allocator`], optionally writing every buffer with the
//! fill kernel and sampling the device's footprint.
//!
//! Peak reserved is measured the same way for every allocator, ours and the peers': the device
//! memory in use (`cuMemGetInfo`: total − free) after each allocation, less what was in use
//! before the replay began. That counts what each allocator holds from the device, whatever its
//! own counters call it, at the granularity the driver maps memory in.

use steppool::sys::{CUdeviceptr, Driver};

use crate::alloc::{Allocator, StepTimes};
use crate::kernel::Fill;
use crate::sequence::{Op, Sequence};
use crate::{BenchError, Result};

/// The device memory in use above a baseline, and its peak.
#[derive(Debug)]
pub struct Footprint {
    driver: Driver,
    baseline: u64,
    peak: u64,
}

impl Footprint {
    /// Starts measuring from what is in use now (the calling thread's current context's device).
    pub fn start(driver: &Driver) -> Result<Self> {
        let (free, total) = driver.mem_get_info()?;
        Ok(Self { driver: driver.clone(), baseline: total - free, peak: 0 })
    }

    /// Takes a sample.
    pub fn sample(&mut self) -> Result<()> {
        let (free, total) = self.driver.mem_get_info()?;
        self.peak = self.peak.max((total - free).saturating_sub(self.baseline));
        Ok(())
    }

    /// The highest sample above the baseline, in bytes.
    pub fn peak(&self) -> u64 {
        self.peak
    }
}

/// Replays operations through an allocator.
pub struct Replayer<'a> {
    allocator: &'a mut dyn Allocator,
    /// The live pointer of each allocation id; 0 when not live.
    live: Vec<CUdeviceptr>,
    fill: Option<&'a Fill>,
    footprint: Option<Footprint>,
    steps: Vec<StepTimes>,
    sequence: String,
}

impl std::fmt::Debug for Replayer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replayer").field("allocator", &self.allocator.name()).field("sequence", &self.sequence).finish()
    }
}

impl<'a> Replayer<'a> {
    /// A replayer of `sequence`'s allocation ids through `allocator`.
    pub fn new(allocator: &'a mut dyn Allocator, sequence: &Sequence) -> Self {
        Self {
            allocator,
            live: vec![0; sequence.allocations()],
            fill: None,
            footprint: None,
            steps: Vec::new(),
            sequence: sequence.name.clone(),
        }
    }

    /// Writes every byte of every allocation with `fill`, right after allocating it.
    pub fn fill(mut self, fill: &'a Fill) -> Self {
        self.fill = Some(fill);
        self
    }

    /// Samples the device's footprint after every allocation, from what is in use now.
    pub fn measure_footprint(mut self) -> Result<Self> {
        self.footprint = Some(Footprint::start(self.allocator.driver())?);
        Ok(self)
    }

    /// Runs `ops`.
    pub fn run(&mut self, ops: &[Op]) -> Result<()> {
        for (index, op) in ops.iter().enumerate() {
            match *op {
                Op::Alloc { id, bytes, lifetime } => {
                    let slot = self.slot(index, id)?;
                    if *slot != 0 {
                        return Err(self.error(index, format!("allocation {id} is made while live")));
                    }
                    let ptr = self.allocator.alloc(id, bytes, lifetime)?;
                    self.live[id as usize] = ptr;
                    if let Some(fill) = self.fill {
                        // SAFETY: `ptr` is a live allocation of `bytes` bytes, aligned as CUDA
                        // allocations are, made for the allocator's stream.
                        unsafe { fill.launch(ptr, bytes, 0xA5, self.allocator.stream()) }?;
                    }
                    if let Some(footprint) = &mut self.footprint {
                        footprint.sample()?;
                    }
                }
                Op::Free { id } => {
                    let ptr = std::mem::take(self.slot(index, id)?);
                    if ptr == 0 {
                        return Err(self.error(index, format!("allocation {id} is freed while not live")));
                    }
                    self.allocator.free(id, ptr)?;
                }
                Op::Step => {
                    if let Some(times) = self.allocator.end_step()? {
                        self.steps.push(times);
                    }
                }
            }
        }
        Ok(())
    }

    fn slot(&mut self, index: usize, id: u32) -> Result<&mut CUdeviceptr> {
        if id as usize >= self.live.len() {
            return Err(self.error(index, format!("allocation id {id} is past the sequence's {}", self.live.len())));
        }
        Ok(&mut self.live[id as usize])
    }

    fn error(&self, index: usize, reason: String) -> BenchError {
        BenchError::Sequence { sequence: self.sequence.clone(), index, reason }
    }

    /// Frees whatever is still live, ends the step, and lets the allocator give memory back.
    pub fn finish(&mut self) -> Result<()> {
        for id in 0..self.live.len() {
            let ptr = std::mem::take(&mut self.live[id]);
            if ptr != 0 {
                self.allocator.free(id as u32, ptr)?;
            }
        }
        if let Some(times) = self.allocator.end_step()? {
            self.steps.push(times);
        }
        self.allocator.finish()
    }

    /// The peak footprint, when measured.
    pub fn peak_reserved(&self) -> Option<u64> {
        self.footprint.as_ref().map(Footprint::peak)
    }

    /// The timings of the step boundaries so far, for allocators that have them.
    pub fn step_times(&self) -> &[StepTimes] {
        &self.steps
    }
}
