use steppool::{Phase, Runtime};

fn main() {
    let runtime = Runtime::new().unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let escaped;
    {
        let step = runtime.begin_step().unwrap();
        escaped = step.alloc(Phase::GRADIENTS, 1 << 20, &stream).unwrap();
    }
    let _ = escaped.ptr();
}

// expect: E0597 (the buffer outlives the step it borrows)
