//! burn's CUDA backend (cubecl) with steppool as its allocator: a small MLP trains for a few steps
//! of varying batch size, with cubecl's device memory routed into steppool phases — the weights
//! into the persistent `weights` phase (cubecl's persistent allocation mode), each step's forward
//! pass into `activations`, its backward pass into `gradients` — and every step ends with burn's
//! memory cleanup, steppool's trim and steppool's report.
//!
//! ```text
//! cargo run --release --manifest-path examples/frameworks/burn/Cargo.toml -- [--steps 8]
//! ```
//!
//! It builds without the CUDA toolkit (cubecl compiles its kernels at run time with NVRTC), and
//! needs a GPU with NVRTC (`libnvrtc.so`, from the toolkit or the `nvidia-cuda-nvrtc-cu12` wheel)
//! to run: the simulated device's libcuda stand-in has no NVRTC and runs no kernel but
//! steppool's own.
//!
//! How it works: cubecl-cuda takes device memory in pages (`GpuStorage::alloc`,
//! `cuMemAllocAsync` on its stream) and places tensors inside them itself.
//! `steppool::interop::route::route_allocations` makes a phase's pool the device's current pool
//! while its guard lives, so the pages cubecl takes meanwhile come from that phase. A phase
//! therefore holds pages, not tensors: a page belongs to the phase that was routed when cubecl
//! took it, and cubecl may later place another phase's tensor in a page it already has. At the
//! step end, `memory_cleanup` makes cubecl free the pages no tensor uses (`cuMemFreeAsync`, into
//! the pools they came from), and steppool's step end trims the step-scoped pools by policy.

use std::error::Error;
use std::process::ExitCode;

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, ElementConversion, Tensor};
use steppool::interop::route::{RouteGuard, route_allocations};
use steppool::{Phase, Runtime};

type Train = Autodiff<Cuda>;

const INPUT: usize = 1024;
const HIDDEN: usize = 4096;
const OUTPUT: usize = 1024;
const LEARNING_RATE: f64 = 0.05;
const MIB: f64 = 1024.0 * 1024.0;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    input: Linear<B>,
    output: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            input: LinearConfig::new(INPUT, HIDDEN).init(device),
            output: LinearConfig::new(HIDDEN, OUTPUT).init(device),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.output.forward(relu(self.input.forward(x)))
    }
}

/// Waits for burn's queued work: burn fuses and runs operations lazily, so a route must stay until
/// what was asked under it has run (and allocated).
fn sync(device: &CudaDevice) -> Result<(), Box<dyn Error>> {
    Train::sync(device).map_err(|error| format!("burn: {error:?}").into())
}

/// The routed pool's numbers as the driver counts them (the step report's `used` counts only
/// what steppool itself handed out, and cubecl's pages are cubecl's).
fn routed(name: &str, route: &RouteGuard<'_>) -> Result<String, Box<dyn Error>> {
    let counters = route.counters()?;
    Ok(format!(
        "  routed {name:<12} cubecl's pages: {:>8.1} MiB live, peak {:>8.1} MiB; pool reserved {:>8.1} MiB",
        counters.used as f64 / MIB,
        counters.used_high as f64 / MIB,
        counters.reserved as f64 / MIB
    ))
}

fn run(steps: usize) -> Result<(), Box<dyn Error>> {
    let device = CudaDevice::default();
    let runtime = Runtime::new()?; // the libcuda that cubecl loads too, so the same device
    println!("device: {}", runtime.driver().describe());
    // The pools' own stream; cubecl allocates on its streams, from whichever pool is current.
    let stream = runtime.device(device.index)?.create_stream()?;

    // Weights: persistent, in cubecl's persistent allocation mode (pages of their own).
    let mut model = {
        let route = route_allocations(&runtime, Phase::WEIGHTS, &stream)?;
        let model = Train::memory_persistent_allocations(&device, &device, Mlp::<Train>::new);
        sync(&device)?;
        println!("{}", routed("weights", &route)?);
        route.end()?;
        model
    };
    let mut optimizer = SgdConfig::new().init();

    let mut losses = Vec::with_capacity(steps);
    for index in 0..steps {
        // Batch sizes vary from step to step, and so do the activations.
        let batch = 64 << (index % 3);
        let step = runtime.begin_step()?;
        let (loss, lines) = {
            let forward = route_allocations(&runtime, Phase::ACTIVATIONS, &stream)?;
            let x = Tensor::<Train, 2>::random([batch, INPUT], Distribution::Normal(0.0, 1.0), &device);
            let loss = model.forward(x).powi_scalar(2).mean();
            sync(&device)?;
            let activations = routed("activations", &forward)?;

            let backward = route_allocations(&runtime, Phase::GRADIENTS, &stream)?;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            sync(&device)?;
            let gradients = routed("gradients", &backward)?;

            // The updated weights go where the weights are.
            let update = route_allocations(&runtime, Phase::WEIGHTS, &stream)?;
            model = optimizer.step(LEARNING_RATE, model, grads);
            let loss: f32 = loss.into_scalar().elem();
            sync(&device)?;
            update.end()?;
            backward.end()?;
            forward.end()?;
            (loss, [activations, gradients])
        };
        // burn's cleanup: cubecl frees the pages no tensor uses, before steppool trims.
        Train::memory_cleanup(&device);
        sync(&device)?;
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
    println!("{steps} steps of burn (CUDA backend) on steppool's phases, losses {losses:?}");
    Ok(())
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut steps = 8;
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next().map(|value| value.parse::<usize>())) {
            ("--steps", Some(Ok(value))) => steps = value,
            _ => {
                eprintln!("usage: steppool-burn-example [--steps N]");
                return ExitCode::from(2);
            }
        }
    }
    match run(steps) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("steppool-burn-example: {error}");
            ExitCode::FAILURE
        }
    }
}
