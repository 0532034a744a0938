//! `pool-probe`: how the selected driver's stream-ordered pool reserves memory, as JSON lines.
//!
//! The simulated device models the driver's pool as an H200 answered: one address range mapped
//! in 32 MiB units, allocations placed across unit boundaries. This replays that probe through
//! steppool's own bindings, so that any GPU can be asked the same questions, and asks one more,
//! which the model answers without a measurement: what the pool does when the device has less
//! free memory than a unit.
//!
//! - `single`: one request of each size into an empty pool, the reservation after it;
//! - `growth`: 48 requests of 1 MiB, then of 5 MiB, held, the reservation after each;
//! - `near_capacity`: for each headroom (the device's free memory left by a `cuMemAlloc` filler,
//!   in whole 2 MiB granules), 1 MiB requests until the pool refuses one or 64 are held: the
//!   reservation and the device's free memory after each, and the refusal;
//! - `placement`, for each trace named after FILE: its allocations and frees replayed in order on
//!   one stream of one pool, and, for every allocation, the address the pool chose (as an offset
//!   from the trace's first allocation) and the reservation after it. Run under the simulated
//!   device and under the driver, two such outputs show where the model's placement differs.
//!
//! Every line is `{"experiment", "op", "bytes", "ok", "reserved", "free", ...}`; the pool's
//! release threshold is raised, as PyTorch's `cudaMallocAsync` backend sets it, and everything is
//! given back between experiments. Follows `STEPPOOL_DEVICE` as the device tests do (`auto`, the
//! simulated device where there is no GPU). Needs the device to itself: other users' memory
//! moves its free memory. `pool-probe [FILE [TRACE...]]` also writes the lines to FILE.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use steppool_sys::{CUdeviceptr, CUmemPool_attribute, CUstream_flags, Driver, DriverError, PoolProps};
use steppool_tests::driver;
use steppool_trace::EventKind;
use steppool_trace::read::read_trace;

const MIB: u64 = 1 << 20;
const GRANULE: u64 = 2 * MIB;

fn main() -> ExitCode {
    let traces: Vec<PathBuf> = std::env::args().skip(2).map(PathBuf::from).collect();
    let mut file = match std::env::args().nth(1).map(std::fs::File::create).transpose() {
        Ok(file) => file,
        Err(error) => {
            eprintln!("pool-probe: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut emit = |line: String| {
        println!("{line}");
        if let Some(file) = &mut file
            && let Err(error) = writeln!(file, "{line}")
        {
            eprintln!("pool-probe: {error}");
        }
    };
    let driver = driver();
    let result = probe(&driver, &mut emit)
        .map_err(|e| e.to_string())
        .and_then(|()| traces.iter().try_for_each(|trace| placement(&driver, trace, &mut emit)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("pool-probe: {error}");
            ExitCode::FAILURE
        }
    }
}

/// One pool on a stream of device 0, with what it holds, given back on drop.
struct Probe<'a> {
    driver: &'a Driver,
    pool: steppool_sys::CUmemoryPool,
    stream: steppool_sys::CUstream,
    held: Vec<CUdeviceptr>,
}

impl<'a> Probe<'a> {
    fn new(driver: &'a Driver) -> Result<Self, DriverError> {
        let device = driver.device(0)?;
        let ctx = driver.primary_context_retain(device)?;
        // SAFETY: `ctx` was just retained from this driver.
        unsafe { driver.context_set_current(ctx) }?;
        let stream = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING)?;
        let pool = driver.mem_pool_create(&PoolProps::device(device).build())?;
        // SAFETY: the pool was just made by this driver.
        unsafe {
            driver.mem_pool_set_attribute(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX)
        }?;
        Ok(Self { driver, pool, stream, held: Vec::new() })
    }

    /// Asks the pool for `bytes`, keeping the allocation; `false` when the driver refuses it for
    /// want of memory.
    fn alloc(&mut self, bytes: u64) -> Result<bool, DriverError> {
        let ok = self.alloc_unsynchronized(bytes)?;
        if ok {
            self.sync()?;
        }
        Ok(ok)
    }

    /// The reservation now.
    fn reserved(&self) -> Result<u64, DriverError> {
        // SAFETY: the pool is this probe's.
        Ok(unsafe { self.driver.mem_pool_counters(self.pool) }?.reserved)
    }

    /// Asks the pool for `bytes` without waiting for the stream: the next line's reservation is
    /// what the driver holds once the request is enqueued.
    fn alloc_unsynchronized(&mut self, bytes: u64) -> Result<bool, DriverError> {
        // SAFETY: the pool and stream are this probe's.
        match unsafe { self.driver.mem_alloc_from_pool_async(bytes as usize, self.pool, self.stream) } {
            Ok(ptr) => {
                self.held.push(ptr);
                Ok(true)
            }
            Err(error) if error.code() == Some(steppool_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY) => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// Frees `held[slot]` on the probe's stream; the slot keeps a null pointer.
    fn free_unsynchronized(&mut self, slot: usize) -> Result<(), DriverError> {
        let ptr = std::mem::take(&mut self.held[slot]);
        // SAFETY: `ptr` came from this pool on this stream and is freed once (its slot is now 0).
        unsafe { self.driver.mem_free_async(ptr, self.stream) }
    }

    /// Frees everything held and gives the pool's memory back to the device.
    fn release(&mut self) -> Result<(), DriverError> {
        for ptr in self.held.drain(..).filter(|&ptr| ptr != 0) {
            // SAFETY: `ptr` came from this pool on this stream and is freed once.
            unsafe { self.driver.mem_free_async(ptr, self.stream) }?;
        }
        self.sync()?;
        // SAFETY: the pool is this probe's.
        unsafe { self.driver.mem_pool_trim_to(self.pool, 0) }
    }

    fn sync(&self) -> Result<(), DriverError> {
        // SAFETY: the stream is this probe's.
        unsafe { self.driver.stream_synchronize(self.stream) }
    }

    /// One line: the reservation and the device's free memory now.
    fn line(&self, experiment: &str, op: &str, bytes: u64, ok: bool, extra: &str) -> Result<String, DriverError> {
        // SAFETY: the pool is this probe's.
        let reserved = unsafe { self.driver.mem_pool_counters(self.pool) }?.reserved;
        let (free, _) = self.driver.mem_get_info()?;
        Ok(format!(
            "{{\"experiment\":\"{experiment}\",\"op\":\"{op}\",\"bytes\":{bytes},\"ok\":{ok},\"reserved\":{reserved},\"free\":{free}{extra}}}"
        ))
    }
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        // Nothing to report from a drop: a failure here leaves memory to the process's end.
        let _ = self.release();
        // SAFETY: the pool and stream are this probe's, and nothing uses them after.
        unsafe {
            let _ = self.driver.mem_pool_destroy(self.pool);
            let _ = self.driver.stream_destroy(self.stream);
        }
    }
}

fn probe(driver: &Driver, emit: &mut dyn FnMut(String)) -> Result<(), DriverError> {
    let mut probe = Probe::new(driver)?;
    emit(format!("{{\"experiment\":\"device\",\"driver\":\"{}\"}}", driver.describe().replace('"', "'")));
    for bytes in [1, 512, MIB, 2 * MIB + 1, 31 * MIB, 32 * MIB, 33 * MIB, 64 * MIB + 1, 100 * MIB, 1 << 30] {
        let ok = probe.alloc(bytes)?;
        emit(probe.line("single", "alloc", bytes, ok, "")?);
        probe.release()?;
    }
    for bytes in [MIB, 5 * MIB] {
        for index in 0..48 {
            let ok = probe.alloc(bytes)?;
            emit(probe.line("growth", "alloc", bytes, ok, &format!(",\"index\":{index}"))?);
        }
        probe.release()?;
    }
    for headroom in [48, 40, 34, 32, 30, 24, 16, 8, 4].map(|mib| mib * MIB) {
        let (free, _) = driver.mem_get_info()?;
        let fill = free.saturating_sub(headroom) / GRANULE * GRANULE;
        let filler = if fill > 0 { Some(driver.mem_alloc(fill as usize)?) } else { None };
        let extra = format!(",\"headroom\":{headroom}");
        emit(probe.line("near_capacity", "fill", fill, true, &extra)?);
        for _ in 0..64 {
            let ok = probe.alloc(MIB)?;
            emit(probe.line("near_capacity", "alloc", MIB, ok, &extra)?);
            if !ok {
                break;
            }
        }
        probe.release()?;
        if let Some(ptr) = filler {
            // SAFETY: `ptr` is the filler allocated above, freed once.
            unsafe { driver.mem_free(ptr) }?;
        }
    }
    Ok(())
}

/// Replays the allocations and frees of the trace at `path` in order on one stream of a fresh
/// pool: one line per allocation, with the address the pool chose as an offset from the first.
fn placement(driver: &Driver, path: &std::path::Path, emit: &mut dyn FnMut(String)) -> Result<(), String> {
    let trace = read_trace(path).map_err(|e| e.to_string())?;
    let name = path.file_name().map(|n| n.to_string_lossy().replace('"', "'")).unwrap_or_default();
    let mut probe = Probe::new(driver).map_err(|e| e.to_string())?;
    // The trace's pointers to the pool's, and each one's index in `probe.held`.
    let mut live: HashMap<u64, usize> = HashMap::new();
    let mut first = None;
    let mut index = 0u64;
    for event in &trace.events {
        match event.kind {
            EventKind::Alloc if event.bytes > 0 => {
                if !probe.alloc_unsynchronized(event.bytes).map_err(|e| e.to_string())? {
                    emit(format!(
                        "{{\"experiment\":\"placement\",\"trace\":\"{name}\",\"index\":{index},\"bytes\":{},\"ok\":false}}",
                        event.bytes
                    ));
                    return Ok(());
                }
                let ptr = *probe.held.last().expect("just allocated");
                let base = *first.get_or_insert(ptr);
                live.insert(event.ptr, probe.held.len() - 1);
                let reserved = probe.reserved().map_err(|e| e.to_string())?;
                emit(format!(
                    "{{\"experiment\":\"placement\",\"trace\":\"{name}\",\"index\":{index},\"bytes\":{},\"offset\":{},\"reserved\":{reserved}}}",
                    event.bytes,
                    ptr.wrapping_sub(base) as i64
                ));
                index += 1;
            }
            EventKind::Free { .. } => {
                if let Some(slot) = live.remove(&event.ptr) {
                    probe.free_unsynchronized(slot).map_err(|e| e.to_string())?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}
