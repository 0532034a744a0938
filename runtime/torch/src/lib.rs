//! steppool as PyTorch's CUDA allocator: a shared library whose C functions
//! `torch.cuda.memory.CUDAPluggableAllocator` loads, over one process-wide steppool
//! [`Runtime`](steppool::Runtime), and the calls the Python package `steppool` makes through
//! ctypes (phases, steps, telemetry). Every behaviour is the runtime's public API; this crate
//! translates arguments and errors and keeps nothing the runtime already knows.
//!
//! # The functions PyTorch calls
//!
//! - `void* steppool_torch_alloc(ssize_t size, int device, cudaStream_t stream)`: `size` bytes
//!   on `device`, in `stream`'s order, in the calling thread's current phase (the persistent
//!   phase `untagged` outside every phase). `NULL` when the allocation cannot be served; PyTorch
//!   then raises its out-of-memory error, and the reason stays readable
//!   (`steppool_torch_telemetry_json`'s `last_failure`, with the OOM report and its verdict).
//!   Zero bytes is `NULL` without an error; a negative size is `NULL` and an error.
//! - `void steppool_torch_free(void* ptr, ssize_t size, int device, cudaStream_t stream)`:
//!   `NULL` is ignored; a pointer steppool does not hold, or a size other than the allocated one,
//!   is refused (nothing is freed) and kept as the thread's last error; a stream other than the
//!   allocation's is waited for before the memory is reused.
//! - The optional hooks of PyTorch's `CUDAPluggableAllocator` whose signatures are plain C (a C++
//!   embedding registers them with `set_reset_fn`, `set_memory_fraction_fn`,
//!   `set_record_stream_fn`, `set_init_fn`; the Python package calls them itself):
//!   `steppool_torch_empty_cache(void)`, `steppool_torch_set_memory_fraction(double, int)`,
//!   `steppool_torch_record_stream(void*, cudaStream_t)`, `steppool_torch_init_devices(int)`.
//!   The graph-capture hooks (`beginAllocateToPool`, `endAllocateToPool`, `releasePool`) take a
//!   `std::pair` and a `std::function`, which no C function can receive; CUDA graph capture is not
//!   supported.
//!
//! # Contract
//!
//! Streams handed in are streams of the device's primary context that live as long as the
//! process (PyTorch's pooled streams and the default stream do), or the special handles. Memory
//! is used in its stream's order, or on other streams recorded with the record-stream hook. A
//! tensor of a step-scoped phase does not outlive its step: the step's end releases it (in
//! checked mode, on by default, its late free is reported as a use after release, not a crash),
//! unless the phase carries (`steppool_torch_phase_declare`): then it may live until the next
//! step's end.
//!
//! # Errors
//!
//! No panic crosses the boundary: every function runs inside `catch_unwind`. A failed call
//! returns its failure value (`NULL`, `-1`) and keeps the error as the calling thread's last
//! error: `steppool_torch_last_error_json` gives it with its numbers.
//!
//! # Device
//!
//! The real driver or the simulated device, as everywhere in steppool: `STEPPOOL_DEVICE`
//! (`auto` when unset: the GPU when one answers, else the simulated device, said once on
//! stderr), or the `device` key of `steppool_torch_init`'s configuration.

mod error;
mod state;

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_double, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use steppool::sys::CUstream;
use steppool::{Scope, Strategy};

use crate::error::{Result, TorchError};
use crate::state::{Config, Threads, Torch, parse_scope, parse_strategy};

thread_local! {
    /// The calling thread's last error, as JSON.
    static LAST_ERROR: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn set_last_error(error: &TorchError) {
    let text = error.to_json().to_string();
    LAST_ERROR.with(|last| *last.borrow_mut() = Some(text));
}

/// Runs `body` inside `catch_unwind`: its value on success; `failed` on an error or a panic,
/// keeping the error as the thread's last.
fn boundary<T>(failed: T, body: impl FnOnce() -> Result<T>) -> T {
    let error = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => return value,
        Ok(Err(error)) => error,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            TorchError::Panic(message)
        }
    };
    // Writing the error cannot unwind past here: a panic while formatting is caught too.
    let _ = catch_unwind(AssertUnwindSafe(|| set_last_error(&error)));
    failed
}

/// Reads a C string argument.
///
/// # Safety
///
/// `text` is null or points to a NUL-terminated string that stays valid for the call.
unsafe fn text<'a>(text: *const c_char, what: &str) -> Result<&'a str> {
    if text.is_null() {
        return Err(TorchError::Invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null, and NUL-terminated and valid by the caller's contract.
    unsafe { CStr::from_ptr(text) }.to_str().map_err(|_| TorchError::Invalid(format!("{what} is not UTF-8")))
}

/// Hands a string to C; the caller frees it with [`steppool_torch_string_free`].
fn c_string(text: String) -> *mut c_char {
    // JSON and the texts here never hold NUL; one that did would become an empty string.
    CString::new(text).unwrap_or_default().into_raw()
}

/// Initialises steppool with a JSON configuration (NULL or `""` for the defaults): `strategy`
/// of step-scoped phases (`planned`, default; `arena`, `direct`, `chunked`),
/// `persistent_strategy` (`chunked`, default, or the others), `device` (`auto`, `cuda`, `sim`;
/// default `STEPPOOL_DEVICE`, else `auto`), `checked` (default true), `record_history` (events
/// of allocation history to keep, default 0). Returns 0, or -1 if the configuration is refused
/// or steppool is already initialised (a first allocation initialises it with the defaults).
///
/// # Safety
///
/// `config` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn steppool_torch_init(config: *const c_char) -> c_int {
    boundary(-1, || {
        let config = if config.is_null() {
            Config::default()
        } else {
            // SAFETY: the caller's contract.
            Config::from_json(unsafe { text(config, "the configuration") }?)?
        };
        Torch::init(config, true).map(|_| 0)
    })
}

/// PyTorch's `init_fn` hook: initialises steppool with the defaults unless it already is.
/// `device_count` is PyTorch's; steppool asks the driver itself.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_init_devices(_device_count: c_int) {
    boundary((), || Torch::get().map(|_| ()))
}

/// PyTorch's `alloc_fn`: `size` bytes on `device` in `stream`'s order, in the calling thread's
/// phase; NULL when it cannot be served (the reason: the thread's last error, and the
/// telemetry's `last_failure`).
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_alloc(size: isize, device: c_int, stream: CUstream) -> *mut c_void {
    boundary(std::ptr::null_mut(), || {
        let ptr = Torch::get()?.alloc(size as i64, i64::from(device), stream)?;
        Ok(ptr as *mut c_void)
    })
}

/// PyTorch's `free_fn`: frees `ptr`, allocated with `size` bytes on `device` and `stream`. NULL
/// is ignored; an unknown pointer or a wrong size is refused and kept as the thread's last error.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_free(ptr: *mut c_void, size: isize, device: c_int, stream: CUstream) {
    boundary((), || Torch::get()?.free(ptr as u64, size as i64, i64::from(device), stream))
}

/// PyTorch's `reset_fn` (`torch.cuda.empty_cache()`): synchronizes every device and gives back
/// what steppool's pools hold without live data.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_empty_cache() {
    boundary((), || Torch::get()?.empty_cache().map(drop))
}

/// [`steppool_torch_empty_cache`] returning the bytes released, or -1.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_release_idle() -> i64 {
    boundary(-1, || Ok(i64::try_from(Torch::get()?.empty_cache()?).unwrap_or(i64::MAX)))
}

/// PyTorch's `memory_fraction_fn`: allocations on `device` fail once its pools would reserve
/// more than `fraction` (0 to 1) of its memory. An invalid fraction or device is kept as the
/// thread's last error.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_set_memory_fraction(fraction: c_double, device: c_int) {
    boundary((), || Torch::get()?.set_memory_fraction(fraction, i64::from(device)))
}

/// PyTorch's `record_stream_fn`: work on `stream` uses `ptr`; its free waits for that work.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_record_stream(ptr: *mut c_void, stream: CUstream) {
    boundary((), || Torch::get()?.record_stream(ptr as u64, stream))
}

/// Enters phase `name` on the calling thread: its allocations go there until the matching
/// [`steppool_torch_phase_leave`]. A new name is declared with `scope` (`persistent`, `step`,
/// `micro_step`) and `strategy` (NULL: the one `init` chose for the scope). Returns 0 or -1.
///
/// # Safety
///
/// `name` and `scope` are NUL-terminated strings; `strategy` is NULL or one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn steppool_torch_phase_enter(
    name: *const c_char,
    scope: *const c_char,
    strategy: *const c_char,
) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { enter_phase(name, scope, strategy, Threads::Current) }
}

/// Enters phase `name` as [`steppool_torch_phase_enter`] does, and for every thread that has
/// entered no phase of its own while it is open: autograd's backward threads, which run the
/// backward pass of a `loss.backward()` called inside it. A thread that enters a phase of its own
/// allocates there instead. Returns 0 or -1.
///
/// # Safety
///
/// As for [`steppool_torch_phase_enter`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn steppool_torch_phase_enter_all_threads(
    name: *const c_char,
    scope: *const c_char,
    strategy: *const c_char,
) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { enter_phase(name, scope, strategy, Threads::All) }
}

/// Enters a phase for `threads`: the body of the two functions above.
///
/// # Safety
///
/// As for [`steppool_torch_phase_enter`].
unsafe fn enter_phase(name: *const c_char, scope: *const c_char, strategy: *const c_char, threads: Threads) -> c_int {
    boundary(-1, || {
        // SAFETY: the caller's contract, for the three strings.
        let (name, scope, strategy) = unsafe { phase_args(name, scope, strategy) }?;
        Torch::get()?.phase_enter(name, scope, strategy, threads).map(|_| 0)
    })
}

/// A phase's name, scope and strategy (NULL: none) as the C functions take them.
///
/// # Safety
///
/// `name` and `scope` are NUL-terminated strings; `strategy` is NULL or one.
unsafe fn phase_args<'a>(
    name: *const c_char,
    scope: *const c_char,
    strategy: *const c_char,
) -> Result<(&'a str, Scope, Option<Strategy>)> {
    // SAFETY: the caller's contract, for the three strings.
    let (name, scope) = unsafe { (text(name, "the phase name")?, text(scope, "the scope")?) };
    let strategy = match strategy.is_null() {
        true => None,
        // SAFETY: the caller's contract.
        false => Some(parse_strategy(unsafe { text(strategy, "the strategy") }?)?),
    };
    Ok((name, parse_scope(scope)?, strategy))
}

/// Declares phase `name` without entering it, or changes an existing one's spec before its first
/// allocation: `scope` and `strategy` as [`steppool_torch_phase_enter`] takes them, and `carry`
/// (non-zero: the allocations a step leaves live are kept for the next step, which frees them;
/// gradients set to `None` by a `zero_grad()` between the forward and backward passes, or at the
/// loop's top). Returns 0 or -1 (a scope other than the existing one's, a phase that allocated
/// already, carrying asked of a phase that is not step-scoped).
///
/// # Safety
///
/// As for [`steppool_torch_phase_enter`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn steppool_torch_phase_declare(
    name: *const c_char,
    scope: *const c_char,
    strategy: *const c_char,
    carry: c_int,
) -> c_int {
    boundary(-1, || {
        // SAFETY: the caller's contract, for the three strings.
        let (name, scope, strategy) = unsafe { phase_args(name, scope, strategy) }?;
        Torch::get()?.declare_phase(name, scope, strategy, Some(carry != 0)).map(|_| 0)
    })
}

/// Leaves the phase the calling thread entered last. Returns 0, or -1 if it entered none.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_phase_leave() -> c_int {
    boundary(-1, || Torch::get()?.phase_leave().map(|()| 0))
}

/// The calling thread's current phase, as a string to free with [`steppool_torch_string_free`];
/// NULL on error.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_current_phase() -> *mut c_char {
    boundary(std::ptr::null_mut(), || Ok(c_string(Torch::get()?.current_phase_name())))
}

/// The step boundary: ends the active step, if any (releasing everything its step-scoped phases
/// still hold), and begins the next. Returns the new step's index, or -1.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_step() -> i64 {
    boundary(-1, || Ok(i64::try_from(Torch::get()?.step()?).unwrap_or(i64::MAX)))
}

/// Ends the active step without beginning another. Returns 0, or -1 (no active step).
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_end_step() -> c_int {
    boundary(-1, || Torch::get()?.end_step().map(|()| 0))
}

/// Everything the telemetry shows, as a JSON object (see the Python package's
/// `steppool.torch.telemetry`), to free with [`steppool_torch_string_free`]; NULL on error.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_telemetry_json() -> *mut c_char {
    boundary(std::ptr::null_mut(), || Ok(c_string(Torch::get()?.telemetry()?.to_string())))
}

/// Starts recording the allocation history afresh, keeping the most recent `max_events`.
/// Returns 0, or -1.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_start_recording(max_events: u64) -> c_int {
    boundary(-1, || {
        Torch::get()?.start_recording(usize::try_from(max_events).unwrap_or(usize::MAX));
        Ok(0)
    })
}

/// Writes the recorded allocation history to `path` as a PyTorch memory snapshot pickle (for
/// `torch.cuda._memory_viz` and pytorch.org/memory_viz). Returns 0, or -1 (nothing recorded, the
/// file could not be written).
///
/// # Safety
///
/// `path` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn steppool_torch_write_snapshot(path: *const c_char) -> c_int {
    // SAFETY: the caller's contract.
    boundary(-1, || Torch::get()?.write_snapshot(unsafe { text(path, "the snapshot path") }?).map(|()| 0))
}

/// Serves Prometheus metrics at `GET /metrics` on `addr` (`host:port`; port 0 picks a free one)
/// until [`steppool_torch_stop_metrics`]. Returns the port, or -1.
///
/// # Safety
///
/// `addr` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn steppool_torch_serve_metrics(addr: *const c_char) -> c_int {
    // SAFETY: the caller's contract.
    boundary(-1, || Torch::get()?.serve_metrics(unsafe { text(addr, "the address") }?).map(c_int::from))
}

/// Stops the metrics server, if one runs.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_stop_metrics() {
    boundary((), || Torch::get().map(Torch::stop_metrics))
}

/// The calling thread's last error as a JSON object (`kind`, `message`, and its numbers), to
/// free with [`steppool_torch_string_free`]; NULL if there was none. Reading it clears it.
#[unsafe(no_mangle)]
pub extern "C" fn steppool_torch_last_error_json() -> *mut c_char {
    boundary(std::ptr::null_mut(), || {
        Ok(LAST_ERROR.with(|last| last.borrow_mut().take()).map_or(std::ptr::null_mut(), c_string))
    })
}

/// Frees a string this library returned. NULL is ignored.
///
/// # Safety
///
/// `text` is NULL or a string this library returned, not freed before.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn steppool_torch_string_free(text: *mut c_char) {
    if !text.is_null() {
        // SAFETY: the caller's contract: it came from `CString::into_raw` here, once.
        drop(unsafe { CString::from_raw(text) });
    }
}
