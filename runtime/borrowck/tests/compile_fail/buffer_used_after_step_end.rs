use steppool::{Phase, Runtime};

fn main() {
    let runtime = Runtime::new().unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let step = runtime.begin_step().unwrap();
    let activations = step.alloc(Phase::ACTIVATIONS, 1 << 20, &stream).unwrap();
    step.end().unwrap();
    let _ = activations.ptr();
}

// expect: E0505 (the step ends while its buffer is still used)
