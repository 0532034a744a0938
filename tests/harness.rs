//! The harness shared by steppool's integration and conformance tests: which driver a device
//! test runs on, guards that release what a test made even when it fails, and a record of the
//! facts a run observes about the device.
//!
//! A device test calls [`Device::open`] or [`runtime`]. Both follow `STEPPOOL_DEVICE`, with
//! `auto` as the default: the GPU when one with memory pools answers, else the simulated device,
//! so CI runs every test. A test never skips: when the selected driver cannot be had
//! (`STEPPOOL_DEVICE=cuda` on a machine without a GPU) it fails, naming the reason. With
//! `STEPPOOL_REQUIRE_GPU=1` a run that would not reach a real GPU fails instead of passing on the
//! simulated device.

use std::fmt;
use std::io::Write;

use steppool_sys::{
    CUcontext, CUdevice, CUevent, CUevent_flags, CUmemoryPool, CUstream, CUstream_flags, DEVICE_VARIABLE, Driver,
    DriverKind, PoolProps, Selection,
};

/// Whether `STEPPOOL_REQUIRE_GPU=1` is set.
pub fn require_gpu() -> bool {
    std::env::var("STEPPOOL_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The driver device tests run on: `STEPPOOL_DEVICE`'s choice, `auto` when it is unset; the
/// real one whatever it says (but `sim`) when `STEPPOOL_REQUIRE_GPU=1`.
///
/// # Panics
///
/// When the selected driver cannot be had (`STEPPOOL_DEVICE=cuda` and no usable GPU), with the
/// loader's reason, or when a GPU is required and not reached: the test fails rather than pass
/// having checked nothing.
pub fn driver() -> Driver {
    let selection = Selection::from_env_or(Selection::Auto).unwrap_or_else(|error| panic!("{error}"));
    let require_gpu = require_gpu();
    if require_gpu && selection == Selection::Sim {
        panic!("STEPPOOL_REQUIRE_GPU=1 contradicts {DEVICE_VARIABLE}=sim");
    }
    let selection = if require_gpu { Selection::Cuda } else { selection };
    match Driver::select(selection) {
        Ok(driver) => driver,
        Err(error) if require_gpu => panic!("STEPPOOL_REQUIRE_GPU=1, but no GPU driver: {error}"),
        Err(error) => panic!(
            "{DEVICE_VARIABLE}={selection}, but this device test cannot have that driver: {error}. Unset \
             {DEVICE_VARIABLE} or set it to `auto` to run on the simulated device where there is no GPU."
        ),
    }
}

/// A runtime on the driver [`driver`] selects.
///
/// # Panics
///
/// As [`driver`] does, and when the runtime cannot be built.
pub fn runtime() -> steppool::Runtime {
    steppool::Runtime::with_driver(driver()).expect("building a runtime")
}

/// A runtime on a simulated device of `capacity` bytes, whatever `STEPPOOL_DEVICE` says: for
/// tests that need a device of a known size (out-of-memory) or its layout. It has virtual memory
/// management, as a GPU does ([`pool_slab_runtime`] is the device without it).
pub fn simulated_runtime(capacity: u64) -> steppool::Runtime {
    steppool::Runtime::builder()
        .simulated(steppool_sys::sim::SimConfig::with_capacity(capacity))
        .build()
        .expect("building a simulated runtime")
}

/// A runtime on a simulated device of `capacity` bytes in the segment model
/// ([`SimConfig::pool_unit`](steppool_sys::sim::SimConfig::pool_unit) `None`), whatever
/// `STEPPOOL_DEVICE` says: a pool reserves a segment of each request rounded to 2 MiB, for worked
/// examples whose figures are read in granules rather than the driver's 32 MiB units.
pub fn segment_runtime(capacity: u64) -> steppool::Runtime {
    let config =
        steppool_sys::sim::SimConfig { pool_unit: None, ..steppool_sys::sim::SimConfig::with_capacity(capacity) };
    steppool::Runtime::builder().simulated(config).build().expect("building a simulated runtime")
}

/// A runtime on a simulated device of `capacity` bytes without virtual memory management, whatever
/// `STEPPOOL_DEVICE` says: slabs, chunks and arenas are pool allocations, the fallback of devices
/// and drivers without it, for tests that read that layout. Its pools are the segment model's, as
/// for [`segment_runtime`].
pub fn pool_slab_runtime(capacity: u64) -> steppool::Runtime {
    let config = steppool_sys::sim::SimConfig {
        vmm_supported: false,
        pool_unit: None,
        ..steppool_sys::sim::SimConfig::with_capacity(capacity)
    };
    steppool::Runtime::builder().simulated(config).build().expect("building a simulated runtime")
}

/// Device 0 of the selected driver, with its primary context retained and current on the
/// calling thread; released on drop.
pub struct Device {
    /// The driver.
    pub driver: Driver,
    /// The device.
    pub device: CUdevice,
    /// Its primary context.
    pub ctx: CUcontext,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device").field("driver", &self.driver).field("device", &self.device).finish()
    }
}

impl Device {
    /// Opens device 0 of the driver [`driver`] selects.
    ///
    /// # Panics
    ///
    /// As [`driver`] does, and when device 0 or its primary context cannot be had.
    pub fn open() -> Self {
        let driver = driver();
        let device = driver.device(0).expect("device 0");
        let ctx = driver.primary_context_retain(device).expect("retaining the primary context");
        // SAFETY: `ctx` was just retained from this driver.
        unsafe { driver.context_set_current(ctx) }.expect("making the primary context current");
        Self { driver, device, ctx }
    }

    /// Whether the tests run on the real driver.
    pub fn is_gpu(&self) -> bool {
        self.driver.kind() == DriverKind::Cuda
    }

    /// A new non-blocking stream, destroyed on drop.
    pub fn stream(&self) -> Stream<'_> {
        let raw = self.driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).expect("creating a stream");
        Stream { device: self, raw }
    }

    /// A new pool on this device, destroyed on drop.
    pub fn pool(&self) -> Pool<'_> {
        let raw = self.driver.mem_pool_create(&PoolProps::device(self.device).build()).expect("creating a pool");
        Pool { device: self, raw }
    }

    /// A new event without timing, destroyed on drop.
    pub fn event(&self) -> Event<'_> {
        let raw = self.driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING).expect("creating an event");
        Event { device: self, raw }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`; the guards that borrow `self` are gone.
        let _ = unsafe { self.driver.primary_context_release(self.device) };
    }
}

/// A stream of a [`Device`], destroyed on drop.
pub struct Stream<'d> {
    device: &'d Device,
    /// The raw handle.
    pub raw: CUstream,
}

impl Stream<'_> {
    /// Waits for the stream's work.
    pub fn sync(&self) {
        // SAFETY: a live stream of this device's driver.
        unsafe { self.device.driver.stream_synchronize(self.raw) }.expect("synchronizing a stream");
    }
}

impl Drop for Stream<'_> {
    fn drop(&mut self) {
        // SAFETY: a live stream made by this driver, not used after this.
        let _ = unsafe { self.device.driver.stream_destroy(self.raw) };
    }
}

impl fmt::Debug for Stream<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Stream({:p})", self.raw)
    }
}

/// A pool of a [`Device`], destroyed on drop.
pub struct Pool<'d> {
    device: &'d Device,
    /// The raw handle.
    pub raw: CUmemoryPool,
}

impl Drop for Pool<'_> {
    fn drop(&mut self) {
        // SAFETY: a live pool made by this driver, not used after this. Allocations still
        // outstanding keep their memory until freed, as cuMemPoolDestroy documents.
        let _ = unsafe { self.device.driver.mem_pool_destroy(self.raw) };
    }
}

impl fmt::Debug for Pool<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pool({:p})", self.raw)
    }
}

/// An event of a [`Device`], destroyed on drop.
pub struct Event<'d> {
    device: &'d Device,
    /// The raw handle.
    pub raw: CUevent,
}

impl Drop for Event<'_> {
    fn drop(&mut self) {
        // SAFETY: a live event made by this driver, not used after this.
        let _ = unsafe { self.device.driver.event_destroy(self.raw) };
    }
}

impl fmt::Debug for Event<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Event({:p})", self.raw)
    }
}

/// A value observed about the device.
#[derive(Clone, Debug, PartialEq)]
pub enum Fact {
    /// A byte count.
    Bytes(u64),
    /// A plain number.
    Number(f64),
    /// Yes or no.
    Bool(bool),
    /// Text.
    Text(String),
}

impl Fact {
    fn json(&self) -> String {
        match self {
            Fact::Bytes(bytes) => bytes.to_string(),
            Fact::Number(number) => number.to_string(),
            Fact::Bool(value) => value.to_string(),
            Fact::Text(text) => json_string(text),
        }
    }
}

fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Records an observed fact: printed, and appended as a JSON line to the file named by
/// `STEPPOOL_FACTS` when it is set (GPU runs commit that file under `benches/results/`).
pub fn record_fact(driver: &Driver, name: &str, value: Fact) {
    let line = format!(
        "{{\"fact\":{},\"value\":{},\"driver\":{}}}",
        json_string(name),
        value.json(),
        json_string(&driver.describe())
    );
    println!("fact {line}");
    if let Ok(path) = std::env::var("STEPPOOL_FACTS") {
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            // One write per line: tests run on threads, and appends of one write each do not
            // interleave (`writeln!` may write the line and its newline apart).
            .and_then(|mut file| file.write_all(format!("{line}\n").as_bytes()));
        if let Err(error) = appended {
            eprintln!("could not append to STEPPOOL_FACTS={path}: {error}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_render_as_json() {
        assert_eq!(Fact::Text("a \"b\"\n".into()).json(), r#""a \"b\"\u000a""#);
        assert_eq!(Fact::Bytes(2 << 20).json(), "2097152");
        assert_eq!(Fact::Bool(false).json(), "false");
    }
}
