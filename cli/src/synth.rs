//! Synthetic training traces, for tests and benchmarks: weights that live for the whole run, then
//! steps whose forward pass allocates activations and scratch, whose backward pass frees them in
//! reverse and allocates gradients, and an optimizer update, with sizes that vary per step as
//! variable-length batches make them.

use steppool_trace::{Event, EventKind, Location, Trace, TraceDevice, TraceFormat};

/// The shape of a synthetic trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Steps.
    pub steps: u32,
    /// Layers of the model.
    pub layers: u32,
    /// Bytes of one layer's weights.
    pub layer_bytes: u64,
    /// Bytes of one layer's activations at the longest sequence.
    pub activation_bytes: u64,
    /// Whether to write step boundaries into the trace (otherwise it is untagged and stepless, as an
    /// RMM log).
    pub boundaries: bool,
    /// Seed of the sequence-length draw.
    pub seed: u64,
}

impl Shape {
    /// A shape of about `events` events (each layer costs 8 events per step).
    pub fn with_events(events: u64) -> Self {
        let layers = 48;
        let steps = (events / (u64::from(layers) * 8 + 2)).max(1) as u32;
        Self { steps, layers, layer_bytes: 24 << 20, activation_bytes: 48 << 20, boundaries: false, seed: 7 }
    }
}

/// Builds the trace of `shape`, as if read from an RMM log (or a steppool trace with boundaries).
pub fn training_trace(shape: Shape) -> Trace {
    let mut trace =
        Trace::new("synthetic.csv", if shape.boundaries { TraceFormat::Steppool } else { TraceFormat::Rmm });
    trace.threads.push("0".to_owned());
    trace.devices.push(TraceDevice { ordinal: 0, total_bytes: None });
    let mut t = 0u64;
    let mut next_ptr = 0x7f00_0000_0000u64;
    let mut rng = shape.seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut push = |trace: &mut Trace, kind: EventKind, ptr: u64, bytes: u64| {
        t += 1_000;
        let mut event = Event::new(t, kind, Location::Line(trace.events.len() as u64 + 2));
        event.ptr = ptr;
        event.bytes = bytes;
        trace.events.push(event);
    };
    let mut alloc = |trace: &mut Trace, push: &mut dyn FnMut(&mut Trace, EventKind, u64, u64), bytes: u64| {
        let ptr = next_ptr;
        next_ptr += bytes.next_multiple_of(512);
        push(trace, EventKind::Alloc, ptr, bytes);
        ptr
    };
    let mut weights = Vec::new();
    for _ in 0..shape.layers {
        weights.push(alloc(&mut trace, &mut push, shape.layer_bytes));
    }
    let mut moments: Vec<u64> = Vec::new();
    for step in 0..shape.steps {
        if shape.boundaries {
            push(&mut trace, EventKind::StepBegin(u64::from(step)), 0, 0);
        }
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        // Sequence length: a quarter to all of the longest, in 512-byte steps.
        let fraction = 256 + (rng >> 33) % 769;
        let activation = (shape.activation_bytes * fraction / 1024).next_multiple_of(512).max(512);
        let mut saved = Vec::new();
        for _ in 0..shape.layers {
            let scratch = alloc(&mut trace, &mut push, activation * 2);
            saved.push((alloc(&mut trace, &mut push, activation), activation));
            push(&mut trace, EventKind::Free { released: false }, scratch, activation * 2);
        }
        let mut grads = Vec::new();
        for (ptr, bytes) in saved.into_iter().rev() {
            let scratch = alloc(&mut trace, &mut push, bytes * 2);
            grads.push(alloc(&mut trace, &mut push, shape.layer_bytes));
            push(&mut trace, EventKind::Free { released: false }, scratch, bytes * 2);
            push(&mut trace, EventKind::Free { released: false }, ptr, bytes);
        }
        if step == 0 {
            // Optimizer moments, allocated once, between the step's short-lived tensors.
            for _ in 0..shape.layers {
                moments.push(alloc(&mut trace, &mut push, shape.layer_bytes));
            }
        }
        for ptr in grads {
            push(&mut trace, EventKind::Free { released: false }, ptr, shape.layer_bytes);
        }
        if shape.boundaries {
            push(&mut trace, EventKind::StepEnd(u64::from(step)), 0, 0);
        }
    }
    let _ = (weights, moments);
    trace
}
