//! `pool-probe` on the simulated device: it answers the H200's probe as the model says, and the
//! question the model answers without a measurement (less free memory than a unit) as documented,
//! and replays a trace's allocations with the address of each.

use std::process::Command;

use serde_json::Value;

const MIB: u64 = 1 << 20;

fn lines() -> Vec<Value> {
    run(&[])
}

fn run(args: &[&std::path::Path]) -> Vec<Value> {
    let output = Command::new(env!("CARGO_BIN_EXE_pool-probe"))
        .args(args)
        .env("STEPPOOL_DEVICE", "sim")
        .env_remove("STEPPOOL_REQUIRE_GPU")
        .env("STEPPOOL_SIM_DEVICES", "8GiB")
        .output()
        .expect("running pool-probe");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap().lines().map(|line| serde_json::from_str(line).unwrap()).collect()
}

fn of<'a>(lines: &'a [Value], experiment: &str, headroom: Option<u64>) -> Vec<&'a Value> {
    lines.iter().filter(|l| l["experiment"] == experiment && headroom.is_none_or(|h| l["headroom"] == h)).collect()
}

#[test]
fn the_simulated_pool_answers_in_32_mib_units_and_maps_them_whole() {
    let lines = lines();
    assert!(lines[0]["driver"].as_str().unwrap().contains("32 MiB pool units"), "{}", lines[0]);
    let single: Vec<(u64, u64)> = of(&lines, "single", None)
        .iter()
        .map(|l| (l["bytes"].as_u64().unwrap(), l["reserved"].as_u64().unwrap()))
        .collect();
    assert_eq!(single[0], (1, 32 * MIB));
    assert!(single.contains(&(33 * MIB, 64 * MIB)) && single.contains(&(100 * MIB, 128 * MIB)), "{single:?}");
    // 48 MiB free: the first unit maps, the 33rd MiB would need a second one of which 16 MiB
    // are free: refused, as the model maps a unit whole or not at all.
    let near = of(&lines, "near_capacity", Some(48 * MIB));
    let granted = near.iter().filter(|l| l["op"] == "alloc" && l["ok"] == true).count();
    assert_eq!(granted, 32);
    assert_eq!(near.last().unwrap()["ok"], false);
    // A unit maps only while a 2 MiB granule stays free beside it: with 34 MiB free the first
    // request maps one, with 32 MiB free it is refused, as an H200's driver answered (it refused
    // with 33.1 MiB free and mapped with 35.1).
    let near = of(&lines, "near_capacity", Some(34 * MIB));
    assert_eq!((near[1]["ok"].as_bool(), near[1]["reserved"].as_u64()), (Some(true), Some(32 * MIB)), "{near:?}");
    let near = of(&lines, "near_capacity", Some(32 * MIB));
    assert_eq!((near[1]["ok"].as_bool(), near[1]["reserved"].as_u64()), (Some(false), Some(0)), "{near:?}");
    // Less free memory than a unit: the first request is refused and nothing is reserved.
    let near = of(&lines, "near_capacity", Some(16 * MIB));
    assert_eq!((near[1]["ok"].as_bool(), near[1]["reserved"].as_u64()), (Some(false), Some(0)), "{near:?}");
    // Everything went back between experiments: each filler takes the whole device but the
    // headroom, and leaves exactly the headroom free.
    assert_eq!(of(&lines, "growth", None).len(), 96);
    for fill in lines.iter().filter(|l| l["op"] == "fill") {
        let (bytes, headroom) = (fill["bytes"].as_u64().unwrap(), fill["headroom"].as_u64().unwrap());
        assert_eq!((bytes + headroom, fill["free"].as_u64().unwrap()), (8 << 30, headroom), "{fill}");
    }
}

#[test]
fn a_trace_replays_with_every_address_the_pool_chose() {
    let dir = std::env::temp_dir().join(format!("steppool-pool-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("holes.jsonl");
    // A and B of 1 MiB; A freed; C of 512 KiB takes A's place (best fit, the lowest address);
    // D of 2 MiB fits in no hole and goes after B. A zero-byte request is not replayed.
    let events = [
        r#"{"event":"alloc","ptr":4096,"bytes":1048576,"t_ns":1}"#,
        r#"{"event":"alloc","ptr":8192,"bytes":1048576,"t_ns":2}"#,
        r#"{"event":"free","ptr":4096,"bytes":1048576,"t_ns":3}"#,
        r#"{"event":"alloc","ptr":12288,"bytes":0,"t_ns":4}"#,
        r#"{"event":"alloc","ptr":16384,"bytes":524288,"t_ns":5}"#,
        r#"{"event":"alloc","ptr":20480,"bytes":2097152,"t_ns":6}"#,
    ];
    let header = r#"{"format":"steppool-trace","version":1,"devices":[{"ordinal":0}],"phases":[]}"#;
    std::fs::write(&trace, format!("{header}\n{}\n", events.join("\n"))).unwrap();
    let out = dir.join("probe.jsonl");
    let lines = run(&[&out, &trace]);
    let placed: Vec<(u64, i64, u64)> = of(&lines, "placement", None)
        .iter()
        .map(|l| (l["bytes"].as_u64().unwrap(), l["offset"].as_i64().unwrap(), l["reserved"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        placed,
        [(MIB, 0, 32 * MIB), (MIB, MIB as i64, 32 * MIB), (MIB / 2, 0, 32 * MIB), (2 * MIB, 2 * MIB as i64, 32 * MIB)]
    );
    assert!(of(&lines, "placement", None).iter().all(|l| l["trace"] == "holes.jsonl"));
    // The file holds what was printed.
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), lines.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_trace_that_cannot_be_read_is_an_error_naming_it() {
    let missing = std::env::temp_dir().join("steppool-pool-probe-no-such-trace.jsonl");
    let output = Command::new(env!("CARGO_BIN_EXE_pool-probe"))
        .arg(std::env::temp_dir().join(format!("steppool-pool-probe-out-{}", std::process::id())))
        .arg(&missing)
        .env("STEPPOOL_DEVICE", "sim")
        .env_remove("STEPPOOL_REQUIRE_GPU")
        .env("STEPPOOL_SIM_DEVICES", "8GiB")
        .output()
        .expect("running pool-probe");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("steppool-pool-probe-no-such-trace.jsonl"), "{stderr}");
}
