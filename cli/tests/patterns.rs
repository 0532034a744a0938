//! The workload patterns: every recorded trace reads with the steps, allocations and peak live
//! bytes its manifest says and replays under every strategy without two live allocations
//! overlapping; every generator makes the pattern it claims, deterministically from its seed.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde_json::Value;
use steppool::sys::sim::SimConfig;
use steppool::{Phase, Runtime, Scope};
use steppool_cli::patterns::{
    ACCUMULATION, Pattern, PatternOptions, TOKEN_BUDGET, curriculum_length, generate, is_eval_step,
};
use steppool_cli::replay::{ReplayOptions, STRATEGIES, Silent, phase_specs, replay, select};
use steppool_trace::analysis::{Analysis, Op, analyse};
use steppool_trace::{EventKind, StepSource, Trace, TraceFormat, read};

const MIB: u64 = 1 << 20;

fn recorded(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/recorded").join(name)
}

fn manifest() -> serde_json::Map<String, Value> {
    let text = std::fs::read_to_string(recorded("manifest.json")).unwrap();
    let manifest: Value = serde_json::from_str(&text).unwrap();
    manifest["traces"].as_object().unwrap().clone()
}

/// Replays `analysis` under `strategy` on a runtime in checked mode, as `replay::run` does, and
/// checks every pointer handed out against the ranges still live: no allocation may overlap one.
/// Returns the peak of live bytes the replay saw.
fn replay_without_overlap(analysis: &Analysis, strategy: &str, capacity: u64) -> u64 {
    let def = STRATEGIES.iter().find(|s| s.name == strategy).unwrap();
    let runtime = Runtime::builder().simulated(SimConfig::with_capacity(capacity)).checked(true).build().unwrap();
    let options = ReplayOptions::new(capacity);
    let mut by_name: HashMap<String, Phase> = HashMap::new();
    let mut phases = Vec::new();
    for spec in phase_specs(def, analysis, &options) {
        let name = spec.name.clone();
        let declared = match by_name.get(&name) {
            Some(&existing) => existing,
            None => {
                let declared = match runtime.phase_named(&name) {
                    Some(built_in) => runtime.set_phase_spec(built_in, spec).map(|()| built_in).unwrap(),
                    None => runtime.declare_phase(spec).unwrap(),
                };
                by_name.insert(name, declared);
                declared
            }
        };
        phases.push(declared);
    }
    assert_eq!(analysis.streams.len(), 1, "the patterns run on one stream");
    let device = runtime.device(0).unwrap();
    let stream = device.create_stream().unwrap();
    let mut pointers = vec![0u64; analysis.allocations.len()];
    // Live ranges: start → end.
    let mut live: BTreeMap<u64, u64> = BTreeMap::new();
    let (mut live_bytes, mut peak) = (0u64, 0u64);
    for &(event, op) in &analysis.ops {
        match op {
            Op::Alloc(id) => {
                let allocation = &analysis.allocations[id as usize];
                // SAFETY: the simulated device's memory is never touched.
                let ptr =
                    unsafe { runtime.raw().alloc(phases[usize::from(allocation.phase)], allocation.bytes, &stream) }
                        .unwrap_or_else(|e| panic!("{strategy}: event {event}: {e}"));
                let end = ptr + allocation.bytes;
                if let Some((&start, &until)) = live.range(..end).next_back() {
                    assert!(
                        until <= ptr,
                        "{strategy}: event {event}: [{ptr:#x}, {end:#x}) overlaps live [{start:#x}, {until:#x})"
                    );
                }
                live.insert(ptr, end);
                pointers[id as usize] = ptr;
                live_bytes += allocation.bytes;
                peak = peak.max(live_bytes);
            }
            Op::Free(id) => {
                let allocation = &analysis.allocations[id as usize];
                assert!(!allocation.released_at_boundary, "the patterns' traces have no boundary releases");
                live.remove(&pointers[id as usize]).unwrap();
                live_bytes -= allocation.bytes;
                // SAFETY: as for the allocation.
                unsafe { runtime.raw().free(pointers[id as usize]) }.unwrap();
            }
            Op::BeginStep => {
                runtime.raw().begin_step().unwrap();
            }
            Op::BeginMicro => {
                runtime.raw().begin_micro_step().unwrap();
            }
            Op::EndMicro => {
                // SAFETY: as for the allocations.
                unsafe { runtime.raw().end_micro_step() }.unwrap();
            }
            Op::EndStep => {
                device.synchronize().unwrap();
                // SAFETY: as for the allocations.
                unsafe { runtime.raw().end_step() }.unwrap();
            }
        }
    }
    peak
}

/// Per step of a trace with boundaries: the sizes it allocated, in order, and its micro-steps.
fn steps_of(trace: &Trace) -> Vec<(Vec<u64>, u32)> {
    let mut steps: Vec<(Vec<u64>, u32)> = Vec::new();
    for event in &trace.events {
        match event.kind {
            EventKind::StepBegin(n) => {
                assert_eq!(n as usize, steps.len(), "steps in order");
                steps.push((Vec::new(), 0));
            }
            EventKind::MicroBegin(..) => steps.last_mut().unwrap().1 += 1,
            EventKind::Alloc => {
                if let Some(step) = steps.last_mut() {
                    step.0.push(event.bytes);
                }
            }
            _ => {}
        }
    }
    steps
}

// ---------------------------------------------------------------------------------------------
// The recorded traces.

/// The manifest's variants: traces of a pattern's workload recorded with another training loop
/// (`record.py --zero-grad`, `--optimizer`, ..., described in the entry's `loop`) or at another
/// scale (`--size`, `--width`), under a name of their own (`--suffix`) beside their `workload`.
fn variants(manifest: &serde_json::Map<String, Value>) -> Vec<&str> {
    let variants: Vec<&str> =
        manifest.iter().filter(|(_, entry)| entry.get("workload").is_some()).map(|(name, _)| name.as_str()).collect();
    for name in &variants {
        let workload = manifest[*name]["workload"].as_str().unwrap();
        assert!(Pattern::ALL.iter().any(|p| p.name() == workload), "{name}: workload {workload}");
    }
    variants
}

#[test]
fn every_recorded_trace_reads_as_its_manifest_says() {
    let manifest = manifest();
    let variants = variants(&manifest);
    assert!(variants.len() >= 2, "{variants:?}");
    assert_eq!(manifest.len(), Pattern::ALL.len() + variants.len(), "one recorded trace per pattern, and variants");
    for name in Pattern::ALL.iter().map(|p| p.name()).chain(variants) {
        let entry = &manifest[name];
        let file = entry["file"].as_str().unwrap();
        let path = recorded(file);
        let size = std::fs::metadata(&path).unwrap().len();
        assert!(size < 3 * MIB, "{file}: {size} bytes");
        let trace = read::read_trace(&path).unwrap();
        assert!(trace.warnings.is_empty(), "{file}: {:?}", trace.warnings.lines());
        let micro_per_step = entry["micro_steps_per_step"].as_u64().unwrap();
        if micro_per_step > 0 {
            assert_eq!((trace.format, &trace.steps), (TraceFormat::Steppool, &StepSource::Trace), "{file}");
        } else {
            assert_eq!(trace.format, TraceFormat::Rmm, "{file}");
            assert_eq!(trace.steps, StepSource::Sidecar(path.with_extension("json")), "{file}");
        }
        let analysis = analyse(&trace).unwrap();
        assert!(analysis.warnings.is_empty(), "{file}: {:?}", analysis.warnings.lines());
        let steps = entry["steps"].as_u64().unwrap();
        assert!(steps >= 6, "{file}: a steady state from the second step on");
        assert_eq!(analysis.steps, steps, "{file}");
        assert_eq!(analysis.micro_steps, steps * micro_per_step, "{file}");
        assert_eq!(analysis.allocations.len() as u64, entry["allocations"].as_u64().unwrap(), "{file}");
        assert_eq!(analysis.peak_live_bytes, entry["peak_live_bytes"].as_u64().unwrap(), "{file}");
        assert_eq!(analysis.live_at_end, entry["live_at_end_bytes"].as_u64().unwrap(), "{file}");
        let records =
            trace.events.iter().filter(|e| matches!(e.kind, EventKind::Alloc | EventKind::Free { .. })).count();
        assert_eq!(records as u64, entry["events"].as_u64().unwrap(), "{file}");
        assert!(analysis.peak_live_bytes > 20 * MIB, "{file}: tens of MiB live at least");
    }
}

#[test]
fn every_recorded_trace_replays_under_every_strategy_without_overlap() {
    for (name, entry) in manifest() {
        let path = recorded(entry["file"].as_str().unwrap());
        let trace = read::read_trace(&path).unwrap();
        let analysis = analyse(&trace).unwrap();
        for strategy in STRATEGIES {
            let peak = replay_without_overlap(&analysis, strategy.name, 16 << 30);
            assert_eq!(peak, analysis.peak_live_bytes, "{name} under {}", strategy.name);
        }
        // What each run reserved and where; the smallest device that completes is the targets'
        // test's (below), and the bisection for it is most of a replay's time.
        let options = ReplayOptions { bisect: false, ..ReplayOptions::new(16 << 30) };
        let results = replay(&trace, &analysis, &select("all").unwrap(), &options, &Silent).unwrap();
        for result in &results {
            assert!(result.run.completed(), "{name} under {}", result.run.strategy);
            assert!(result.run.peak_reserved_bytes >= analysis.peak_live_bytes, "{name} under {}", result.run.strategy);
            // No boundary (a planned range mapping its holes again) reserves more than the
            // allocation peak, where the breakdown reads the layout: it attributes the whole.
            let run = &result.run;
            assert_eq!(run.peak_op_reserved_bytes, run.peak_reserved_bytes, "{name} under {}", run.strategy);
            if let Some(breakdown) = &result.breakdown {
                assert_eq!(breakdown.unattributed_bytes, 0, "{name} under {}", run.strategy);
            }
        }
    }
}

#[test]
fn the_recorded_variants_meet_the_targets_under_the_planned_strategy() {
    // (trace, static shapes, planned's peak reserved in MiB). `zero_grad()` as the loop's first
    // statement frees a step's gradients after the next step's mark, before its first allocation;
    // the step begins there, and the last step's gradients, never freed, are its own: before,
    // they were persistent, and planned reserved 308 MiB (1.108x), above PyTorch's 288 MiB.
    // Gradients kept (`set_to_none=False`) under a foreach AdamW: without the sidecar, inference
    // found 1008 steps of the 8. SGD under gradient accumulation: the first step makes the
    // momentum where later steps allocate more, so the second step runs past the first one's plan;
    // laid out in allocation order for the third step, that plan held 202 MiB (1.082x), above
    // PyTorch's 200 MiB. A ResNet under fp16 and Adafactor whose largest batch comes first at
    // step 5, after three smaller batches of one sequence: served best-fit from the range's start
    // it held 36 MiB (1.293x, steady 1.268x the limit); from the plan its sequence predicts, 30.
    // A ResNet under fp16 whose second step, the first of its steady sequence (fp16 skips the
    // first optimizer step), is a larger batch: one plan of a shorter sequence, served best fit
    // it held 30 MiB (1.272x, steady 1.253x the limit); predicted from that plan past a prefix
    // that follows it, 26. `zero_grad()` between the forward and backward passes: the
    // gradients are carried into the next step, planned in the step's plan above what the next
    // forward pass makes before freeing them. The BERT's recording step left them among its
    // activations, where, pinned, the plan held 222 MiB of a 193 MiB step; it moves to a new
    // range instead, and reserves 288 MiB (steady 280, at peak live), where, kept with the
    // long-lived allocations, they cost 308 MiB (1.091x the limit, steady). Each micro-batch
    // copied to the device at the step's start and bound to the name the step before's had: the
    // new batch is made before the old one is freed, so a batch has two places the steps take
    // in turn; with one place, each step deviated at its first batch and held 218 MiB (steady
    // 228, 1.069x the limit). The same with a token budget, every step another shape, and
    // `zero_grad()` after the copy: a plan that packed the batch's own place into the smallest
    // gap between the pinned gradients split the next step's forward pass (steady 512 MiB,
    // 1.087x the limit); beside its second place, 478 (480 since the gradients of a new shape
    // are made at the lowest free range). Inferred, its steps are the sidecar's 8,
    // but each from the third on begins after the batch copy and the gradients' frees (the
    // quiescent point follows the frees), which the step before then holds: 472. A mixture of
    // experts at 2 GiB live, whose expert sizes reach a new largest step after step while the
    // largest together cost under 1/128 more than a step's own: each step left the packing of the
    // largest sizes part way and went on best fit around it, 2,040 MiB (one pool 2,048); laid
    // out in allocation order after such a step, 2,030. Training steps of a loop that calls
    // `zero_grad()` at its top, with an evaluation step after every second one: the training step
    // before an evaluation step carries its gradients into it. Its first carrying plan kept
    // their range apart from the next training step's activations, which received nothing, and
    // the last training step's gradients, never freed, were persistent, held beside the plan's
    // place for them: 1,710 and 1,734 MiB (one pool 1,696); with the plan before restored and
    // those gradients carried into the last step, 1,610, the peak of live bytes. Inferred, the
    // evaluation steps hold the gradients of the step before and its steps are 6 of the 9: not
    // replayed without the sidecar here. The same loop at half the width, where the evaluation
    // step is the largest and receives the gradients where the training plan put them: best fit
    // left the small ones each on a page of its own, 22 MiB of pages for 13 MiB at the
    // evaluation step's peak, 892 MiB (PyTorch's expandable segments 890); gathered onto the
    // pages the others hold, 888. Train/eval under SGD with the gradients set to `None` between
    // the passes: the training step before an evaluation step receives gradients and carries
    // none (its own live through the evaluation step, persistent), the one after it the
    // reverse, both under one key; each left the other's plan, 1,936 MiB (one pool 1,824); with
    // a plan each, 1,788. A variable-length GPT-2 under `zero_grad()` between the passes, every
    // step another shape: best fit scattered each step's gradients through the holes of its
    // backward pass, 486 MiB; made at the lowest free range, together, 480. A mixture of
    // experts under Adafactor and bf16, its batch copied in the step after `zero_grad()`: 188
    // MiB, where PyTorch's caching allocator (modelled) holds 190 and completes on a device of
    // 188 too, the closest of the recorded loops to PyTorch's figures. A static BERT of 1 GiB
    // live under SGD, `zero_grad()` between the passes and a loader: its second step runs past
    // the first step's plan (the optimizer's first update) and makes its batch at another index;
    // read by index, its plan guessed that batch freed at the step's peak, the third step left
    // it, and the run held 1,062 MiB (1.053x the limit); read in the order made, and moved
    // again, 1,012. Inferred, it has no steps (lifetimes do not tell the gradients it hands on
    // from its activations): not replayed without the sidecar here. Train/eval under SGD with
    // clipping and bf16, its batch copied in the step: 866 MiB. Inferred, one step is three of
    // the sidecar's (train, train, eval repeat as one pattern), and the second such step leaves
    // the first one's plan part way; laid out in allocation order whatever it cost, that step's
    // plan held 951 MiB where its packing needs 781, and the run 1,032 MiB (PyTorch's expandable
    // segments 1,044); within 1/128 of the packing or packed, 872.
    let manifest = manifest();
    for (file, fixed, planned_mib, inferred_mib) in [
        ("bert_static_zero_grad_first.csv", true, 280, Some(280)),
        ("gpt2_varlen_grads_kept.csv", false, 504, Some(504)),
        ("llama_accum_sgd.jsonl", true, 188, Some(188)),
        ("resnet_varbatch_s41.csv", false, 30, Some(30)),
        ("resnet_varbatch_s16fp16.csv", false, 26, Some(26)),
        ("gpt2_varlen_zero_grad_backward.csv", false, 480, Some(480)),
        ("bert_static_zero_grad_backward.csv", true, 288, Some(288)),
        ("bert_static_sgd_loader_zero_grad_backward.csv", true, 1012, None),
        ("llama_accum_inputs_step.jsonl", false, 214, Some(214)),
        ("gpt2_token_budget_inputs_step.csv", false, 480, Some(472)),
        ("moe_routing_2gib.csv", false, 2030, Some(2030)),
        ("moe_routing_adafactor_bf16.csv", false, 188, Some(188)),
        ("train_eval_zero_grad_first.csv", false, 1610, None),
        ("train_eval_zero_grad_first_w1.csv", false, 888, None),
        ("train_eval_sgd_zero_grad_backward.csv", false, 1788, None),
        ("train_eval_sgd_clip_bf16.csv", false, 866, Some(872)),
    ] {
        let (name, _) = file.split_once('.').unwrap();
        let steps = manifest[name]["steps"].as_u64().unwrap();
        // Inferred, a loop of two training steps and an evaluation pass is one step of all three
        // (`steppool_trace::steps`).
        let pattern = manifest[name]["pattern"].as_str().unwrap();
        let inferred_steps = if pattern.contains("'train', 'train', 'eval'") { steps / 3 } else { steps };
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join(file);
        std::fs::copy(recorded(file), &copy).unwrap();
        let replays =
            [(recorded(file), Some((planned_mib, steps))), (copy, inferred_mib.map(|mib| (mib, inferred_steps)))];
        for (path, (planned_mib, steps)) in replays.into_iter().filter_map(|(path, expected)| Some((path, expected?))) {
            let trace = read::read_trace(&path).unwrap();
            let analysis = analyse(&trace).unwrap();
            assert_eq!(analysis.steps, steps, "{}: {:?}", path.display(), trace.steps);
            let limit = steppool_cli::limit::limit(&analysis).unwrap().bytes;
            // The smallest device is compared for planned and the three it must beat; the other
            // strategies are replayed for the recommendation alone, without the bisection.
            let (compared, rest): (Vec<_>, Vec<_>) = select("all").unwrap().into_iter().partition(|allocator| {
                ["planned", "default-pool", "torch-caching", "torch-expandable"].contains(&allocator.name())
            });
            let options = ReplayOptions::new(80 << 30);
            let mut results = replay(&trace, &analysis, &compared, &options, &Silent).unwrap();
            let unbisected = ReplayOptions { bisect: false, ..options };
            results.extend(replay(&trace, &analysis, &rest, &unbisected, &Silent).unwrap());
            let peak = |name: &str| results.iter().find(|r| r.run.strategy == name).unwrap().run.peak_reserved_bytes;
            assert_eq!(steppool_cli::replay::recommended(&results), Some("planned"), "{file}");
            let planned = results.iter().find(|r| r.run.strategy == "planned").unwrap();
            assert_eq!(planned.run.peak_reserved_bytes, planned_mib * MIB, "{}", path.display());
            let below = ["default-pool", "torch-caching", "torch-expandable"].map(peak);
            assert!(below.iter().all(|&other| planned_mib * MIB < other), "{file}: {below:?}");
            let smallest = |name: &str| results.iter().find(|r| r.run.strategy == name).unwrap().min_capacity_bytes;
            let others = ["default-pool", "torch-caching", "torch-expandable"].map(|name| smallest(name).unwrap());
            assert!(others.iter().all(|&other| planned.min_capacity_bytes.unwrap() <= other), "{file}: {others:?}");
            let steady = planned.run.steady_peak_reserved_bytes.unwrap() as f64;
            let target = if fixed { 1.03 } else { 1.08 };
            assert!(steady <= target * limit as f64 + (2 * MIB) as f64, "{file}: {steady} against {limit}");
        }
    }
}

#[test]
fn a_bert_that_copies_its_batch_and_frees_its_gradients_between_the_passes_moves_once() {
    // The batch copied in the step, the forward pass, `zero_grad()`, the backward pass. The first
    // plan guesses the gradients freed right after the copy, where pinned where the recording's
    // best fit left them (across the forward pass's room) costs nothing; weighed as if they
    // lived to the plan's peak, the plan moves to a new range at the second step's start, which
    // follows it: 288 MiB over the run, 280 from the third step on. Weighed under the guess alone
    // it stayed, the second step corrected it around the gradients, and the run held 310 MiB
    // (1.098x the limit). Inferred, the first step began after its copy (the batch lives about a
    // step and is left out as long-lived), its plan saw no copy and guessed no early free: 308,
    // until the first step's start moved back over the copy the later steps begin with.
    let file = "bert_static_inputs_step_zero_grad_backward.csv";
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join(file);
    std::fs::copy(recorded(file), &copy).unwrap();
    for path in [recorded(file), copy] {
        let trace = read::read_trace(&path).unwrap();
        let analysis = analyse(&trace).unwrap();
        let limit = steppool_cli::limit::limit(&analysis).unwrap().bytes;
        let results =
            replay(&trace, &analysis, &select("all").unwrap(), &ReplayOptions::new(80 << 30), &Silent).unwrap();
        let run = |name: &str| &results.iter().find(|r| r.run.strategy == name).unwrap().run;
        assert_eq!(run("planned").peak_reserved_bytes, 288 * MIB, "{}", path.display());
        let others = ["default-pool", "torch-caching", "torch-expandable"].map(|name| run(name).peak_reserved_bytes);
        assert!(others.iter().all(|&other| 288 * MIB < other), "{others:?}");
        let steady = run("planned").steady_peak_reserved_bytes.unwrap() as f64;
        assert!(steady <= 1.03 * limit as f64 + (2 * MIB) as f64, "{steady} against {limit}");
    }
}

#[test]
fn gradients_set_to_none_between_forward_and_backward_are_carried_into_the_next_step() {
    // `zero_grad()` after the forward pass: a step's 61 gradients are made in its backward pass
    // and freed in the next step's, after that step's forward pass. They are the `carried`
    // phase (the last step's too, never freed: carried as the steps before carried theirs), and the
    // per-step limit holds them in both steps' region: at the peak of live bytes (473.7 MiB),
    // where counted as persistent memory, apart from the step's region, it was 502.2 MiB.
    let trace = read::read_trace(recorded("gpt2_varlen_zero_grad_backward.csv")).unwrap();
    let analysis = analyse(&trace).unwrap();
    let carried = analysis.phases.iter().position(|p| p.carried).expect("a carried phase");
    assert_eq!(analysis.phases[carried].name, steppool_trace::analysis::CARRIED_PHASE);
    let facts = analysis.facts[carried];
    assert_eq!((facts.allocations, facts.never_freed), (61 * 8, 61));
    let limit = steppool_cli::limit::limit(&analysis).unwrap();
    let per_step = limit.per_step_bytes.unwrap();
    assert!(per_step >= limit.lower_bound_bytes && per_step < limit.lower_bound_bytes + MIB, "{limit:?}");
}

#[test]
fn the_recorded_evaluation_passes_allocate_differently_from_training() {
    let trace = read::read_trace(recorded("train_eval.csv")).unwrap();
    let steps = steps_of(&trace);
    let (train, eval): (Vec<_>, Vec<_>) = (1..steps.len()).partition(|&s| !is_eval_step(s as u32));
    assert!(!eval.is_empty() && train.len() > 1);
    for &e in &eval {
        for &t in &train {
            assert_ne!(steps[e].0.len(), steps[t].0.len(), "eval step {e} against training step {t}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The generators.

/// Small enough to replay in a test: the real shapes divided by 1024.
const SMOKE: f64 = 1.0 / 1024.0;

fn smoke(pattern: Pattern, steps: u32) -> Trace {
    generate(pattern, &PatternOptions { steps, seed: 7, scale: SMOKE, ..PatternOptions::default() }).unwrap()
}

/// At the real shapes (generation only; nothing replays these).
fn full(pattern: Pattern, steps: u32) -> Trace {
    generate(pattern, &PatternOptions { steps, ..PatternOptions::default() }).unwrap()
}

#[test]
fn every_generated_trace_replays_under_every_strategy_without_overlap() {
    for pattern in Pattern::ALL {
        let steps = if pattern == Pattern::Gpt2KvGenerate { 3 } else { 6 };
        let trace = smoke(pattern, steps);
        // Through the steppool format and back, as `steppool synth` writes it.
        let mut text = Vec::new();
        steppool_trace::jsonl::write(&trace, &mut text).unwrap();
        let back = read::read_bytes(Path::new("synth.jsonl"), &text).unwrap();
        assert_eq!(back.events.len(), trace.events.len(), "{pattern:?}");
        assert!(back.warnings.is_empty(), "{pattern:?}: {:?}", back.warnings.lines());
        let analysis = analyse(&back).unwrap();
        assert!(analysis.warnings.is_empty(), "{pattern:?}: {:?}", analysis.warnings.lines());
        assert_eq!(analysis.steps, u64::from(steps), "{pattern:?}");
        for strategy in STRATEGIES {
            let peak = replay_without_overlap(&analysis, strategy.name, 1 << 30);
            assert_eq!(peak, analysis.peak_live_bytes, "{pattern:?} under {}", strategy.name);
        }
    }
}

#[test]
fn generated_traces_reach_gib_at_full_scale_and_follow_the_scale() {
    for pattern in Pattern::ALL {
        let big = analyse(&full(pattern, 8)).unwrap().peak_live_bytes;
        let small = analyse(
            &generate(pattern, &PatternOptions { steps: 8, scale: 0.25, ..PatternOptions::default() }).unwrap(),
        )
        .unwrap()
        .peak_live_bytes;
        assert!(big >= 1 << 30, "{pattern:?}: {big} bytes");
        // Every size is scaled (rounded up to 16 bytes), so the peak is too, within the rounding.
        let ratio = small as f64 / big as f64;
        assert!((0.249..0.26).contains(&ratio), "{pattern:?}: {ratio}");
    }
}

#[test]
fn generators_are_deterministic_from_their_seed() {
    for pattern in Pattern::ALL {
        let a = generate(pattern, &PatternOptions { steps: 3, seed: 1, scale: SMOKE, ..PatternOptions::default() })
            .unwrap();
        let b = generate(pattern, &PatternOptions { steps: 3, seed: 1, scale: SMOKE, ..PatternOptions::default() })
            .unwrap();
        assert_eq!(a.events, b.events, "{pattern:?}");
    }
    for pattern in [Pattern::Gpt2Varlen, Pattern::ResnetVarbatch, Pattern::MoeRouting, Pattern::Gpt2KvGenerate] {
        let a = generate(pattern, &PatternOptions { steps: 3, seed: 1, scale: SMOKE, ..PatternOptions::default() })
            .unwrap();
        let b = generate(pattern, &PatternOptions { steps: 3, seed: 2, scale: SMOKE, ..PatternOptions::default() })
            .unwrap();
        assert_ne!(a.events, b.events, "{pattern:?}: the seed draws its shapes");
    }
}

#[test]
fn static_bert_repeats_its_steps_exactly() {
    let steps = steps_of(&full(Pattern::BertStatic, 6));
    // The first step also allocates the optimizer's state.
    assert!(steps[0].0.len() > steps[1].0.len());
    for step in &steps[2..] {
        assert_eq!(step.0, steps[1].0);
    }
}

/// The sequence length of a GPT-2 step with 4 sequences: its fp32 logits are 4 × length × the
/// vocabulary × 4 bytes, the length a multiple of 64. The embedding (vocabulary × 768 × 4 bytes) is
/// left out: it would read as 192 tokens.
fn gpt2_length(sizes: &[u64]) -> u64 {
    let row = 4 * 50257 * 4;
    let embedding = 50257 * 768 * 4;
    sizes.iter().filter(|&&b| b != embedding && b % row == 0 && (b / row) % 64 == 0).map(|b| b / row).max().unwrap()
}

#[test]
fn variable_length_gpt2_changes_its_sizes_but_not_its_sequence() {
    let steps = steps_of(&full(Pattern::Gpt2Varlen, 8));
    let lengths: Vec<u64> = steps.iter().map(|s| gpt2_length(&s.0)).collect();
    for (step, &length) in steps[1..].iter().zip(&lengths[1..]) {
        assert_eq!(step.0.len(), steps[1].0.len());
        assert!((128..=1024).contains(&length), "{length}");
    }
    assert!(lengths.iter().any(|&l| l != lengths[0]), "lengths vary: {lengths:?}");
}

#[test]
fn accumulation_patterns_have_their_micro_steps_and_gradients_span_them() {
    for pattern in [Pattern::LlamaAccum, Pattern::CurriculumAccum] {
        let trace = full(pattern, 6);
        for (step, (_, micro)) in steps_of(&trace).iter().enumerate() {
            assert_eq!(*micro, ACCUMULATION, "{pattern:?} step {step}");
        }
        let analysis = analyse(&trace).unwrap();
        assert_eq!(analysis.micro_steps, 6 * u64::from(ACCUMULATION));
        // Activations die in their micro-step; gradients live from the first micro-step's backward
        // to the optimizer step: step-scoped.
        let scoped = |scope: Scope| analysis.allocations.iter().filter(|a| a.scope == scope).count();
        assert!(scoped(Scope::MicroStep) > scoped(Scope::Step) && scoped(Scope::Step) > 0, "{pattern:?}");
        let largest_step_scoped =
            analysis.allocations.iter().filter(|a| a.scope == Scope::Step).map(|a| a.bytes).max().unwrap();
        // The largest gradient is the embedding's.
        let embedding = if pattern == Pattern::LlamaAccum { 32000 * 2048 * 4 } else { 50257 * 768 * 4 };
        assert_eq!(largest_step_scoped, embedding, "{pattern:?}");
    }
}

#[test]
fn the_curriculum_lengthens_its_sequences() {
    let steps = 8;
    let trace = full(Pattern::CurriculumAccum, steps);
    let lengths: Vec<u64> = steps_of(&trace).iter().map(|(sizes, _)| gpt2_length(sizes)).collect();
    let expected: Vec<u64> = (0..steps).map(|step| curriculum_length(step, steps)).collect();
    assert_eq!(lengths, expected);
    assert_eq!((lengths[0], lengths[7]), (128, 1024));
}

#[test]
fn resnet_batches_vary_between_steps() {
    let steps = steps_of(&full(Pattern::ResnetVarbatch, 8));
    let image = 3 * 224 * 224 * 4;
    let batches: Vec<u64> = steps.iter().map(|s| s.0[0] / image).collect();
    for (step, &batch) in batches.iter().enumerate() {
        assert_eq!(steps[step].0[0], batch * image);
        assert!([8, 16, 24, 32].contains(&batch), "{batch}");
    }
    assert!(batches.iter().any(|&b| b != batches[0]), "{batches:?}");
}

#[test]
fn moe_routing_changes_every_step() {
    let steps = steps_of(&full(Pattern::MoeRouting, 6));
    for a in 1..steps.len() {
        for b in a + 1..steps.len() {
            assert_ne!(steps[a].0, steps[b].0, "steps {a} and {b} routed alike");
        }
    }
}

#[test]
fn checkpointing_recomputes_every_layer_under_bf16() {
    // TinyLlama's SwiGLU activations in bf16 for 4 × 2048 tokens: gate, up and their product per
    // layer in the checkpointed forward, again in the recomputation, and a gradient for each.
    let ffn_activation = 4 * 2048 * 5632 * 2;
    let layers = 6;
    for (step, (sizes, _)) in steps_of(&full(Pattern::LlamaCheckpointBf16, 4)).iter().enumerate() {
        let count = sizes.iter().filter(|&&b| b == ffn_activation).count();
        assert_eq!(count, 3 * 3 * layers, "step {step}");
    }
}

#[test]
fn kv_generation_grows_its_cache_one_token_a_micro_step() {
    let trace = full(Pattern::Gpt2KvGenerate, 4);
    let row = 8 * 1024 * 2; // batch × GPT-2 medium's width × fp16, per position
    let mut tokens = Vec::new();
    let mut step_micro: Option<(u64, u32)> = None;
    let mut per_micro: BTreeMap<(u64, u32), Vec<u64>> = BTreeMap::new();
    for event in &trace.events {
        match event.kind {
            EventKind::MicroBegin(n, k) => step_micro = Some((n, k)),
            EventKind::MicroEnd(..) => step_micro = None,
            EventKind::Alloc => {
                if let Some(key) = step_micro {
                    per_micro.entry(key).or_default().push(event.bytes);
                }
            }
            _ => {}
        }
    }
    for (step, (_, micro)) in steps_of(&trace).iter().enumerate() {
        tokens.push(*micro);
        // The prompt's caches: 24 layers' keys and values, the prompt a multiple of 64.
        let prefill = &per_micro[&(step as u64, 0)];
        let prompt = prefill.iter().filter(|&&b| b % row == 0 && (b / row) % 64 == 0).map(|b| b / row).min().unwrap();
        for k in 1..*micro {
            let context = prompt + u64::from(k);
            let grown = per_micro[&(step as u64, k)].iter().filter(|&&b| b == context * row).count();
            assert_eq!(grown, 2 * 24, "step {step} token {k}");
        }
    }
    assert!(tokens.iter().all(|&t| t >= 17), "{tokens:?}");
    assert!(tokens.iter().any(|&t| t != tokens[0]), "requests generate different lengths: {tokens:?}");
}

#[test]
fn token_budget_batches_change_batch_and_length_together() {
    // GPT-2 small, fp32: logits of `tokens` rows, attention scores of 12 heads per token and key.
    let (vocab_row, embedding) = (50257 * 4, 50257 * 768 * 4);
    let mut shapes = Vec::new();
    for (step, (sizes, _)) in steps_of(&full(Pattern::Gpt2TokenBudget, 8)).iter().enumerate() {
        let tokens =
            sizes.iter().filter(|&&b| b != embedding && b % vocab_row == 0).map(|b| b / vocab_row).max().unwrap();
        let seq = (128..=1024)
            .step_by(64)
            .find(|&seq| tokens == TOKEN_BUDGET / seq * seq && sizes.contains(&(tokens * 12 * seq * 4)))
            .unwrap_or_else(|| panic!("step {step}: {tokens} tokens fill no batch of the budget"));
        shapes.push((tokens / seq, seq));
    }
    assert!(shapes.iter().any(|s| s.0 != shapes[0].0) && shapes.iter().any(|s| s.1 != shapes[0].1), "{shapes:?}");
}

#[test]
fn on_policy_steps_generate_then_train_on_what_they_generated() {
    let trace = full(Pattern::RlGenerateTrain, 6);
    assert_eq!(analyse(&trace).unwrap().micro_steps, 0, "generation and training share the step");
    let mut lengths = Vec::new();
    for (step, (sizes, _)) in steps_of(&trace).iter().enumerate() {
        // The sequences' token ids (8 sequences of 8-byte ids) grow by one token at a time, from
        // the prompt's length on; the longest run of such sizes ends at the generated length.
        let ids = |length: u64| sizes.contains(&(8 * length * 8));
        let generated = (64..=512).rev().find(|&l| (l - 32..=l).all(ids)).expect("a generated sequence");
        let prompt = (64..=256).step_by(64).find(|&p| (p..=generated).all(ids)).expect("a prompt");
        // The training pass's fp32 logits are over the whole generated sequences.
        assert!(sizes.contains(&(8 * generated * 50257 * 4)), "step {step}: no training over {generated} tokens");
        assert!(generated - prompt > 32, "step {step}: {prompt} -> {generated}");
        lengths.push((prompt, generated));
    }
    assert!(lengths.iter().any(|&l| l != lengths[0]), "{lengths:?}");
}

#[test]
fn evaluation_passes_allocate_differently_from_training_steps() {
    let steps = steps_of(&full(Pattern::TrainEval, 9));
    let eval: Vec<usize> = (0..9).filter(|&s| is_eval_step(s as u32)).collect();
    let train: Vec<usize> = (1..9).filter(|&s| !is_eval_step(s as u32)).collect();
    assert_eq!(eval, [2, 5, 8]);
    for &e in &eval {
        assert_eq!(steps[e].0, steps[eval[0]].0, "evaluation passes repeat");
        for &t in &train {
            assert_ne!(steps[e].0, steps[t].0);
            assert!(steps[e].0.len() < steps[t].0.len(), "no gradients in evaluation");
        }
    }
    for &t in &train[1..] {
        assert_eq!(steps[t].0, steps[train[0]].0, "training steps repeat");
    }
}

#[test]
fn without_micro_steps_the_allocations_are_the_same() {
    for pattern in [Pattern::LlamaAccum, Pattern::Gpt2KvGenerate, Pattern::CurriculumAccum] {
        let options = PatternOptions { steps: 2, scale: SMOKE, ..PatternOptions::default() };
        let with = generate(pattern, &options).unwrap();
        let without = generate(pattern, &PatternOptions { micro_steps: false, ..options }).unwrap();
        let records = |trace: &Trace| -> Vec<(EventKind, u64, u64)> {
            trace.events.iter().filter(|e| !e.kind.is_boundary()).map(|e| (e.kind, e.ptr, e.bytes)).collect()
        };
        assert_eq!(records(&with), records(&without), "{pattern:?}");
        let micro = |trace: &Trace| analyse(trace).unwrap().micro_steps;
        assert!(micro(&with) >= 2 * u64::from(ACCUMULATION), "{pattern:?}");
        assert_eq!(micro(&without), 0, "{pattern:?}");
        assert_eq!(analyse(&without).unwrap().steps, 2);
    }
}
