//! The shared training traces: they read, their steps and peak live bytes are right, they replay
//! under every strategy, and the `steppool` binary prints and writes what the library computes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use steppool_cli::replay::{ReplayOptions, STRATEGIES, Silent, TORCH_MODELS, replay, select};
use steppool_trace::analysis::analyse;
use steppool_trace::{EventKind, Location, StepSource, Trace, read, steps};

const TRACES: [&str; 2] = ["vit_static_train", "t5_varlen_train"];

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

/// The peak of live bytes, computed straight from the CSV text: a map of pointer to size.
fn peak_live_from_csv(path: &Path) -> u64 {
    let text = std::fs::read_to_string(path).unwrap();
    let mut live: HashMap<String, u64> = HashMap::new();
    let (mut now, mut peak) = (0u64, 0u64);
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        let size: u64 = fields[4].parse().unwrap();
        match fields[2] {
            "allocate" => {
                live.insert(fields[3].to_owned(), size);
                now += size;
                peak = peak.max(now);
            }
            "free" => now -= live.remove(fields[3]).unwrap(),
            other => panic!("unexpected action {other}"),
        }
    }
    peak
}

#[test]
fn peak_live_bytes_is_the_true_peak() {
    for name in TRACES {
        let path = data(&format!("{name}.csv"));
        let trace = read::read_trace(&path).unwrap();
        let analysis = analyse(&trace).unwrap();
        assert_eq!(analysis.peak_live_bytes, peak_live_from_csv(&path), "{name}");
        assert!(trace.warnings.is_empty() && analysis.warnings.is_empty(), "{name}: {:?}", trace.warnings);
    }
}

/// The record (line) each step of `trace` begins before.
fn begins(trace: &Trace) -> Vec<u64> {
    let mut lines = Vec::new();
    for window in trace.events.windows(2) {
        if matches!(window[0].kind, EventKind::StepBegin(_)) {
            lines.push(match window[1].location {
                Location::Line(line) => line,
                other => panic!("{other:?}"),
            });
        }
    }
    lines
}

#[test]
fn sidecar_steps_are_used_and_inference_finds_the_same_boundaries() {
    for (name, steps) in [("vit_static_train", 5), ("t5_varlen_train", 6)] {
        let path = data(&format!("{name}.csv"));
        let with_sidecar = read::read_trace(&path).unwrap();
        assert!(matches!(with_sidecar.steps, StepSource::Sidecar(_)), "{name}: {:?}", with_sidecar.steps);
        assert_eq!(with_sidecar.step_count(), steps, "{name}");

        let bytes = std::fs::read(&path).unwrap();
        let mut inferred = read::read_bytes(&path, &bytes).unwrap();
        assert!(matches!(steps::infer(&mut inferred), StepSource::Inferred { every: 1, .. }), "{name}");
        assert_eq!(begins(&with_sidecar), begins(&inferred), "{name}");
    }
}

/// The recorded RMM logs, each with its sidecar of step starts.
fn recorded_logs() -> Vec<PathBuf> {
    let mut logs: Vec<PathBuf> = std::fs::read_dir(data("recorded"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "csv"))
        .collect();
    logs.sort();
    logs
}

#[test]
fn recorded_logs_copied_without_their_sidecar_infer_the_sidecars_steps() {
    let dir = tempfile::tempdir().unwrap();
    let logs = recorded_logs();
    assert!(logs.len() >= 7, "{logs:?}");
    for path in logs {
        let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
        let with_sidecar = read::read_trace(&path).unwrap();
        assert!(matches!(with_sidecar.steps, StepSource::Sidecar(_)), "{name}: {:?}", with_sidecar.steps);
        let copy = dir.path().join(path.file_name().unwrap());
        std::fs::copy(&path, &copy).unwrap();
        let inferred = read::read_trace(&copy).unwrap();
        // A batch copied at each step's start, then `zero_grad()`: inference finds the sidecar's
        // steps (the first step's points, where the optimizer's state is made, dropped), but
        // puts the copy and the gradients' frees at the end of the step before: a step begins
        // after them (the quiescent point follows the frees), within the sidecar's step, and the
        // first after the copy (it begins at what counts). The token-budget GPT-2's second step
        // begins where the sidecar's does; the MoE's (Adafactor, bf16), like the rest, after.
        if ["gpt2_token_budget_inputs_step", "moe_routing_adafactor_bf16"].contains(&name.as_str()) {
            let (inferred, sidecar) = (begins(&inferred), begins(&with_sidecar));
            assert_eq!(inferred.len(), sidecar.len(), "{name}");
            for (i, &at) in inferred.iter().enumerate() {
                let within = sidecar[i] <= at && sidecar.get(i + 1).is_none_or(|&next| at < next);
                assert!(within, "{name}: step {i} inferred at event {at}, the sidecar's steps at {sidecar:?}");
            }
            if name == "gpt2_token_budget_inputs_step" {
                assert_eq!(inferred[1], sidecar[1], "{name}");
            }
            continue;
        }
        // Under `zero_grad()` at the loop's top, the training step before an evaluation step hands
        // its gradients to it: no point lies between the two, which are one inferred step.
        if name.starts_with("train_eval_zero_grad_first") {
            let sidecar: Vec<u64> =
                begins(&with_sidecar).into_iter().enumerate().filter(|(i, _)| i % 3 != 2).map(|(_, at)| at).collect();
            assert_eq!(begins(&inferred), sidecar, "{name}");
            continue;
        }
        // Under SGD with the gradients set to `None` between the passes, those of the training
        // step before an evaluation step live through it into the next training step, which
        // frees them after its forward pass: no quiescent point lies in the three steps they
        // span, and the steps inferred are fewer than the sidecar's, each beginning where one of
        // the sidecar's does (the trace is replayed with its sidecar in `patterns.rs`).
        if name == "train_eval_sgd_zero_grad_backward" {
            let (inferred, sidecar) = (begins(&inferred), begins(&with_sidecar));
            assert!(inferred.len() < sidecar.len(), "{name}: {inferred:?}");
            assert!(inferred.iter().all(|at| sidecar.contains(at)), "{name}: {inferred:?} of {sidecar:?}");
            continue;
        }
        // A loop that copies its next batch before each step's mark and sets its gradients to
        // `None` between the passes hands about a seventh of its allocations to the next step,
        // and lifetime does not tell them from its activations: no point is quiescent, and the
        // steps are found by the period of the sizes, a step every 421 allocations. Each begins
        // where the batch is copied, a few lines before the sidecar's mark, which comes after
        // the copy.
        if name == "bert_static_sgd_loader_zero_grad_backward" {
            assert_eq!(inferred.steps, StepSource::Periodic { allocations: 421 }, "{name}");
            let (inferred, sidecar) = (begins(&inferred), begins(&with_sidecar));
            assert_eq!(inferred.len(), sidecar.len(), "{name}: {inferred:?} against {sidecar:?}");
            for (step, (&at, &mark)) in inferred.iter().zip(&sidecar).enumerate() {
                assert!(at <= mark && mark - at <= 20, "{name}: step {step} at line {at}, its mark at {mark}");
            }
            continue;
        }
        // train_eval's steps go train, train, eval, and the pattern that repeats is all three: one
        // inferred step is three of the sidecar's. With gradients kept across steps, every
        // temporary of the optimizer step is a quiescent point: a step is many of them. With
        // gradients set to `None` between the forward and backward passes, a step is several.
        let sidecar: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path.with_extension("json")).unwrap()).unwrap();
        let train_eval = sidecar["workload"] == "train_eval";
        let (every, points) = match inferred.steps {
            StepSource::Inferred { every, .. } => (if train_eval { 3 } else { 1 }, every),
            ref other => panic!("{name}: {other:?}"),
        };
        if name.ends_with("_grads_kept") {
            assert!(points > 100, "{name}: {points}");
        } else if name.ends_with("_zero_grad_backward") {
            assert!(points > every, "{name}: {points}");
        } else {
            assert_eq!(points, every, "{name}");
        }
        let sidecar: Vec<u64> = begins(&with_sidecar).into_iter().step_by(every).collect();
        assert_eq!(begins(&inferred), sidecar, "{name}");
        assert_eq!(inferred.step_count(), sidecar.len(), "{name}");
    }
}

#[test]
fn the_binary_replays_a_log_without_its_sidecar_as_with_it() {
    // bert_static's input batches live from before the first step to teardown: inference leaves
    // them out as long-lived and finds the sidecar's eight steps.
    let dir = tempfile::tempdir().unwrap();
    let path = data("recorded/bert_static.csv");
    let copy = dir.path().join("bert_static.csv");
    std::fs::copy(&path, &copy).unwrap();
    let mut documents = Vec::new();
    for (trace, out) in [(&path, "sidecar.json"), (&copy, "inferred.json")] {
        let json = dir.path().join(out);
        let output = steppool(&["replay", trace.to_str().unwrap(), "--json", json.to_str().unwrap()]);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let document: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        documents.push((stdout, document));
    }
    let (sidecar, inferred) = (&documents[0], &documents[1]);
    assert!(sidecar.0.contains("8 steps from"), "{}", sidecar.0);
    assert!(
        inferred.0.contains("8 steps inferred") && inferred.0.contains("8 longer-lived left out"),
        "{}",
        inferred.0
    );
    assert_eq!(inferred.1["results"], sidecar.1["results"]);
    assert_eq!(inferred.1["recommended"], sidecar.1["recommended"]);
    assert_eq!(inferred.1["recommended"], "planned");
    // The page traffic: none in CUDA pools, some in the ranges of arenas and plans, null for the
    // models of PyTorch's allocator.
    for result in sidecar.1["results"].as_array().unwrap() {
        let traffic = &result["page_traffic"];
        match result["strategy"].as_str().unwrap() {
            "torch-caching" | "torch-expandable" => assert!(traffic.is_null(), "{result}"),
            "default-pool" | "phase-pools" => assert_eq!(traffic["mapped_bytes"], 0, "{result}"),
            _ => assert!(traffic["mapped_bytes"].as_u64().unwrap() > 0, "{result}"),
        }
    }
    assert!(sidecar.0.contains("page traffic"), "{}", sidecar.0);
}

#[test]
fn a_log_with_no_quiescent_point_is_replayed_from_the_period_of_its_sizes_near_its_peak() {
    // The set w BERT (1,008.3 MiB live) without its sidecar: its steps come from the period of
    // its sizes, its first two steps begin with other sizes than the later ones, and the plan
    // of the shape the loop settles into moves as a first plan does. The planned strategy holds
    // 1,014 MiB (1,136 while that plan stayed pinned; with the sidecar, 1,012), below one pool's
    // 1,088.
    let dir = tempfile::tempdir().unwrap();
    let name = "bert_static_sgd_loader_zero_grad_backward.csv";
    let copy = dir.path().join(name);
    std::fs::copy(data(&format!("recorded/{name}")), &copy).unwrap();
    let json = dir.path().join("inferred.json");
    let output = steppool(&[
        "replay",
        copy.to_str().unwrap(),
        "--strategy",
        "planned",
        "--no-bisect",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("8 steps inferred: a step every 421 allocations"), "{stdout}");
    let document: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let peak = document["results"][0]["peak_reserved_bytes"].as_u64().unwrap();
    assert_eq!(peak, 1014 << 20, "{stdout}");
}

#[test]
fn every_shared_trace_replays_under_every_strategy() {
    for name in TRACES {
        let trace = read::read_trace(data(&format!("{name}.csv"))).unwrap();
        let analysis = analyse(&trace).unwrap();
        let results =
            replay(&trace, &analysis, &select("all").unwrap(), &ReplayOptions::new(80 << 30), &Silent).unwrap();
        assert_eq!(results.len(), STRATEGIES.len() + TORCH_MODELS.len());
        for result in &results {
            let run = &result.run;
            // The breakdown's parts sum exactly to peak reserved − peak live.
            let breakdown = result.breakdown.expect("a completed run has a breakdown");
            assert_eq!(
                breakdown.total(),
                run.peak_reserved_bytes as i64 - analysis.peak_live_bytes as i64,
                "{name} {}: {breakdown:?}",
                run.strategy
            );
            assert_eq!(breakdown.unattributed_bytes, 0, "{name} {}: every reservation is in a pool", run.strategy);
            assert!(breakdown.peak_shift_bytes <= 0);
            let steady = run.steady_peak_reserved_bytes.expect("the shared traces have steps");
            assert!(steady <= run.peak_reserved_bytes && run.steady_peak_live_bytes.unwrap() <= run.peak_live_bytes);
            assert!(run.completed(), "{name} {}: {:?}", run.strategy, run.failure);
            assert_eq!(run.peak_live_bytes, analysis.peak_live_bytes, "{name} {}", run.strategy);
            assert!(run.peak_reserved_bytes >= analysis.peak_live_bytes, "{name} {}", run.strategy);
            assert_eq!(run.peak_reserved_bytes % (2 << 20), 0, "reservations are whole granules");
            let min = result.min_capacity_bytes.unwrap();
            // A CUDA pool's units need one granule free beside them.
            let beside = 2 << 20;
            assert!(
                min >= analysis.peak_live_bytes && min <= run.peak_reserved_bytes + beside,
                "{name} {}",
                run.strategy
            );
            // The smallest capacity completes and one granule less does not.
            let def = select(run.strategy).unwrap()[0];
            let options = ReplayOptions::new(min);
            let at_min = steppool_cli::replay::run(&trace, &analysis, def, min, &options, &Silent).unwrap();
            assert!(at_min.completed(), "{name} {} at {min}", run.strategy);
            let below = steppool_cli::replay::run(&trace, &analysis, def, min - (2 << 20), &options, &Silent).unwrap();
            assert!(!below.completed(), "{name} {} at {min} - 2 MiB", run.strategy);
        }
    }
}

fn steppool(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_steppool")).args(args).output().expect("the steppool binary runs")
}

#[test]
fn the_binary_prints_the_table_and_writes_json_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    for name in TRACES {
        let trace = data(&format!("{name}.csv"));
        let json = dir.path().join(format!("{name}.json"));
        let svg = dir.path().join(format!("{name}.svg"));
        let output = steppool(&[
            "replay",
            trace.to_str().unwrap(),
            "--capacity",
            "80GiB",
            "--json",
            json.to_str().unwrap(),
            "--svg",
            svg.to_str().unwrap(),
        ]);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{name}: {}", String::from_utf8_lossy(&output.stderr));
        for strategy in select("all").unwrap() {
            assert!(stdout.contains(strategy.name()), "{stdout}");
        }
        assert!(stdout.contains("at 80 GiB") && stdout.contains("completed"), "{stdout}");
        assert!(stdout.contains("offline limit") && stdout.contains("* recommended: "), "{stdout}");

        let document: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let peak = peak_live_from_csv(&trace);
        assert_eq!(document["peak_live_bytes"], peak);
        assert_eq!(document["events"], if name == "vit_static_train" { 16182 } else { 32331 });
        let results = document["results"].as_array().unwrap();
        assert_eq!(results.len(), STRATEGIES.len() + TORCH_MODELS.len());
        let limit = document["limit_bytes"].as_u64().unwrap();
        assert!(limit >= peak && limit >= document["limit_lower_bound_bytes"].as_u64().unwrap());
        // The recommended strategy is steppool's least peak reserved.
        let recommended = document["recommended"].as_str().unwrap();
        let least = results
            .iter()
            .filter(|r| r["kind"] == "steppool")
            .min_by_key(|r| r["peak_reserved_bytes"].as_u64().unwrap())
            .unwrap();
        assert_eq!(least["strategy"], recommended);
        for result in results {
            for key in [
                "strategy",
                "peak_reserved_bytes",
                "overhead",
                "fragmentation_ratio",
                "steady_peak_reserved_bytes",
                "steady_overhead",
                "limit_distance_bytes",
                "breakdown",
                "completed",
                "min_capacity_bytes",
            ] {
                assert!(result.get(key).is_some(), "{key} missing in {result}");
            }
            let b = &result["breakdown"];
            let parts: i64 = ["rounding_bytes", "granule_tail_bytes", "segregation_bytes", "hole_bytes"]
                .iter()
                .map(|k| b[k].as_i64().unwrap())
                .sum::<i64>()
                + b["unattributed_bytes"].as_i64().unwrap()
                + b["peak_shift_bytes"].as_i64().unwrap();
            let reserved = result["peak_reserved_bytes"].as_u64().unwrap();
            assert_eq!(parts, reserved as i64 - peak as i64, "{result}");
            assert_eq!(result["limit_distance_bytes"].as_i64().unwrap(), reserved as i64 - limit as i64);
            let reserved = result["peak_reserved_bytes"].as_u64().unwrap();
            let overhead = result["overhead"].as_f64().unwrap();
            assert!((overhead - reserved as f64 / peak as f64).abs() < 1e-9);
            let fragmentation = result["fragmentation_ratio"].as_f64().unwrap();
            assert!((fragmentation - (1.0 - peak as f64 / reserved as f64)).abs() < 1e-9);
            // One entry per step; the steps hold the run's peaks, but what came before the first.
            let steps = result["steps"].as_array().unwrap();
            assert_eq!(steps.len() as u64, document["steps"].as_u64().unwrap(), "{result}");
            let most = |key: &str| steps.iter().map(|s| s[key].as_u64().unwrap()).max().unwrap();
            assert!(most("peak_reserved_bytes") <= reserved && most("peak_live_bytes") <= peak, "{result}");
            // The step that first reached the peak holds it.
            let at = result["peak_step"].as_u64().unwrap() as usize;
            assert_eq!(steps[at]["peak_reserved_bytes"].as_u64(), Some(reserved), "{result}");
            assert!(steps[..at].iter().all(|s| s["peak_reserved_bytes"].as_u64().unwrap() < reserved), "{result}");
            let steady = result["steady_peak_reserved_bytes"].as_u64().unwrap();
            assert_eq!(steps[1..].iter().map(|s| s["peak_reserved_bytes"].as_u64().unwrap()).max().unwrap(), steady);
            // The table prints the same peak as the JSON.
            let shown = steppool_sys::bytes::Bytes(reserved).to_string();
            assert!(stdout.contains(&shown), "{shown} not in {stdout}");
        }
        let picture = std::fs::read_to_string(&svg).unwrap();
        assert!(picture.starts_with("<svg") && picture.trim_end().ends_with("</svg>"));
        assert_eq!(picture.matches("<polyline").count(), STRATEGIES.len() + TORCH_MODELS.len());
    }
}

#[test]
fn the_binary_inspects_and_explains_bad_input() {
    let trace = data("t5_varlen_train.csv");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("inspect.json");
    let output = steppool(&["inspect", trace.to_str().unwrap(), "--json", json.to_str().unwrap()]);
    assert!(output.status.success());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("16299 allocations") && stdout.contains("6 (from"), "{stdout}");
    assert!(stdout.contains("lifetimes by phase"), "{stdout}");
    let document: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(document["steps"], 6);
    assert_eq!(document["peak_live_bytes"], peak_live_from_csv(&trace));

    let bad = dir.path().join("bad.csv");
    std::fs::write(&bad, "Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,64,0x0\n1,5,allocate,0x20\n")
        .unwrap();
    let output = steppool(&["replay", bad.to_str().unwrap()]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("bad.csv") && stderr.contains("line 3") && stderr.contains("found 4"), "{stderr}");

    let output = steppool(&["replay", trace.to_str().unwrap(), "--strategy", "best"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("no strategy `best`"));
    let output = steppool(&["replay", trace.to_str().unwrap(), "--capacity", "80 gigs"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("gigs"));
}
