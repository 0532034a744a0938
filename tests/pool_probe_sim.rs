//! `pool-probe` on the simulated device: it answers the H200's probe as the model says, and the
//! question the model answers without a measurement (less free memory than a unit) as documented.

use std::process::Command;

use serde_json::Value;

const MIB: u64 = 1 << 20;

fn lines() -> Vec<Value> {
    let output = Command::new(env!("CARGO_BIN_EXE_pool-probe"))
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
