//! A training loop written against cudarc, with steppool as its allocator: weights, activations
//! and gradients are steppool buffers that cudarc's launches and copies use through typed views,
//! the repository's PTX fill kernel (`sys/kernels/fill_bytes.ptx`) writes them, cudarc's own
//! scratch allocations are routed into the workspace phase, and every step ends with its report.
//!
//! ```text
//! cargo run --example cudarc_trainer -- [--steps 4]
//! ```
//!
//! With a GPU (or `STEPPOOL_DEVICE=cuda`) it uses the real `libcuda`. Without one it opens the
//! libcuda stand-in `sys/libcuda-sim` (built beside the example, as its dependency) before cudarc
//! loads anything, so cudarc and the runtime share one simulated device. The stand-in's memory is
//! backed by host memory and it runs the fill kernel at launch (it recognizes the PTX exactly;
//! other kernels are checked and ordered, not run), so the values read back are real on both.

use std::error::Error;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, DevicePtrMut, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use steppool::interop::cudarc::{CudaBuffer, StreamPair, route_allocations};
use steppool::sys::{CudaLibrary, Driver, Selection, kernels};
use steppool::{Phase, Runtime};

const MIB: u64 = 1 << 20;
const STAND_IN: &str = "libsteppool_libcuda_sim.so";

/// The real driver, or the stand-in opened by path (cudarc then finds it by its soname).
fn driver() -> Result<Driver, Box<dyn Error>> {
    match Selection::from_env_or(Selection::Auto)? {
        Selection::Cuda => return Ok(Driver::cuda()?),
        Selection::Auto => match Driver::cuda() {
            Ok(driver) => return Ok(driver),
            Err(why) => eprintln!("no CUDA device answered ({why}); using the simulated device through {STAND_IN}"),
        },
        Selection::Sim => {}
    }
    let exe = std::env::current_exe()?;
    let folder = exe.parent().ok_or("the example has no folder")?;
    let path = [folder.join(STAND_IN), folder.join("../deps").join(STAND_IN), folder.join("..").join(STAND_IN)]
        .into_iter()
        .find(|path| path.is_file())
        .map_or_else(|| Err(format!("{STAND_IN} not found near {}", exe.display())), Ok::<PathBuf, String>)?;
    // SAFETY: the stand-in is this workspace's own library, whose entry points have the
    // driver's signatures; opening it runs nothing but Rust's initialization.
    let library = unsafe { CudaLibrary::open_path(&path) }?;
    Ok(Driver::from_library(library)?)
}

/// Fills `view` with `value` with the PTX kernel, launched by cudarc on `stream`.
fn fill(
    stream: &Arc<CudaStream>,
    kernel: &CudaFunction,
    view: &mut CudaBuffer<'_, u8>,
    value: u8,
) -> Result<(), Box<dyn Error>> {
    let len = view.buffer().len();
    let value = u32::from(value);
    let (ptr, _record) = view.device_ptr_mut(stream);
    let mut launch = stream.launch_builder(kernel);
    launch.arg(&ptr).arg(&len).arg(&value);
    // SAFETY: `fill_bytes(u8 *dst, u64 len, u32 value)` gets a pointer to `len` live bytes (the
    // view keeps its buffer alive, and `_record` orders the launch before any later free), the
    // length and the value; the grid-stride loop covers any length with this shape.
    unsafe { launch.launch(LaunchConfig { grid_dim: (32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }) }?;
    Ok(())
}

/// Reads `view` back with cudarc and checks every byte.
fn check(stream: &Arc<CudaStream>, view: &CudaBuffer<'_, u8>, value: u8) -> Result<(), Box<dyn Error>> {
    let bytes = stream.clone_dtoh(view)?;
    match bytes.iter().position(|&byte| byte != value) {
        None => Ok(()),
        Some(at) => Err(format!("byte {at} of {} is {:#x}, not {value:#x}", bytes.len(), bytes[at]).into()),
    }
}

fn run(steps: u32) -> Result<(), Box<dyn Error>> {
    let driver = driver()?;
    let stand_in = driver.library().is_some_and(|library| library.path().ends_with(STAND_IN));
    let note = if stand_in { " — the libcuda stand-in: steppool's simulated device, host-backed" } else { "" };
    println!("device: {}{note}", driver.describe());
    let runtime = Runtime::with_driver(driver)?;
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let device = runtime.device(0)?;
    // SAFETY: `pair` lives to the end of `run`, after every buffer made on its steppool half.
    let pair = unsafe { StreamPair::from_cudarc(&device, &stream) }?;
    let module = ctx.load_module(Ptx::from_src(kernels::FILL_BYTES_PTX.to_str()?))?;
    let kernel = module.load_function(kernels::FILL_BYTES.to_str()?)?;

    let mut weights = pair.view::<u8>(runtime.alloc(Phase::WEIGHTS, 8 * MIB, pair.steppool())?)?;
    fill(&stream, &kernel, &mut weights, 0x11)?;
    let mut checked = 8 * MIB;
    for index in 0..steps {
        let step = runtime.begin_step()?;
        // Sequence lengths vary from step to step, and so do the activations.
        let activations = (4 + 2 * u64::from(index % 3)) * MIB;
        let mut acts = pair.view::<u8>(step.alloc(Phase::ACTIVATIONS, activations, pair.steppool())?)?;
        let mut grads = pair.view::<u8>(step.alloc(Phase::GRADIENTS, 8 * MIB, pair.steppool())?)?;
        fill(&stream, &kernel, &mut acts, index as u8 + 1)?;
        fill(&stream, &kernel, &mut grads, 0xF0)?;
        {
            // cudarc's own allocations (a framework's scratch) land in the workspace phase.
            let route = route_allocations(&runtime, Phase::WORKSPACE, pair.steppool())?;
            let scratch = stream.alloc_zeros::<f32>(256 * 1024)?;
            let zeros = stream.clone_dtoh(&scratch)?;
            if zeros.iter().any(|&x| x != 0.0) {
                return Err("a zeroed scratch buffer read back non-zero".into());
            }
            drop(scratch);
            route.end()?;
        }
        check(&stream, &acts, index as u8 + 1)?;
        check(&stream, &grads, 0xF0)?;
        checked += activations + 8 * MIB;
        drop((acts, grads));
        let report = step.end()?;
        println!("{report}");
    }
    check(&stream, &weights, 0x11)?;
    drop(weights);
    let errors = runtime.take_errors();
    if !errors.is_empty() {
        return Err(format!("the runtime recorded errors: {errors:?}").into());
    }
    println!(
        "{steps} steps: every byte the fill kernel wrote read back through cudarc ({} MiB checked)",
        checked / MIB
    );
    Ok(())
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut steps = 4;
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--steps", Some(value)) if value.parse::<u32>().is_ok() => steps = value.parse().unwrap_or(steps),
            _ => {
                eprintln!("usage: cudarc_trainer [--steps N]");
                return ExitCode::from(2);
            }
        }
    }
    match run(steps) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("cudarc_trainer: {error}");
            ExitCode::FAILURE
        }
    }
}
