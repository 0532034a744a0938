//! A PyTorch program recorded on a GPU at two sizes (`recorded-h200-torch`): the models of PyTorch's allocator
//! give the peaks PyTorch itself reported for the same requests, and `planned`, replayed with the
//! trace's own lifetimes, reserves less than each. (Run under PyTorch, steppool serves these
//! requests through the phases its PyTorch integration sets, and the figures differ:
//! `benches/results/2026-11-27-h200-torch-gpt.md`.)

use std::path::{Path, PathBuf};

use steppool_cli::replay::{ReplayOptions, Silent, replay, select};
use steppool_trace::analysis::analyse;
use steppool_trace::read::read_trace;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/recorded-h200-torch").join(name)
}

#[test]
fn the_models_of_pytorchs_allocator_give_the_peaks_it_reported_on_the_gpu() {
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(data("manifest.json")).unwrap()).unwrap();
    let traces = manifest["traces"].as_object().unwrap();
    assert_eq!(traces.len(), 2);
    for (name, recorded) in traces {
        let measured = |allocator: &str| recorded["peak_reserved_bytes"][allocator].as_u64().unwrap();
        let trace = read_trace(data(name)).unwrap();
        let analysis = analyse(&trace).unwrap();
        assert_eq!(analysis.peak_live_bytes, recorded["peak_live_bytes"].as_u64().unwrap(), "{name}");
        let results =
            replay(&trace, &analysis, &select("all").unwrap(), &ReplayOptions::new(80 << 30), &Silent).unwrap();
        let peak = |strategy: &str| {
            let result = results.iter().find(|r| r.run.strategy == strategy).unwrap();
            assert!(result.run.completed(), "{name}: {strategy}");
            result.run.peak_reserved_bytes
        };
        // To the byte: the native allocator's 9.08 and 22.2 GiB, expandable segments' 5.7 and
        // 17.8 GiB.
        assert_eq!(peak("torch-caching"), measured("native"), "{name}");
        assert_eq!(peak("torch-expandable"), measured("expandable"), "{name}");
        // The driver placed one pool's blocks otherwise than the simulated device: 64 MiB more
        // on the small run, 577 MiB less on the large one.
        let one_pool = peak("default-pool") as f64 / measured("async") as f64;
        assert!((0.96..1.04).contains(&one_pool), "{name}: default-pool / async = {one_pool}");
        let best = ["default-pool", "torch-caching", "torch-expandable"].map(peak).into_iter().min().unwrap();
        assert!(peak("planned") < best, "{name}: planned {} vs {best}", peak("planned"));
        // Page traffic: none for one CUDA pool, no runtime under the models, and a planned step
        // phase whose every step is a new length maps and unmaps a tenth of what is live a step
        // (it gave back every free page at each growth, and mapped them again: 1.2× peak live).
        let run = |strategy: &str| &results.iter().find(|r| r.run.strategy == strategy).unwrap().run;
        assert_eq!(run("default-pool").pages.unwrap().whole, Default::default(), "{name}");
        assert_eq!(run("torch-expandable").pages, None, "{name}");
        let per_step = run("planned").steady_page_traffic_per_step().unwrap();
        assert!(per_step < analysis.peak_live_bytes / 5, "{name}: {per_step} bytes a step");
    }
}
