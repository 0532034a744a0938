//! The C ABI through its exported symbols: the built `libsteppool_torch.so` opened with
//! libloading, as PyTorch opens it, on the simulated device. Allocation and free, bad sizes,
//! null and unknown pointers, frees on another stream, out of memory and its verdict, steps,
//! phases that carry memory into the next step, several threads in their own phases, and the
//! telemetry, snapshot and metrics exports.
//!
//! The library is one process-wide runtime, so the tests take turns (`serial`) and read the
//! counters as differences.

use std::ffi::{CStr, CString, c_char, c_double, c_int, c_void};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::{Barrier, Mutex, MutexGuard, OnceLock};

use serde_json::Value;

type Alloc = unsafe extern "C" fn(isize, c_int, *mut c_void) -> *mut c_void;
type Free = unsafe extern "C" fn(*mut c_void, isize, c_int, *mut c_void);

/// The exported functions, resolved once.
struct Lib {
    init: unsafe extern "C" fn(*const c_char) -> c_int,
    alloc: Alloc,
    free: Free,
    phase_enter: unsafe extern "C" fn(*const c_char, *const c_char, *const c_char) -> c_int,
    phase_enter_all_threads: unsafe extern "C" fn(*const c_char, *const c_char, *const c_char) -> c_int,
    phase_declare: unsafe extern "C" fn(*const c_char, *const c_char, *const c_char, c_int) -> c_int,
    phase_leave: unsafe extern "C" fn() -> c_int,
    current_phase: unsafe extern "C" fn() -> *mut c_char,
    step: unsafe extern "C" fn() -> i64,
    telemetry: unsafe extern "C" fn() -> *mut c_char,
    last_error: unsafe extern "C" fn() -> *mut c_char,
    string_free: unsafe extern "C" fn(*mut c_char),
    record_stream: unsafe extern "C" fn(*mut c_void, *mut c_void),
    set_memory_fraction: unsafe extern "C" fn(c_double, c_int),
    release_idle: unsafe extern "C" fn() -> i64,
    start_recording: unsafe extern "C" fn(u64) -> c_int,
    write_snapshot: unsafe extern "C" fn(*const c_char) -> c_int,
    serve_metrics: unsafe extern "C" fn(*const c_char) -> c_int,
    stop_metrics: unsafe extern "C" fn(),
}

/// The null stream and `CU_STREAM_PER_THREAD`: two streams every context has.
const STREAM_A: *mut c_void = std::ptr::null_mut();
const STREAM_B: *mut c_void = 2 as *mut c_void;
const MIB: isize = 1 << 20;

fn library_path() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let deps = exe.parent().expect("the test executable's folder");
    // Integration tests live in target/<profile>/deps, where cargo also puts the cdylib.
    [deps.join("libsteppool_torch.so"), deps.join("../libsteppool_torch.so")]
        .into_iter()
        .find(|path| path.exists())
        .unwrap_or_else(|| panic!("libsteppool_torch.so not found beside {}", exe.display()))
}

fn lib() -> &'static Lib {
    static LIB: OnceLock<Lib> = OnceLock::new();
    LIB.get_or_init(|| {
        // SAFETY: the library is this crate's own build; its initialisers only set up statics.
        let library =
            Box::leak(Box::new(unsafe { libloading::Library::new(library_path()) }.expect("open the cdylib")));
        macro_rules! symbol {
            ($name:literal) => {
                // SAFETY: each symbol has the type of its `extern "C"` definition in src/lib.rs.
                *unsafe { library.get(concat!($name, "\0").as_bytes()) }.expect($name)
            };
        }
        let lib = Lib {
            init: symbol!("steppool_torch_init"),
            alloc: symbol!("steppool_torch_alloc"),
            free: symbol!("steppool_torch_free"),
            phase_enter: symbol!("steppool_torch_phase_enter"),
            phase_enter_all_threads: symbol!("steppool_torch_phase_enter_all_threads"),
            phase_declare: symbol!("steppool_torch_phase_declare"),
            phase_leave: symbol!("steppool_torch_phase_leave"),
            current_phase: symbol!("steppool_torch_current_phase"),
            step: symbol!("steppool_torch_step"),
            telemetry: symbol!("steppool_torch_telemetry_json"),
            last_error: symbol!("steppool_torch_last_error_json"),
            string_free: symbol!("steppool_torch_string_free"),
            record_stream: symbol!("steppool_torch_record_stream"),
            set_memory_fraction: symbol!("steppool_torch_set_memory_fraction"),
            release_idle: symbol!("steppool_torch_release_idle"),
            start_recording: symbol!("steppool_torch_start_recording"),
            write_snapshot: symbol!("steppool_torch_write_snapshot"),
            serve_metrics: symbol!("steppool_torch_serve_metrics"),
            stop_metrics: symbol!("steppool_torch_stop_metrics"),
        };
        let config = CString::new(r#"{"device": "sim", "strategy": "planned", "checked": true}"#).unwrap();
        // SAFETY: a NUL-terminated string.
        assert_eq!(unsafe { (lib.init)(config.as_ptr()) }, 0, "init: {:?}", lib.last_error());
        lib
    })
}

/// Takes the library for one test: the counters and the step are process-wide.
fn serial() -> (MutexGuard<'static, ()>, &'static Lib) {
    static SERIAL: Mutex<()> = Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    (guard, lib())
}

impl Lib {
    fn take_string(&self, text: *mut c_char) -> Option<String> {
        if text.is_null() {
            return None;
        }
        // SAFETY: a NUL-terminated string from the library, freed right after.
        let owned = unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned();
        // SAFETY: returned by the library, freed once.
        unsafe { (self.string_free)(text) };
        Some(owned)
    }

    fn last_error(&self) -> Option<Value> {
        // SAFETY: no arguments.
        let text = self.take_string(unsafe { (self.last_error)() })?;
        Some(serde_json::from_str(&text).expect("the last error is JSON"))
    }

    fn telemetry(&self) -> Value {
        // SAFETY: no arguments.
        let text = self.take_string(unsafe { (self.telemetry)() }).expect("telemetry");
        serde_json::from_str(&text).expect("the telemetry is JSON")
    }

    fn counter(&self, name: &str) -> u64 {
        self.telemetry()["counters"][name].as_u64().expect(name)
    }

    fn phase(&self, name: &str) -> Value {
        let telemetry = self.telemetry();
        let phases = telemetry["phases"].as_array().expect("phases");
        phases.iter().find(|p| p["phase"] == name).cloned().unwrap_or(Value::Null)
    }

    fn used(&self, phase: &str) -> u64 {
        self.phase(phase)["used_bytes"].as_u64().unwrap_or(0)
    }

    fn enter(&self, name: &str, scope: &str) {
        let (name, scope) = (CString::new(name).unwrap(), CString::new(scope).unwrap());
        // SAFETY: NUL-terminated strings and a NULL strategy.
        let code = unsafe { (self.phase_enter)(name.as_ptr(), scope.as_ptr(), std::ptr::null()) };
        assert_eq!(code, 0, "phase_enter: {:?}", self.last_error());
    }

    /// Enters `name` for every thread without a phase of its own.
    fn enter_all_threads(&self, name: &str, scope: &str) {
        let (name, scope) = (CString::new(name).unwrap(), CString::new(scope).unwrap());
        // SAFETY: NUL-terminated strings and a NULL strategy.
        let code = unsafe { (self.phase_enter_all_threads)(name.as_ptr(), scope.as_ptr(), std::ptr::null()) };
        assert_eq!(code, 0, "phase_enter_all_threads: {:?}", self.last_error());
    }

    /// Declares `name` carrying (or not); the call's return value.
    fn declare(&self, name: &str, scope: &str, carry: bool) -> c_int {
        let (name, scope) = (CString::new(name).unwrap(), CString::new(scope).unwrap());
        // SAFETY: NUL-terminated strings and a NULL strategy.
        unsafe { (self.phase_declare)(name.as_ptr(), scope.as_ptr(), std::ptr::null(), c_int::from(carry)) }
    }

    /// The released bytes of `phase` in the last step's report.
    fn released(&self, phase: &str) -> Option<u64> {
        let report = &self.telemetry()["last_step"];
        let phases = report["phases"].as_array()?;
        phases.iter().find(|p| p["phase"] == phase)?["released_bytes"].as_u64()
    }

    /// The calling thread's phase.
    fn current(&self) -> String {
        // SAFETY: no arguments; the string is taken and freed.
        self.take_string(unsafe { (self.current_phase)() }).expect("a phase")
    }

    fn leave(&self) {
        // SAFETY: no arguments.
        assert_eq!(unsafe { (self.phase_leave)() }, 0, "phase_leave: {:?}", self.last_error());
    }

    fn alloc(&self, size: isize, stream: *mut c_void) -> *mut c_void {
        // SAFETY: the ABI takes any values; the stream is one every context has.
        unsafe { (self.alloc)(size, 0, stream) }
    }

    fn free(&self, ptr: *mut c_void, size: isize, stream: *mut c_void) {
        // SAFETY: as for `alloc`; the pointer is not used afterwards.
        unsafe { (self.free)(ptr, size, 0, stream) }
    }
}

#[test]
fn alloc_and_free_land_in_the_threads_phase() {
    let (_serial, lib) = serial();
    lib.enter("abi_basic", "persistent");
    let before = lib.counter("allocations");
    let ptr = lib.alloc(3 * MIB, STREAM_A);
    assert!(!ptr.is_null(), "{:?}", lib.last_error());
    assert_eq!(lib.used("abi_basic"), 3 << 20);
    assert_eq!(lib.phase("abi_basic")["scope"], "persistent");
    assert_eq!(lib.counter("allocations"), before + 1);
    lib.free(ptr, 3 * MIB, STREAM_A);
    assert_eq!(lib.last_error(), None);
    assert_eq!(lib.used("abi_basic"), 0);
    lib.leave();
    // Outside every phase: the persistent phase `untagged`.
    // SAFETY: no arguments.
    assert_eq!(lib.take_string(unsafe { (lib.current_phase)() }).as_deref(), Some("untagged"));
    let ptr = lib.alloc(MIB, STREAM_A);
    assert_eq!(lib.used("untagged"), 1 << 20);
    lib.free(ptr, MIB, STREAM_A);
    assert_eq!(lib.used("untagged"), 0);
    // Leaving more often than entering is an error, not a crash.
    // SAFETY: no arguments.
    assert_eq!(unsafe { (lib.phase_leave)() }, -1);
    assert_eq!(lib.last_error().unwrap()["kind"], "invalid");
}

#[test]
fn bad_sizes_and_devices_are_refused_with_their_numbers() {
    let (_serial, lib) = serial();
    lib.enter("abi_sizes", "persistent");
    assert!(lib.alloc(-5, STREAM_A).is_null());
    let error = lib.last_error().expect("an error for a negative size");
    assert_eq!((error["kind"].as_str(), error["size"].as_i64()), (Some("bad_size"), Some(-5)));

    // Zero bytes: NULL and no error, as PyTorch expects for an empty tensor.
    let zeros = lib.counter("zero_size_allocations");
    assert!(lib.alloc(0, STREAM_A).is_null());
    assert_eq!(lib.last_error(), None);
    assert_eq!(lib.counter("zero_size_allocations"), zeros + 1);

    // SAFETY: any values are accepted.
    assert!(unsafe { (lib.alloc)(MIB, 7, STREAM_A) }.is_null());
    let error = lib.last_error().unwrap();
    assert_eq!((error["kind"].as_str(), error["device"].as_i64()), (Some("bad_device"), Some(7)));
    assert_eq!(error["device_count"], lib.telemetry()["device_count"]);

    // A free with the wrong size, or a negative one, frees nothing.
    let refused = lib.counter("refused_frees");
    let ptr = lib.alloc(2 * MIB, STREAM_A);
    for size in [MIB, -1] {
        lib.free(ptr, size, STREAM_A);
        let error = lib.last_error().unwrap();
        assert_eq!(error["kind"], "size_mismatch");
        assert_eq!((error["size"].as_i64(), error["allocated_bytes"].as_u64()), (Some(size as i64), Some(2 << 20)));
        assert_eq!(lib.used("abi_sizes"), 2 << 20, "a refused free frees nothing");
    }
    assert_eq!(lib.counter("refused_frees"), refused + 2);
    lib.free(ptr, 2 * MIB, STREAM_A);
    assert_eq!((lib.last_error(), lib.used("abi_sizes")), (None, 0));

    // A memory fraction out of range is refused; a fraction in range limits the device.
    // SAFETY: any values are accepted.
    unsafe { (lib.set_memory_fraction)(1.5, 0) };
    assert_eq!(lib.last_error().unwrap()["fraction"], 1.5);
    // SAFETY: as above.
    unsafe { (lib.set_memory_fraction)(0.0, 0) };
    assert!(lib.alloc(MIB, STREAM_A).is_null());
    let error = lib.last_error().unwrap();
    assert_eq!((error["kind"].as_str(), error["allowed_bytes"].as_u64()), (Some("out_of_memory"), Some(0)));
    // SAFETY: as above.
    unsafe { (lib.set_memory_fraction)(1.0, 0) };
    let ptr = lib.alloc(MIB, STREAM_A);
    assert!(!ptr.is_null());
    lib.free(ptr, MIB, STREAM_A);
    lib.leave();
}

#[test]
fn null_unknown_and_released_pointers_are_defined() {
    let (_serial, lib) = serial();
    let nulls = lib.counter("null_frees");
    lib.free(std::ptr::null_mut(), 0, STREAM_A);
    lib.free(std::ptr::null_mut(), 64, STREAM_B);
    assert_eq!(lib.last_error(), None);
    assert_eq!(lib.counter("null_frees"), nulls + 2);

    lib.free(0xdead_0000 as *mut c_void, 64, STREAM_A);
    let error = lib.last_error().unwrap();
    assert_eq!((error["kind"].as_str(), error["ptr"].as_u64()), (Some("unknown_pointer"), Some(0xdead_0000)));

    // Freed twice: the second free is refused.
    lib.enter("abi_twice", "persistent");
    let ptr = lib.alloc(MIB, STREAM_A);
    lib.free(ptr, MIB, STREAM_A);
    assert_eq!(lib.last_error(), None);
    lib.free(ptr, MIB, STREAM_A);
    assert_eq!(lib.last_error().unwrap()["kind"], "unknown_pointer");
    lib.leave();

    // A tensor of a step-scoped phase that outlives its step: the step released it, and its late
    // free is reported with the step (checked mode), not honoured.
    // SAFETY: no arguments.
    let step = unsafe { (lib.step)() };
    assert!(step >= 0, "{:?}", lib.last_error());
    lib.enter("abi_step", "step");
    let ptr = lib.alloc(4 * MIB, STREAM_A);
    assert!(!ptr.is_null(), "{:?}", lib.last_error());
    lib.leave();
    // SAFETY: no arguments.
    assert_eq!(unsafe { (lib.step)() }, step + 1);
    let report = &lib.telemetry()["last_step"];
    let phase = report["phases"].as_array().unwrap().iter().find(|p| p["phase"] == "abi_step").unwrap();
    assert_eq!(phase["released_bytes"].as_u64(), Some(4 << 20));
    lib.free(ptr, 4 * MIB, STREAM_A);
    let error = lib.last_error().unwrap();
    assert_eq!(error["kind"], "use_after_release");
    assert_eq!((error["phase"].as_str(), error["step"].as_i64()), (Some("abi_step"), Some(step)));
}

#[test]
fn a_carrying_phase_keeps_what_a_step_leaves_until_the_next_one_ends() {
    let (_serial, lib) = serial();
    // Carrying is for step-scoped phases, before their first allocation.
    assert_eq!(lib.declare("abi_carry_persistent", "persistent", true), -1);
    let error = lib.last_error().unwrap();
    assert!(error["message"].as_str().unwrap().contains("cannot carry"), "{error}");
    assert_eq!(lib.declare("abi_carry", "step", true), 0, "{:?}", lib.last_error());
    // SAFETY: no arguments.
    let first = unsafe { (lib.step)() };
    assert!(first >= 0, "{:?}", lib.last_error());
    lib.enter("abi_carry", "step");
    let (gradient, kept) = (lib.alloc(4 * MIB, STREAM_A), lib.alloc(2 * MIB, STREAM_A));
    assert!(!gradient.is_null() && !kept.is_null(), "{:?}", lib.last_error());
    lib.leave();
    // SAFETY: no arguments.
    assert_eq!(unsafe { (lib.step)() }, first + 1);
    assert_eq!((lib.released("abi_carry"), lib.used("abi_carry")), (Some(0), 6 << 20), "kept for this step");
    // Freed in the next step, as a `zero_grad()` sets gradients to None: an ordinary free.
    lib.free(gradient, 4 * MIB, STREAM_A);
    assert_eq!(lib.last_error(), None);
    // What the next step does not free, its end releases.
    // SAFETY: no arguments.
    assert_eq!(unsafe { (lib.step)() }, first + 2);
    assert_eq!((lib.released("abi_carry"), lib.used("abi_carry")), (Some(2 << 20), 0));
    lib.free(kept, 2 * MIB, STREAM_A);
    assert_eq!(lib.last_error().unwrap()["kind"], "use_after_release");
    // The phase has allocated: its spec stays.
    assert_eq!(lib.declare("abi_carry", "step", false), -1);
}

#[test]
fn a_free_on_another_stream_waits_for_it_and_frees() {
    let (_serial, lib) = serial();
    lib.enter("abi_streams", "persistent");
    let other = lib.counter("other_stream_frees");
    let ptr = lib.alloc(MIB, STREAM_A);
    lib.free(ptr, MIB, STREAM_B);
    assert_eq!(lib.last_error(), None);
    assert_eq!(lib.counter("other_stream_frees"), other + 1);
    assert_eq!(lib.used("abi_streams"), 0);

    // The record-stream hook: the free on the allocation's own stream then waits for the other.
    let ptr = lib.alloc(MIB, STREAM_A);
    // SAFETY: a live pointer and a stream of the context.
    unsafe { (lib.record_stream)(ptr, STREAM_B) };
    assert_eq!(lib.last_error(), None);
    lib.free(ptr, MIB, STREAM_A);
    assert_eq!((lib.last_error(), lib.used("abi_streams")), (None, 0));
    // SAFETY: an unknown pointer is refused, not dereferenced.
    unsafe { (lib.record_stream)(0xbeef_0000 as *mut c_void, STREAM_B) };
    assert_eq!(lib.last_error().unwrap()["kind"], "unknown_pointer");
    lib.leave();
}

#[test]
fn out_of_memory_is_null_with_a_verdict() {
    let (_serial, lib) = serial();
    lib.enter("abi_oom", "persistent");
    let total = lib.telemetry()["devices"][0]["total_bytes"].as_u64().unwrap();
    // Two pieces fit, a third does not.
    let piece = isize::try_from(total / 3).unwrap() + MIB;
    let failed = lib.counter("failed_allocations");
    let mut held = Vec::new();
    let mut error = None;
    for _ in 0..8 {
        let ptr = lib.alloc(piece, STREAM_A);
        if ptr.is_null() {
            error = lib.last_error();
            break;
        }
        held.push(ptr);
    }
    let error = error.expect("a device of three pieces cannot hold eight larger ones");
    assert_eq!(held.len(), 2);
    assert_eq!(error["kind"], "out_of_memory");
    assert_eq!(error["requested_bytes"].as_i64(), Some(piece as i64));
    assert_eq!(error["verdict"], "demand");
    let failure = &lib.telemetry()["last_failure"];
    assert_eq!((failure["phase"].as_str(), failure["error"]["verdict"].as_str()), (Some("abi_oom"), Some("demand")));
    assert_eq!(lib.counter("failed_allocations"), failed + 1);
    for ptr in held {
        lib.free(ptr, piece, STREAM_A);
    }
    assert_eq!(lib.used("abi_oom"), 0);
    // SAFETY: no arguments.
    assert!(unsafe { (lib.release_idle)() } >= 0);
    lib.leave();
}

#[test]
fn threads_allocate_at_once_each_in_its_own_phase() {
    const THREADS: usize = 4;
    let (_serial, lib) = serial();
    let holding = Barrier::new(THREADS + 1);
    let checked = Barrier::new(THREADS + 1);
    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let (holding, checked) = (&holding, &checked);
            scope.spawn(move || {
                let name = format!("abi_thread_{thread}");
                lib.enter(&name, "persistent");
                let size = (thread as isize + 1) * MIB;
                let pointers: Vec<_> = (0..3).map(|_| lib.alloc(size, STREAM_A)).collect();
                // SAFETY: no arguments.
                let current = lib.take_string(unsafe { (lib.current_phase)() });
                // Assert only after the barriers, so a failure cannot leave the others waiting.
                holding.wait();
                checked.wait();
                let served = pointers.iter().all(|p| !p.is_null());
                for ptr in pointers.into_iter().filter(|p| !p.is_null()) {
                    lib.free(ptr, size, if thread % 2 == 0 { STREAM_A } else { STREAM_B });
                }
                lib.leave();
                assert!(served, "thread {thread}: an allocation failed");
                assert_eq!(current, Some(name));
                assert_eq!(lib.last_error(), None);
            });
        }
        // Every thread holds its allocations now: they were all live at once, each in its phase.
        holding.wait();
        let live: Vec<u64> = (0..THREADS).map(|thread| lib.used(&format!("abi_thread_{thread}"))).collect();
        checked.wait();
        let expected: Vec<u64> = (0..THREADS as u64).map(|thread| (3 * (thread + 1)) << 20).collect();
        assert_eq!(live, expected);
    });
    for thread in 0..THREADS {
        assert_eq!(lib.used(&format!("abi_thread_{thread}")), 0);
    }
}

#[test]
fn a_phase_for_all_threads_routes_threads_without_their_own() {
    // As autograd's backward thread allocates while the thread that called `loss.backward()` is
    // inside the phase: a helper thread, stepped through each state by the main thread.
    let (_serial, lib) = serial();
    let (to_helper, at_helper) = std::sync::mpsc::channel::<&str>();
    let (to_main, at_main) = std::sync::mpsc::channel::<(String, u64, u64)>();
    let helper = std::thread::spawn(move || {
        while let Ok(command) = at_helper.recv() {
            if command == "own" {
                lib.enter("abi_helper_own", "persistent");
            }
            let ptr = lib.alloc(MIB, STREAM_A);
            assert!(!ptr.is_null(), "{command}: {:?}", lib.last_error());
            let report = (lib.current(), lib.used("abi_all_threads"), lib.used("abi_helper_own"));
            lib.free(ptr, MIB, STREAM_A);
            if command == "own" {
                lib.leave();
            }
            to_main.send(report).unwrap();
        }
    });
    let ask = |command| {
        to_helper.send(command).unwrap();
        at_main.recv().unwrap()
    };
    assert_eq!(ask("plain"), ("untagged".to_owned(), 0, 0), "before the phase");
    // SAFETY: no arguments.
    assert!(unsafe { (lib.step)() } >= 0, "{:?}", lib.last_error());
    lib.enter_all_threads("abi_all_threads", "step");
    assert_eq!(lib.current(), "abi_all_threads");
    assert_eq!(ask("plain"), ("abi_all_threads".to_owned(), 1 << 20, 0), "inside, without a phase of its own");
    assert_eq!(ask("own"), ("abi_helper_own".to_owned(), 0, 1 << 20), "inside, with a phase of its own");
    // A phase for the current thread only, nested inside, routes nobody else.
    lib.enter("abi_main_only", "step");
    assert_eq!(ask("plain").0, "abi_all_threads", "a thread-only phase nested inside");
    lib.leave();
    lib.leave();
    assert_eq!(ask("plain"), ("untagged".to_owned(), 0, 0), "after the phase");
    drop(to_helper);
    helper.join().unwrap();
}

#[test]
fn snapshot_and_metrics_are_exported() {
    let (_serial, lib) = serial();
    // SAFETY: plain arguments.
    assert_eq!(unsafe { (lib.start_recording)(10_000) }, 0);
    lib.enter("abi_recorded", "persistent");
    let ptr = lib.alloc(MIB, STREAM_A);
    lib.free(ptr, MIB, STREAM_A);
    lib.leave();
    let path = std::env::temp_dir().join(format!("steppool-torch-abi-{}.pickle", std::process::id()));
    let c_path = CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { (lib.write_snapshot)(c_path.as_ptr()) }, 0, "{:?}", lib.last_error());
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(bytes.first(), Some(&0x80), "a pickle starts with its protocol opcode");

    let addr = CString::new("127.0.0.1:0").unwrap();
    // SAFETY: a NUL-terminated address.
    let port = unsafe { (lib.serve_metrics)(addr.as_ptr()) };
    assert!(port > 0, "{:?}", lib.last_error());
    let mut connection = std::net::TcpStream::connect(("127.0.0.1", port as u16)).unwrap();
    connection.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    connection.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("abi_recorded"), "the phase is among the metrics");
    // SAFETY: no arguments.
    unsafe { (lib.stop_metrics)() };

    // A second init is refused with the configuration in force.
    // SAFETY: NULL asks for the defaults.
    assert_eq!(unsafe { (lib.init)(std::ptr::null()) }, -1);
    let error = lib.last_error().unwrap();
    assert_eq!(error["kind"], "already_initialised");
    assert!(error["message"].as_str().unwrap().contains("strategy planned"), "{error}");
}

#[test]
fn the_devices_peak_counts_memory_two_phases_took_turns_with_once() {
    let (_serial, lib) = serial();
    // Two persistent phases (chunked ranges on the simulated device) take turns with 64 MiB:
    // the first one's freed pages go back before the second maps its own.
    lib.enter("abi_turn_a", "persistent");
    let first = lib.alloc(64 * MIB, STREAM_A);
    assert!(!first.is_null(), "{:?}", lib.last_error());
    lib.free(first, 64 * MIB, STREAM_A);
    lib.leave();
    lib.enter("abi_turn_b", "persistent");
    let second = lib.alloc(64 * MIB, STREAM_A);
    assert!(!second.is_null(), "{:?}", lib.last_error());
    let telemetry = lib.telemetry();
    let reserved = |phase: &str| lib.phase(phase)["reserved_bytes"].as_u64().unwrap();
    assert_eq!(reserved("abi_turn_a"), 0, "the first phase gave its pages back");
    assert!(reserved("abi_turn_b") >= 64 << 20);
    let device = &telemetry["devices"][0];
    let (peak, mapped) =
        (device["reserved_high_bytes"].as_u64().unwrap(), device["mapped_high_bytes"].as_u64().unwrap());
    assert!(mapped >= 64 << 20 && peak >= mapped, "the device's mark of mapped pages is in its peak: {device}");
    lib.free(second, 64 * MIB, STREAM_A);
    lib.leave();
}
