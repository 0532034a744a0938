use steppool::Runtime;

fn main() {
    let runtime = Runtime::new().unwrap();
    let step = runtime.begin_step().unwrap();
    let micro_step = step.begin_micro_step().unwrap();
    step.end().unwrap();
    micro_step.end().unwrap();
}

// expect: E0505 (the step ends while its micro-step is alive)
