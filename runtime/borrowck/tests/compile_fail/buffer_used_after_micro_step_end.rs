use steppool::{Phase, PhaseSpec, Runtime, Scope};

fn main() {
    let runtime = Runtime::new().unwrap();
    let micro = runtime.declare_phase(PhaseSpec::new("micro", Scope::MicroStep)).unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let step = runtime.begin_step().unwrap();
    let micro_step = step.begin_micro_step().unwrap();
    let activations = micro_step.alloc(micro, 1 << 20, &stream).unwrap();
    micro_step.end().unwrap();
    let _ = activations.ptr();
    drop(activations);
    step.end().unwrap();
    let _ = Phase::WEIGHTS;
}

// expect: E0505 (the micro-step ends while its buffer is still used)
