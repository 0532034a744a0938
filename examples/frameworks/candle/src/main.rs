//! candle with steppool as its CUDA allocator: a small MLP trains for a few steps of varying batch
//! size, with candle's own CUDA allocations routed into steppool phases — the weights into the
//! persistent `weights` phase, each step's forward pass into `activations`, its backward pass and
//! update into `gradients` — and every step ends with steppool's report.
//!
//! ```text
//! cargo run --release --manifest-path examples/frameworks/candle/Cargo.toml -- [--steps 8]
//! ```
//!
//! It needs a GPU and, to build, the CUDA toolkit (candle compiles its kernels with nvcc).
//!
//! How it works: candle 0.11's `CudaDevice` allocates every tensor with cudarc's
//! `CudaStream::alloc` (`cuMemAllocAsync` on a device with memory pools), which takes memory from
//! the device's current pool. `steppool::interop::route::route_allocations` makes a phase's pool
//! current for as long as its guard lives, so the tensors candle makes meanwhile land in that
//! phase; candle still owns them and frees them into the same pool when they drop. The step end
//! then trims each step-scoped pool by its phase's policy. candle links cudarc with
//! `dynamic-linking`, which cudarc refuses beside steppool's `cudarc` feature (`dynamic-loading`),
//! so this program routes through the runtime's own driver and needs no steppool cudarc types.

use std::error::Error;
use std::process::ExitCode;

use candle_core::{DType, Device, Tensor, Var};
use steppool::interop::route::{RouteGuard, route_allocations};
use steppool::{Phase, Runtime};

const INPUT: usize = 1024;
const HIDDEN: usize = 4096;
const OUTPUT: usize = 1024;
const MIB: f64 = 1024.0 * 1024.0;

/// The routed pool's numbers as the driver counts them (the step report's `used` counts only
/// what steppool itself handed out, and candle's tensors are candle's).
fn routed(name: &str, route: &RouteGuard<'_>) -> Result<String, Box<dyn Error>> {
    let counters = route.counters()?;
    Ok(format!(
        "  routed {name:<12} candle's tensors: {:>8.1} MiB live, peak {:>8.1} MiB; pool reserved {:>8.1} MiB",
        counters.used as f64 / MIB,
        counters.used_high as f64 / MIB,
        counters.reserved as f64 / MIB
    ))
}

fn run(steps: usize) -> Result<(), Box<dyn Error>> {
    // candle's device first: it is dropped last, after every steppool object over its stream.
    let device = Device::new_cuda_with_stream(0)?;
    let cuda = device.as_cuda_device()?;
    let runtime = Runtime::new()?; // the same libcuda that candle linked, so the same device
    println!("device: {}", runtime.driver().describe());
    let gpu = runtime.device(0)?;
    // SAFETY: candle's stream is live (`device` holds it) and belongs to device 0's primary
    // context (cudarc's `CudaContext::new` retains it); `stream` and every pool on it are
    // dropped before `device`, which is declared first.
    let stream = unsafe { gpu.wrap_stream(cuda.cuda_stream().cu_stream() as steppool::sys::CUstream) }?;

    // Weights: persistent, routed once.
    let (w1, w2) = {
        let route = route_allocations(&runtime, Phase::WEIGHTS, &stream)?;
        let w1 = Var::randn(0f32, 0.02, (INPUT, HIDDEN), &device)?;
        let w2 = Var::randn(0f32, 0.02, (HIDDEN, OUTPUT), &device)?;
        device.synchronize()?;
        println!("{}", routed("weights", &route)?);
        route.end()?;
        (w1, w2)
    };

    let mut losses = Vec::with_capacity(steps);
    for index in 0..steps {
        // Batch sizes vary from step to step, and so do the activations.
        let batch = 64 << (index % 3);
        let step = runtime.begin_step()?;
        let (loss, lines) = {
            let forward = route_allocations(&runtime, Phase::ACTIVATIONS, &stream)?;
            let x = Tensor::randn(0f32, 1.0, (batch, INPUT), &device)?;
            let target = Tensor::zeros((batch, OUTPUT), DType::F32, &device)?;
            let hidden = x.matmul(w1.as_tensor())?.relu()?;
            let y = hidden.matmul(w2.as_tensor())?;
            let mean_square = (y - &target)?.sqr()?.mean_all()?;
            device.synchronize()?;
            let activations = routed("activations", &forward)?;

            let backward = route_allocations(&runtime, Phase::GRADIENTS, &stream)?;
            let grads = mean_square.backward()?;
            for w in [&w1, &w2] {
                let grad = grads.get(w.as_tensor()).ok_or("a weight has no gradient")?;
                w.set(&(w.as_tensor() - (grad * 0.1)?)?)?;
            }
            let loss = mean_square.to_scalar::<f32>()?;
            device.synchronize()?;
            let gradients = routed("gradients", &backward)?;
            // Everything of the step goes before its end: candle frees it into the routed pools.
            drop((grads, x, target, hidden, mean_square));
            device.synchronize()?;
            backward.end()?;
            forward.end()?;
            (loss, [activations, gradients])
        };
        let report = step.end()?;
        print!("{report}");
        for line in lines {
            println!("{line}");
        }
        println!("  batch {batch}, loss {loss:.6}");
        losses.push(loss);
    }
    let errors = runtime.take_errors();
    if !errors.is_empty() {
        return Err(format!("the runtime recorded errors: {errors:?}").into());
    }
    if losses.iter().any(|loss| !loss.is_finite()) {
        return Err(format!("a loss is not finite: {losses:?}").into());
    }
    println!("{steps} steps of candle on steppool's phases, losses {losses:?}");
    Ok(())
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut steps = 8;
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next().map(|value| value.parse::<usize>())) {
            ("--steps", Some(Ok(value))) => steps = value,
            _ => {
                eprintln!("usage: steppool-candle-example [--steps N]");
                return ExitCode::from(2);
            }
        }
    }
    match run(steps) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("steppool-candle-example: {error}");
            ExitCode::FAILURE
        }
    }
}
